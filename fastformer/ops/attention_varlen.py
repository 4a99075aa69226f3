import math
from typing import Dict, Optional

import torch

from .. import backends, philox
from ..autograd import AttentionVarlenFunction
from ..autograd.attention_varlen import split
from ..internal import validation
from ..internal.eager import eager
from . import reference, relative_position

_FACTS = ("head_dim",)  # what the backend choice reads of a call
_REL_FACTS = ("head_dim", "relative_bias")  # a call with a relative position bias


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
                     dropout_p: float = 0.0, relative_attention_bias: Optional[torch.Tensor] = None,
                     bidirectional: bool = True, relative_attention_max_distance: int = 128) -> torch.Tensor:
    """Attention within each sequence of packed rows, FlashAttention's ``flash_attn_varlen_func``
    layout: no padded position exists, so none is computed.

    Args:
        q: queries ``(total_q, H, D)``, the rows of all sequences one after the other.
        k, v: keys and values ``(total_k, H_kv, D)``; any ``D <= 256``. ``H_kv`` may be smaller
            than ``H`` when it divides it (grouped-query attention): query head ``h`` reads k/v
            head ``h // (H // H_kv)`` (as :func:`attention`).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` cumulative lengths on q's device: sequence
            ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
            ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``. A sequence may be empty.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (bounds for the kernels' grids).
        is_causal: query ``i`` of a sequence sees its key ``j`` iff ``j <= i + Lk - Lq``
            (bottom-right aligned per sequence, as :func:`attention`).
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: dropout on the probabilities. It drops exactly what :func:`attention` drops on
            the same sequences right-padded to ``(B, H, max_seqlen_q, max_seqlen_k)``.
        relative_attention_bias, bidirectional, relative_attention_max_distance: T5's relative
            position bias, as :func:`attention`'s, with positions within each sequence: its query
            ``i`` at position ``i + Lk - Lq`` (the last ``Lq`` of its ``Lk`` positions).

    Returns:
        ``(total_q, H, D)`` in q's dtype: each row equals :func:`attention` of its own sequence; a
        query with no key outputs zeros. As :func:`attention`, the ``Lq x Lk`` matrices are never
        stored for backward, and a NaN or inf in ``v`` at a key hidden from a row (causal) may or
        may not make that row NaN (see :func:`attention`); at a key it sees, it does.
    """
    validation.tensor("q", q, ndim=3, floating=True)
    validation.tensor("k", k, ndim=3, floating=True)
    validation.tensor("v", v, ndim=3, floating=True)
    total_k, H_kv, D = k.shape[0], k.shape[1], q.shape[2]
    validation.shape("k", k, (total_k, H_kv, D), "(total_k, H_kv, D) with q's D")
    validation.kv_heads("k", H_kv, q.shape[1])
    validation.shape("v", v, (total_k, H_kv, D), "(total_k, H_kv, D) matching k")
    return _attention_varlen("q,k,v", {"q": q, "k": k, "v": v}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, is_causal, scale, dropout_p,
                             (relative_attention_bias, bidirectional, relative_attention_max_distance))


def attention_varlen_qkvpacked(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                               is_causal: bool = False, scale: Optional[float] = None,
                               dropout_p: float = 0.0, relative_attention_bias: Optional[torch.Tensor] = None,
                               bidirectional: bool = True, relative_attention_max_distance: int = 128) -> torch.Tensor:
    """:func:`attention_varlen` of self-attention's packed projection (FlashAttention's
    ``flash_attn_varlen_qkvpacked_func``): ``qkv`` ``(total, 3, H, D)`` holds q, k, v of the same
    sequences (``cu_seqlens``, ``max_seqlen``). Same result as ``attention_varlen(*qkv.unbind(1), ...)``;
    its gradient is written as one ``(total, 3, H, D)`` tensor instead of three stacked after.
    """
    validation.tensor("qkv", qkv, ndim=4, floating=True)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, H, D), got {tuple(qkv.shape)}")
    return _attention_varlen("qkv", {"qkv": qkv}, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, is_causal,
                             scale, dropout_p, (relative_attention_bias, bidirectional, relative_attention_max_distance))


def attention_varlen_kvpacked(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                              is_causal: bool = False, scale: Optional[float] = None,
                              dropout_p: float = 0.0, relative_attention_bias: Optional[torch.Tensor] = None,
                              bidirectional: bool = True, relative_attention_max_distance: int = 128) -> torch.Tensor:
    """:func:`attention_varlen` with keys and values packed as ``kv`` ``(total_k, 2, H_kv, D)``
    (cross-attention's projection of the memory; FlashAttention's ``flash_attn_varlen_kvpacked_func``).
    Same result as ``attention_varlen(q, *kv.unbind(1), ...)``; kv's gradient is one tensor.
    """
    validation.tensor("q", q, ndim=3, floating=True)
    validation.tensor("kv", kv, ndim=4, floating=True)
    validation.shape("kv", kv, (kv.shape[0], 2, kv.shape[2], q.shape[2]), "(total_k, 2, H_kv, D) with q's D")
    validation.kv_heads("kv", kv.shape[2], q.shape[1])
    return _attention_varlen("q,kv", {"q": q, "kv": kv}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             is_causal, scale, dropout_p,
                             (relative_attention_bias, bidirectional, relative_attention_max_distance))


def _attention_varlen(layout: str, inputs: Dict[str, torch.Tensor], cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                      scale: Optional[float], dropout_p: float, position=(None, True, 128)) -> torch.Tensor:
    """The checks and the call every layout shares; ``inputs`` by argument name, shapes checked;
    ``position``: (table or None, bidirectional, max_distance) of a relative position bias."""
    q, k, v = split(layout, tuple(inputs.values()))
    total_q, H, D = q.shape
    total_k = k.shape[0]
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
    validation.same_device(**inputs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    max_seqlen_q = validation.positive_int("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = validation.positive_int("max_seqlen_k", max_seqlen_k, minimum=0)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q", "total_q = q.shape[0]")
    if cu_seqlens_k is not cu_seqlens_q or total_k != total_q or max_seqlen_k != max_seqlen_q:
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k", "total_k = k.shape[0]")
    is_causal = validation.flag("is_causal", is_causal)
    dropout_p = validation.probability("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else validation.positive("scale", scale)
    table, bidirectional, max_distance = position
    if table is not None:
        validation.same_device(q=q, relative_attention_bias=table)
        bidirectional, max_distance = relative_position.check_table(table, H, bidirectional, max_distance)

    lowp = validation.autocast_dtype(q.device)
    inputs = {name: validation.cast(t, lowp) for name, t in inputs.items()}
    validation.same_dtype(**inputs)
    tensors = tuple(inputs.values())

    if table is None:
        kernels = backends.select_cached("attention_varlen", q.device, tensors[0].dtype, None, _FACTS, (D,))
    else:
        kernels = backends.select_cached("attention_varlen", q.device, tensors[0].dtype, None, _REL_FACTS, (D, True))
    if kernels is None:
        rel = {} if table is None else dict(relative_attention_bias=table, bidirectional=bidirectional,
                                            relative_attention_max_distance=max_distance)
        return reference.attention_varlen(*split(layout, tensors), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, is_causal=is_causal, scale=scale, dropout_p=dropout_p, **rel)
    tensors = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)
    same_lengths = cu_seqlens_k is cu_seqlens_q  # passed once: torch.compile traces no duplicate input
    cu_seqlens_q = cu_seqlens_q.contiguous()
    cu_seqlens_k = None if same_lengths else cu_seqlens_k.contiguous()
    with validation.autocast_off(q.device):
        rel = None
        if table is not None:  # the bias by distance (H, 2R + 1)
            rel = relative_position.bias_by_distance(table, bidirectional, max_distance,
                                                     torch.promote_types(tensors[0].dtype, torch.float32))
        if kernels.attention_varlen is not None and eager() and rel is None:  # the backward in C++
            return kernels.attention_varlen(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                            float(scale), dropout_p, philox.draw(dropout_p, q.device), *tensors)
        return AttentionVarlenFunction.apply(layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             is_causal, float(scale), dropout_p, kernels, rel, *tensors)
