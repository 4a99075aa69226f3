"""Skipping padding: the real tokens of a padded batch, packed into rows of their own.

In a padded batch ``(B, S)`` only ``n <= B * S`` positions hold tokens. A Transformer layer can
run entirely on the ``n`` real rows ``(n, E)``: every part but attention treats each position on
its own, and attention runs on the packed rows too, within each sequence
(:func:`fastformer.ops.attention_varlen`, FlashAttention's variable-length layout, with the
packing's ``cu_seqlens``). No padded position is computed and no row moves between layouts
inside a layer. ::

    packing = Packing(tokens == pad_idx)      # (B, S) bool, True = padded
    x = packing.pack(embedded)                # (B, S, E) -> (n, E)
    y = packing.unpack(x)                     # (n, E) -> (B, S, E), zeros at the padding

Packed-sequence training puts several short sentences into one row: ``segment_ids`` ``(B, S)``
then says which sentence of its row each position belongs to (a sentence is a run of equal ids),
attention stays within each sentence and ``positions`` restart at 0 in each.
"""
from typing import Optional

import torch


def may_pack() -> bool:
    """Whether the real-token count may set a size here: always eagerly; under torch.compile only
    where dynamo captures data-dependent sizes (``capture_dynamic_output_shape_ops``)."""
    return not torch.compiler.is_compiling() or torch._dynamo.config.capture_dynamic_output_shape_ops


class Packing:
    """Where the real tokens of a ``(B, S)`` batch lie, and the moves between the layouts.

    Args:
        padding_mask: ``(B, S)`` bool, True where a position is padding (a key padding mask).
        segment_ids: optional ``(B, S)`` integer ids: the real positions of a row with equal
            consecutive ids form one sequence (several sentences packed into one row). Without
            it, each row is one sequence.

    Attributes:
        padding_mask: the mask it was built from.
        index: ``(n,)`` int64, the real positions as flat indices into ``B * S`` rows.
        positions: ``(n,)`` int64, each real token's position: its column in the padded row
            (as the padded computation numbers it), counted from its sentence's first column
            with ``segment_ids``.
        num_tokens: ``n``.
        cu_seqlens: ``(num_sequences + 1,)`` int32 cumulative sequence lengths over the packed
            rows (for :func:`fastformer.ops.attention_varlen`); an empty row without
            ``segment_ids`` is a sequence of length 0, so a batch's two packings line up.
        max_seqlen: a bound on the sequence lengths, for :func:`fastformer.ops.attention_varlen`:
            the row width ``S``, with or without ``segment_ids`` (no read of the data: no host
            sync on a GPU, and a size torch.compile can trace; attention's dropout then numbers
            its bits as the padded layout's).
        dense: True when nothing is padded; then ``pack`` and ``unpack`` are views, and the
            packed rows are the padded batch's rows in the same order.
    """

    def __init__(self, padding_mask: torch.Tensor, segment_ids: Optional[torch.Tensor] = None):
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool or padding_mask.dim() != 2:
            got = (f"{padding_mask.dtype} tensor of shape {tuple(padding_mask.shape)}"
                   if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__)
            raise ValueError(f"padding_mask must be a (B, S) bool tensor (True = padded), got {got}")
        self.padding_mask = padding_mask
        self.batch_size, self.seq_len = padding_mask.shape
        self.index = (~padding_mask).reshape(-1).nonzero().squeeze(1)  # (n,)
        # Traced by torch.compile, n is a data-dependent size: kept symbolic, and the moves always
        # gather and scatter (dense would be a guard on the data).
        traced = torch.compiler.is_compiling()
        self.num_tokens = self.index.numel() if traced else int(self.index.numel())
        self.dense = not traced and self.num_tokens == padding_mask.numel()
        self._rows = self.index // self.seq_len  # (n,) batch row of each token
        self._cols = self.index % self.seq_len  # (n,) its column in the padded layout
        self._pad_index = padding_mask.reshape(-1).nonzero().squeeze(1)  # (B * S - n,)
        self._lengths: Optional[torch.Tensor] = None  # (num_sequences,), computed when first asked for
        self._cu_seqlens: Optional[torch.Tensor] = None
        if segment_ids is None:
            self.positions = self._cols  # as in the padded layout, where a row's column is its position
        else:
            if (not isinstance(segment_ids, torch.Tensor) or segment_ids.shape != padding_mask.shape
                    or segment_ids.is_floating_point() or segment_ids.is_complex() or segment_ids.dtype == torch.bool):
                got = (f"{segment_ids.dtype} tensor of shape {tuple(segment_ids.shape)}"
                       if isinstance(segment_ids, torch.Tensor) else type(segment_ids).__name__)
                raise ValueError(f"segment_ids must be an integer tensor of padding_mask's shape "
                                 f"{tuple(padding_mask.shape)}, got {got}")
            seg = segment_ids.reshape(-1).index_select(0, self.index.to(segment_ids.device)).to(self.index.device)
            new = torch.ones(self.num_tokens, dtype=torch.bool, device=self.index.device)  # a sequence starts here
            new[1:] = (self._rows[1:] != self._rows[:-1]) | (seg[1:] != seg[:-1])
            first = new.nonzero().squeeze(1)  # (num_sequences,)
            lengths = torch.diff(first, append=self.index.new_full((1,), self.num_tokens))
            starts = self._cols[first].repeat_interleave(lengths, output_size=self.num_tokens)  # (n,)
            self.positions = self._cols - starts  # 0 at each sentence's start
            self._lengths = lengths

    # The sequences are computed only when asked for: the position-wise layers never need them
    # (a Hugging Face encoder layer takes only pack / unpack).
    @property
    def _sequence_lengths(self) -> torch.Tensor:
        if self._lengths is None:  # one sequence a row, empty rows included
            self._lengths = (~self.padding_mask).sum(dim=1)  # (B,)
        return self._lengths

    @property
    def has_tokens(self) -> bool:
        """Whether any position is real. Taken as true under torch.compile, which cannot branch on
        the data: the packed layers then run on zero rows."""
        return torch.compiler.is_compiling() or self.num_tokens > 0

    @property
    def num_sequences(self) -> int:
        """The number of sequences; with ``segment_ids``, data: symbolic under torch.compile."""
        return self.batch_size if self._lengths is None else self._lengths.numel()

    # Cached by hand: functools.cached_property holds a lock on Python 3.11, which dynamo cannot enter.
    @property
    def cu_seqlens(self) -> torch.Tensor:
        if self._cu_seqlens is None:
            lengths = self._sequence_lengths
            self._cu_seqlens = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
        return self._cu_seqlens

    @property
    def max_seqlen(self) -> int:
        return self.seq_len  # a sequence lies within one row

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
            return x[self._rows, self._cols]
        return x.reshape(self.batch_size * self.seq_len, *x.shape[2:]).index_select(0, self.index)

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:  # (n, *rest) -> (B, S, *rest), zero padding
        rest = tuple(x.shape[1:])
        out = x.new_empty((self.batch_size * self.seq_len,) + rest)
        out.index_copy_(0, self.index, x).index_fill_(0, self._pad_index, 0)  # every row written once
        return out.view((self.batch_size, self.seq_len) + rest)

    def __repr__(self) -> str:
        return (f"Packing(batch_size={self.batch_size}, seq_len={self.seq_len}, num_tokens={self.num_tokens}, "
                f"num_sequences={self.num_sequences})")


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
