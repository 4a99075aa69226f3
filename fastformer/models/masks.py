"""The masks a sequence-to-sequence model builds from token ids (bool, True = masked out)."""
import torch


def padding_mask(tokens: torch.Tensor, pad_idx: int) -> torch.Tensor:
    """(B, S) bool key padding mask: True where ``tokens`` is ``pad_idx``."""
    return tokens.eq(pad_idx)


def causal_mask(length: int, device=None) -> torch.Tensor:
    """(length, length) bool: True above the diagonal, where query i may not see key j > i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
