"""Flash-attention-2 style Triton kernels for ``fastformer.ops.attention``: the forward kernel
(its tile helpers, shared with the backward kernels of attention_backward.py, are in
attention_tiles.py), the host functions with the C++ schema's semantics (csrc/ops.cpp), their
registration as ``torch.library`` ops and the ahead-of-time compile specs.

Semantics (the contract, ``fastformer.ops.reference.attention`` is the definition):
``out = dropout(softmax(q k^T * scale + attn_mask, masked)) v`` with q ``(B, H, Sq, D)`` and
k/v ``(B, H_kv, Sk, D)`` (H_kv divides H: query head h reads k/v head ``h // (H // H_kv)``, the
kernels' ``KV_GROUP``; dK / dV are written per query head in fp32 and each group summed after);
key ``j`` is hidden from query ``i`` when it is padded, when
``is_causal`` and ``j > i + Sk - Sq`` (bottom-right aligned), or when ``attn_mask`` is -inf.
A query row with no visible key outputs 0, its lse is +inf and it gets zero gradient.
A relative position bias by distance ``rel_bias`` (H, 2R + 1) (csrc/schemas.h; ``HAS_REL``) adds
``rel_bias[h, clamp(j - i - (Sk - Sq) - rel_shift, -R, R) + R]`` to the scaled score; the
backward returns its gradient, summed deterministically (attention_backward.py).
Dropout is fastformer/philox.py's attention dropout (v3): element ``(b, h, i, j)`` takes one byte of
the Philox call on counter ``offset + ((bh * ceil(Sq / 16) + i // 16) * ceil(Sk / 32) + j // 32) * 32 + lane``
(``bh = b*H + h``, the lane and byte from ``(i % 16, j % 32)``), kept iff the byte is
``>= round(256 p)`` and scaled by ``256 / (256 - round(256 p))`` (attention_tiles.keep_tile).

Inside the kernels scores live in log2 units (``s * log2(e)``) so the softmax uses ``exp2``;
the saved lse is the natural log-sum-exp.

The backward, padded and packed (varlen), makes dQ in the dK/dV kernel (``FUSED_DQ``,
attention_backward.py, BACKWARD.md): with the forward, the dropout bits are made twice a training
step. The environment variable ``FASTFORMER_TRITON_FUSED_DQ=0`` (read at import) goes back to the
two-kernel backward (dK/dV, then dQ: the bits three times; the default on ROCm, whose Triton cannot
run the fused kernel's PTX inline asm).

``FASTFORMER_TRITON_TMA=1`` (read at each launch; off by default, untimed) streams the forward's K
and V and the dK/dV kernel's Q and dO tiles (and its K / V) at d64 / d128 (fp16 / bf16) on sm_90
through tensor descriptors (TMA), padded and packed, where the layouts allow (tma_eligible;
HOPPER.md).

The same kernels run ``fastformer.ops.attention_varlen`` (attention_varlen.py) with ``VARLEN``:
each grid entry b is then a packed sequence whose rows and lengths come from ``cu_seqlens``
(a :class:`Layout` says which); ``forward`` / ``backward`` are the launch code both ops' host
functions share.
"""
import contextlib
import functools
import os
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import attention_backward as kernels
from .attention_tiles import (LN2, LOG2E, cast, causal_key_bounds, dot, head_base, keep_tile, key_bases,
                              key_tile_scores, load_rows, masked_scores, program_sequence, rel_row, stats_row,
                              store_rows, tma_rows)
from .matmul import input_precision
from .registration import kernel, register_op
from ..philox import attention_keep_scale, attention_threshold
from .utils import (INTERPRET, cdiv, first_config_only, load_philox, next_power_of_2,
                    on_device_of_first_tensor, philox_args)

MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attention_fwd_tile(acc, l_i, m_i, q, start_m, start_n, offs_m, offs_n, offs_d,
                        k_base, stride_kn, v_base, stride_vn, kpm_base, stride_kpm_n,
                        am_base, stride_am_m, stride_am_n, Sq, Sk, D, qk_scale,
                        seed, rng_base, drop_cols, drop_threshold, drop_scale, rel_base, R, pos0,
                        MASK_EDGE: tl.constexpr, EVEN_D: tl.constexpr, HAS_KPM: tl.constexpr,
                        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                        HAS_REL: tl.constexpr, INPUT_PRECISION: tl.constexpr, LARGE_OFFSETS: tl.constexpr,
                        TMA: tl.constexpr):
    """One key tile of the online softmax (queries ``offs_m`` from ``start_m``): returns the updated
    (acc, l_i, m_i). ``Sq``, ``Sk``: this sequence's lengths; ``drop_cols``: the dropout rows' width
    (keep_tile's ``Sk``); ``rel_base``, ``R``, ``pos0``: the relative position bias (masked_scores).
    With TMA ``k_base`` / ``v_base`` are the head's (Sk, D) tensor descriptors (block (BN, BD); VARLEN: the
    sequence's rows)."""
    if TMA:  # the descriptor zero-fills rows past Sk and columns past D, as load_rows' masks do
        k = k_base.load([start_n, 0])  # (BN, BD)
        v = v_base.load([start_n, 0])  # (BN, BD)
        qk = dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), INPUT_PRECISION)
        s = masked_scores(qk, offs_m[:, None], (start_n + offs_n)[None, :], kpm_base, stride_kpm_n, am_base,
                          stride_am_m, stride_am_n, Sq, Sk, qk_scale, rel_base, R, pos0, MASK_EDGE, HAS_KPM,
                          HAS_MASK, IS_CAUSAL, HAS_REL, LARGE_OFFSETS)  # (BM, BN)
    else:
        k, v, s = key_tile_scores(q, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn, kpm_base,
                                  stride_kpm_n, am_base, stride_am_m, stride_am_n, Sq, Sk, D, qk_scale, rel_base, R,
                                  pos0, MASK_EDGE, EVEN_D, HAS_KPM, HAS_MASK, IS_CAUSAL, HAS_REL, INPUT_PRECISION,
                                  LARGE_OFFSETS)
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BM,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible so far
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # (BM, BN)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = keep_tile(seed, rng_base, start_m, start_n, drop_cols, drop_threshold, q.shape[0], k.shape[0],
                         False, q.dtype != tl.float32)  # (BM, BN)
        p = tl.where(keep, p * drop_scale, 0.0)
    acc = dot(cast(p, v.dtype), v, acc * alpha[:, None], INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold", "rel_shift"])
def _attention_fwd(
    Q,  # (B, H, Sq, D) queries, last dim contiguous; VARLEN: (total_q, H, D) packed sequences
    K,  # (B, H_kv, Sk, D) keys, last dim contiguous; VARLEN: (total_k, H_kv, D)
    V,  # (B, H_kv, Sk, D) values, last dim contiguous; VARLEN: (total_k, H_kv, D)
    KPM,  # (B, Sk) u8 key padding mask, nonzero = padded (None without HAS_KPM)
    AM,  # fp32 additive mask viewed as (B, H, Sq, Sk) (None without HAS_MASK)
    RelBias,  # (H, 2R + 1) fp32 contiguous relative position bias by distance (None without HAS_REL)
    CuSeqlensQ,  # VARLEN: (B + 1,) int32 first query row of each sequence (None otherwise)
    CuSeqlensK,  # VARLEN: (B + 1,) int32 first key row of each sequence (None otherwise)
    Out,  # (B, H, Sq, D) output; VARLEN: (total_q, H, D)
    Lse,  # fp32 natural log-sum-exp, +inf for rows with no visible key: (B, H, Sq); VARLEN: (H, total_q)
    stride_qb,  # q batch stride (0 with VARLEN)
    stride_qh,  # q head stride
    stride_qm,  # q row stride
    stride_kb,  # k batch stride (0 with VARLEN)
    stride_kh,  # k head stride
    stride_kn,  # k row stride
    stride_vb,  # v batch stride (0 with VARLEN)
    stride_vh,  # v head stride
    stride_vn,  # v row stride
    stride_ob,  # out batch stride (0 with VARLEN)
    stride_oh,  # out head stride
    stride_om,  # out row stride
    stride_kpm_b,  # key padding mask batch stride
    stride_kpm_n,  # key padding mask key stride
    stride_am_b,  # additive mask batch stride (0 when broadcast)
    stride_am_h,  # additive mask head stride (0 when broadcast)
    stride_am_m,  # additive mask query stride (0 when broadcast)
    stride_am_n,  # additive mask key stride (0 when broadcast)
    H,  # number of heads
    Sq,  # number of queries (VARLEN: max_seqlen_q), the dropout rows per head
    Sk,  # number of keys (VARLEN: max_seqlen_k), the dropout rows' width
    total_q,  # VARLEN: rows of q (every sequence is clamped into them) and of each head of lse; unused otherwise
    total_k,  # VARLEN: rows of k and v; unused otherwise
    D,  # head dim (<= BLOCK_D)
    scale,  # fp32 score scale
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # i64 dropout Philox seed (without Philox)
    rng_offset,  # i64 dropout Philox counter of element 0 (without Philox)
    drop_threshold,  # i32 attention_threshold(dropout_p) = round(dropout_p * 256): keep iff byte >= it
    drop_scale,  # fp32 attention_keep_scale(dropout_p) = 256 / (256 - drop_threshold)
    R,  # the relative position bias's largest distance (0 without HAS_REL)
    rel_shift,  # query i of a sequence is at position i + Lk - Lq + rel_shift (0 with VARLEN)
    TUNE_SQ,  # autotune key only: Sq bucket (power of two)
    TUNE_SK,  # autotune key only: Sk bucket (power of two)
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two >= 16
    EVEN_D: tl.constexpr,  # D == BLOCK_D (no head-dim masking)
    HAS_KPM: tl.constexpr,  # a key padding mask is given
    HAS_MASK: tl.constexpr,  # an additive mask is given
    IS_CAUSAL: tl.constexpr,  # bottom-right causal masking
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    HAS_REL: tl.constexpr,  # a relative position bias is given
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 operands: "ieee" | "tf32"
    LARGE_OFFSETS: tl.constexpr,  # some row or mask offset of one head passes 2**31: int64 offsets
    VARLEN: tl.constexpr,  # packed sequences: entry b of the grid is sequence b of the cu_seqlens
    KV_GROUP: tl.constexpr,  # query heads per k/v head: query head h reads k/v head h // KV_GROUP
    TMA: tl.constexpr,  # K and V through device-side tensor descriptors (sm_90's TMA; tma_eligible)
):
    start_m, h, b64, h64, q0, k0, Lq, Lk = program_sequence(CuSeqlensQ, CuSeqlensK, H, Sq, Sk, total_q, total_k,
                                                           BLOCK_M, False, IS_CAUSAL, VARLEN)
    if VARLEN:
        if start_m >= Lq:  # the grid covers the longest sequence: this one ends before the tile
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_rows(head_base(Q, b64, h64, stride_qb, stride_qh, q0, stride_qm), offs_m, stride_qm, offs_d, Lq, D,
                  EVEN_D, LARGE_OFFSETS)
    seed, rng_offset = load_philox(Philox, seed, rng_offset)
    k_base, v_base, kpm_base, am_base, rng_base = key_bases(
        K, V, KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, k0, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
        stride_vn, stride_kpm_b, stride_am_b, stride_am_h, KV_GROUP)
    if TMA:
        # one (Lk, D) descriptor per tensor and program, built in the kernel (128 B of the launch's
        # global scratch each, triton.set_allocator's): TMA copies each (BN, BD) tile into shared
        # memory, cp.async.bulk.tensor where the default is cp.async (HOPPER.md). VARLEN: based at
        # the sequence's first key row, Lk rows long, so the zero fill stops at its own last key
        k_base = tma_rows(k_base, Lk, D, stride_kn, BLOCK_N, BLOCK_D, VARLEN)
        v_base = tma_rows(v_base, Lk, D, stride_vn, BLOCK_N, BLOCK_D, VARLEN)
    rel_base = rel_row(RelBias, b64, h64, R)
    pos0 = Lk - Lq + rel_shift
    qk_scale = scale * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi, hi = causal_key_bounds(start_m, Lq, Lk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for start_n in range(0, full_hi, BLOCK_N):  # tiles every query of the block sees whole
        acc, l_i, m_i = _attention_fwd_tile(
            acc, l_i, m_i, q, start_m, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn,
            kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D, qk_scale, seed,
            rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, False, EVEN_D, HAS_KPM, HAS_MASK,
            IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS, TMA)
    for start_n in range(full_hi, hi, BLOCK_N):  # the causal diagonal and the ragged key tail
        acc, l_i, m_i = _attention_fwd_tile(
            acc, l_i, m_i, q, start_m, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn,
            kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D, qk_scale, seed,
            rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, True, EVEN_D, HAS_KPM, HAS_MASK,
            IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS, TMA)

    empty = l_i == 0.0  # no visible key: output 0, lse +inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])  # 0 even if v held NaN (0 * NaN)
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    store_rows(head_base(Out, b64, h64, stride_ob, stride_oh, q0, stride_om), cast(out, Out.dtype.element_ty),
               offs_m, stride_om, offs_d, Lq, D, EVEN_D, LARGE_OFFSETS)
    tl.store(stats_row(Lse, b64, h, H, Sq, q0, total_q, VARLEN) + offs_m, lse, mask=offs_m < Lq)


# ----------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------
# The interpreter runs one fixed, small configuration (tests monkeypatch it to force more tiles),
# or, with INTERPRET_FIRST_CHOICE, each kernel's first-choice GPU tile (as deterministic mode does).
INTERPRET_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32}
INTERPRET_FIRST_CHOICE = False
# The backward (padded and packed) makes dQ in the dK/dV kernel (ordered fp32 adds, BACKWARD.md):
# dropout bits twice a training step (forward, fused backward), no dQ kernel. On by default (not on ROCm: its
# hand-over's barrier is PTX inline asm); FASTFORMER_TRITON_FUSED_DQ=0 goes back to the two-kernel
# backward (dK/dV, then dQ), for the launches and for aot_specs() (which then compiles the
# two-kernel path in full)
FUSED_DQ = os.environ.get("FASTFORMER_TRITON_FUSED_DQ", "0" if torch.version.hip else "1") != "0"
SMEM_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory per block (opt-in maximum)
PREPROCESS_BLOCK_M = 64
BLOCK_D_BUCKETS = (32, 64, 128, 256)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and BLOCK_D bucket, best guess first.
# fwd / dq: BLOCK_M queries kept per program, BLOCK_N keys streamed; dkdv: BLOCK_N keys kept,
# BLOCK_M queries streamed. "heavy" launches (dropout or an additive mask) get smaller score
# tiles: the Philox state (one call per 8 scores) and the fp32 mask tile would otherwise spill
# registers.
# fp32 (rare on a GPU; full-precision FMA dots, or tf32 ones, which want small tiles) runs one
# config per class (_CONFIGS_FP32), the largest tile tried that compiles without spills for ieee
# and tf32 dots on sm_80 and sm_90 (the heavy one also serves rel unless _CONFIGS_REL has its own).
# Every first choice compiles for sm_80 and sm_90 with all features of its class on and
# no register spill (python -m fastformer.triton_kernels.aot --module attention; tests/test_triton_compile.py
# fails on any); alternates may spill a little and the autotuner then only picks them if faster.
_CONFIGS_LOWP = {
    "fwd": {
        32: {"light": [(128, 64, 4, 3), (64, 64, 4, 3)], "heavy": [(128, 32, 8, 3), (64, 32, 4, 3)]},
        64: {"light": [(128, 64, 8, 3), (64, 64, 4, 4)], "heavy": [(64, 64, 8, 3), (128, 32, 8, 3)]},
        128: {"light": [(64, 64, 8, 3), (128, 32, 8, 3)], "heavy": [(64, 32, 8, 2), (128, 32, 8, 2)]},
        256: {"light": [(64, 32, 8, 2), (32, 64, 8, 2)], "heavy": [(32, 64, 8, 2), (64, 32, 8, 2)]},
    },
    "dkdv": {
        32: {"light": [(32, 128, 8, 3), (32, 64, 4, 3)], "heavy": [(32, 64, 8, 3), (16, 64, 4, 3)]},
        64: {"light": [(32, 128, 8, 3), (32, 64, 4, 3)], "heavy": [(32, 32, 8, 3), (16, 64, 4, 3)]},
        128: {"light": [(32, 64, 8, 3), (64, 64, 8, 2)], "heavy": [(32, 32, 8, 2), (16, 64, 8, 3)]},
        256: {"light": [(16, 32, 8, 2), (32, 32, 8, 2)], "heavy": [(32, 16, 8, 2), (16, 16, 4, 2)]},
    },
    "dq": {
        32: {"light": [(128, 64, 8, 3), (64, 64, 4, 3)], "heavy": [(64, 32, 8, 3), (64, 32, 4, 3)]},
        64: {"light": [(64, 64, 8, 3), (128, 32, 8, 3)], "heavy": [(32, 64, 4, 3), (64, 32, 8, 3)]},
        128: {"light": [(64, 64, 8, 3), (128, 32, 8, 2)], "heavy": [(64, 32, 8, 2), (32, 64, 8, 2)]},
        256: {"light": [(32, 32, 8, 2), (16, 64, 4, 2)], "heavy": [(32, 64, 8, 2), (16, 64, 4, 2)]},
    },
}
# Since dropout v3 (its Philox words live across the tile) and the one-axis grid the heavy class
# takes a smaller tile or other warps / stages where light's spilled with it: the forward at d32
# (64x32 spilled on sm_80) and d256 (16x32), dQ at d64 (32x32, sm_80), d128 (16x32 with 8 warps) and
# d256 (4 warps), dK/dV at d256 (2 stages, sm_80). ptxas allocates these small fp32 tiles erratically
# (a clean config with one stage less or half the warps can spill kilobytes): each entry here and
# below is a config that compiled clean, not a trend (python -m fastformer.triton_kernels.aot
# --match '_fp32_' compiles them all).
_CONFIGS_FP32 = {
    "fwd": {
        32: {"light": (64, 32, 8, 3), "heavy": (32, 32, 8, 3)},
        64: {"light": (16, 32, 8, 3), "heavy": (16, 32, 8, 3)},
        128: {"light": (16, 32, 8, 2), "heavy": (16, 32, 8, 2)},
        256: {"light": (16, 32, 8, 1), "heavy": (16, 16, 8, 2)},
    },
    "dkdv": {
        32: {"light": (16, 16, 8, 3), "heavy": (16, 16, 8, 3)},
        64: {"light": (16, 32, 8, 3), "heavy": (16, 32, 8, 3)},
        128: {"light": (16, 16, 8, 2), "heavy": (16, 16, 8, 2)},
        256: {"light": (16, 16, 8, 2), "heavy": (16, 16, 8, 1)},
    },
    "dq": {
        32: {"light": (16, 32, 4, 3), "heavy": (16, 32, 4, 3)},
        64: {"light": (32, 32, 4, 2), "heavy": (32, 16, 4, 2)},
        128: {"light": (16, 32, 8, 2), "heavy": (16, 16, 4, 2)},
        256: {"light": (16, 16, 4, 2), "heavy": (16, 16, 8, 2)},
    },
}


# Packed sequences (VARLEN) hold each sequence's first rows and lengths in registers (loaded from
# cu_seqlens, where the padded kernels read kernel parameters): where that makes the padded op's
# first choice spill, the varlen kernels lead with their own (kind, BLOCK_D, element size, heavy).
# The Philox pointer argument (load_philox) costs the heavy kernels a few registers more: so do
# the heavy fp16 / bf16 dK/dV at d256 (the padded (32, 16, 8, 2) spilled on sm_90; 16x16 tiles spill
# on sm_80 with 8 warps, on sm_90 with 4), and in fp32 the forward at d64 (3 stages spilled on
# sm_90), dQ at d64 (32x32 spilled with tf32 dots on sm_90), d128 (4 warps spilled on sm_90) and
# d256 (8 warps spilled on sm_80), dK/dV at d32 (3 stages spilled on sm_80) and the light one at
# d128 (2 stages spilled, 8 warps on sm_80, 4 with tf32 dots on sm_90).
_CONFIGS_VARLEN = {
    ("fwd", 128, 2, False): [(128, 32, 8, 3), (64, 64, 4, 3)],
    ("fwd", 64, 4, True): [(16, 32, 8, 2)],
    ("dq", 64, 4, True): [(32, 16, 8, 3)],
    ("dq", 128, 4, True): [(16, 16, 8, 2)],
    ("dq", 256, 4, True): [(16, 16, 4, 2)],
    ("dkdv", 32, 4, True): [(16, 16, 8, 2)],
    ("dkdv", 128, 4, False): [(16, 16, 8, 1)],
    ("dkdv", 128, 4, True): [(16, 16, 8, 2)],
    ("dkdv", 256, 2, True): [(32, 16, 8, 1)],
    ("dkdv", 256, 4, True): [(16, 16, 8, 1)],
}

# A relative position bias (HAS_REL: a per-score gather, and dK/dV's diagonal sums and their
# window) runs in the heavy class; where that class's first choice spills with it, its own lead
# (kind, BLOCK_D, element size, varlen): padded, the fp32 dK/dV at d256 (1 stage spilled on sm_90);
# packed, the fp16 / bf16 dK/dV at d32 (3 stages spilled on sm_80) and d128 (32x32 spilled on
# sm_90), and in fp32 the forward at d128 (2 stages spilled with tf32 dots on sm_90), dK/dV at
# d128 (16x16 spilled on sm_90, 16x16 with 4 warps on sm_80) and d256 (every 16x16 tile tried
# spilled on sm_90; tf32 dots: _CONFIGS_TF32) and dQ at d256 (the varlen heavy's 4 warps spilled
# with tf32 dots on sm_90).
_CONFIGS_REL = {
    ("dkdv", 256, 4, False): [(16, 16, 8, 2)],
    ("fwd", 128, 4, True): [(16, 32, 8, 1)],
    ("dkdv", 32, 2, True): [(32, 64, 8, 2)],
    ("dkdv", 128, 2, True): [(32, 16, 8, 2)],
    ("dkdv", 128, 4, True): [(32, 16, 8, 2)],
    ("dq", 256, 4, True): [(16, 16, 8, 2)],
    ("dkdv", 256, 4, True): [(32, 16, 8, 2)],
}

# fp32 with tf32 dots, where no config tried compiles clean for both precisions: its own lead by
# (kind, BLOCK_D, varlen, rel), before the tables above: dK/dV at d256 with a bias, padded (the
# ieee lead, 16x16 with 2 stages, spilled 8-24 B with tf32 dots; 1 stage spilled with ieee ones on
# sm_90) and packed (the ieee lead, 32x16 with 2 stages, spilled 64-72 B with tf32 dots; 1 stage
# spilled kilobytes with ieee ones; every 16x16 tile tried, 4 / 8 warps, 1-3 stages, spilled on
# sm_90).
_CONFIGS_TF32 = {
    ("dkdv", 256, False, True): [(16, 16, 8, 1)],
    ("dkdv", 256, True, True): [(32, 16, 8, 1)],
}


# sm_90 (Hopper) runs a dot on wgmma (HGMMA in the SASS) when its M side (the accumulator's rows:
# BLOCK_M of the forward's and dQ's dots, BLOCK_N of dK/dV's) is at least 64, a warpgroup's; below
# that it runs on sm_80's mma.sync (HMMA). Where sm_80's fp16 / bf16 first choice has a dot below
# 64 rows, the sm_90 family leads with its own, by (kind, BLOCK_D, class: "light" / "heavy" /
# "rel"; rel takes heavy's unless listed), for the padded and packed layouts alike; then sm_80's
# candidates. None: none fits, every 64-row tile tried spilled on sm_90 (dK/dV at d256, where dK and
# dV alone are 2 x 64 x 256 fp32 accumulators; dK/dV at d128 with dropout; dQ at d256 with dropout),
# so sm_80's first choice (mma.sync) stays. fp32 keeps its one config (FMA or tf32 dots). The sm_90
# compiles behind these (registers, spills, HGMMA per kernel): triton_kernels/HOPPER.md.
_CONFIGS_SM90 = {
    ("dkdv", 64, "heavy"): (32, 64, 8, 3),
    ("dq", 64, "heavy"): (64, 32, 4, 3),
    ("dkdv", 128, "heavy"): None,
    ("fwd", 256, "heavy"): (64, 16, 8, 2),
    ("dq", 256, "light"): (64, 32, 8, 2),
    ("dkdv", 256, "light"): None,
    ("dkdv", 256, "heavy"): None,
    ("dq", 256, "heavy"): None,
}

# Short sequences (both lengths <= SHORT_LENGTH, where encoder-decoders train) also try these
# fp16 / bf16 candidates, by (kind, BLOCK_D, heavy), after the others: a key range in one or two
# wide tiles (the light forward: 128 keys a step) and 64-row tiles (wgmma on sm_90; twice the
# programs of a 128-row tile when B * H alone does not fill the GPU), 2 stages (little to pipeline
# in a short loop); each compiles without spills on sm_80 and sm_90 (fp16, all classes, padded and
# packed); the other kernels' tries spilled on one of them (HOPPER.md lists them). Longer or
# symbolic lengths do not try them (_short).
SHORT_LENGTH = 512
_CONFIGS_SHORT = {
    ("fwd", 32, False): [(64, 128, 8, 2)],
    ("fwd", 128, False): [(64, 128, 8, 2)],
    ("fwd", 32, True): [(64, 32, 4, 2)],
    ("fwd", 64, True): [(64, 32, 4, 2)],
    ("dq", 32, False): [(64, 64, 4, 2)],
    ("dq", 64, False): [(64, 64, 8, 2)],
    ("dq", 128, False): [(64, 32, 4, 2)],
    ("dq", 32, True): [(64, 32, 4, 2)],
    ("dkdv", 32, False): [(64, 64, 4, 2)],
}


# The fused backward (FUSED_DQ: kind "dkdv_dq", dK/dV's kernel making dQ too) takes dK/dV's
# configs, led by its own where dK/dV's first choice spills with the dQ product, its transpose
# and the accumulator's pointers: by (BLOCK_D, element size, "tf32" for fp32 with tf32 dots,
# class, arch, varlen) (python -m fastformer.triton_kernels.aot --match dkdvdq_; BACKWARD.md's
# tables). Padded: fp16 / bf16 rel at d64 on sm_90 (its sm_90 lead, 32x64, spilled 136-148 B),
# fp32 at d128 on sm_80 (8 warps spilled 24-32 B at 128 registers) and fp32 rel at d256 on sm_90
# (2 stages spilled 56 B; 1 stage: the loop is not pipelined, 4 warps spilled 456 B). Packed
# (varlen's dK/dV first choices, _CONFIGS_VARLEN / _CONFIGS_REL / _CONFIGS_TF32, differ): the
# padded leads where they compile clean there too, and fp16 / bf16 rel at d32 on sm_80 (32x64
# spilled 4 / 4 B stores / loads at 255 registers), fp32 heavy at d128 on sm_80 (the padded lead's
# 4 warps spilled 16 / 16 B: varlen dK/dV's 8) and fp32 rel with tf32 dots at d256 on sm_90 (32x16
# w8 s1 spilled 12 / 12 B; the other 16x16 / 16x32 / 32x16 tiles tried, 1-3 stages, 4 or 8 warps,
# spilled 8 - 1,588 B stores + loads).
_CONFIGS_FUSED = {
    (64, 2, "rel", 90, False): (32, 32, 8, 3),
    (128, 4, "light", 80, False): (16, 16, 4, 2),
    (128, 4, "heavy", 80, False): (16, 16, 4, 2),
    (256, 4, "rel", 90, False): (16, 16, 8, 1),
    (32, 2, "rel", 80, True): (16, 64, 8, 2),
    (64, 2, "rel", 90, True): (32, 32, 8, 3),
    (128, 4, "light", 80, True): (16, 16, 4, 2),
    (128, 4, "heavy", 80, True): (16, 16, 8, 2),
    (256, 4, "rel", 90, True): (16, 16, 8, 1),
    (256, "tf32", "rel", 90, True): (16, 16, 8, 3),
}


def _sm90_lead(kind: str, block_d: int, heavy: bool, rel: bool):
    """sm_90's first choice of a kernel (_CONFIGS_SM90), or None where sm_80's stays first."""
    cls = "rel" if rel else "heavy" if heavy else "light"
    if (kind, block_d, cls) in _CONFIGS_SM90:
        return _CONFIGS_SM90[kind, block_d, cls]
    return _CONFIGS_SM90.get((kind, block_d, "heavy")) if rel else None


def _arch(device: torch.device) -> int:
    """The config family of ``device``: 90 on a Hopper GPU (sm_90's wgmma), 80 otherwise (sm_80's
    mma.sync tiles; also the interpreter's CPU tensors). Asked at launch, never at import."""
    if device.type != "cuda":
        return 80
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    # ROCm reports its gfx9 GPUs as capability 9.x too: no wgmma there
    return 90 if torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9 else 80


# TMA (tensor descriptors) for the kernels' row streams: opt-in (FASTFORMER_TRITON_TMA=1, read at
# each launch) until a GPU times it against the cp.async stream; the forward's K / V and the dK/dV
# kernel's Q / dO (and its K / V tile), padded and packed layouts, fp16 / bf16, these BLOCK_D
# buckets, sm_90 only (HOPPER.md, "TMA (tensor descriptors)")
TMA_ENV = "FASTFORMER_TRITON_TMA"
TMA_BLOCK_D = (64, 128)
# the dK/dV kernel's BLOCK_D buckets with TMA for the heavy classes (dropout, an additive mask, a
# bias): at d128 their first choices (mma.sync tiles at 170-211 registers) reach 255 with the
# descriptors and spill 216-804 B (HOPPER.md), so d128 takes TMA in the light class only
TMA_BWD_HEAVY_BLOCK_D = (64,)


def tma_requested() -> bool:
    """Whether the environment asks for the TMA kernels (``FASTFORMER_TRITON_TMA=1``)."""
    return os.environ.get(TMA_ENV, "0") == "1"


def tma_layout_ok(t: torch.Tensor) -> bool:
    """Whether a (..., rows, D) tensor, or a packed (total, H, D) one, meets TMA's rules for the
    descriptors the kernels build from its heads (and, packed, from each sequence's first row):
    contiguous in D, ``D * element size >= 16``, a 16-byte aligned base and every other stride a
    multiple of 16 bytes (a size-1 dimension's stride is never applied: not checked)."""
    elt = t.element_size()
    if t.dim() < 2 or t.shape[-1] * elt < 16 or (t.stride(-1) != 1 and t.shape[-1] > 1):
        return False
    try:
        if t.data_ptr() % 16:
            return False
    except RuntimeError:  # a fake tensor (tracing) has no address: the cp.async kernel
        return False
    return all(stride * elt % 16 == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1)


def tma_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: "Layout", arch: int,
                 *streamed: torch.Tensor) -> bool:
    """Whether this launch streams its rows through tensor descriptors (the kernels' ``TMA``):
    asked for (tma_requested), on sm_90 (``arch``, _arch's), keys to stream (``layout.Sk`` > 0;
    packed: the longest sequence's), fp16 / bf16, a BLOCK_D in TMA_BLOCK_D, k, v and the backward's
    ``streamed`` tensors (q and dout, whose tiles dK/dV loads) within TMA's rules (tma_layout_ok),
    and not under torch.compile (its captured launch would run without the scratch allocator the
    launch installs). Otherwise the cp.async kernel runs. Either layout: packed, each program's
    descriptors start at its sequence's first row. A few attribute reads a call."""
    if arch != 90 or not tma_requested() or layout.Sk == 0:  # Sk = 0: nothing to stream
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or _block_d(layout.D) not in TMA_BLOCK_D:
        return False
    if torch.compiler.is_compiling():
        return False
    return all(tma_layout_ok(t) for t in (k, v, *streamed))


@contextlib.contextmanager
def _tma_scratch(device: torch.device):
    """The device-side descriptors' global scratch, for one launch: triton.set_allocator's hook
    is a ContextVar (this thread's, this context's), set here to allocate from torch's caching
    allocator on ``device`` and reset to whatever was there before (the user's, Inductor's, or
    none) when the launch returns. The buffer is freed after the launch is queued, which torch's
    stream-ordered allocator makes safe (the kernel runs on the current stream, as torch's ops do)."""
    from triton.runtime import _allocation  # the ContextVar itself: its token restores exactly
    token = _allocation._allocator.set(
        lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0 (axes 1 and 2: 65,535)


def attention_grid(n_rows, block: int, H: int, B: int) -> Tuple[int, int, int]:
    """The grid of a kernel over ``cdiv(n_rows, block)`` tiles of each of the B * H heads: one axis
    (attention_tiles.program_ids decodes it), so B and H are bounded by axis 0's 2**31 - 1
    programs in all, not by axis 1 / 2's 65,535 each."""
    n = cdiv(n_rows, block) * H * B
    if isinstance(n, int) and n > MAX_PROGRAMS:
        raise ValueError(f"attention: {cdiv(n_rows, block)} tiles x H={H} heads x B={B} sequences = {n} programs, "
                         f"more than a CUDA grid's {MAX_PROGRAMS}")
    return (n, 1, 1)


def _smem_estimate(kind: str, block_m: int, block_n: int, block_d: int, stages: int, elt: int,
                   has_mask: bool) -> int:
    """Shared memory (bytes) a configuration needs: the software pipeliner keeps ``stages - 1``
    copies of every tile the loop streams (the fp32 additive-mask tile too), plus the tiles kept
    for the whole loop as dot operands, a P / dS staging tile and the small per-row vectors.
    Matches ``triton.compile`` for sm_80 within those vectors (sm_90 adds up to ~60 KiB for its
    wgmma operands, still inside its larger limit: see aot_specs())."""
    mask = 4 * block_m * block_n if has_mask else 0
    staging = elt * block_m * block_n
    if kind == "dkdv_dq":  # its dQ accumulator lives in global memory
        kind = "dkdv"
    if kind == "fwd":  # q kept; k, v streamed
        kept, streamed = block_m * block_d * elt, 2 * block_n * block_d * elt
    elif kind == "dkdv":  # k, v kept; q, dO (and lse, delta) streamed
        kept, streamed = 2 * block_n * block_d * elt, 2 * block_m * block_d * elt + 8 * block_m
    else:  # dq: q, dO kept; k, v streamed
        kept, streamed = 2 * block_m * block_d * elt, 2 * block_n * block_d * elt
    return max(stages - 1, 1) * (streamed + mask) + kept + staging + 1024


def _prune(kind: str, candidates, block_d: int, elt: int, heavy: bool, smem_limit: int) -> List[triton.Config]:
    """``candidates`` as Configs, pruned to ``smem_limit``: a config that would not fit loses
    pipeline stages first, and is dropped if even one stage is too much."""
    keep = []
    for bm, bn, warps, stages in candidates:
        while stages > 1 and _smem_estimate(kind, bm, bn, block_d, stages, elt, heavy) > smem_limit:
            stages -= 1
        if _smem_estimate(kind, bm, bn, block_d, stages, elt, heavy) <= smem_limit:
            keep.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return keep


@functools.lru_cache(maxsize=None)
def _configs(kind: str, block_d: int, elt: int, heavy: bool, varlen: bool = False,
             rel: bool = False, arch: int = 80, short: bool = False, tf32: bool = False) -> Tuple[triton.Config, ...]:
    """Autotune configs for one kernel, BLOCK_D bucket, element size, feature class (heavy =
    dropout, an additive mask or a relative position bias; ``rel``: the last, see _CONFIGS_REL),
    layout and config family (``arch``: _arch's 80 or 90; 90 leads with _CONFIGS_SM90's first
    choice), pruned to fit sm_80's shared memory (sm_90's for its own first choice). ``short``
    appends the short-length candidates (_CONFIGS_SHORT) after the first choice and the others;
    ``tf32``: fp32 with tf32 dots (_CONFIGS_TF32). ``kind`` "dkdv_dq" (FUSED_DQ): dK/dV's, led by
    _CONFIGS_FUSED's where it lists one."""
    if kind == "dkdv_dq":
        keep = list(_configs("dkdv", block_d, elt, heavy, varlen, rel, arch, short, tf32))
        cls = "rel" if rel else "heavy" if heavy else "light"
        lead = _CONFIGS_FUSED.get((block_d, "tf32" if tf32 and elt == 4 else elt, cls, arch, varlen))
        if lead is not None:
            keep = _prune("dkdv", [lead], block_d, elt, heavy, SMEM_LIMIT[arch]) + keep
        unique = {}
        for cfg in keep:
            unique.setdefault((tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages), cfg)
        return tuple(unique.values())
    if tf32 and elt == 4 and (kind, block_d, varlen, rel) in _CONFIGS_TF32:
        candidates = _CONFIGS_TF32[kind, block_d, varlen, rel]
    elif rel and (kind, block_d, elt, varlen) in _CONFIGS_REL:
        candidates = _CONFIGS_REL[kind, block_d, elt, varlen]
    elif varlen and (kind, block_d, elt, heavy) in _CONFIGS_VARLEN:
        candidates = _CONFIGS_VARLEN[kind, block_d, elt, heavy]
    elif elt == 4:
        candidates = [_CONFIGS_FP32[kind][block_d]["heavy" if heavy else "light"]]
    else:
        candidates = _CONFIGS_LOWP[kind][block_d]["heavy" if heavy else "light"]
    keep = _prune(kind, candidates, block_d, elt, heavy, SMEM_LIMIT[80])
    if short and elt == 2:
        keep += _prune(kind, _CONFIGS_SHORT.get((kind, block_d, heavy), ()), block_d, elt, heavy, SMEM_LIMIT[80])
    if arch == 90 and elt == 2:
        lead = _sm90_lead(kind, block_d, heavy, rel)
        if lead is not None:
            keep = _prune(kind, [lead], block_d, elt, heavy, SMEM_LIMIT[90]) + keep
    if not keep:  # the smallest tile fits everything
        keep.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1))
    unique = {}
    for cfg in keep:  # a config listed twice is benchmarked once
        unique.setdefault((tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages), cfg)
    return tuple(unique.values())


_TUNERS = {}
# constexprs within one feature class that change how much of each tile is work (masked tiles,
# skipped causal tiles, a key padding mask's loads, k/v rows shared by a group): Triton's
# autotuner keys on the launch's keyword arguments named here, so each combination is timed apart
_TUNE_FEATURES = ("IS_CAUSAL", "HAS_KPM", "HAS_MASK", "HAS_DROPOUT", "KV_GROUP")


def _tuned(kind: str, fn, block_d: int, elt: int, heavy: bool, varlen: bool = False, rel: bool = False,
           arch: int = 80, short: bool = False, tf32: bool = False, tma: bool = False):
    """The autotuned launcher of ``fn`` for one (BLOCK_D bucket, element size, feature class,
    layout, bias or not, config family, short lengths or not, tf32 dots or not, TMA or not), keyed on
    the sequence-length buckets, the head dim and the masks the launch applies (_TUNE_FEATURES: a
    causal launch's best tile is timed, not inherited from an unmasked launch's)."""
    key = (kind, block_d, elt, heavy, varlen, rel, arch, short, tf32, tma)
    if key not in _TUNERS:
        # dK/dV's rel_bias gradient scratch is summed whole and must start at zero: each
        # benchmarked config writes its own rows, so the tuner zeroes it again before the real run
        # FUSED_DQ's counters too: a benchmarked run leaves them at each tile's last key block
        reset = (["DRel"] if rel and kind in ("dkdv", "dkdv_dq") else []) + (["DQLock"] if kind == "dkdv_dq" else [])
        reset = reset or None
        _TUNERS[key] = triton.autotune(configs=list(_configs(kind, block_d, elt, heavy, varlen, rel, arch, short,
                                                             tf32)),
                                       key=["TUNE_SQ", "TUNE_SK", "D",
                                            *(f for f in _TUNE_FEATURES if f in fn.arg_names)],
                                       reset_to_zero=reset)(fn)
    return _TUNERS[key]


def _short(Sq, Sk) -> bool:
    """Whether a launch tries the short-length candidates: both lengths known (not symbolic under
    torch.compile's dynamic shapes) and at most SHORT_LENGTH."""
    return isinstance(Sq, int) and isinstance(Sk, int) and max(Sq, Sk) <= SHORT_LENGTH


def _tune_bucket(n) -> int:
    """The autotune key of a sequence length: its power-of-two bucket (a symbolic length under
    torch.compile's dynamic shapes is passed through rather than specialised)."""
    return max(16, next_power_of_2(n)) if isinstance(n, int) else n


def _block_d(D: int) -> int:
    """The BLOCK_D bucket of head dim D: the next power of two, at least the smallest bucket."""
    return max(BLOCK_D_BUCKETS[0], next_power_of_2(D))


# ----------------------------------------------------------------------------------------------
# Host functions (the C++ schema's semantics)
# ----------------------------------------------------------------------------------------------
def check_kv_heads(op: str, k: torch.Tensor, H: int) -> None:
    """k's heads (dimension 1 in either layout) divide q's H (grouped-query attention)."""
    H_kv = k.shape[1]
    if H_kv != H and (H_kv < 1 or H % H_kv):
        raise ValueError(f"{op}: k has {H_kv} heads, which must divide q's {H} heads (grouped-query attention)")


def _check_inputs(q, k, v, key_padding_mask, attn_mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention: q, k, v must be 4-D (B, H, S, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    if tuple(k.shape) != (B, H_kv, Sk, D) or tuple(v.shape) != (B, H_kv, Sk, D):
        raise ValueError(f"attention: k and v must have shape (B, H_kv, Sk, D) = (B, H_kv, Sk, {D}) with q's B; "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_kv_heads("attention", k, H)
    if D > MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim {D} is larger than the Triton kernels' maximum {MAX_HEAD_DIM}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v must share one dtype of fp16/bf16/fp32, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"attention: {name} must have a contiguous last dimension, got strides {t.stride()}")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                         or tuple(key_padding_mask.shape) != (B, Sk)):
        raise ValueError(f"attention: key_padding_mask must be a (B, Sk) = {(B, Sk)} bool tensor, got "
                         f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}")
    if attn_mask is not None and attn_mask.dtype != torch.float32:
        raise TypeError(f"attention: attn_mask must be an fp32 additive mask, got {attn_mask.dtype}")


def _mask_args(key_padding_mask, attn_mask, B, H, Sq, Sk):
    """(kpm tensor, its 2 strides, am tensor, its 4 strides): the masks, or None (the kernels'
    constexpr None: nothing allocated, nothing read) and zero strides."""
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(torch.uint8)  # (B, Sk)
        kpm_strides = kpm.stride()
    else:
        kpm, kpm_strides = None, (0, 0)
    if attn_mask is not None:
        am = attn_mask.expand(B, H, Sq, Sk)  # a view: broadcast dims get stride 0
        am_strides = am.stride()
    else:
        am, am_strides = None, (0, 0, 0, 0)
    return kpm, kpm_strides, am, am_strides


def _large_offsets(Sq, Sk, q_row_strides, k_row_strides, am_strides, kpm_strides) -> bool:
    """Whether an element offset inside one (b, h) head can reach 2**31: a row of a query-side
    (``q_row_strides``: q, out, dout, dq) or key-side (k, v, dk, dv) tensor, or the additive or
    padding mask. The kernels then compute those offsets in int64 (LARGE_OFFSETS); the batch and
    head offsets are always int64."""
    spans = [(Sq - 1) * abs(s) for s in q_row_strides] + [(Sk - 1) * abs(s) for s in k_row_strides]
    spans.append((Sq - 1) * abs(am_strides[2]) + (Sk - 1) * abs(am_strides[3]))
    spans.append((Sk - 1) * abs(kpm_strides[1]))
    return max(spans) + MAX_HEAD_DIM >= 2**31


def _dropout_args(dropout_p: float):
    """(HAS_DROPOUT, threshold, scale) for attention's keep-test ``byte >= threshold`` (philox.py, v3)."""
    if dropout_p <= 0.0:
        return False, 0, 1.0
    return True, attention_threshold(dropout_p), attention_keep_scale(dropout_p)


@functools.lru_cache(maxsize=None)
def _first_config(kind: str, block_d: int, elt: int, heavy: bool, varlen: bool, rel: bool = False,
                  arch: int = 80, tf32: bool = False) -> dict:
    """The launch keywords (tiles, warps, stages) of a kernel's first-choice config, built once."""
    cfg = _configs(kind, block_d, elt, heavy, varlen, rel, arch, False, tf32)[0]
    return dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _heavy(meta: dict) -> bool:
    """The feature class of a launch: dropout, an additive mask or a relative position bias (its
    per-score gather, and dK/dV's diagonal sums) want the smaller "heavy" tiles."""
    return bool(meta["HAS_MASK"] or meta["HAS_DROPOUT"] or meta.get("HAS_REL", False))


def _rel_tiles(Sk: int, block_d: int, elt: int, meta: dict, arch: int = 80, short: bool = False,
               kind: str = "dkdv") -> int:
    """Rows per head of the dK/dV kernel's rel_bias gradient scratch: its grid's key tiles under
    the smallest BLOCK_N any config of the launch (``kind``: "dkdv" or "dkdv_dq") may take (the
    autotuner picks after allocation)."""
    if INTERPRET and not INTERPRET_FIRST_CHOICE:
        block_n = INTERPRET_BLOCKS["BLOCK_N"]
    else:
        block_n = min(cfg.kwargs["BLOCK_N"] for cfg in _configs(kind, block_d, elt, _heavy(meta),
                                                                  meta.get("VARLEN", False), True, arch, short,
                                                                  meta.get("INPUT_PRECISION") == "tf32"))
    return cdiv(Sk, block_n)


def _launch(kind, fn, grid_of, block_d, elt, args, meta, arch=80, short=False):
    """Launch ``fn`` through ``wrap_triton`` (inside a traced op torch.compile captures the kernel;
    on the eager path it is the kernel itself): autotuned on a GPU (its first config where
    ``utils.first_config_only()``), the fixed interpreter blocks on CPU. ``grid_of(launch keywords)``:
    the grid of a config; ``arch``: the device's config family (_arch); ``short``: the lengths try
    the short-length candidates too (_short)."""
    if INTERPRET and not INTERPRET_FIRST_CHOICE:
        kernel(fn)[grid_of(INTERPRET_BLOCKS)](*args, **meta, **INTERPRET_BLOCKS)
    else:
        heavy = _heavy(meta)
        varlen = meta.get("VARLEN", False)
        rel = meta.get("HAS_REL", False)
        tf32 = meta.get("INPUT_PRECISION") == "tf32"
        if INTERPRET or first_config_only():  # the first (best-guess) config, no autotuning
            launch = _first_config(kind, block_d, elt, heavy, varlen, rel, arch, tf32)
            kernel(fn)[grid_of(launch)](*args, **meta, **launch)
        else:
            kernel(_tuned(kind, fn, block_d, elt, heavy, varlen, rel, arch, short, tf32,
                          meta.get("TMA", False)))[grid_of](*args, **meta)


def _grad_like(x: torch.Tensor) -> torch.Tensor:
    g = torch.empty_like(x)
    return g if g.stride(-1) == 1 or g.shape[-1] == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


class Layout(NamedTuple):
    """Where the kernels find the rows of each of the B sequences: padded, sequence b is entry b of
    (B, H, S, D) tensors, Sq queries and Sk keys; VARLEN (attention_varlen.py), sequence b owns rows
    ``cu_q[b]:cu_q[b + 1]`` of packed (total_q, H, D) queries and ``cu_k[b]:cu_k[b + 1]`` of
    (total_k, H, D) keys and values, Sq and Sk are the longest lengths (the grid's bound and the
    dropout rows' shape: the padded op's counters)."""
    B: int
    H: int
    Sq: int
    Sk: int
    D: int
    total_q: int  # rows of q: B * Sq when padded
    total_k: int  # rows of k and v: B * Sk when padded
    cu_q: Optional[torch.Tensor]  # (B + 1,) int32 with VARLEN, else None
    cu_k: Optional[torch.Tensor]
    varlen: bool

    def strides(self, t: torch.Tensor) -> Tuple[int, int, int]:
        """(batch, head, row) strides of a q-, k- or v-shaped tensor (batch 0 when packed)."""
        return (0, t.stride(1), t.stride(0)) if self.varlen else (t.stride(0), t.stride(1), t.stride(2))

    def lse_shape(self) -> Tuple[int, ...]:
        """lse (and delta): (H, total_q) when packed (the schema's), else (B, H, Sq); contiguous."""
        return (self.H, self.total_q) if self.varlen else (self.B, self.H, self.Sq)


def padded_layout(q: torch.Tensor, k: torch.Tensor) -> Layout:
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    return Layout(B, H, Sq, Sk, D, B * Sq, B * Sk, None, None, False)


def kv_group(layout: Layout, k: torch.Tensor) -> int:
    """Query heads per k/v head: 1, or H // H_kv for grouped-query attention (k's dimension 1 is
    its heads in both layouts)."""
    return layout.H // k.shape[1] if k.shape[1] else 1


def _meta(q, layout: Layout, block_d: int, key_padding_mask, attn_mask, is_causal: bool, has_dropout: bool,
          large: bool, group: int, rel_bias: Optional[torch.Tensor]) -> dict:
    """The constexprs every attention kernel but the preprocess takes."""
    return dict(BLOCK_D=block_d, EVEN_D=layout.D == block_d, HAS_KPM=key_padding_mask is not None,
                HAS_MASK=attn_mask is not None, IS_CAUSAL=bool(is_causal), HAS_DROPOUT=has_dropout,
                HAS_REL=rel_bias is not None, INPUT_PRECISION=input_precision(q.dtype), LARGE_OFFSETS=large,
                VARLEN=layout.varlen, KV_GROUP=group)


def _rel_args(rel_bias: Optional[torch.Tensor], rel_shift: int) -> Tuple[Optional[torch.Tensor], int, int]:
    """(RelBias, R, rel_shift) of the kernels: a checked (H, 2R + 1) bias or None (and zeros)."""
    if rel_bias is None:
        return None, 0, 0
    return rel_bias, (rel_bias.shape[1] - 1) // 2, rel_shift


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
            key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], is_causal: bool,
            scale: float, dropout_p: float, philox: torch.Tensor, op: str, rel_bias: Optional[torch.Tensor] = None,
            rel_shift: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs in ``layout`` -> out (q's shape, contiguous) and lse (``layout.lse_shape()``);
    ``philox`` the op's (``op`` names it in errors), see utils.philox_args; ``rel_bias`` a checked
    (H, 2R + 1) relative position bias or None, ``rel_shift`` its queries' shift."""
    B, H, Sq, Sk, D = layout.B, layout.H, layout.Sq, layout.Sk, layout.D
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(layout.lse_shape(), dtype=torch.float32, device=q.device)
    if B * H * Sq * D == 0 or out.numel() == 0:  # nothing to launch (packed: no sequence has a query)
        lse.fill_(float("inf"))
        return out.zero_(), lse
    kpm, kpm_strides, am, am_strides = _mask_args(key_padding_mask, attn_mask, B, H, Sq, Sk)
    has_dropout, threshold, drop_scale = _dropout_args(dropout_p)
    rng = philox_args(philox, q.device, op, has_dropout)
    block_d = _block_d(D)
    qs, ks, vs, outs = (layout.strides(t) for t in (q, k, v, out))
    rel, R, rel_shift = _rel_args(rel_bias, rel_shift)
    args = (q, k, v, kpm, am, rel, layout.cu_q, layout.cu_k, out, lse, *qs, *ks, *vs, *outs,
            *kpm_strides, *am_strides, H, Sq, Sk, layout.total_q, layout.total_k, D, float(scale), *rng,
            threshold, drop_scale, R, rel_shift, _tune_bucket(Sq), _tune_bucket(Sk))
    large = _large_offsets(Sq, Sk, (qs[2], outs[2]), (ks[2], vs[2]), am_strides, kpm_strides)
    arch = _arch(q.device)
    tma = tma_eligible(q, k, v, layout, arch)
    meta = dict(_meta(q, layout, block_d, key_padding_mask, attn_mask, is_causal, has_dropout, large,
                      kv_group(layout, k), rel_bias), TMA=tma)
    with _tma_scratch(q.device) if tma else contextlib.nullcontext():
        _launch("fwd", _attention_fwd, lambda META: attention_grid(Sq, META["BLOCK_M"], H, B), block_d,
                q.element_size(), args, meta, arch, _short(Sq, Sk))
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, layout: Layout, key_padding_mask: Optional[torch.Tensor],
             attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, dropout_p: float,
             philox: torch.Tensor, op: str, rel_bias: Optional[torch.Tensor] = None,
             rel_shift: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked inputs in ``layout`` -> dq, dk, dv laid out like ``empty_like(q / k / v)``, and
    rel_bias's gradient (rel_bias_grad's empty tensor without one)."""
    has_dropout, threshold, drop_scale = _dropout_args(dropout_p)
    rng = philox_args(philox, q.device, op, has_dropout)
    B, H, Sq, Sk, D = layout.B, layout.H, layout.Sq, layout.Sk, layout.D
    # laid out like empty_like(q / k / v), as every backend's kernels and the shared fake promise
    # (a transposed (B, S, H, D) input gets a gradient of that layout); the kernel writes dk and dv
    # with one set of strides, so a dv laid out otherwise than dk is written to a copy of dk's layout
    dq, dk_out = _grad_like(q), _grad_like(k)
    dv_out = _grad_like(v)
    group = kv_group(layout, k)
    drel = rel_bias_grad(q, rel_bias)  # zeros, the gradient where no kernel runs
    if B * H == 0 or D == 0:
        return dq, dk_out, dv_out, drel
    if Sq == 0 or layout.total_q == 0:  # no query: every key gets zero gradient
        return dq, dk_out.zero_(), dv_out.zero_(), drel
    if group > 1:
        # grouped-query: dK / dV per query head in fp32, each group summed after (FlashAttention-2's
        # way: deterministic, no atomics)
        per_head = (*k.shape[:1], H, *k.shape[2:])
        dk = torch.empty(per_head, dtype=torch.float32, device=k.device)
        dv = torch.empty_like(dk)
    else:
        dk = dk_out
        dv = dv_out if dv_out.stride() == dk.stride() else torch.empty_like(dk)
    kpm, kpm_strides, am, am_strides = _mask_args(key_padding_mask, attn_mask, B, H, Sq, Sk)
    block_d = _block_d(D)
    qs, ks, vs, dos, outs, dqs, dks = (layout.strides(t) for t in (q, k, v, dout, out, dq, dk))
    delta = torch.empty(layout.lse_shape(), dtype=torch.float32, device=q.device)
    large = _large_offsets(Sq, Sk, (qs[2], outs[2], dos[2], dqs[2], D), (ks[2], vs[2], dks[2]), am_strides,
                           kpm_strides)  # D: FUSED_DQ's accumulator rows
    # the preprocess runs on rows alone: packed rows are one sequence of total_q rows
    pre_b, pre_rows = (1, layout.total_q) if layout.varlen else (B, Sq)
    pre_large = large or _large_offsets(pre_rows, 1, (outs[2], dos[2]), (), (0, 0, 0, 0), (0, 0))
    pre_block = INTERPRET_BLOCKS["BLOCK_M"] if INTERPRET else PREPROCESS_BLOCK_M
    kernel(kernels._attention_bwd_preprocess)[attention_grid(pre_rows, pre_block, H, pre_b)](
        out, dout, delta, *outs, *dos, H, pre_rows, D, BLOCK_M=pre_block, BLOCK_D=block_d, EVEN_D=D == block_d,
        LARGE_OFFSETS=pre_large)

    rel, R, rel_shift = _rel_args(rel_bias, rel_shift)
    common = (q, k, v, dout, lse, delta, kpm, am, rel, layout.cu_q, layout.cu_k)
    strides = (*qs, *ks, *vs, *dos, *kpm_strides, *am_strides)
    scalars = (H, Sq, Sk, layout.total_q, layout.total_k, D, float(scale), *rng, threshold, drop_scale, R, rel_shift)
    buckets = (_tune_bucket(Sq), _tune_bucket(Sk))
    meta = _meta(q, layout, block_d, key_padding_mask, attn_mask, is_causal, has_dropout, large, group, rel_bias)
    elt = q.element_size()
    arch, short = _arch(q.device), _short(Sq, Sk)
    # dQ made in the dK/dV kernel (FUSED_DQ, BACKWARD.md): its fp32 partial sums and a counter a
    # query tile (the counters at start_m // 16: every BLOCK_M the tuner may pick has a slot)
    fused = FUSED_DQ and Sk > 0
    if fused:
        acc_shape = (H, layout.total_q, D) if layout.varlen else (B, H, Sq, D)
        dq_args = (dq, torch.empty(acc_shape, dtype=torch.float32, device=q.device),
                   torch.zeros((B, H, cdiv(Sq, 16)), dtype=torch.int32, device=q.device))
        dq_strides = dqs
    else:
        dq_args, dq_strides = (None, None, None), (0, 0, 0)
    if Sk > 0:
        # rel_bias's gradient: each dK/dV program's own row of sums by distance, summed here in a
        # fixed order (no atomics: the same bits every run)
        rel_tiles = (_rel_tiles(Sk, block_d, elt, meta, arch, short, "dkdv_dq" if fused else "dkdv")
                     if rel is not None else 0)
        drel_rows = (torch.zeros((B, H, rel_tiles, 2 * R + 1), dtype=torch.float32, device=q.device)
                     if rel is not None else None)
        # TMA: the dK/dV kernel's Q / dO tiles (and its K / V) through descriptors (tma_eligible);
        # the two-kernel path's dQ kernel stays on cp.async
        tma = (block_d in TMA_BWD_HEAVY_BLOCK_D or not _heavy(meta)) and tma_eligible(q, k, v, layout, arch, q, dout)
        with _tma_scratch(q.device) if tma else contextlib.nullcontext():
            _launch("dkdv_dq" if fused else "dkdv", kernels._attention_bwd_dkdv,
                    lambda META: attention_grid(Sk, META["BLOCK_N"], H, B), block_d, elt,
                    (*common, dk, dv, drel_rows, *dq_args, *strides, *dks, *dq_strides, *scalars, rel_tiles,
                     *buckets), dict(meta, FUSED_DQ=fused, TMA=tma), arch, short)
        if rel is not None:
            drel = drel_rows.sum(dim=(0, 2))
    if not fused:
        _launch("dq", kernels._attention_bwd_dq, lambda META: attention_grid(Sq, META["BLOCK_M"], H, B),
                block_d, elt, (*common, dq, *strides, *dqs, *scalars, *buckets), meta, arch, short)
    if group > 1:
        groups = (*k.shape[:1], k.shape[1], group, *k.shape[2:])  # (.., H_kv, G, ..)
        if Sk > 0:
            dk_out.copy_(dk.view(groups).sum(2))
            dv_out.copy_(dv.view(groups).sum(2))
    elif dv is not dv_out:
        dv_out.copy_(dv)
    return dq, dk_out, dv_out, drel


MAX_REL_SHIFT = 1 << 30  # csrc/checks/attention.h's bound: positions stay far from int32 overflow


def check_rel_bias(op: str, q: torch.Tensor, rel_bias: Optional[torch.Tensor], H: int, rel_shift: int = 0) -> None:
    """rel_bias and rel_shift (csrc/schemas.h), as csrc/checks/attention.h's check_rel_bias: an
    (H, 2R + 1) fp32 contiguous tensor on q's device (the kernels' only stat dtype), or None."""
    if not -MAX_REL_SHIFT <= rel_shift <= MAX_REL_SHIFT:
        raise ValueError(f"{op}: rel_shift must be in [-2^30, 2^30], got {rel_shift}")
    if rel_bias is None:
        return
    if rel_bias.device != q.device:
        raise ValueError(f"{op}: rel_bias is on {rel_bias.device} but q is on {q.device}")
    if rel_bias.dtype != torch.float32:
        raise TypeError(f"{op}: rel_bias must be float32, got {rel_bias.dtype}")
    if rel_bias.dim() != 2 or rel_bias.shape[0] != H or rel_bias.shape[1] % 2 != 1 or rel_bias.shape[1] > MAX_REL_SHIFT:
        raise ValueError(f"{op}: rel_bias must have shape (H, 2R + 1) = ({H}, an odd size), got "
                         f"{tuple(rel_bias.shape)}")
    if not rel_bias.is_contiguous():
        raise ValueError(f"{op}: rel_bias must be contiguous, got strides {rel_bias.stride()}")


def rel_bias_grad(q: torch.Tensor, rel_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The backward's fourth result: (H, 2R + 1) fp32 zeros for a rel_bias (the gradient where
    no kernel runs), an empty (0,) fp32 tensor without one."""
    if rel_bias is None:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    return torch.zeros(rel_bias.shape, dtype=torch.float32, device=q.device)


@on_device_of_first_tensor
def _attention_fwd_host(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                        is_causal: bool, scale: float, dropout_p: float,
                        philox: torch.Tensor, rel_bias: Optional[torch.Tensor] = None,
                        rel_shift: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, key_padding_mask, attn_mask)
    check_rel_bias("attention_fwd", q, rel_bias, q.shape[1], rel_shift)
    return forward(q, k, v, padded_layout(q, k), key_padding_mask, attn_mask, is_causal, scale, dropout_p, philox,
                   "attention_fwd", rel_bias, rel_shift)


@on_device_of_first_tensor
def _attention_bwd_host(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                        attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float,
                        dropout_p: float, philox: torch.Tensor, rel_bias: Optional[torch.Tensor] = None,
                        rel_shift: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, key_padding_mask, attn_mask)
    check_rel_bias("attention_bwd", q, rel_bias, q.shape[1], rel_shift)
    B, H, Sq, D = q.shape
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (B, H, Sq):
        raise ValueError(f"attention_bwd: dout and out must have q's shape {tuple(q.shape)} and lse "
                         f"{(B, H, Sq)}; got {tuple(dout.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}")
    if dout.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("attention_bwd: dout and out must have a contiguous last dimension")
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError("attention_bwd: lse must be a contiguous fp32 (B, H, Sq) tensor")
    return backward(dout, q, k, v, out, lse, padded_layout(q, k), key_padding_mask, attn_mask, is_causal, scale,
                    dropout_p, philox, "attention_bwd", rel_bias, rel_shift)


# q, k, v (B, H, S, D) -> out (B, H, Sq, D), lse (B, H, Sq) fp32
attention_fwd = register_op("attention_fwd", _attention_fwd_host)
# -> dq, dk, dv, laid out as q, k, v, and rel_bias's gradient
attention_bwd = register_op("attention_bwd", _attention_bwd_host)


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compile specs
# ----------------------------------------------------------------------------------------------
ARCHS = (80, 90)  # the config families (_arch), each with its AOT target
# (dtype, BLOCK_D) of the padded two-kernel backward's specs (dK/dV, dQ) while FUSED_DQ is on:
# the opt-out's kernels, a sample that keeps tests/test_triton_compile.py's run short (every
# class, both targets, the head dims of the converted models)
TWO_KERNEL_SAMPLE = ((torch.float16, 64), (torch.float16, 128))
_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def _signature(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:  # strides, sizes and the autotune buckets
            sig[name] = "i32"
    return sig


def _divisible_by_16(fn, signature: dict) -> List[str]:
    """The arguments the JIT specialises for typical inputs: 16-byte aligned pointers and tensor
    strides (and D, with EVEN_D) that are multiples of 16. Without these hints loads are not
    vectorised and the software pipeliner does not run: not the code a GPU launch compiles."""
    return [name for name in fn.arg_names
            if signature[name].startswith("*")
            or (name.startswith("stride_") and not name.startswith(("stride_kpm", "stride_am")))
            or name == "D"]


def _spec(name: str, fn, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    signature = _signature(fn, types, constexprs)
    return {"name": name, "fn": fn, "signature": signature, "constexprs": constexprs, "num_warps": num_warps,
            "num_stages": num_stages, "divisible_by_16": _divisible_by_16(fn, signature)}


def kernel_specs(prefix: str, classes: dict, varlen: bool = False) -> List[dict]:
    """Specs of the forward, dK/dV and dQ kernels: each dtype, each BLOCK_D bucket, each feature
    class ``{name: (heavy, constexprs)}`` (its features all on: its largest code and register
    footprint) with each of its autotune configs. The pointers of absent features (a mask, the
    cu_seqlens of the padded layout, the philox of a launch without dropout) are launched as None:
    constexprs here too. With dropout ``Philox`` is a pointer: the device form of the argument,
    which loads (seed, offset); the CPU form (scalars) only drops those two loads. Each config
    family (ARCHS: sm_80's, sm_90's) has its specs, with the short-length candidates, compiled for
    its own target (the spec's ``ccs``; sm_90's names end in ``_sm90``). With FUSED_DQ the padded
    layout's backward is the fused dK/dV + dQ kernel ("dkdvdq" names), compiled in full; the
    two-kernel backward (FASTFORMER_TRITON_FUSED_DQ=0) only for TWO_KERNEL_SAMPLE (it is compiled
    in full when FUSED_DQ is off)."""
    specs = []
    fused = FUSED_DQ
    kinds = {"fwd": _attention_fwd, **({"dkdv_dq": kernels._attention_bwd_dkdv} if fused else {}),
             "dkdv": kernels._attention_bwd_dkdv, "dq": kernels._attention_bwd_dq}
    for dtype, ptr in _PTR.items():
        elt = torch.empty((), dtype=dtype).element_size()
        types = _types(ptr)
        # fp32 runs "ieee" dots, or "tf32" ones where torch allows tf32 matmuls (its own specs)
        for precision in (("ieee", "tf32") if dtype == torch.float32 else ("ieee",)):
            for block_d in BLOCK_D_BUCKETS:
                for cls, (heavy, features) in classes.items():
                    features = dict(BLOCK_D=block_d, EVEN_D=True, INPUT_PRECISION=precision, LARGE_OFFSETS=False,
                                    KV_GROUP=1, TMA=False,
                                    **features, **_absent_pointers(features))
                    for kind, fn in kinds.items():
                        if fused and kind in ("dkdv", "dq") and (dtype, block_d) not in TWO_KERNEL_SAMPLE:
                            continue  # the opt-out path: a sample of it
                        for arch in ARCHS:
                            for cfg in _configs(kind, block_d, elt, heavy, varlen, features["HAS_REL"], arch, True,
                                                precision == "tf32"):
                                bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
                                tag = kind.replace("_", "")  # dkdv_dq: "dkdvdq"
                                name = (f"{prefix}_{tag}_{ptr[1:]}{'_tf32' if precision == 'tf32' else ''}"
                                        f"_d{block_d}_{cls}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}"
                                        f"{'' if arch == 80 else f'_sm{arch}'}")
                                constexprs = {k: c for k, c in features.items() if k in fn.arg_names}  # DRel
                                if fn is kernels._attention_bwd_dkdv:  # "dkdv_dq": makes dQ too
                                    constexprs["FUSED_DQ"] = kind == "dkdv_dq"
                                    if kind == "dkdv":
                                        constexprs.update(DQ=None, DQAcc=None, DQLock=None)
                                spec = _spec(name, fn, types, {**constexprs, **cfg.kwargs}, cfg.num_warps,
                                             cfg.num_stages)
                                spec["ccs"] = [arch]  # each family compiles for its own target
                                specs.append(spec)
    return specs


def _absent_pointers(features: dict) -> dict:
    """The pointer arguments a launch with these feature flags passes as None (constexprs)."""
    absent = {}
    if not features["HAS_KPM"]:
        absent["KPM"] = None
    if not features["HAS_MASK"]:
        absent["AM"] = None
    if not features["VARLEN"]:
        absent.update(CuSeqlensQ=None, CuSeqlensK=None)
    if not features["HAS_DROPOUT"]:
        absent["Philox"] = None
    if not features["HAS_REL"]:
        absent.update(RelBias=None, DRel=None)
    return absent


def _types(ptr: str) -> dict:
    types = {name: ptr for name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV")}
    types.update({"scale": "fp32", "seed": "i64", "rng_offset": "i64", "drop_scale": "fp32", "KPM": "*u8",
                  "AM": "*fp32", "Lse": "*fp32", "Delta": "*fp32", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32",
                  "Philox": "*i64", "RelBias": "*fp32", "DRel": "*fp32", "DQAcc": "*fp32", "DQLock": "*i32"})
    return types


def _feature_classes(varlen: bool) -> dict:
    """A layout's feature classes, each with all its features on: {name: (heavy, constexprs)}. The
    packed op (attention_varlen.aot_specs) has no masks."""
    masks = not varlen
    features = dict(HAS_KPM=masks, IS_CAUSAL=True, VARLEN=varlen)
    return {"light": (False, dict(features, HAS_MASK=False, HAS_DROPOUT=False, HAS_REL=False)),
            "heavy": (True, dict(features, HAS_MASK=masks, HAS_DROPOUT=True, HAS_REL=False)),
            "rel": (True, dict(features, HAS_MASK=False, HAS_DROPOUT=True, HAS_REL=True))}


_PADDED_CLASSES = _feature_classes(varlen=False)
_VARLEN_CLASSES = _feature_classes(varlen=True)


def tma_specs(dtypes=(torch.float16, torch.bfloat16), block_ds=TMA_BLOCK_D, classes=("light", "heavy", "rel"),
              kinds=("fwd", "bwd"), varlen: bool = False) -> List[dict]:
    """The TMA kernels' specs (``TMA=True``): the forward ("fwd") and the dK/dV kernel ("bwd": making
    dQ too with FUSED_DQ, "dkdvdq" names), padded or packed (``varlen``: "attention_varlen_"
    names), sm_90's first choice of each dtype, BLOCK_D bucket and class, for sm_90 only (names
    ``..._sm90_tma``; the backward's where it takes TMA: TMA_BWD_HEAVY_BLOCK_D). Not in aot_specs()
    unless TMA is asked for (tma_requested): an opt-in's 20 compiles a layout stay out of the
    default AOT run; the tests compile a few."""
    specs = []
    prefix, feature_classes = ("attention_varlen", _VARLEN_CLASSES) if varlen else ("attention", _PADDED_CLASSES)
    for dtype in dtypes:
        ptr = _PTR[dtype]
        elt = torch.empty((), dtype=dtype).element_size()
        for block_d in block_ds:
            for cls in classes:
                heavy, features = feature_classes[cls]
                for kind in kinds:
                    if kind == "bwd" and heavy and block_d not in TMA_BWD_HEAVY_BLOCK_D:
                        continue  # backward() launches the cp.async kernel there
                    if kind == "fwd":
                        fn, launch_kind, extra = _attention_fwd, "fwd", {}
                    else:  # what backward() launches: FUSED_DQ's dK/dV + dQ, or dK/dV alone
                        fn = kernels._attention_bwd_dkdv
                        launch_kind = "dkdv_dq" if FUSED_DQ else "dkdv"
                        extra = dict(FUSED_DQ=FUSED_DQ, **({} if FUSED_DQ else dict(DQ=None, DQAcc=None, DQLock=None)))
                    cfg = _configs(launch_kind, block_d, elt, heavy, varlen, features["HAS_REL"], 90)[0]
                    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
                    constexprs = dict(BLOCK_D=block_d, EVEN_D=True, INPUT_PRECISION="ieee", LARGE_OFFSETS=False,
                                      KV_GROUP=1, TMA=True, **features, **_absent_pointers(features), **extra,
                                      **cfg.kwargs)
                    constexprs = {k: c for k, c in constexprs.items() if k in fn.arg_names}
                    spec = _spec(f"{prefix}_{launch_kind.replace('_', '')}_{ptr[1:]}_d{block_d}_{cls}_m{bm}_n{bn}"
                                 f"_w{cfg.num_warps}_s{cfg.num_stages}_sm90_tma", fn, _types(ptr), constexprs,
                                 cfg.num_warps, cfg.num_stages)
                    spec["ccs"] = [90]
                    specs.append(spec)
    return specs


def aot_specs() -> List[dict]:
    """One spec per kernel specialisation the padded op's host code launches on a GPU (see
    kernel_specs): "light" = padding mask + causal, "heavy" = those + additive mask + dropout,
    "rel" = padding mask + causal + dropout + relative position bias (T5's call; with an additive
    mask too, the largest fp32 tiles may spill a few bytes). The preprocess kernel (the varlen
    op's too) runs at its one fixed block."""
    specs = kernel_specs("attention", _PADDED_CLASSES)
    if tma_requested():  # FASTFORMER_TRITON_TMA=1 python -m fastformer.triton_kernels.aot --cc 90 --match _tma
        specs += tma_specs()
    for ptr in _PTR.values():
        for block_d in BLOCK_D_BUCKETS:
            specs.append(_spec(f"attention_bwd_preprocess_{ptr[1:]}_d{block_d}", kernels._attention_bwd_preprocess,
                               _types(ptr), {"BLOCK_M": PREPROCESS_BLOCK_M, "BLOCK_D": block_d, "EVEN_D": True,
                                             "LARGE_OFFSETS": False}, 4, 1))
    return specs
