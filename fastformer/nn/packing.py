"""Skipping padding: the real tokens of a padded batch, packed into rows of their own.

In a padded batch ``(B, S)`` only ``n <= B * S`` positions hold tokens. Every part of a
Transformer layer but attention treats each position on its own (the linear projections,
the feed-forward network, add & LayerNorm, the output projection and the loss), so those
parts can run on the ``n`` real rows alone, ``(n, E)``, and skip the work on padding.
Attention mixes positions: its projections are put back into the padded ``(B, S, ...)``
layout (zeros where the padding is, which the key padding mask hides) just around the
attention op, and its output rows are packed again.

Padded positions never reach a real one (they are masked as keys, and their own outputs
are not used), so the real rows come out as in the padded computation. ::

    packing = Packing(tokens == pad_idx)      # (B, S) bool, True = padded
    x = packing.pack(embedded)                # (B, S, E) -> (n, E)
    y = packing.unpack(x)                     # (n, E) -> (B, S, E), zeros at the padding
"""
import torch


class Packing:
    """Where the real tokens of a ``(B, S)`` batch lie, and the moves between the layouts.

    Args:
        padding_mask: ``(B, S)`` bool, True where a position is padding (a key padding mask).

    Attributes:
        padding_mask: the mask it was built from, for the attention op.
        index: ``(n,)`` int64, the real positions as flat indices into ``B * S`` rows.
        positions: ``(n,)`` int64, each real token's position in its sequence (0 .. S - 1).
        num_tokens: ``n``.
        dense: True when nothing is padded; then ``pack`` and ``unpack`` are views, and the
            packed rows are the padded batch's rows in the same order.
    """

    def __init__(self, padding_mask: torch.Tensor):
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool or padding_mask.dim() != 2:
            got = (f"{padding_mask.dtype} tensor of shape {tuple(padding_mask.shape)}"
                   if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__)
            raise ValueError(f"padding_mask must be a (B, S) bool tensor (True = padded), got {got}")
        self.padding_mask = padding_mask
        self.batch_size, self.seq_len = padding_mask.shape
        self.index = (~padding_mask).reshape(-1).nonzero().squeeze(1)  # (n,)
        self.num_tokens = int(self.index.numel())
        self.dense = self.num_tokens == padding_mask.numel()
        self.positions = self.index % self.seq_len  # (n,)
        self._rows = self.index // self.seq_len  # (n,) batch row of each token
        self._pad_index = padding_mask.reshape(-1).nonzero().squeeze(1)  # (B * S - n,)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, S, *rest)`` -> ``(n, *rest)``: the rows of the real tokens."""
        B, S = self.batch_size, self.seq_len
        if tuple(x.shape[:2]) != (B, S):
            raise ValueError(f"x must have shape (B, S, ...) = ({B}, {S}, ...), got {tuple(x.shape)}")
        if self.dense:
            return x.reshape(B * S, *x.shape[2:])
        return _Move.apply(x, self, True)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, *rest)`` -> ``(B, S, *rest)``, zeros at the padded positions."""
        B, S, n = self.batch_size, self.seq_len, self.num_tokens
        if x.shape[0] != n:
            raise ValueError(f"x must hold one row per real token, {n}, got shape {tuple(x.shape)}")
        if self.dense:
            return x.reshape(B, S, *x.shape[1:])
        return _Move.apply(x, self, False)

    # the two moves, each the other's gradient (the indices are unique: no accumulation)
    def _gather(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, *rest) -> (n, *rest)
        if x.dim() > 2 and not x.is_contiguous():  # e.g. a (B, S, H, D) view of (B, H, S, D): one gather
            return x[self._rows, self.positions]
        return x.reshape(self.batch_size * self.seq_len, *x.shape[2:]).index_select(0, self.index)

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:  # (n, *rest) -> (B, S, *rest), zero padding
        rest = tuple(x.shape[1:])
        out = x.new_empty((self.batch_size * self.seq_len,) + rest)
        out.index_copy_(0, self.index, x).index_fill_(0, self._pad_index, 0)  # every row written once
        return out.view((self.batch_size, self.seq_len) + rest)

    def __repr__(self) -> str:
        return f"Packing(batch_size={self.batch_size}, seq_len={self.seq_len}, num_tokens={self.num_tokens})"


class _Move(torch.autograd.Function):
    """``packing.pack`` (``to_rows``) or ``packing.unpack``; the gradient is the other move."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packing: Packing, to_rows: bool) -> torch.Tensor:
        ctx.packing, ctx.to_rows = packing, to_rows
        return packing._gather(x) if to_rows else packing._scatter(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        move = ctx.packing._scatter if ctx.to_rows else ctx.packing._gather
        return move(grad), None, None
