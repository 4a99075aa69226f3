"""A tiled GEMM ``C = A @ B`` with fused epilogues: the kernel behind the Triton feed-forward.

Operands are passed with their strides, so a transposed operand (``w^T``, ``dout^T``) is just a
stride swap and never a copy. The epilogue, picked by constexprs, fuses what would otherwise be
extra passes over an ``(M, N)`` tensor:

* ``"none"``:    ``C = A @ B (+ bias)``.
* ``"act_fwd"``: ``pre = A @ B (+ bias)`` is stored to ``C`` and ``D = dropout(act(pre))`` (the next
  GEMM's input) to ``D``.
* ``"act_bwd"``: ``A @ B`` is the gradient of ``D``; with ``pre`` loaded from ``pre_ptr``, stores
  ``C = dpre = (A @ B) * keep * scale * act'(pre)`` and ``D = dropout(act(pre))`` recomputed.

``ROW_SUM_A`` also writes ``sum_k A[m, k]`` (fp32 accumulation): for a weight-gradient GEMM
``dW = dY^T X`` that is the bias gradient ``db = dY.sum(0)``, from the programs of the first
column block, without another kernel launch.

Dropout is the shared Philox definition (fastformer/philox.py, :func:`triton_kernels.utils.dropout_keep_tile`)
with rows of ``N`` columns: element ``(m, n)`` of the ``(M, N)`` tensor takes its 16 bits from the
Philox call on counter ``offset + m * ceil(N / 8) + n // 8`` (column tiles start at multiples of
``BLOCK_N``, a multiple of 8, so a tile holds whole groups).

Any M, N, K (no multiple-of-block rule: every load and store is masked). Accumulation is fp32;
fp32 inputs use ``input_precision="ieee"`` unless ``torch.backends.cuda.matmul.allow_tf32``.

Split-K. One program per (M, N) tile leaves most of the GPU idle when the tiles are few and K is
long: the feed-forward weight gradients ``dW = dY^T X`` reduce over every token, and a 512 x 2048
weight is 64 tiles of 128 x 128, under half of an H100's 132 SMs. :func:`launch` then cuts K into
S slices of whole BLOCK_K steps (:func:`choose_split_k`: the fewest S with tiles x S >= the SM
count whose last wave of programs is also well filled; the SM count read from the device at the
first launch and cached, 132 under the interpreter; at most K / MIN_K_PER_SPLIT slices and
SPLIT_K_WORKSPACE_BYTES of workspace; S = 1, the single-kernel path above, when the tiles
already fill the SMs or K is short). Program (tile, s) of
:func:`_matmul_split_k` writes its fp32 partial tile to an (S, M, N) workspace (and, for
``ROW_SUM_A``, its partial row sums to (S, M)); :func:`_split_k_reduce` then adds the S partials
of each output block in slice order 0..S-1 and applies the same epilogue (bias, cast,
activation/dropout, row sums). A fixed summation order and no float atomics: the same bits on
every run (for a given device, as S follows its SM count). The split path runs one fixed tile
config (the tile count must be known to choose S), never the autotuner.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from .utils import cdiv, dropout_keep_tile, dropout_threshold, first_config_only, load_philox, next_power_of_2

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_GELU_TANH_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_TANH_KAPPA = tl.constexpr(0.044715)
EPILOGUE_ROWS = tl.constexpr(16)  # rows per step of the activation/dropout pass over a finished tile


def _config(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Autotune candidates on a GPU, per operand width. 16-bit: tensor-core tiles after the Triton
# matmul tutorial, from large (128x256x64) to small (64x128x32, short token counts). fp32 without
# tf32 runs on FMA units, where Triton holds a whole BLOCK_K slice of both operands in registers:
# BLOCK_K = 16 keeps those kernels spill-free (BLOCK_K = 32 spills on sm_80; see triton_kernels.aot).
CONFIGS_16BIT = [
    _config(128, 256, 64, 8, 3),
    _config(128, 128, 64, 4, 4),
    _config(64, 128, 32, 4, 4),
]
CONFIGS_32BIT = [
    _config(128, 128, 16, 8, 3),
    _config(64, 64, 16, 4, 3),
]
# The interpreter runs every program instance in numpy: one small tile keeps tests fast and still
# spans several tiles (and their tails) at test shapes.
CONFIGS_INTERPRET = [_config(32, 32, 32, 4, 1, group_m=4)]

# The autotune key: sizes that vary from batch to batch (token counts: M in the forward, K in the
# weight gradients) enter rounded to a power of two, so a new batch shape does not re-tune;
# the strides tell the operand layouts (NT / NN / TN) apart.
_KEY = ["CACHE_KEY_M", "N", "CACHE_KEY_K", "stride_ak", "stride_bk", "EPILOGUE", "ACTIVATION",
        "HAS_BIAS", "DROPOUT", "ROW_SUM_A"]


@triton.jit
def _gelu_tanh_s(x, SIGN: tl.constexpr):
    """sigmoid(SIGN 2z), z = sqrt(2 / pi) (x + 0.044715 x^3): gelu_tanh's 0.5 (1 + tanh(z)) for SIGN 1
    and 0.5 (1 - tanh(z)) for SIGN -1, each to fp32's relative precision (1 +- tanh(z) by
    subtraction would lose it where tanh nears -+1); 0 or 1, never NaN, where exp overflows."""
    z = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x * x * x)
    return 1.0 / (1.0 + tl.exp(-2.0 * SIGN * z))


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) for fp32 x: relu, the exact (erf) gelu, silu x sigmoid(x), or gelu_tanh (the tanh
    approximation, F.gelu(approximate="tanh"))."""
    if ACTIVATION == "relu":
        return tl.maximum(x, 0.0)
    elif ACTIVATION == "silu":
        return x * (1.0 / (1.0 + tl.exp(-x)))
    elif ACTIVATION == "gelu_tanh":
        return x * _gelu_tanh_s(x, 1.0)
    else:
        return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act / dx for fp32 x. relu: 1 where x > 0, 0 at and below 0 (F.relu's rule, as the reference);
    gelu: Phi(x) + x phi(x); silu: s (1 + x (1 - s)) with s = sigmoid(x) (torch's silu_backward)."""
    if ACTIVATION == "relu":
        return tl.where(x > 0.0, 1.0, 0.0)
    elif ACTIVATION == "silu":
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        # the tanh form's own derivative 0.5 (1 + t) + 0.5 x (1 - t^2) z' with t = tanh(z), written
        # s + 2 x s (1 - s) z' with s = 0.5 (1 + t), 1 - s = 0.5 (1 - t) (1 - t^2 = 4 s (1 - s))
        s = _gelu_tanh_s(x, 1.0)
        dz = _GELU_TANH_BETA * (1.0 + 3.0 * _GELU_TANH_KAPPA * x * x)
        return s + 2.0 * x * s * _gelu_tanh_s(x, -1.0) * dz
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
        return cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI


@triton.jit
def _cast(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 x to dtype. EMULATE_BF16: the interpreter truncates fp32 -> bf16 where a GPU rounds to
    nearest even, so round the fp32 bits first (the truncation is then exact)."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in the grouped order: GROUP_M row blocks sweep the column
    blocks together, so their B tiles stay in L2 while they are reused."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _dot_tile(a_ptr, b_ptr, rm, rn, mask_m, mask_n, K, stride_am, stride_ak, stride_bk, stride_bn,
               EMULATE_BF16: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) tile of ``A[rm, :K] @ B[:K, rn]`` in steps of BLOCK_K (rows and
    columns outside the masks, and k past K, read as 0). A split-K slice passes pointers already
    advanced to its first k."""
    rk = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    # int64 row/column offsets: M * stride can pass 2**31 for large token counts.
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
        if EMULATE_BF16:  # the interpreter's tl.dot multiplies bf16 bit patterns as integers
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _row_sums(a_ptr, rm, mask_m, K, stride_am, stride_ak, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (BLOCK_M,) sums ``A[rm, :K].sum(1)``. Called after the tile is stored: summing inside
    the main loop keeps a second accumulator live there and spills on sm_80."""
    rk = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < K - k * BLOCK_K), other=0.0)
        row_sum += tl.sum(a.to(tl.float32), axis=1)
        a_ptrs += BLOCK_K * stride_ak
    return row_sum


@triton.jit
def _act_tail(c, pre, rows, c0, N, seed, offset, threshold, scale, EPILOGUE: tl.constexpr,
              ACTIVATION: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The activation/dropout epilogue on fp32 (R, BLOCK_N) values of rows ``rows`` and columns
    ``c0 + arange(BLOCK_N)`` (c0 a multiple of 8). ``c`` is C as stored (rounded to the output
    dtype): pre (act_fwd) or dD (act_bwd); ``pre`` the pre-activation (act_bwd; act_fwd passes c).
    Returns (C, D): act_fwd (pre, dropout(act(pre))); act_bwd (dpre, dropout(act(pre)))."""
    if EPILOGUE == "act_fwd":
        # act of the stored (rounded) pre: exactly what backward recomputes.
        d = _activation(c, ACTIVATION)
    else:
        d = _activation(pre, ACTIVATION)
        c = c * _activation_grad(pre, ACTIVATION)
    if DROPOUT:
        keep = dropout_keep_tile(seed, offset, rows, tl.cdiv(N, 8), c0, threshold, BLOCK_N)  # (R, BLOCK_N)
        d = tl.where(keep, d * scale, 0.0)
        if EPILOGUE == "act_bwd":
            c = tl.where(keep, c * scale, 0.0)
    return c, d


@triton.jit(do_not_specialize=["seed", "offset"])
def _matmul(
    a_ptr,  # (M, K) operand A, element (m, k) at m * stride_am + k * stride_ak
    b_ptr,  # (K, N) operand B, element (k, n) at k * stride_bk + n * stride_bn
    c_ptr,  # (M, N) output, row stride stride_cm, column stride 1: C, pre (act_fwd) or dpre (act_bwd)
    d_ptr,  # (M, N) second output, same strides as C: dropout(act(pre)) (act_fwd / act_bwd only)
    pre_ptr,  # (M, N) pre-activation read by act_bwd, same strides as C
    bias_ptr,  # (N,) bias added to A @ B (HAS_BIAS only)
    rowsum_ptr,  # (M,) output: sum over k of A[m, k] (ROW_SUM_A only)
    M,  # rows of A and C
    N,  # columns of B and C; also the row length of the dropout tensor
    K,  # the reduction length
    CACHE_KEY_M,  # next power of two >= M: autotune key only, unused here
    CACHE_KEY_K,  # next power of two >= K: autotune key only, unused here
    stride_am,  # A row stride
    stride_ak,  # A column stride
    stride_bk,  # B row stride
    stride_bn,  # B column stride
    stride_cm,  # row stride of C, D and pre
    philox_ptr,  # int64 (2,) = (seed, offset) on the device, loaded by the epilogue; None: the scalars below
    seed,  # dropout Philox key (without philox_ptr)
    offset,  # dropout Philox counter of element (0, 0) (without philox_ptr)
    threshold,  # dropout: keep iff the element's 16 Philox bits >= threshold = round(p * 2**16)
    scale,  # dropout: 1 / (1 - p), applied to kept elements
    EPILOGUE: tl.constexpr,  # "none" | "act_fwd" | "act_bwd"
    ACTIVATION: tl.constexpr,  # "relu" | "gelu" | "silu" | "gelu_tanh" (act_* epilogues)
    HAS_BIAS: tl.constexpr,  # add bias_ptr[n] to every row
    DROPOUT: tl.constexpr,  # apply the dropout mask (act_* epilogues)
    ROW_SUM_A: tl.constexpr,  # write the row sums of A to rowsum_ptr
    EMULATE_BF16: tl.constexpr,  # interpreter + bf16 only: fp32 tl.dot, round-to-nearest stores
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 operands: "ieee" | "tf32"
    BLOCK_M: tl.constexpr,  # rows of C per program
    BLOCK_N: tl.constexpr,  # columns of C per program
    BLOCK_K: tl.constexpr,  # reduction step
    GROUP_M: tl.constexpr,  # row blocks per group in the L2-friendly program order
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_m = rm < M
    mask_n = rn < N
    acc = _dot_tile(a_ptr, b_ptr, rm, rn, mask_m, mask_n, K, stride_am, stride_ak, stride_bk, stride_bn,
                     EMULATE_BF16, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)

    mask = mask_m[:, None] & mask_n[None, :]  # (BLOCK_M, BLOCK_N)
    c_offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]  # (BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == "none":
        tl.store(c_ptr + c_offs, _cast(acc, c_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    else:
        # act_fwd: C = pre, kept for backward. act_bwd: C = da = dD, overwritten with dpre below.
        tl.store(c_ptr + c_offs, _cast(acc, c_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
        # The elementwise tail (erf ~ 30 flops, Philox ~ 100 integer ops per element) runs over the
        # tile just stored, EPILOGUE_ROWS rows per loop step, rereading it from L1/L2: on the whole
        # register tile at once the compiler interleaves every element's chain and spills.
        tl.debug_barrier()  # this program's stores are visible to all of its threads
        seed, offset = load_philox(philox_ptr, seed, offset)  # here: not live across the K loop
        rows_here = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M)
        for i in range(0, rows_here, EPILOGUE_ROWS):
            r = pid_m * BLOCK_M + i + tl.arange(0, EPILOGUE_ROWS)  # (EPILOGUE_ROWS,)
            sub_mask = (r[:, None] < M) & mask_n[None, :]  # (EPILOGUE_ROWS, BLOCK_N)
            sub_offs = r[:, None].to(tl.int64) * stride_cm + rn[None, :]
            c_sub = tl.load(c_ptr + sub_offs, mask=sub_mask, other=0.0).to(tl.float32)
            if EPILOGUE == "act_bwd":
                pre = tl.load(pre_ptr + sub_offs, mask=sub_mask, other=0.0).to(tl.float32)
            else:
                pre = c_sub
            c_sub, d_sub = _act_tail(c_sub, pre, r, pid_n * BLOCK_N, N, seed, offset, threshold, scale,
                                     EPILOGUE, ACTIVATION, DROPOUT, BLOCK_N)
            tl.store(d_ptr + sub_offs, _cast(d_sub, d_ptr.dtype.element_ty, EMULATE_BF16), mask=sub_mask)
            if EPILOGUE == "act_bwd":
                tl.store(c_ptr + sub_offs, _cast(c_sub, c_ptr.dtype.element_ty, EMULATE_BF16),
                         mask=sub_mask)

    if ROW_SUM_A:
        # The first column block's program sums its A rows once more, after the tile is stored:
        # summing inside the main loop keeps a second accumulator live there and spills on sm_80.
        if pid_n == 0:
            row_sum = _row_sums(a_ptr, rm, mask_m, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
            tl.store(rowsum_ptr + rm, _cast(row_sum, rowsum_ptr.dtype.element_ty, EMULATE_BF16), mask=mask_m)


_matmul_16bit = triton.autotune(configs=CONFIGS_INTERPRET if INTERPRET else CONFIGS_16BIT, key=_KEY)(_matmul)
_matmul_32bit = triton.autotune(configs=CONFIGS_INTERPRET if INTERPRET else CONFIGS_32BIT, key=_KEY)(_matmul)


@triton.jit
def _matmul_split_k(
    a_ptr,  # (M, K) operand A, as in _matmul
    b_ptr,  # (K, N) operand B, as in _matmul
    ws_ptr,  # (S, M, N) fp32 workspace, contiguous: slice s's partial tile of A @ B
    ws_rowsum_ptr,  # (S, M) fp32 workspace, contiguous: slice s's partial row sums of A (ROW_SUM_A only)
    M, N, K,  # the GEMM's sizes
    K_SLICE,  # k per slice, a multiple of BLOCK_K: slice s covers [s * K_SLICE, min(K, (s + 1) * K_SLICE))
    stride_ws,  # M * N: distance between workspace slices
    stride_am, stride_ak, stride_bk, stride_bn,  # operand strides, as in _matmul
    ROW_SUM_A: tl.constexpr,  # also write the slice's row sums of A
    EMULATE_BF16: tl.constexpr,  # interpreter + bf16 only: fp32 tl.dot
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 operands
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Split-K, first pass: program (tile, s) stores the fp32 tile of A[:, slice s] @ B[slice s, :]."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_m = rm < M
    mask_n = rn < N
    k0 = pid_s.to(tl.int64) * K_SLICE
    k_len = tl.minimum(K - k0, K_SLICE).to(tl.int32)
    a_slice = a_ptr + k0 * stride_ak
    acc = _dot_tile(a_slice, b_ptr + k0 * stride_bk, rm, rn, mask_m, mask_n, k_len, stride_am, stride_ak,
                    stride_bk, stride_bn, EMULATE_BF16, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    ws_offs = (pid_s.to(tl.int64) * stride_ws + rm[:, None].to(tl.int64) * N
               + rn[None, :])  # (BLOCK_M, BLOCK_N)
    tl.store(ws_ptr + ws_offs, acc, mask=mask_m[:, None] & mask_n[None, :])
    if ROW_SUM_A:
        if pid_n == 0:
            row_sum = _row_sums(a_slice, rm, mask_m, k_len, stride_am, stride_ak, BLOCK_M, BLOCK_K)
            tl.store(ws_rowsum_ptr + pid_s.to(tl.int64) * M + rm, row_sum, mask=mask_m)


@triton.jit(do_not_specialize=["seed", "offset"])
def _split_k_reduce(
    ws_ptr,  # (S, M, N) fp32 partial tiles from _matmul_split_k
    ws_rowsum_ptr,  # (S, M) fp32 partial row sums (ROW_SUM_A only)
    c_ptr, d_ptr, pre_ptr, bias_ptr, rowsum_ptr,  # as in _matmul
    M, N,  # the output's sizes
    SPLITS,  # S, the number of slices
    stride_ws,  # M * N
    stride_cm,  # row stride of C, D and pre
    philox_ptr, seed, offset, threshold, scale,  # dropout, as in _matmul
    EPILOGUE: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    ROW_SUM_A: tl.constexpr, EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program, a multiple of 8 (whole dropout groups)
):
    """Split-K, second pass: sums the S partials of its (BLOCK_M, BLOCK_N) block in slice order
    0, 1, ..., S - 1 (a fixed order: the same bits every run) and applies _matmul's epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_m = rm < M
    mask_n = rn < N
    mask = mask_m[:, None] & mask_n[None, :]  # (BLOCK_M, BLOCK_N)
    ws_ptrs = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]  # (BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, SPLITS):
        acc += tl.load(ws_ptrs, mask=mask, other=0.0)
        ws_ptrs += stride_ws
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]  # (BLOCK_M, BLOCK_N)
    c = _cast(acc, c_ptr.dtype.element_ty, EMULATE_BF16)
    if EPILOGUE == "none":
        tl.store(c_ptr + c_offs, c, mask=mask)
    else:
        c32 = c.to(tl.float32)  # C as _matmul stores and rereads it: rounded to the output dtype
        if EPILOGUE == "act_bwd":
            pre = tl.load(pre_ptr + c_offs, mask=mask, other=0.0).to(tl.float32)
        else:
            pre = c32
        seed, offset = load_philox(philox_ptr, seed, offset)
        c32, d = _act_tail(c32, pre, rm, pid_n * BLOCK_N, N, seed, offset, threshold, scale, EPILOGUE,
                           ACTIVATION, DROPOUT, BLOCK_N)
        tl.store(d_ptr + c_offs, _cast(d, d_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
        if EPILOGUE == "act_fwd":
            tl.store(c_ptr + c_offs, c, mask=mask)
        else:
            tl.store(c_ptr + c_offs, _cast(c32, c_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    if ROW_SUM_A:
        if pid_n == 0:
            rs_ptrs = ws_rowsum_ptr + rm  # (BLOCK_M,)
            row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for _ in range(0, SPLITS):
                row_sum += tl.load(rs_ptrs, mask=mask_m, other=0.0)
                rs_ptrs += M
            tl.store(rowsum_ptr + rm, _cast(row_sum, rowsum_ptr.dtype.element_ty, EMULATE_BF16), mask=mask_m)


def kernel_for(dtype: torch.dtype):
    return _matmul_32bit if dtype == torch.float32 else _matmul_16bit


def input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


# ---------------------------------------------------------------------------------------------
# Split-K: when the (M, N) tiles cannot fill the GPU and K is long
# ---------------------------------------------------------------------------------------------
# The tile of the split-K first pass (one config, no autotuning: the tile count, and so the split,
# must be known before launch): 128 x 128, as in the autotune lists. A split launches about one
# program per SM, so 16-bit takes 8 warps per program (4 warps there also reach 255 registers and
# spill on sm_80); fp32 is the first fp32 autotune config. Both spill-free on sm_80 and sm_90.
SPLIT_K_CONFIG_16BIT = _config(128, 128, 64, 8, 3)
SPLIT_K_CONFIG_32BIT = _config(128, 128, 16, 8, 3)
# The reduction pass: 16 x 128 outputs per 4-warp program (16 per thread), the sub-tile shape of
# _matmul's activation/dropout tail. The interpreter uses narrower blocks, so test shapes span
# several of them.
REDUCE_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 128}, num_warps=4, num_stages=1)
REDUCE_CONFIG_INTERPRET = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)
MIN_K_PER_SPLIT = 256  # a slice shorter than this costs more in workspace traffic than it gains
WAVE_FILL = 0.8  # the split's last wave of programs must keep this share of the SMs busy
SPLIT_K_WORKSPACE_BYTES = 64 << 20  # the most fp32 workspace, (S, M, N) + (S, M), one launch may take
INTERPRET_SM_COUNT = 132  # CPU tensors under the interpreter: an H100's SM count
# Tests set this to force a split count on every launch (None: choose from the SM count).
FORCE_SPLIT_K = None


def split_k_config(dtype: torch.dtype) -> triton.Config:
    if INTERPRET:
        return CONFIGS_INTERPRET[0]
    return SPLIT_K_CONFIG_32BIT if dtype == torch.float32 else SPLIT_K_CONFIG_16BIT


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, read once per device (at the first launch, never at
    import); ``INTERPRET_SM_COUNT`` for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return INTERPRET_SM_COUNT
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def split_k_slices(K: int, splits: int, block_k: int):
    """``(S, K_SLICE)``: ``splits`` cut to slices of whole BLOCK_K steps with none empty
    (S <= splits, S * K_SLICE >= K > (S - 1) * K_SLICE)."""
    k_slice = cdiv(cdiv(K, max(splits, 1)), block_k) * block_k
    return cdiv(K, k_slice), k_slice


def choose_split_k(M: int, N: int, K: int, sms: int, block_m: int, block_n: int, block_k: int) -> int:
    """How many K slices an (M, N, K) GEMM with (block_m, block_n) tiles runs on ``sms`` SMs.

    1 (no split) when its tiles already fill the SMs, or K holds fewer than two slices of
    MIN_K_PER_SPLIT. Else the fewest slices with tiles x S >= sms whose programs also fill their
    last wave to WAVE_FILL: one program per SM at a time (the split tiles hold one per SM), so 192
    programs on 132 SMs take two full waves' time, as long as 264 would (64 tiles: S = 4, not 3).
    At most K / MIN_K_PER_SPLIT slices and SPLIT_K_WORKSPACE_BYTES of workspace: when that bound
    is below tiles x S >= sms, the bound (every program then runs in the first wave). S counts
    slices of whole BLOCK_K steps (:func:`split_k_slices`).
    """
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    if tiles >= sms:
        return 1
    most = min(K // MIN_K_PER_SPLIT, SPLIT_K_WORKSPACE_BYTES // (4 * (M * N + M)))
    if most < 2:
        return 1
    best, best_fill = 1, 0.0
    for wanted in range(cdiv(sms, tiles), most + 1):
        splits = split_k_slices(K, wanted, block_k)[0]
        programs = tiles * splits
        fill = programs / (cdiv(programs, sms) * sms)  # busy share of the waves' SM time
        if programs >= sms and fill >= WAVE_FILL:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    if tiles * split_k_slices(K, most, block_k)[0] < sms:  # K or the workspace caps S: all of it
        return split_k_slices(K, most, block_k)[0]
    return best


def launch(a, b, c, *, d=None, pre=None, bias=None, rowsum=None, epilogue="none", activation="relu",
           dropout_p=0.0, seed=0, offset=0, philox=None, wrap=None, config=None, split_k=None):
    """``c = A @ B`` with the chosen epilogue; ``a`` (M, K) and ``b`` (K, N) may be transposed
    views, ``c`` (and ``d``, ``pre``) must be (M, N) with unit column stride. Returns the number
    of K slices it ran (1: one kernel, no split).

    ``philox``: an int64 (2,) = (seed, offset) tensor on the device, which the dropout epilogue loads
    (``seed`` and ``offset`` are then unused); None: ``seed`` and ``offset`` as scalars.
    ``wrap``: ``torch.library.wrap_triton`` when called from a ``triton_op`` (so torch.compile
    sees the kernel), else None. ``config``: a ``triton.Config`` to run instead of autotuning
    (tests and benchmarks of single configs); where ``utils.first_config_only()`` (deterministic
    mode, ``utils.first_configs()``) the first autotune candidate is run instead of autotuning.
    ``split_k``: the number of K slices to ask for (default ``FORCE_SPLIT_K``, else
    :func:`choose_split_k` from the device's SM count); cut to whole ``BLOCK_K`` steps, so a short K
    may still run unsplit.
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:  # nothing to launch (K == 0 does launch: C = bias, row sums 0)
        if rowsum is not None and M > 0:
            rowsum.copy_(a.sum(1, dtype=torch.float32))
        return 1
    assert c.stride(1) == 1 and c.shape == (M, N)
    for name, t in (("d", d), ("pre", pre)):
        assert t is None or (t.shape == c.shape and t.stride() == c.stride()), name
    dropout = dropout_p > 0.0 and epilogue != "none"
    args = dict(
        EPILOGUE=epilogue,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        DROPOUT=dropout,
        ROW_SUM_A=rowsum is not None,
        EMULATE_BF16=INTERPRET and a.dtype == torch.bfloat16,
    )
    threshold = dropout_threshold(dropout_p) if dropout else 0
    scale = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    split_config = config or split_k_config(a.dtype)
    kw = split_config.kwargs
    if split_k is None:
        split_k = FORCE_SPLIT_K
    if split_k is None:
        split_k = choose_split_k(M, N, K, sm_count(a.device), kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"])
    splits, k_slice = split_k_slices(K, split_k, kw["BLOCK_K"]) if K > 0 else (1, 0)
    if splits > 1:
        _launch_split_k(a, b, c, d, pre, bias, rowsum, splits, k_slice, split_config, args,
                        (philox if dropout else None, seed, offset), threshold, scale, wrap)
        return splits

    if config is None and not INTERPRET and first_config_only():  # the first listed config
        config = kernel_for(a.dtype).configs[0]
    kernel = kernel_for(a.dtype) if config is None else _matmul
    if wrap is not None:
        kernel = wrap(kernel)
    explicit = {} if config is None else dict(config.kwargs, num_warps=config.num_warps,
                                              num_stages=config.num_stages)
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        a, b, c, d, pre, bias, rowsum,  # absent ones are None: constexpr, never touched
        M, N, K,
        next_power_of_2(max(M, 1)), next_power_of_2(max(K, 1)),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        philox if dropout else None, seed, offset, threshold, scale,
        INPUT_PRECISION=input_precision(a.dtype),
        **args,
        **explicit,
    )
    return 1


def _launch_split_k(a, b, c, d, pre, bias, rowsum, splits, k_slice, config, args, rng, threshold, scale,
                    wrap):
    """The two split-K passes: fp32 partials of each K slice into a workspace, then their sum in
    slice order with the epilogue."""
    M, K = a.shape
    N = b.shape[1]
    ws = torch.empty((splits, M, N), device=a.device, dtype=torch.float32)
    ws_rowsum = torch.empty((splits, M), device=a.device, dtype=torch.float32) if rowsum is not None else None
    partial, reduce = _matmul_split_k, _split_k_reduce
    if wrap is not None:
        partial, reduce = wrap(partial), wrap(reduce)
    kw = config.kwargs
    grid = (cdiv(M, kw["BLOCK_M"]) * cdiv(N, kw["BLOCK_N"]), splits)
    partial[grid](
        a, b, ws, ws_rowsum,
        M, N, K, k_slice, M * N,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ROW_SUM_A=args["ROW_SUM_A"], EMULATE_BF16=args["EMULATE_BF16"],
        INPUT_PRECISION=input_precision(a.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **kw,
    )
    red = REDUCE_CONFIG_INTERPRET if INTERPRET else REDUCE_CONFIG
    grid = (cdiv(M, red.kwargs["BLOCK_M"]), cdiv(N, red.kwargs["BLOCK_N"]))
    reduce[grid](
        ws, ws_rowsum, c, d, pre, bias, rowsum,
        M, N, splits, M * N, c.stride(0),
        *rng, threshold, scale,
        num_warps=red.num_warps, num_stages=red.num_stages, **red.kwargs, **args,
    )


# ---------------------------------------------------------------------------------------------
# Ahead-of-time specialisations (see triton_kernels/aot.py)
# ---------------------------------------------------------------------------------------------
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# Which strides are 1 in each operand layout (Triton specialises an int argument equal to 1 as a
# constexpr at launch): "nt" = A row-major, B = W^T (x @ w1^T); "nn" = both row-major
# (dout @ w2, dpre @ w1); "tn" = A = Y^T column-major, B row-major (dout^T @ a, dpre^T @ x).
_UNIT_STRIDES = {"nt": ("stride_ak", "stride_bk"), "nn": ("stride_ak", "stride_bn"),
                 "tn": ("stride_am", "stride_bn")}


def _label(name, dt, config):
    kw = config.kwargs
    return f"{name}[{dt},{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']},w{config.num_warps},s{config.num_stages}]"


def _spec(label, fn, signature, constexprs, config, aligned):
    """An ``aot_specs()`` entry: every constexpr marked as such in the signature, the config's
    warps and stages, ``aligned(signature)`` the arguments Triton's launcher sees as 16-divisible."""
    for arg in constexprs:
        signature[arg] = "constexpr"
    return {"name": label, "fn": fn,
            "signature": signature, "constexprs": constexprs, "num_warps": config.num_warps,
            "num_stages": config.num_stages, "divisible_by_16": aligned(signature)}


def aot_spec(name, dtype, layout, config, *, epilogue="none", activation="relu", has_bias=False,
             dropout=False, row_sum_a=False):
    """One compile specialisation of :func:`_matmul` in the format of ``aot_specs()``.

    Sizes, strides and pointers are marked divisible by 16 (``divisible_by_16``), the
    specialisation Triton's launcher makes for aligned tensors and sizes like 512 or 2048, so the
    compiled code (vector widths, cp.async pipelining) is the one such launches run.
    """
    dt = _TRITON_DTYPE[dtype]
    unit = _UNIT_STRIDES[layout]
    used = {"a_ptr": True, "b_ptr": True, "c_ptr": True, "d_ptr": epilogue != "none",
            "pre_ptr": epilogue == "act_bwd", "bias_ptr": has_bias, "rowsum_ptr": row_sum_a}
    signature = {arg: "*" + dt for arg, on in used.items() if on}
    for arg in ("M", "N", "K", "CACHE_KEY_M", "CACHE_KEY_K", "stride_am", "stride_ak", "stride_bk",
                "stride_bn", "stride_cm"):
        signature[arg] = "constexpr" if arg in unit else "i32"
    signature.update(philox_ptr="*i64", seed="i64", offset="i64", threshold="i32", scale="fp32")
    constexprs = {arg: 1 for arg in unit}
    constexprs.update({arg: None for arg, on in used.items() if not on})  # launched as None
    if not dropout:
        constexprs["philox_ptr"] = None
    constexprs.update(EPILOGUE=epilogue, ACTIVATION=activation, HAS_BIAS=has_bias, DROPOUT=dropout,
                      ROW_SUM_A=row_sum_a, EMULATE_BF16=False, INPUT_PRECISION=input_precision(dtype))
    constexprs.update(config.kwargs)
    sizes = [arg for arg in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm")
             if arg not in unit]
    return _spec(_label(name, dt, config), _matmul, signature, constexprs, config,
                 lambda sig: [arg for arg, ty in sig.items() if ty.startswith("*")] + sizes)


def _layout_signature(dt, layout):
    """Operand pointer types and the int/constexpr sizes and strides of a layout's launch."""
    unit = _UNIT_STRIDES[layout]
    signature = {"a_ptr": "*" + dt, "b_ptr": "*" + dt}
    for arg in ("stride_am", "stride_ak", "stride_bk", "stride_bn"):
        signature[arg] = "constexpr" if arg in unit else "i32"
    return signature, {arg: 1 for arg in unit}


def aot_spec_split_k(name, dtype, layout, config, *, row_sum_a=False):
    """One compile specialisation of :func:`_matmul_split_k` (the first split-K pass), in the
    format of ``aot_specs()``; sizes, strides and pointers 16-divisible as in :func:`aot_spec`."""
    dt = _TRITON_DTYPE[dtype]
    signature, constexprs = _layout_signature(dt, layout)
    signature.update(ws_ptr="*fp32", M="i32", N="i32", K="i32", K_SLICE="i32", stride_ws="i32")
    if row_sum_a:
        signature["ws_rowsum_ptr"] = "*fp32"
    else:
        constexprs["ws_rowsum_ptr"] = None
    constexprs.update(ROW_SUM_A=row_sum_a, EMULATE_BF16=False, INPUT_PRECISION=input_precision(dtype))
    constexprs.update(config.kwargs)
    return _spec(_label(name, dt, config), _matmul_split_k, signature, constexprs, config,
                 lambda sig: [arg for arg, ty in sig.items() if ty != "constexpr"])


def aot_spec_split_k_reduce(name, dtype, *, epilogue="none", activation="relu", has_bias=False,
                            dropout=False, row_sum_a=False, config=REDUCE_CONFIG):
    """One compile specialisation of :func:`_split_k_reduce` (the second split-K pass)."""
    dt = _TRITON_DTYPE[dtype]
    used = {"ws_ptr": True, "ws_rowsum_ptr": row_sum_a, "c_ptr": True, "d_ptr": epilogue != "none",
            "pre_ptr": epilogue == "act_bwd", "bias_ptr": has_bias, "rowsum_ptr": row_sum_a}
    signature = {arg: "*fp32" if arg.startswith("ws") else "*" + dt for arg, on in used.items() if on}
    signature.update(M="i32", N="i32", SPLITS="i32", stride_ws="i32", stride_cm="i32", philox_ptr="*i64",
                     seed="i64", offset="i64", threshold="i32", scale="fp32")
    constexprs = {arg: None for arg, on in used.items() if not on}
    if not dropout:
        constexprs["philox_ptr"] = None
    constexprs.update(EPILOGUE=epilogue, ACTIVATION=activation, HAS_BIAS=has_bias, DROPOUT=dropout,
                      ROW_SUM_A=row_sum_a, EMULATE_BF16=False)
    constexprs.update(config.kwargs)
    kw = config.kwargs
    return _spec(f"{name}[{dt},{kw['BLOCK_M']}x{kw['BLOCK_N']},w{config.num_warps}]", _split_k_reduce, signature,
                 constexprs, config,
                 lambda sig: [arg for arg, ty in sig.items() if ty.startswith("*")] + ["M", "N", "stride_ws", "stride_cm"])
