"""The checks the modules make of their configuration and their inputs, before any work:
a ValueError / TypeError naming the argument, what it got and what it wants (torch's own
modules assert or fail deep inside a GEMM instead). Built on :mod:`fastformer.ops._checks`."""
from typing import Optional

import torch

from ..ops import _checks


def attention_config(embed_dim, num_heads, dropout, embed_name: str = "embed_dim",
                     heads_name: str = "num_heads") -> None:
    """Sizes of a multi-head attention: positive ints, ``embed_dim`` a multiple of ``num_heads``."""
    _checks.positive_int(embed_name, embed_dim)
    _checks.positive_int(heads_name, num_heads)
    if embed_dim % num_heads:
        raise ValueError(f"{embed_name} ({embed_dim}) must be divisible by {heads_name} ({num_heads})")
    _checks.probability("dropout", dropout)


def layer_config(d_model, nhead, dim_feedforward, dropout, layer_norm_eps) -> None:
    """A Transformer layer's constructor arguments."""
    attention_config(d_model, nhead, dropout, "d_model", "nhead")
    _checks.positive_int("dim_feedforward", dim_feedforward)
    _checks.positive("layer_norm_eps", layer_norm_eps)


def hidden(name: str, x, width: int, like: Optional[torch.Tensor], ranks=(2, 3),
           width_name: str = "d_model") -> None:
    """A module input ``x``: a floating tensor of one of ``ranks`` ending in ``width``, on the
    device of the module's parameter ``like`` and (outside autocast) of its dtype."""
    _checks.tensor(name, x, floating=True)
    if x.dim() not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions, got shape {tuple(x.shape)}")
    if x.shape[-1] != width:
        raise ValueError(f"{name}'s last dimension must be {width_name}={width}, got shape {tuple(x.shape)}")
    if like is None:
        return
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the module's parameters are on {like.device}")
    if _checks.autocast_dtype(x.device) is None and x.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the module's parameters have dtype {like.dtype}; "
                        "they must match (or run under torch.autocast)")


def key_padding_mask(name: str, mask, B: int, S: int, device) -> None:
    """``(B, S)`` bool (True = padded) or float (added) on ``device``."""
    _checks.tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = padded) or floating point, got {mask.dtype}")
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"{name} must have shape (N, S) = {(B, S)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the input is on {device}")


def attn_mask(name: str, mask, B: int, H: int, L: int, S: int, device) -> None:
    """``(L, S)`` or ``(B * H, L, S)``, bool (True = masked out) or float (added), on ``device``."""
    _checks.tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = masked out) or floating point, got {mask.dtype}")
    if mask.dim() == 2:
        if tuple(mask.shape) != (L, S):
            raise ValueError(f"a 2-D {name} must have shape (L, S) = {(L, S)}, got {tuple(mask.shape)}")
    elif mask.dim() == 3:
        if tuple(mask.shape) != (B * H, L, S):
            raise ValueError(f"a 3-D {name} must have shape (N * num_heads, L, S) = {(B * H, L, S)}, got "
                             f"{tuple(mask.shape)}")
    else:
        raise ValueError(f"{name} must be 2-D (L, S) or 3-D (N * num_heads, L, S), got shape {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the input is on {device}")


def sequence_dims(x: torch.Tensor, batch_first: bool):
    """(B, S) of a (B, S, E) / (S, B, E) batched or (S, E) unbatched input."""
    if x.dim() == 2:
        return 1, x.shape[0]
    return (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])


def layer_masks(x: torch.Tensor, batch_first: bool, nhead: int, mask, mask_name: str, kpm, kpm_name: str,
                keys: Optional[torch.Tensor] = None) -> None:
    """A layer's attention mask and key padding mask for input ``x`` (and ``keys``: the memory)."""
    B, L = sequence_dims(x, batch_first)
    S = sequence_dims(keys, batch_first)[1] if keys is not None else L
    if mask is not None:
        attn_mask(mask_name, mask, B, nhead, L, S, x.device)
    if kpm is not None:
        if x.dim() == 2:  # unbatched: (S,)
            _checks.tensor(kpm_name, kpm, ndim=1)
            kpm = kpm[None]
        key_padding_mask(kpm_name, kpm, B, S, x.device)
