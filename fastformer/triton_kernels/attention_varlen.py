"""Triton kernels for ``fastformer.ops.attention_varlen``: attention over packed sequences
(FlashAttention's varlen layout), run by the padded op's flash-attention kernels (attention.py,
attention_backward.py) with ``VARLEN``: the host functions with the schema's semantics
(csrc/schemas.h), their registration as ``torch.library`` ops and the ahead-of-time compile specs.

Semantics (``fastformer.ops.reference.attention_varlen`` is the definition): q ``(total_q, H, D)``,
k/v ``(total_k, H_kv, D)`` (H_kv divides H: query head h reads k/v head ``h // (H // H_kv)``);
sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and
key rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``, and its query i sees its key j (causal:
iff ``j <= i + Lk - Lq``). Dropout takes the padded op's counters on
``(B, H, max_seqlen_q, max_seqlen_k)`` (attention dropout v3, fastformer/philox.py): query i and
key j of head h of sequence b keep ``attention_keep_mask((B, H, max_seqlen_q, max_seqlen_k))[b, h, i, j]``.
lse is ``(H, total_q)``, +inf for a row with no key.

Launches: the forward over ``cdiv(max_seqlen_q, BLOCK_M)`` query tiles of each of the B * H
heads, dK/dV (making dQ too: attention.FUSED_DQ, BACKWARD.md) over ``cdiv(max_seqlen_k, BLOCK_N)``
key tiles (a program whose tile starts past its sequence's end returns at once: no padded position
is computed; key block 0 of a sequence without keys zeroes its dQ rows), the delta preprocess over
the ``total_q`` packed rows (with ``FASTFORMER_TRITON_FUSED_DQ=0`` dQ over the query tiles, as the
forward); each on one grid axis (attention.attention_grid), so B may pass 65,535. The host never reads cu_seqlens (a GPU would synchronise): the kernels
clamp each sequence into the tensors' rows and its maximum length instead, and the functional
op checks the values where it can read them (CPU tensors).
"""
from typing import List, Optional, Tuple

import torch

from . import attention
from .attention import MAX_HEAD_DIM, Layout
from .registration import register_op
from .utils import on_device_of_first_tensor


def _check_last_dim(op: str, name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 and t.shape[-1] > 1 and t.numel() > 0:
        raise ValueError(f"{op}: {name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_inputs(op: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Layout:
    """The schema's checks of the shared arguments (shapes, dtypes, devices, layouts; not the
    values of cu_seqlens) -> the packed layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D (total, H, D), got shape {tuple(t.shape)}")
    total_q, H, D = q.shape
    total_k = k.shape[0]
    if tuple(k.shape) != (total_k, k.shape[1], D) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{op}: k and v must have shape (total_k, H_kv, D) = (total_k, H_kv, {D}) with q's D; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    attention.check_kv_heads(op, k, H)
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D must be in [1, {MAX_HEAD_DIM}] (the Triton kernels' maximum), got {D}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_last_dim(op, name, t)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{op}: {name} must be int32 (cumulative sequence lengths), got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1 or not cu.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous (B + 1,) tensor with B >= 0, got shape "
                             f"{tuple(cu.shape)}, strides {cu.stride()}")
        if cu.device != q.device:
            raise ValueError(f"{op}: {name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"{op}: cu_seqlens_k must have cu_seqlens_q's shape (B + 1,) = {tuple(cu_seqlens_q.shape)}, "
                         f"got {tuple(cu_seqlens_k.shape)}")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"{op}: max_seqlen_q and max_seqlen_k must be >= 0, got {max_seqlen_q}, {max_seqlen_k}")
    return Layout(cu_seqlens_q.shape[0] - 1, H, max_seqlen_q, max_seqlen_k, D, total_q, total_k, cu_seqlens_q,
                  cu_seqlens_k, True)


@on_device_of_first_tensor
def _attention_varlen_fwd_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                               scale: float, dropout_p: float, philox: torch.Tensor,
                               rel_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    layout = _check_inputs("attention_varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    attention.check_rel_bias("attention_varlen_fwd", q, rel_bias, layout.H)
    return attention.forward(q, k, v, layout, None, None, is_causal, scale, dropout_p, philox, "attention_varlen_fwd",
                             rel_bias)


@on_device_of_first_tensor
def _attention_varlen_bwd_host(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                               scale: float, dropout_p: float, philox: torch.Tensor,
                               rel_bias: Optional[torch.Tensor] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "attention_varlen_bwd"
    layout = _check_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    attention.check_rel_bias(op, q, rel_bias, layout.H)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != layout.lse_shape():
        raise ValueError(f"{op}: dout and out must have q's shape {tuple(q.shape)} and lse (H, total_q) = "
                         f"{layout.lse_shape()}; got {tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise TypeError(f"{op}: dout and out must have q's dtype {q.dtype}, got {dout.dtype}, {out.dtype}")
    _check_last_dim(op, "dout", dout)
    _check_last_dim(op, "out", out)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{op}: lse must be a contiguous fp32 (H, total_q) tensor")
    return attention.backward(dout, q, k, v, out, lse, layout, None, None, is_causal, scale, dropout_p, philox, op,
                              rel_bias)


# q (total_q, H, D), k / v (total_k, H, D) -> out (total_q, H, D), lse (H, total_q) fp32
attention_varlen_fwd = register_op("attention_varlen_fwd", _attention_varlen_fwd_host)
# -> dq, dk, dv, laid out as q, k, v, and rel_bias's gradient
attention_varlen_bwd = register_op("attention_varlen_bwd", _attention_varlen_bwd_host)


def aot_specs() -> List[dict]:
    """The padded op's forward, dK/dV and dQ kernels with VARLEN, one spec per specialisation the
    host launches (attention.kernel_specs): "light" = causal, "heavy" = causal + dropout (no masks
    exist here), "rel" = those + a relative position bias. The delta preprocess is attention.py's
    own spec. With FASTFORMER_TRITON_TMA=1 also the packed TMA kernels' (attention.tma_specs)."""
    specs = attention.kernel_specs("attention_varlen", attention._VARLEN_CLASSES, varlen=True)
    if attention.tma_requested():  # FASTFORMER_TRITON_TMA=1 ... aot --cc 90 --module attention_varlen --match _tma
        specs += attention.tma_specs(varlen=True)
    return specs
