import math
from typing import Optional

import torch

from .. import backends
from ..autograd import AttentionVarlenFunction
from ..internal import validation
from . import reference


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, max_name: str,
                      total_name: str) -> None:
    """cu[0] = 0, non-decreasing, cu[-1] = total, no length above ``max_seqlen``: read on the host
    for CPU tensors (a GPU's would need a synchronisation; its kernels clamp every sequence to the
    tensors' rows instead)."""
    if cu.device.type != "cpu" or torch.compiler.is_compiling():
        return
    c = cu.tolist()
    lengths = [b - a for a, b in zip(c, c[1:])]
    if c[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {c[0]}")
    if any(n < 0 for n in lengths):
        b = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing, got {name}[{b}] = {c[b]} > {name}[{b + 1}] = {c[b + 1]}")
    if c[-1] != total:
        raise ValueError(f"{name}[-1] must equal {total_name} ({total}), got {c[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} is {max_seqlen} but {name} holds a sequence of {max(lengths)} rows")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     is_causal: bool = False, scale: Optional[float] = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Attention within each sequence of packed rows, FlashAttention's ``flash_attn_varlen_func``
    layout: no padded position exists, so none is computed.

    Args:
        q: queries ``(total_q, H, D)``, the rows of all sequences one after the other.
        k, v: keys and values ``(total_k, H, D)``; any ``D <= 256``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` cumulative lengths on q's device: sequence
            ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
            ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``. A sequence may be empty.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (bounds for the kernels' grids).
        is_causal: query ``i`` of a sequence sees its key ``j`` iff ``j <= i + Lk - Lq``
            (bottom-right aligned per sequence, as :func:`attention`).
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: dropout on the probabilities. It drops exactly what :func:`attention` drops on
            the same sequences right-padded to ``(B, H, max_seqlen_q, max_seqlen_k)``.

    Returns:
        ``(total_q, H, D)`` in q's dtype: each row equals :func:`attention` of its own sequence; a
        query with no key outputs zeros. As :func:`attention`, the ``Lq x Lk`` matrices are never
        stored for backward, and a NaN or inf in ``v`` at a key hidden from a row (causal) may or
        may not make that row NaN (see :func:`attention`); at a key it sees, it does.
    """
    validation.tensor("q", q, ndim=3, floating=True)
    validation.tensor("k", k, ndim=3, floating=True)
    validation.tensor("v", v, ndim=3, floating=True)
    total_q, H, D = q.shape
    total_k = k.shape[0]
    validation.shape("k", k, (total_k, H, D), "(total_k, H, D) with q's H and D")
    validation.shape("v", v, (total_k, H, D), "(total_k, H, D) matching k")
    validation.nonempty_dim("q", q, -1, "the head dim D")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        validation.tensor(name, cu, ndim=1)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor of cumulative lengths, got {cu.dtype}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have shape (B + 1,) with B >= 0, got {tuple(cu.shape)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape (B + 1,) = {tuple(cu_seqlens_q.shape)}, "
                         f"got {tuple(cu_seqlens_k.shape)}")
    validation.same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    max_seqlen_q = validation.positive_int("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = validation.positive_int("max_seqlen_k", max_seqlen_k, minimum=0)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q", "total_q = q.shape[0]")
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k", "total_k = k.shape[0]")
    is_causal = validation.flag("is_causal", is_causal)
    dropout_p = validation.probability("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else validation.positive("scale", scale)

    lowp = validation.autocast_dtype(q.device)
    q, k, v = (validation.cast(t, lowp) for t in (q, k, v))
    validation.same_dtype(q=q, k=k, v=v)

    kernels = backends.select("attention_varlen", q.device, q.dtype, head_dim=D)
    if kernels is None:
        return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with torch.autocast(q.device.type, enabled=False):
        return AttentionVarlenFunction.apply(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                             max_seqlen_q, max_seqlen_k, is_causal, float(scale), dropout_p,
                                             kernels)
