"""The fused input embedding in Triton (the C++ schemas embedding_fwd / embedding_bwd, csrc/schemas.h).

Forward: a program per ``BLOCK_R`` ids, the rows in steps of up to 256 columns:
``out = (weight[id] * scale + positional[pos]) * keep / (1 - p)`` in fp32, rounded once. Dropout is
fastformer/philox.py's over the (N, D) output rows: element ``(i, col)`` takes its 16 bits from the
Philox call on counter ``offset + i * ceil(D / 8) + col // 8``.

Backward, deterministic (as torch's CUDA embedding backward: sorted ids and segment sums, no
atomics): the host sorts the keys (ids, or positions for the table's gradient) stably and finds
each sorted position's segment end (``searchsorted``: no sync, no data-dependent shape). Program
``(r, column block)`` runs only where ``r`` starts a segment: it sums the rows ``order[r .. end)``
of ``grad * keep / (1 - p)`` in that order (increasing id position, the CPU kernel's order too),
scales, and writes its key's row of the zero-filled table once; padding_idx's row stays zero.
"""
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .registration import kernel, register_op
from .utils import (cdiv, check_float, check_tensor, dropout_args, dropout_keep_tile, load_philox, next_power_of_2,
                    on_device_of_first_tensor, philox_args)

_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FWD_ROWS = 8  # ids a forward program ...
_FWD_MAX_BLOCK_D = 256  # ... and its columns a step: 8 x 1024 fp32 spilled registers at 4 warps
_BWD_MAX_BLOCK_D = 1024  # columns a backward program (one row of them)


@triton.jit(do_not_specialize=["seed", "offset"])
def _embedding_fwd(
    Ids,  # (N,) int64 rows of W
    W,  # (V, D) table
    Pos,  # (N,) int64 rows of PT (not read without HAS_POS)
    PT,  # (P, D) positional table (not read without HAS_POS)
    Out,  # (N, D) output
    N,  # number of ids
    D,  # row width (= row stride of W, PT and Out)
    scale,  # multiplies the rows of W
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # Philox key of the dropout mask (without Philox)
    offset,  # Philox counter of element (0, 0) (without Philox)
    drop_threshold,  # round(dropout_p * 2**16): keep iff the element's 16 Philox bits >= drop_threshold
    drop_scale,  # 1 / (1 - dropout_p)
    HAS_POS: tl.constexpr,  # add PT[Pos]
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    BLOCK_R: tl.constexpr,  # ids a program
    BLOCK_D: tl.constexpr,  # columns a step, a power of two >= 8 (whole Philox groups)
):
    seed, offset = load_philox(Philox, seed, offset)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (R,)
    rmask = rows < N
    ids = tl.load(Ids + rows, mask=rmask, other=0)
    if HAS_POS:
        pos = tl.load(Pos + rows, mask=rmask, other=0)
    G = tl.cdiv(D, 8)
    for c0 in range(0, D, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(W + ids[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32) * scale
        if HAS_POS:
            x += tl.load(PT + pos[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = dropout_keep_tile(seed, offset, rows, G, c0, drop_threshold, BLOCK_D)
            x = tl.where(keep, x * drop_scale, 0.0)
        tl.store(Out + rows.to(tl.int64)[:, None] * D + cols[None, :], x.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "offset"])
def _embedding_bwd(
    Grad,  # (N, D) upstream gradient
    Keys,  # (N,) int64 sorted keys (stable)
    Order,  # (N,) int64: the id position of each sorted key
    Ends,  # (N,) int64: the end of each sorted position's segment
    Table,  # (K, D) output, zero-filled: the gradient of the table
    N,  # number of ids
    D,  # row width
    skip_row,  # the key whose row stays zero (padding_idx), -1: none
    scale,  # multiplies the sums (the forward's scale for the weight, 1 for the positional table)
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # Philox key of the dropout mask (without Philox)
    offset,  # Philox counter of element (0, 0) (without Philox)
    drop_threshold,  # round(dropout_p * 2**16)
    drop_scale,  # 1 / (1 - dropout_p)
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    BLOCK_D: tl.constexpr,  # columns a program, a power of two >= 8 (whole Philox groups)
):
    seed, offset = load_philox(Philox, seed, offset)
    r = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK_D
    key = tl.load(Keys + r)
    prev = tl.load(Keys + r - 1, mask=r > 0, other=-1)
    if (key != prev) & (key != skip_row):  # r starts a segment: this program owns its key's row
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        G = tl.cdiv(D, 8)
        end = tl.load(Ends + r)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s in range(r, end):
            i = tl.load(Order + s)
            g = tl.load(Grad + i * D + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_DROPOUT:
                keep = dropout_keep_tile(seed, offset, tl.full((1,), i, tl.int64), G, c0, drop_threshold, BLOCK_D)
                g = tl.where(tl.reshape(keep, (BLOCK_D,)), g * drop_scale, 0.0)
            acc += g
        tl.store(Table + key * D + cols, (acc * scale).to(Table.dtype.element_ty), mask=cmask)


def _check_ids(name: str, t: torch.Tensor, n: Optional[int] = None) -> int:
    if t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous():
        raise ValueError(f"{name} must be 1-D contiguous int64 ids, got {t.dtype} {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have the length of input ({n}), got {t.shape[0]}")
    return t.shape[0]


def _check_rows(name: str, t: torch.Tensor) -> Tuple[int, int]:
    check_float(name, t, 2, "be 2-D")
    return t.shape


def _block_d(D: int, cap: int) -> int:
    return min(next_power_of_2(max(D, 8)), cap)


@on_device_of_first_tensor
def _embedding_fwd_impl(input: torch.Tensor, weight: torch.Tensor, positional: Optional[torch.Tensor],
                        positions: Optional[torch.Tensor], scale: float, dropout_p: float,
                        philox: torch.Tensor) -> torch.Tensor:
    N = _check_ids("input", input)
    V, D = _check_rows("weight", weight)
    has_dropout, threshold, drop_scale = dropout_args(dropout_p)
    rng = philox_args(philox, weight.device, "embedding_fwd", has_dropout)
    if (positional is None) != (positions is None):
        raise ValueError("embedding_fwd: positional and positions must be given together")
    if positional is not None:
        check_tensor("positional", positional, (positional.shape[0], D), weight.dtype)
        _check_ids("positions", positions, N)
    out = torch.empty((N, D), dtype=weight.dtype, device=weight.device)
    if N == 0 or D == 0:
        return out
    has_pos = positional is not None
    kernel(_embedding_fwd)[(cdiv(N, _FWD_ROWS),)](
        input, weight, positions if has_pos else input, positional if has_pos else weight, out, N, D, scale,
        *rng, threshold, drop_scale, HAS_POS=has_pos, HAS_DROPOUT=has_dropout, BLOCK_R=_FWD_ROWS,
        BLOCK_D=_block_d(D, _FWD_MAX_BLOCK_D), num_warps=4, num_stages=1)
    return out


def _table_grad(grad, keys, K, skip_row, scale, rng, dropout_p):
    N, D = grad.shape
    table = torch.zeros((K, D), dtype=grad.dtype, device=grad.device)
    if N == 0 or D == 0 or K == 0:
        return table
    sorted_keys, order = torch.sort(keys, stable=True)  # a segment's rows in increasing id position
    ends = torch.searchsorted(sorted_keys, sorted_keys, right=True)
    has_dropout, threshold, drop_scale = dropout_args(dropout_p)
    block_d = _block_d(D, _BWD_MAX_BLOCK_D)
    kernel(_embedding_bwd)[(N, cdiv(D, block_d))](
        grad, sorted_keys, order, ends, table, N, D, skip_row, scale, *rng, threshold, drop_scale,
        HAS_DROPOUT=has_dropout, BLOCK_D=block_d, num_warps=4, num_stages=1)
    return table


@on_device_of_first_tensor
def _embedding_bwd_impl(grad: torch.Tensor, input: torch.Tensor, positions: Optional[torch.Tensor],
                        num_weights: int, num_positions: int, weight_grad: bool, positional_grad: bool,
                        padding_idx: int, scale: float, dropout_p: float,
                        philox: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    N = _check_ids("input", input)
    _check_rows("grad", grad)
    if grad.shape[0] != N:
        raise ValueError(f"embedding_bwd: grad must have shape ({N}, D), got {tuple(grad.shape)}")
    rng = philox_args(philox, grad.device, "embedding_bwd", dropout_args(dropout_p)[0])
    if positions is not None:
        _check_ids("positions", positions, N)
    if positional_grad and positions is None:
        raise ValueError("embedding_bwd: positional_grad needs positions")
    dweight = (_table_grad(grad, input, num_weights, padding_idx, scale, rng, dropout_p) if weight_grad
               else grad.new_empty(0))
    dpositional = (_table_grad(grad, positions, num_positions, -1, 1.0, rng, dropout_p) if positional_grad
                   else grad.new_empty(0))
    return dweight, dpositional


# input (N,), weight (V, D), positional (P, D) or None, positions (N,) or None -> out (N, D)
embedding_fwd = register_op("embedding_fwd", _embedding_fwd_impl)
# grad (N, D) -> dweight (V, D) or empty, dpositional (P, D) or empty
embedding_bwd = register_op("embedding_bwd", _embedding_bwd_impl)


def aot_specs() -> List[dict]:
    """Every kernel specialisation the host launches, for ahead-of-time compilation: each dtype, the
    forward at BLOCK_D 64 and 256 (its widest step), the backward at 256 and 1024 (its widest), the
    flags with the most code (positional, dropout). Pointers (fresh torch allocations) and D (a
    multiple of 16, as model widths are) carry Triton's divisible-by-16 specialisation, as the
    launcher gives them."""
    specs = []
    for dtype, t in _TL_DTYPE.items():
        for block_d in (64, _FWD_MAX_BLOCK_D):
            specs.append(dict(
                name=f"_embedding_fwd_{t}_D{block_d}", fn=_embedding_fwd,
                signature={"Ids": "*i64", "W": f"*{t}", "Pos": "*i64", "PT": f"*{t}", "Out": f"*{t}", "N": "i32",
                           "D": "i32", "scale": "fp32", "Philox": "*i64", "seed": "i64", "offset": "i64",
                           "drop_threshold": "i32", "drop_scale": "fp32", "HAS_POS": "constexpr", "HAS_DROPOUT": "constexpr",
                           "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"},
                constexprs={"HAS_POS": True, "HAS_DROPOUT": True, "BLOCK_R": _FWD_ROWS, "BLOCK_D": block_d},
                divisible_by_16=("Ids", "W", "Pos", "PT", "Out", "Philox", "D"), num_warps=4, num_stages=1))
        for block_d in (256, _BWD_MAX_BLOCK_D):
            specs.append(dict(
                name=f"_embedding_bwd_{t}_D{block_d}", fn=_embedding_bwd,
                signature={"Grad": f"*{t}", "Keys": "*i64", "Order": "*i64", "Ends": "*i64", "Table": f"*{t}",
                           "N": "i32", "D": "i32", "skip_row": "i64", "scale": "fp32", "Philox": "*i64",
                           "seed": "i64", "offset": "i64", "drop_threshold": "i32", "drop_scale": "fp32",
                           "HAS_DROPOUT": "constexpr", "BLOCK_D": "constexpr"},
                constexprs={"HAS_DROPOUT": True, "BLOCK_D": block_d},
                divisible_by_16=("Grad", "Keys", "Order", "Ends", "Table", "Philox", "D"), num_warps=4, num_stages=1))
    return specs
