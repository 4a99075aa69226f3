"""Fused dropout + residual add + LayerNorm in Triton (the C++ schemas of csrc/ops.cpp).

Forward: one program per row, the whole row in registers (``BLOCK_C`` = next power of two of
C, masked past C), statistics in fp32 over the real C columns only.
Backward: ``_add_layer_norm_bwd`` computes dx (and the residual's gradient) row by row; each
program also sums ``dy * xhat`` and ``dy`` over its block of rows into one fp32 row of a
``(G, C)`` partials buffer, and ``_add_layer_norm_bwd_dwdb`` reduces those G rows into
dweight / dbias: two stages, no atomics, so the result is deterministic. From ``BLOCK_C >=
SPLIT_BLOCK_C`` a row and the two full-row accumulators no longer fit the 64 registers a
1024-thread program gets: there ``_add_layer_norm_bwd_chunked`` walks each row in column chunks
twice (the row sums, then dx chunk by chunk) and ``_add_layer_norm_bwd_part`` (one program per
column block and block of rows) fills the same partials buffer from dy, h and the row statistics.
RMSNorm (``RMS_NORM``, the ops' ``rms_norm``): no mean (Mean is written as 0, so the backward's
``(h - mean) * rstd`` is RMSNorm's xhat), ``rstd`` from ``mean(h^2)``, ``h * rstd`` rounded to the
output dtype before the weight multiply (T5's cast), and the gradient's ``mean(w * dy)`` term dropped.
Dropout is fastformer/philox.py's with rows of ``C`` columns: element ``(row, col)`` takes its 16 bits
from the Philox call on counter ``offset + row * ceil(C / 8) + col // 8``; the backward regenerates the
forward's mask from ``(seed, offset)``: the ops' ``philox`` tensor, loaded by each program where it
lies on the op's device, else read on the host and passed as scalars (utils.philox_args).
"""
import functools
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .registration import kernel, register_op
from .utils import (cdiv, check_float, check_tensor, dropout_args, dropout_keep_tile, load_philox, next_power_of_2,
                    on_device_of_first_tensor, philox_args, reload_philox)

MAX_C = 16384  # the widest row one program keeps in registers
_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DWDB_BLOCK_G = 32  # partial rows summed per step of the dweight/dbias reduction
_DWDB_BLOCK_N = 128  # columns per program of the dweight/dbias reduction
SPLIT_BLOCK_C = 16384  # from this BLOCK_C on the backward runs the chunked kernels
_CHUNK_C = 4096  # columns per step of _add_layer_norm_bwd_chunked
_CHUNK_WARPS = 16  # its warps: 8 columns per thread
_PART_BLOCK_N = 256  # columns per program of _add_layer_norm_bwd_part


@triton.jit
def _row_keep(seed, offset, row, C, c0, threshold, BLOCK_C: tl.constexpr):
    """Dropout keep-mask (BLOCK_C,) of columns ``c0 .. c0 + BLOCK_C - 1`` of row ``row``."""
    rows = tl.full((1,), row, tl.int64)  # (1,)
    keep = dropout_keep_tile(seed, offset, rows, tl.cdiv(C, 8), c0, threshold, BLOCK_C)  # (1, BLOCK_C)
    return tl.reshape(keep, (BLOCK_C,))


@triton.jit
def _row_block(g, rows_per_program, N):
    """Rows [row_start, row_end) of block ``g`` of the backward's row blocks."""
    row_start = g * rows_per_program
    return row_start, tl.minimum(row_start + rows_per_program, N)


@triton.jit
def _store_dh_dx(dh, idx, mask, DHIn, DRes, DX, Philox, seed, offset, row, C, c0, drop_threshold, drop_scale,
                 HAS_DH: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_DRES: tl.constexpr, BLOCK_C: tl.constexpr,
                 RELOAD_PHILOX: tl.constexpr):
    """The tail both row backwards share, on columns ``c0 + arange(BLOCK_C)`` of ``row`` (elements
    ``idx``): the gradient of h (``dh`` from the LayerNorm, plus DHIn) to DRes, dropout's backward
    of it to DX."""
    if HAS_DH:
        dh += tl.load(DHIn + idx, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRES:
        tl.store(DRes + idx, dh.to(DRes.dtype.element_ty), mask=mask)
    dx = dh
    if HAS_DROPOUT:
        if RELOAD_PHILOX:  # (seed, offset) loaded here, at its use: not held in registers across the row loop
            seed, offset = reload_philox(Philox, seed, offset)
        keep = _row_keep(seed, offset, row, C, c0, drop_threshold, BLOCK_C)
        dx = tl.where(keep, dh * drop_scale, 0.0)
    tl.store(DX + idx, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _store_partials(DWPart, DBPart, g, C, cols, mask, dw_acc, db_acc):
    """Row ``g`` of the (G, C) dweight / dbias partials, columns ``cols``."""
    part = g.to(tl.int64) * C + cols
    tl.store(DWPart + part, dw_acc, mask=mask)
    tl.store(DBPart + part, db_acc, mask=mask)


@triton.jit(do_not_specialize=["seed", "offset"])
def _add_layer_norm_fwd(
    X,  # (N, C) input, dropped out before the add
    R,  # (N, C) residual (not read without HAS_RESIDUAL)
    W,  # (C,) LayerNorm weight
    B,  # (C,) LayerNorm bias
    Y,  # (N, C) output: LayerNorm(h)
    H,  # (N, C) output: h = residual + dropout(x)
    Mean,  # (N,) fp32 output: mean of each row of h
    Rstd,  # (N,) fp32 output: 1 / sqrt(var + eps) of each row of h
    C,  # hidden size (= row stride, rows are contiguous)
    eps,  # added to the variance
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # Philox key of the dropout mask (without Philox)
    offset,  # Philox counter of element (0, 0) (without Philox)
    drop_threshold,  # round(dropout_p * 2**16): keep iff the element's 16 Philox bits >= drop_threshold
    drop_scale,  # 1 / (1 - dropout_p)
    HAS_RESIDUAL: tl.constexpr,  # add R
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    BLOCK_C: tl.constexpr,  # next power of two >= max(C, 8)
    RMS_NORM: tl.constexpr = False,  # RMSNorm: no mean, xhat rounded to Y's dtype
):
    seed, offset = load_philox(Philox, seed, offset)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    mask = cols < C
    idx = row * C + cols  # row-major element index (int64)
    h = tl.load(X + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _row_keep(seed, offset, row, C, 0, drop_threshold, BLOCK_C)
        h = tl.where(keep, h * drop_scale, 0.0)
    if HAS_RESIDUAL:
        h += tl.load(R + idx, mask=mask, other=0.0).to(tl.float32)
    h_out = h.to(H.dtype.element_ty)
    tl.store(H + idx, h_out, mask=mask)
    h = h_out.to(tl.float32)  # the statistics of the h that is stored (and that backward sees)
    if RMS_NORM:
        mean = 0.0
        diff = h  # 0 past C
    else:
        mean = tl.sum(h, axis=0) / C
        diff = tl.where(mask, h - mean, 0.0)
    var = tl.sum(diff * diff, axis=0) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    xn = diff * rstd
    if RMS_NORM:
        xn = xn.to(Y.dtype.element_ty).to(tl.float32)  # T5's cast (exact for fp32)
    y = xn * w + b
    tl.store(Y + idx, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit(do_not_specialize=["seed", "offset"])
def _add_layer_norm_bwd(
    DY,  # (N, C) gradient of y
    DHIn,  # (N, C) extra gradient of h (prenorm's second output); not read without HAS_DH
    H,  # (N, C) h saved by the forward
    W,  # (C,) LayerNorm weight
    Mean,  # (N,) fp32
    Rstd,  # (N,) fp32
    DX,  # (N, C) output: gradient of x
    DRes,  # (N, C) output: gradient of the residual (= of h); written only with STORE_DRES
    DWPart,  # (G, C) fp32 output: this program's sum of dy * xhat over its rows
    DBPart,  # (G, C) fp32 output: this program's sum of dy over its rows
    N,  # number of rows
    C,  # hidden size (= row stride)
    rows_per_program,  # rows [pid * rows_per_program, (pid + 1) * rows_per_program) are ours
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # Philox key of the dropout mask (without Philox)
    offset,  # Philox counter of element (0, 0) (without Philox)
    drop_threshold,  # round(dropout_p * 2**16)
    drop_scale,  # 1 / (1 - dropout_p)
    HAS_DH: tl.constexpr,  # add DHIn to the gradient of h
    HAS_DROPOUT: tl.constexpr,  # dx = dropout'(gradient of h)
    STORE_DRES: tl.constexpr,  # write the gradient of h to DRes
    BLOCK_C: tl.constexpr,  # next power of two >= max(C, 8)
    RMS_NORM: tl.constexpr = False,  # RMSNorm: no mean(w * dy) term (Mean holds zeros)
):
    RELOAD: tl.constexpr = BLOCK_C == 4096  # loaded once it spills 4 B at 16 warps on sm_80 (reloaded: 36 B at 8192)
    if not RELOAD:
        seed, offset = load_philox(Philox, seed, offset)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    mask = cols < C
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    row_start, row_end = _row_block(pid, rows_per_program, N)
    for row in range(row_start, row_end):
        idx = tl.cast(row, tl.int64) * C + cols
        h = tl.load(H + idx, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + idx, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / C
        if RMS_NORM:
            c2 = 0.0
        else:
            c2 = tl.sum(wdy, axis=0) / C
        dh = (wdy - (xhat * c1 + c2)) * rstd
        _store_dh_dx(dh, idx, mask, DHIn, DRes, DX, Philox, seed, offset, row, C, 0, drop_threshold, drop_scale,
                     HAS_DH, HAS_DROPOUT, STORE_DRES, BLOCK_C, RELOAD)
        dw_acc += dy * xhat
        db_acc += dy
    _store_partials(DWPart, DBPart, pid, C, cols, mask, dw_acc, db_acc)


@triton.jit(do_not_specialize=["seed", "offset"])
def _add_layer_norm_bwd_chunked(
    DY,  # (N, C) gradient of y
    DHIn,  # (N, C) extra gradient of h (prenorm's second output); not read without HAS_DH
    H,  # (N, C) h saved by the forward
    W,  # (C,) LayerNorm weight
    Mean,  # (N,) fp32
    Rstd,  # (N,) fp32
    DX,  # (N, C) output: gradient of x
    DRes,  # (N, C) output: gradient of the residual (= of h); written only with STORE_DRES
    N,  # number of rows
    C,  # hidden size (= row stride)
    rows_per_program,  # rows [pid * rows_per_program, (pid + 1) * rows_per_program) are ours
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # Philox key of the dropout mask (without Philox)
    offset,  # Philox counter of element (0, 0) (without Philox)
    drop_threshold,  # round(dropout_p * 2**16)
    drop_scale,  # 1 / (1 - dropout_p)
    HAS_DH: tl.constexpr,  # add DHIn to the gradient of h
    HAS_DROPOUT: tl.constexpr,  # dx = dropout'(gradient of h)
    STORE_DRES: tl.constexpr,  # write the gradient of h to DRes
    CHUNK_C: tl.constexpr,  # columns per step, a multiple of 8 (whole Philox groups)
    RMS_NORM: tl.constexpr = False,  # RMSNorm: no mean(w * dy) term (Mean holds zeros)
):
    """_add_layer_norm_bwd's dx / dres for rows too wide for registers: a first pass over the
    row's column chunks sums ``xhat * w * dy`` and ``w * dy``, a second recomputes each chunk
    (from cache) and stores its gradients. dweight / dbias come from _add_layer_norm_bwd_part."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK_C)  # (CHUNK_C,)
    row_start, row_end = _row_block(pid, rows_per_program, N)
    for row in range(row_start, row_end):
        base = tl.cast(row, tl.int64) * C
        mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        s_xw = tl.zeros((CHUNK_C,), dtype=tl.float32)
        s_w = tl.zeros((CHUNK_C,), dtype=tl.float32)
        for c0 in range(0, C, CHUNK_C):  # pass 1: the row sums
            cols = c0 + offs
            mask = cols < C
            h = tl.load(H + base + cols, mask=mask, other=0.0).to(tl.float32)
            wdy = (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                   * tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32))
            s_xw += tl.where(mask, (h - mean) * rstd, 0.0) * wdy
            s_w += wdy
        c1 = tl.sum(s_xw, axis=0) / C
        if RMS_NORM:
            c2 = 0.0
        else:
            c2 = tl.sum(s_w, axis=0) / C
        for c0 in range(0, C, CHUNK_C):  # pass 2: the gradients, chunk by chunk
            cols = c0 + offs
            mask = cols < C
            idx = base + cols
            h = tl.load(H + idx, mask=mask, other=0.0).to(tl.float32)
            wdy = (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                   * tl.load(DY + idx, mask=mask, other=0.0).to(tl.float32))
            xhat = tl.where(mask, (h - mean) * rstd, 0.0)
            dh = (wdy - (xhat * c1 + c2)) * rstd
            _store_dh_dx(dh, idx, mask, DHIn, DRes, DX, Philox, seed, offset, row, C, c0, drop_threshold,
                         drop_scale, HAS_DH, HAS_DROPOUT, STORE_DRES, CHUNK_C, True)


@triton.jit
def _add_layer_norm_bwd_part(
    DY,  # (N, C) gradient of y
    H,  # (N, C) h saved by the forward
    Mean,  # (N,) fp32
    Rstd,  # (N,) fp32
    DWPart,  # (G, C) fp32 output: sum of dy * xhat over the rows of block g
    DBPart,  # (G, C) fp32 output: sum of dy over the rows of block g
    N,  # number of rows
    C,  # hidden size (= row stride)
    rows_per_program,  # block g is rows [g * rows_per_program, (g + 1) * rows_per_program)
    BLOCK_N: tl.constexpr,  # columns per program
):
    """The dweight/dbias partials of _add_layer_norm_bwd for wide rows: program (j, g) sums
    columns ``j * BLOCK_N + arange(BLOCK_N)`` over row block g, row by row."""
    g = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = cols < C
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start, row_end = _row_block(g, rows_per_program, N)
    for row in range(row_start, row_end):
        idx = tl.cast(row, tl.int64) * C + cols
        h = tl.load(H + idx, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + idx, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (h - tl.load(Mean + row)) * tl.load(Rstd + row), 0.0)
        dw_acc += dy * xhat
        db_acc += dy
    _store_partials(DWPart, DBPart, g, C, cols, mask, dw_acc, db_acc)


@triton.jit
def _add_layer_norm_bwd_dwdb(
    DWPart,  # (G, C) fp32 per-program partial sums of dy * xhat
    DBPart,  # (G, C) fp32 per-program partial sums of dy
    DW,  # (C,) output: dweight, in the weight's dtype
    DB,  # (C,) output: dbias, in the weight's dtype
    G,  # number of partial rows
    C,  # hidden size
    BLOCK_G: tl.constexpr,  # partial rows per step
    BLOCK_N: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    cmask = cols < C
    dw = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        rows = g0 + tl.arange(0, BLOCK_G)  # (BLOCK_G,)
        m = (rows < G)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]  # (BLOCK_G, BLOCK_N)
        dw += tl.load(DWPart + offs, mask=m, other=0.0)
        db += tl.load(DBPart + offs, mask=m, other=0.0)
    tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=cmask)
    tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=cmask)


def _num_warps(block_c: int) -> int:
    """Warps per row program: 8 columns per thread (4 warps at least, 32 at most), so the
    backward's row vectors and its two accumulators fit in registers without spilling."""
    return max(4, min(32, block_c // 256))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _partial_rows(n: int, device: torch.device) -> Tuple[int, int]:
    """(rows_per_program, G) for the backward: about 4 programs per SM on a GPU, 4 programs
    in the interpreter; G = cdiv(n, rows_per_program) so no program is empty."""
    target = 4
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = 4 * _sm_count(index)
    rows_per_program = cdiv(n, min(n, target))
    return rows_per_program, cdiv(n, rows_per_program)


def _check_x(x: torch.Tensor, name: str = "x") -> Tuple[int, int]:
    check_float(name, x, 2, "be 2-D (N, C)")
    N, C = x.shape
    if C > MAX_C:
        raise ValueError(f"the triton add_layer_norm keeps a row in registers and supports hidden "
                         f"sizes up to {MAX_C}, got C = {C}")
    return N, C


@on_device_of_first_tensor
def _add_layer_norm_fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                             bias: torch.Tensor, eps: float, dropout_p: float, philox: torch.Tensor,
                             rms_norm: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, C = _check_x(x)
    has_dropout, threshold, scale = dropout_args(dropout_p)
    rng = philox_args(philox, x.device, "add_layer_norm_fwd", has_dropout)
    if residual is not None:
        check_tensor("residual", residual, (N, C), x.dtype)
    check_tensor("weight", weight, (C,))
    check_tensor("bias", bias, (C,))
    y = torch.empty_like(x)  # (N, C)
    h = torch.empty_like(x)  # (N, C)
    mean = torch.empty(N, dtype=torch.float32, device=x.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)
    if N == 0:
        return y, h, mean, rstd
    block_c = next_power_of_2(max(C, 8))  # whole Philox groups of 8 columns
    kernel(_add_layer_norm_fwd)[(N,)](
        x, residual if residual is not None else x, weight, bias, y, h, mean, rstd,
        C, eps, *rng, threshold, scale,
        HAS_RESIDUAL=residual is not None, HAS_DROPOUT=has_dropout, BLOCK_C=block_c, RMS_NORM=bool(rms_norm),
        num_warps=_num_warps(block_c), num_stages=1)
    return y, h, mean, rstd


@on_device_of_first_tensor
def _add_layer_norm_bwd_impl(dy: torch.Tensor, dh: Optional[torch.Tensor], h: torch.Tensor,
                             weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                             dropout_p: float, philox: torch.Tensor, has_residual: bool,
                             rms_norm: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, C = _check_x(h, "h")
    has_dropout, threshold, scale = dropout_args(dropout_p)
    rng = philox_args(philox, h.device, "add_layer_norm_bwd", has_dropout)
    check_tensor("dy", dy, (N, C), h.dtype)
    if dh is not None:
        check_tensor("dh", dh, (N, C), h.dtype)
    check_tensor("weight", weight, (C,))
    check_tensor("mean", mean, (N,), torch.float32)
    check_tensor("rstd", rstd, (N,), torch.float32)
    store_dres = has_residual and has_dropout
    dx = torch.empty_like(h)  # (N, C)
    dres = torch.empty_like(h) if store_dres else h.new_empty(0)  # empty: the residual's grad is dx
    dweight = torch.empty_like(weight)  # (C,)
    dbias = torch.empty_like(weight)  # (C,)
    if N == 0:
        return dx, dres, dweight.zero_(), dbias.zero_()
    rows_per_program, G = _partial_rows(N, h.device)
    dw_part = torch.empty((G, C), dtype=torch.float32, device=h.device)
    db_part = torch.empty((G, C), dtype=torch.float32, device=h.device)
    block_c = next_power_of_2(max(C, 8))  # whole Philox groups of 8 columns
    dh_in, dres_out = dh if dh is not None else dy, dres if store_dres else dx
    flags = dict(HAS_DH=dh is not None, HAS_DROPOUT=has_dropout, STORE_DRES=store_dres, RMS_NORM=bool(rms_norm))
    if block_c < SPLIT_BLOCK_C:
        kernel(_add_layer_norm_bwd)[(G,)](
            dy, dh_in, h, weight, mean, rstd, dx, dres_out, dw_part, db_part, N, C, rows_per_program,
            *rng, threshold, scale, **flags, BLOCK_C=block_c, num_warps=_num_warps(block_c),
            num_stages=1)
    else:  # wide rows: column chunks, and the dweight/dbias partials in their own kernel
        kernel(_add_layer_norm_bwd_chunked)[(G,)](
            dy, dh_in, h, weight, mean, rstd, dx, dres_out, N, C, rows_per_program, *rng,
            threshold, scale, **flags, CHUNK_C=_CHUNK_C, num_warps=_CHUNK_WARPS, num_stages=1)
        kernel(_add_layer_norm_bwd_part)[(cdiv(C, _PART_BLOCK_N), G)](
            dy, h, mean, rstd, dw_part, db_part, N, C, rows_per_program, BLOCK_N=_PART_BLOCK_N,
            num_warps=4, num_stages=1)
    kernel(_add_layer_norm_bwd_dwdb)[(cdiv(C, _DWDB_BLOCK_N),)](
        dw_part, db_part, dweight, dbias, G, C, BLOCK_G=_DWDB_BLOCK_G, BLOCK_N=_DWDB_BLOCK_N,
        num_warps=4, num_stages=1)
    return dx, dres, dweight, dbias


# x, residual (N, C); weight, bias (C,) -> y (N, C), h (N, C), mean (N,) fp32, rstd (N,) fp32
add_layer_norm_fwd = register_op("add_layer_norm_fwd", _add_layer_norm_fwd_impl)
# -> dx (N, C), dresidual (N, C) or empty (it equals dx), dweight (C,), dbias (C,)
add_layer_norm_bwd = register_op("add_layer_norm_bwd", _add_layer_norm_bwd_impl)


def aot_specs() -> List[dict]:
    """Every kernel specialisation the host code launches, for ahead-of-time compilation:
    each dtype, BLOCK_C 1024 / 2048 / 4096 / 8192 / 16384 (MAX_C) with the num_warps the host
    picks for it (4 / 8 / 16 / 32 / 32), the flag combination with the most code (residual, dropout, dh, dres), the
    chunked backward and its partials kernel for BLOCK_C >= SPLIT_BLOCK_C, and the dweight/dbias
    reduction. Pointers (fresh torch allocations) and C (a multiple of 16, as
    hidden sizes are) carry Triton's divisible-by-16 specialisation, as the launcher gives them.
    RMSNorm (``RMS_NORM``) is compiled in bf16 (its rounding) at the widest row of each kernel, where
    registers are scarcest; it uses fewer than LayerNorm elsewhere (no mean)."""
    specs = []
    for dtype, t in _TL_DTYPE.items():
        for block_c in (1024, 2048, 4096, 8192, MAX_C):
            warps = _num_warps(block_c)
            for rms in ((False, True) if t == "bf16" and block_c == MAX_C else (False,)):
                specs.append(_fwd_spec(t, block_c, warps, rms))
            if block_c >= SPLIT_BLOCK_C:
                continue  # the backward of wide rows: the chunked kernels below
            for rms in ((False, True) if t == "bf16" and block_c == SPLIT_BLOCK_C // 2 else (False,)):
                specs.append(_bwd_spec(t, block_c, warps, rms))
        for rms in ((False, True) if t == "bf16" else (False,)):
            specs.append(_bwd_chunked_spec(t, rms))
        specs.append(dict(
            name=f"_add_layer_norm_bwd_part_{t}", fn=_add_layer_norm_bwd_part,
            signature={"DY": f"*{t}", "H": f"*{t}", "Mean": "*fp32", "Rstd": "*fp32",
                       "DWPart": "*fp32", "DBPart": "*fp32", "N": "i32", "C": "i32",
                       "rows_per_program": "i32"},
            constexprs={"BLOCK_N": _PART_BLOCK_N},
            divisible_by_16=("DY", "H", "Mean", "Rstd", "DWPart", "DBPart", "C"),
            num_warps=4, num_stages=1))
        specs.append(dict(
            name=f"_add_layer_norm_bwd_dwdb_{t}", fn=_add_layer_norm_bwd_dwdb,
            signature={"DWPart": "*fp32", "DBPart": "*fp32", "DW": f"*{t}", "DB": f"*{t}",
                       "G": "i32", "C": "i32", "BLOCK_G": "constexpr", "BLOCK_N": "constexpr"},
            constexprs={"BLOCK_G": _DWDB_BLOCK_G, "BLOCK_N": _DWDB_BLOCK_N},
            divisible_by_16=("DWPart", "DBPart", "DW", "DB", "C"),
            num_warps=4, num_stages=1))
    return specs


def _rms_suffix(rms: bool) -> str:
    return "_rms" if rms else ""


def _fwd_spec(t: str, block_c: int, warps: int, rms: bool) -> dict:
    return dict(
        name=f"_add_layer_norm_fwd{_rms_suffix(rms)}_{t}_C{block_c}_w{warps}", fn=_add_layer_norm_fwd,
        signature={"X": f"*{t}", "R": f"*{t}", "W": f"*{t}", "B": f"*{t}", "Y": f"*{t}",
                   "H": f"*{t}", "Mean": "*fp32", "Rstd": "*fp32", "C": "i32", "eps": "fp32",
                   "Philox": "*i64", "seed": "i64", "offset": "i64", "drop_threshold": "i32",
                   "drop_scale": "fp32", "HAS_RESIDUAL": "constexpr",
                   "HAS_DROPOUT": "constexpr", "BLOCK_C": "constexpr", "RMS_NORM": "constexpr"},
        constexprs={"HAS_RESIDUAL": True, "HAS_DROPOUT": True, "BLOCK_C": block_c, "RMS_NORM": rms},
        divisible_by_16=("X", "R", "W", "B", "Y", "H", "Mean", "Rstd", "Philox", "C"),
        num_warps=warps, num_stages=1)


def _bwd_spec(t: str, block_c: int, warps: int, rms: bool) -> dict:
    return dict(
        name=f"_add_layer_norm_bwd{_rms_suffix(rms)}_{t}_C{block_c}_w{warps}", fn=_add_layer_norm_bwd,
        signature={"DY": f"*{t}", "DHIn": f"*{t}", "H": f"*{t}", "W": f"*{t}",
                   "Mean": "*fp32", "Rstd": "*fp32", "DX": f"*{t}", "DRes": f"*{t}",
                   "DWPart": "*fp32", "DBPart": "*fp32", "N": "i32", "C": "i32",
                   "rows_per_program": "i32", "Philox": "*i64", "seed": "i64", "offset": "i64",
                   "drop_threshold": "i32", "drop_scale": "fp32", "HAS_DH": "constexpr",
                   "HAS_DROPOUT": "constexpr", "STORE_DRES": "constexpr",
                   "BLOCK_C": "constexpr", "RMS_NORM": "constexpr"},
        constexprs={"HAS_DH": True, "HAS_DROPOUT": True, "STORE_DRES": True,
                    "BLOCK_C": block_c, "RMS_NORM": rms},
        divisible_by_16=("DY", "DHIn", "H", "W", "Mean", "Rstd", "DX", "DRes", "DWPart",
                         "DBPart", "Philox", "C"),
        num_warps=warps, num_stages=1)


def _bwd_chunked_spec(t: str, rms: bool) -> dict:
    return dict(
        name=f"_add_layer_norm_bwd_chunked{_rms_suffix(rms)}_{t}_K{_CHUNK_C}_w{_CHUNK_WARPS}",
        fn=_add_layer_norm_bwd_chunked,
        signature={"DY": f"*{t}", "DHIn": f"*{t}", "H": f"*{t}", "W": f"*{t}",
                   "Mean": "*fp32", "Rstd": "*fp32", "DX": f"*{t}", "DRes": f"*{t}",
                   "N": "i32", "C": "i32", "rows_per_program": "i32", "Philox": "*i64", "seed": "i64",
                   "offset": "i64", "drop_threshold": "i32", "drop_scale": "fp32"},
        constexprs={"HAS_DH": True, "HAS_DROPOUT": True, "STORE_DRES": True, "CHUNK_C": _CHUNK_C,
                    "RMS_NORM": rms},
        divisible_by_16=("DY", "DHIn", "H", "W", "Mean", "Rstd", "DX", "DRes", "Philox", "C"),
        num_warps=_CHUNK_WARPS, num_stages=1)
