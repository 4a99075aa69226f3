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
"""
import os

import torch
import triton
import triton.language as tl

from .utils import dropout_keep_tile, dropout_threshold

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
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
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) for fp32 x: relu, or the exact (erf) gelu."""
    if ACTIVATION == "relu":
        return tl.maximum(x, 0.0)
    else:
        return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))


@triton.jit
def _activation_grad(x, ACTIVATION: tl.constexpr):
    """d act / dx for fp32 x. relu: 1 where x > 0, 0 at and below 0 (F.relu's rule, as the reference)."""
    if ACTIVATION == "relu":
        return tl.where(x > 0.0, 1.0, 0.0)
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
    seed,  # dropout Philox key
    offset,  # dropout Philox counter of element (0, 0)
    threshold,  # dropout: keep iff the element's 16 Philox bits >= threshold = round(p * 2**16)
    scale,  # dropout: 1 / (1 - p), applied to kept elements
    EPILOGUE: tl.constexpr,  # "none" | "act_fwd" | "act_bwd"
    ACTIVATION: tl.constexpr,  # "relu" | "gelu" (act_* epilogues)
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
    # Grouped ordering: GROUP_M row blocks sweep the column blocks together, so their B tiles
    # stay in L2 while they are reused.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    rk = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    mask_m = rm < M
    mask_n = rn < N
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
        rows_here = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M)
        for i in range(0, rows_here, EPILOGUE_ROWS):
            r = pid_m * BLOCK_M + i + tl.arange(0, EPILOGUE_ROWS)  # (EPILOGUE_ROWS,)
            sub_mask = (r[:, None] < M) & mask_n[None, :]  # (EPILOGUE_ROWS, BLOCK_N)
            sub_offs = r[:, None].to(tl.int64) * stride_cm + rn[None, :]
            c_sub = tl.load(c_ptr + sub_offs, mask=sub_mask, other=0.0).to(tl.float32)
            if EPILOGUE == "act_fwd":
                # act of the stored (rounded) pre: exactly what backward recomputes.
                d_sub = _activation(c_sub, ACTIVATION)
            else:
                pre = tl.load(pre_ptr + sub_offs, mask=sub_mask, other=0.0).to(tl.float32)
                d_sub = _activation(pre, ACTIVATION)
                c_sub = c_sub * _activation_grad(pre, ACTIVATION)
            if DROPOUT:
                keep = dropout_keep_tile(seed, offset, r, tl.cdiv(N, 8), pid_n * BLOCK_N, threshold,
                                         BLOCK_N)  # (EPILOGUE_ROWS, BLOCK_N)
                d_sub = tl.where(keep, d_sub * scale, 0.0)
                if EPILOGUE == "act_bwd":
                    c_sub = tl.where(keep, c_sub * scale, 0.0)
            tl.store(d_ptr + sub_offs, _cast(d_sub, d_ptr.dtype.element_ty, EMULATE_BF16), mask=sub_mask)
            if EPILOGUE == "act_bwd":
                tl.store(c_ptr + sub_offs, _cast(c_sub, c_ptr.dtype.element_ty, EMULATE_BF16),
                         mask=sub_mask)

    if ROW_SUM_A:
        # The first column block's program sums its A rows once more, after the tile is stored:
        # summing inside the main loop keeps a second accumulator live there and spills on sm_80.
        if pid_n == 0:
            row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < K - k * BLOCK_K), other=0.0)
                row_sum += tl.sum(a.to(tl.float32), axis=1)
                a_ptrs += BLOCK_K * stride_ak
            tl.store(rowsum_ptr + rm, _cast(row_sum, rowsum_ptr.dtype.element_ty, EMULATE_BF16), mask=mask_m)


_matmul_16bit = triton.autotune(configs=CONFIGS_INTERPRET if INTERPRET else CONFIGS_16BIT, key=_KEY)(_matmul)
_matmul_32bit = triton.autotune(configs=CONFIGS_INTERPRET if INTERPRET else CONFIGS_32BIT, key=_KEY)(_matmul)


def kernel_for(dtype: torch.dtype):
    return _matmul_32bit if dtype == torch.float32 else _matmul_16bit


def input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def launch(a, b, c, *, d=None, pre=None, bias=None, rowsum=None, epilogue="none", activation="relu",
           dropout_p=0.0, seed=0, offset=0, wrap=None, config=None):
    """``c = A @ B`` with the chosen epilogue; ``a`` (M, K) and ``b`` (K, N) may be transposed
    views, ``c`` (and ``d``, ``pre``) must be (M, N) with unit column stride.

    ``wrap``: ``torch.library.wrap_triton`` when called from a ``triton_op`` (so torch.compile
    sees the kernel), else None. ``config``: a ``triton.Config`` to run instead of autotuning
    (tests and benchmarks of single configs); under ``torch.use_deterministic_algorithms(True)``
    the first autotune candidate is run instead of autotuning.
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:  # nothing to launch (K == 0 does launch: C = bias, row sums 0)
        if rowsum is not None and M > 0:
            rowsum.copy_(a.sum(1, dtype=torch.float32))
        return
    assert c.stride(1) == 1 and c.shape == (M, N)
    for name, t in (("d", d), ("pre", pre)):
        assert t is None or (t.shape == c.shape and t.stride() == c.stride()), name
    if config is None and not INTERPRET and torch.are_deterministic_algorithms_enabled():
        # the autotuner's pick may differ between processes and BLOCK_K changes the summation
        # order: run the first listed config, the same in every process
        config = kernel_for(a.dtype).configs[0]
    kernel = kernel_for(a.dtype) if config is None else _matmul
    if wrap is not None:
        kernel = wrap(kernel)
    explicit = {} if config is None else dict(config.kwargs, num_warps=config.num_warps,
                                              num_stages=config.num_stages)
    dropout = dropout_p > 0.0 and epilogue != "none"
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        a, b, c, d, pre, bias, rowsum,  # absent ones are None: constexpr, never touched
        M, N, K,
        triton.next_power_of_2(max(M, 1)), triton.next_power_of_2(max(K, 1)),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        seed, offset,
        dropout_threshold(dropout_p) if dropout else 0,
        1.0 / (1.0 - dropout_p) if dropout else 1.0,
        EPILOGUE=epilogue,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        DROPOUT=dropout,
        ROW_SUM_A=rowsum is not None,
        EMULATE_BF16=INTERPRET and a.dtype == torch.bfloat16,
        INPUT_PRECISION=input_precision(a.dtype),
        **explicit,
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
    signature.update(seed="i64", offset="i64", threshold="i32", scale="fp32")
    constexprs = {arg: 1 for arg in unit}
    constexprs.update({arg: None for arg, on in used.items() if not on})  # launched as None
    constexprs.update(EPILOGUE=epilogue, ACTIVATION=activation, HAS_BIAS=has_bias, DROPOUT=dropout,
                      ROW_SUM_A=row_sum_a, EMULATE_BF16=False, INPUT_PRECISION=input_precision(dtype))
    constexprs.update(config.kwargs)
    for arg in constexprs:
        signature[arg] = "constexpr"
    aligned = [arg for arg, ty in signature.items() if ty.startswith("*")]
    aligned += [arg for arg in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                                "stride_cm") if arg not in unit]
    kw = config.kwargs
    tile = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}"
    return {
        "name": f"{name}[{dt},{tile},w{config.num_warps},s{config.num_stages}]",
        "fn": _matmul,
        "signature": signature,
        "constexprs": constexprs,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "divisible_by_16": aligned,
    }
