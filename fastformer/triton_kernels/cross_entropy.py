"""Fused log-softmax + label smoothing + NLL in Triton, and the chunked linear + cross-entropy.

``_cross_entropy_fwd`` runs one program per row: a first loop over the V classes in
``BLOCK_V`` chunks keeps an online log-sum-exp (running max, running sum of exponentials) and
the sum of the logits (for the smoothing term); a second loop writes the gradient
``scale * (softmax - (1 - eps) * onehot - eps / V)`` in the same kernel. The gradient may be
written over the logits themselves: each chunk is read before it is written.

``linear_cross_entropy_*`` never build the ``(N, V)`` logits: rows go in chunks; per chunk
the logits come from a cuBLAS/torch GEMM, the kernel turns them into d(loss)/d(logits) in
place, and two more GEMMs give that chunk's dhidden and its contribution to dweight, which
is accumulated in fp32.
"""
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from .registration import kernel, register_op
from .utils import check_float, check_tensor, next_power_of_2, on_device_of_first_tensor

MAX_BLOCK_V = 4096  # classes per step of the row loops
_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_CHUNK_ELEMENTS = 1 << 23  # logits elements per chunk of linear_cross_entropy (at least)


@triton.jit
def _cross_entropy_fwd(
    Logits,  # (N, V) logits, rows contiguous
    Target,  # (N,) int64 class indices
    LossRows,  # (N,) fp32 output: each row's loss, 0 for an ignored row
    Grad,  # (N, V) output: scale * d(row loss)/d(logits); may be Logits itself (in place)
    GradScale,  # fp32: one factor for every row, or one per row with SCALE_PER_ROW
    V,  # number of classes (= row stride)
    ignore_index,  # rows with this target get loss 0 and gradient 0
    label_smoothing,  # eps: loss = (1 - eps) * nll + eps * mean_c(-log p_c)
    COMPUTE_GRAD: tl.constexpr,  # write Grad
    SCALE_PER_ROW: tl.constexpr,  # GradScale holds N factors instead of one
    BLOCK_V: tl.constexpr,  # classes per loop step (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * V
    target = tl.load(Target + row)
    valid = target != ignore_index
    in_range = valid & (target >= 0) & (target < V)
    safe_target = tl.where(in_range, target, 0)

    cols = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    m = float("-inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    sum_x = 0.0  # sum of the logits
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)

    x_target = tl.load(row_ptr + safe_target).to(tl.float32)
    nll = lse - x_target
    smooth = lse - sum_x / V
    # without smoothing the smoothing term is left out, not multiplied by 0: an infinite term
    # (a -inf logit) would turn 0 * inf into NaN where the reference gives inf
    loss = tl.where(label_smoothing > 0.0, (1.0 - label_smoothing) * nll + label_smoothing * smooth, nll)
    tl.store(LossRows + row, tl.where(valid, loss, 0.0))

    if COMPUTE_GRAD:
        if SCALE_PER_ROW:
            scale = tl.load(GradScale + row).to(tl.float32)
        else:
            scale = tl.load(GradScale).to(tl.float32)
        off_value = label_smoothing / V
        on_value = 1.0 - label_smoothing
        grad_ptr = Grad + row * V
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            x = tl.load(row_ptr + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - off_value - tl.where(c == target, on_value, 0.0)
            g = tl.where(valid, g * scale, 0.0)
            tl.store(grad_ptr + c, g.to(Grad.dtype.element_ty), mask=mask)


def _launch_config(V: int) -> Tuple[int, int]:
    """(BLOCK_V, num_warps): up to MAX_BLOCK_V classes per step; 4 warps up to 1024, else 8."""
    block_v = min(next_power_of_2(V), MAX_BLOCK_V)
    return block_v, (4 if block_v <= 1024 else 8)


def _launch(logits, target, loss_rows, grad, grad_scale, ignore_index, label_smoothing,
            compute_grad, scale_per_row):
    """Run the kernel on (n, V) logits; grad may be logits (in place) or unused."""
    n, V = logits.shape
    if n == 0:
        return
    block_v, warps = _launch_config(V)
    kernel(_cross_entropy_fwd)[(n,)](
        logits, target, loss_rows, grad, grad_scale, V, ignore_index, label_smoothing,
        COMPUTE_GRAD=compute_grad, SCALE_PER_ROW=scale_per_row, BLOCK_V=block_v,
        num_warps=warps, num_stages=1)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    check_float(name, t, ndim, f"have {ndim} dimensions")


def _check_reduction(reduction: int) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")


def _grad_scale(target: torch.Tensor, ignore_index: int, reduction: int):
    """(the factor of every row's gradient, the number of non-ignored rows), both on device:
    no host sync. mean divides by the count (inf when every row is ignored: those rows'
    gradients are 0 and the loss is 0 / 0 = nan, as torch gives)."""
    n_valid = (target != ignore_index).sum().to(torch.float32)
    if reduction == 1:
        return 1.0 / n_valid, n_valid
    return torch.ones((), dtype=torch.float32, device=target.device), n_valid


def _reduce(loss_rows: torch.Tensor, n_valid: torch.Tensor, reduction: int, dtype: torch.dtype):
    if reduction == 0:
        return loss_rows.to(dtype)
    if reduction == 2:
        return loss_rows.sum().to(dtype)
    return (loss_rows.sum() / n_valid).to(dtype)


@on_device_of_first_tensor
def _cross_entropy_fwd_impl(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                            ignore_index: int, reduction: int,
                            compute_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_float("logits", logits, 2)
    _check_reduction(reduction)
    N, V = logits.shape
    check_tensor("target", target, (N,), torch.int64)
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)  # (N, V)
    scale, n_valid = _grad_scale(target, ignore_index, reduction)
    _launch(logits, target, loss_rows, grad if compute_grad else logits, scale, ignore_index,
            label_smoothing, compute_grad, False)
    return _reduce(loss_rows, n_valid, reduction, logits.dtype), grad


def _chunk_rows(N: int, D: int, V: int) -> int:
    """Rows per chunk of linear_cross_entropy: the chunk's logits hold about as many elements
    as hidden does, and at least _CHUNK_ELEMENTS (so the GEMMs stay large)."""
    return max(1, min(N, max(N * D, _CHUNK_ELEMENTS) // V))


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if bias is None:
        return torch.mm(h, weight.t())  # (n, V)
    return torch.addmm(bias, h, weight.t())  # (n, V)


def _accumulate_dweight(dw_acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dw_acc (V, D) fp32 += dlogits^T (V, n) @ h (n, D)."""
    if dlogits.dtype == torch.float32:
        return dw_acc.addmm_(dlogits.t(), h)
    if dlogits.is_cuda:  # cuBLAS: 16-bit inputs, fp32 accumulate and output
        return torch.addmm(dw_acc, dlogits.t(), h, out_dtype=torch.float32)
    return dw_acc.add_(torch.mm(dlogits.t(), h))  # CPU has no 16-bit -> fp32 GEMM


def _linear_cross_entropy_chunks(hidden, weight, bias, target, label_smoothing, ignore_index,
                                 grad_scale, scale_per_row, compute_grad):
    """Loop over row chunks. Returns per-row fp32 losses (N,) and, with compute_grad,
    dhidden (N, D), dweight (V, D) fp32 and dbias (V,) fp32 (or None)."""
    N, D = hidden.shape
    V = weight.shape[0]
    rows = _chunk_rows(N, D, V)
    losses, dh_chunks = [], []
    dw_acc = torch.zeros((V, D), dtype=torch.float32, device=hidden.device) if compute_grad else None
    db_acc = torch.zeros(V, dtype=torch.float32, device=hidden.device) \
        if (compute_grad and bias is not None) else None
    for start in range(0, N, rows):
        n = min(rows, N - start)
        h = hidden.narrow(0, start, n)  # (n, D)
        logits = _logits(h, weight, bias)  # (n, V)
        loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
        scale = grad_scale.narrow(0, start, n) if scale_per_row else grad_scale
        _launch(logits, target.narrow(0, start, n), loss_rows, logits, scale, ignore_index,
                label_smoothing, compute_grad, scale_per_row)  # with compute_grad: logits := dlogits
        losses.append(loss_rows)
        if compute_grad:
            dh_chunks.append(torch.mm(logits, weight))  # (n, D)
            dw_acc = _accumulate_dweight(dw_acc, logits, h)
            if db_acc is not None:
                db_acc += logits.sum(0, dtype=torch.float32)
    loss_rows = torch.cat(losses) if losses else hidden.new_empty(0, dtype=torch.float32)
    dhidden = (torch.cat(dh_chunks) if dh_chunks else torch.empty_like(hidden)) if compute_grad else None
    return loss_rows, dhidden, dw_acc, db_acc


def _check_linear(hidden, weight, bias, target) -> None:
    _check_float("hidden", hidden, 2)
    _check_float("weight", weight, 2)
    N, D = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape (V, {D}) to match hidden (N, D), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}")
    if bias is not None:
        check_tensor("bias", bias, (V,), hidden.dtype)
    check_tensor("target", target, (N,), torch.int64)


@on_device_of_first_tensor
def _linear_cross_entropy_fwd_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   target: torch.Tensor, label_smoothing: float, ignore_index: int,
                                   reduction: int, compute_grad: bool
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_linear(hidden, weight, bias, target)
    _check_reduction(reduction)
    scale, n_valid = _grad_scale(target, ignore_index, reduction)
    loss_rows, dh, dw, db = _linear_cross_entropy_chunks(
        hidden, weight, bias, target, label_smoothing, ignore_index, scale, False, compute_grad)
    loss = _reduce(loss_rows, n_valid, reduction, hidden.dtype)
    if not compute_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0), weight.new_empty(0)
    db = db.to(bias.dtype) if bias is not None else weight.new_empty(0)
    return loss, dh, dw.to(weight.dtype), db


@on_device_of_first_tensor
def _linear_cross_entropy_bwd_impl(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                   bias: Optional[torch.Tensor], target: torch.Tensor,
                                   label_smoothing: float, ignore_index: int
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_linear(hidden, weight, bias, target)
    check_tensor("grad_loss", grad_loss, (hidden.shape[0],), torch.float32)
    _, dh, dw, db = _linear_cross_entropy_chunks(
        hidden, weight, bias, target, label_smoothing, ignore_index, grad_loss, True, True)
    db = db.to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dh, dw.to(weight.dtype), db


# logits (N, V), target (N,) -> loss (() or (N,)), grad (N, V) or empty
cross_entropy_fwd = register_op("cross_entropy_fwd", _cross_entropy_fwd_impl)
# hidden (N, D), weight (V, D), bias (V,) -> loss, dhidden (N, D), dweight (V, D), dbias (V,) or empties
linear_cross_entropy_fwd = register_op("linear_cross_entropy_fwd", _linear_cross_entropy_fwd_impl)
# grad_loss (N,) fp32 -> dhidden (N, D), dweight (V, D), dbias (V,) or empty
linear_cross_entropy_bwd = register_op("linear_cross_entropy_bwd", _linear_cross_entropy_bwd_impl)


def aot_specs() -> List[dict]:
    """Every specialisation of ``_cross_entropy_fwd`` the host code launches, for ahead-of-time
    compilation: each dtype; BLOCK_V 1024 (4 warps) and MAX_BLOCK_V (8 warps); at MAX_BLOCK_V
    every flag combination the host uses (cross_entropy with and without the gradient,
    linear_cross_entropy's backward with one factor per row)."""
    specs = []
    flag_sets = ((True, False), (False, False), (True, True))  # (COMPUTE_GRAD, SCALE_PER_ROW)
    for dtype, t in _TL_DTYPE.items():
        for block_v in (1024, MAX_BLOCK_V):
            warps = 4 if block_v <= 1024 else 8
            for compute_grad, per_row in (flag_sets if block_v == MAX_BLOCK_V else flag_sets[:1]):
                specs.append(dict(
                    name=f"_cross_entropy_fwd_{t}_V{block_v}_w{warps}_g{int(compute_grad)}_r{int(per_row)}",
                    fn=_cross_entropy_fwd,
                    signature={"Logits": f"*{t}", "Target": "*i64", "LossRows": "*fp32",
                               "Grad": f"*{t}", "GradScale": "*fp32", "V": "i32",
                               "ignore_index": "i32", "label_smoothing": "fp32",
                               "COMPUTE_GRAD": "constexpr", "SCALE_PER_ROW": "constexpr",
                               "BLOCK_V": "constexpr"},
                    constexprs={"COMPUTE_GRAD": compute_grad, "SCALE_PER_ROW": per_row,
                                "BLOCK_V": block_v},
                    # a row chunk's target / per-row scales are views at any offset
                    divisible_by_16=("Logits", "LossRows", "Grad", "V") if per_row else
                    ("Logits", "Target", "LossRows", "Grad", "GradScale", "V"),
                    num_warps=warps, num_stages=1))
    return specs
