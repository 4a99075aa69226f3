"""Fused log-softmax + label smoothing + NLL in Triton, and the chunked linear + cross-entropy.

``_cross_entropy_fwd`` runs one program per row: a first loop over the V classes in
``BLOCK_V`` chunks keeps an online log-sum-exp (running max, running sum of exponentials) and
the sum of the logits (for the smoothing term); a second loop writes the gradient
``scale * (softmax - (1 - eps) * onehot - eps / V)`` in the same kernel. With torch's class
weights ``w`` (``HAS_WEIGHT``) the sum is ``sum_c w_c x_c`` and the gradient
``scale * (((1 - eps) w[t] + eps sum(w) / V) softmax - (1 - eps) w[t] onehot - eps / V w)``. Class
probabilities as the target (torch's soft targets) go to ``_soft_cross_entropy_fwd``, the same two
loops with ``q = (1 - eps) probs + eps / V`` (for cross_entropy and, per chunk, linear_cross_entropy).
The gradient may be written over the logits themselves: each chunk is read before it is written.

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
    ClassWeight,  # (V,) fp32 class weights (read only with HAS_WEIGHT)
    WeightSum,  # fp32: their sum (read only with HAS_WEIGHT)
    V,  # number of classes (= row stride)
    ignore_index,  # rows with this target get loss 0 and gradient 0
    label_smoothing,  # eps: loss = (1 - eps) * nll + eps * mean_c(-log p_c)
    COMPUTE_GRAD: tl.constexpr,  # write Grad
    SCALE_PER_ROW: tl.constexpr,  # GradScale holds N factors instead of one
    HAS_WEIGHT: tl.constexpr,  # class weights: torch's cross_entropy(weight=ClassWeight)
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
    sum_x = 0.0  # sum of the logits (times their class weights with HAS_WEIGHT)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        if HAS_WEIGHT:
            w = tl.load(ClassWeight + start + cols, mask=mask, other=0.0)
            sum_x += tl.sum(tl.where(mask, x, 0.0) * w, axis=0)
        else:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)

    x_target = tl.load(row_ptr + safe_target).to(tl.float32)
    nll = lse - x_target
    if HAS_WEIGHT:
        w_target = tl.load(ClassWeight + safe_target)
        w_sum = tl.load(WeightSum)
        nll = w_target * nll
        smooth = (w_sum * lse - sum_x) / V
    else:
        w_target = 1.0
        w_sum = V * 1.0
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
        on_value = (1.0 - label_smoothing) * w_target
        p_mass = on_value + off_value * w_sum  # the softmax's share: 1 without class weights
        grad_ptr = Grad + row * V
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            x = tl.load(row_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                off = off_value * tl.load(ClassWeight + c, mask=mask, other=0.0)
                g = tl.exp(x - lse) * p_mass - off - tl.where(c == target, on_value, 0.0)
            else:
                g = tl.exp(x - lse) - off_value - tl.where(c == target, on_value, 0.0)
            g = tl.where(valid, g * scale, 0.0)
            tl.store(grad_ptr + c, g.to(Grad.dtype.element_ty), mask=mask)


@triton.jit
def _soft_cross_entropy_fwd(
    Logits,  # (N, V) logits, rows contiguous
    Probs,  # (N, V) fp32 class probabilities (torch's soft targets)
    LossRows,  # (N,) fp32 output: each row's loss
    Grad,  # (N, V) output: scale * d(row loss)/d(logits); may be Logits itself (in place)
    GradScale,  # fp32: one factor for every row, or one per row with SCALE_PER_ROW
    ClassWeight,  # (V,) fp32 class weights (read only with HAS_WEIGHT)
    V,  # number of classes (= row stride)
    label_smoothing,  # eps: q = (1 - eps) * probs + eps / V
    COMPUTE_GRAD: tl.constexpr,  # write Grad
    SCALE_PER_ROW: tl.constexpr,  # GradScale holds N factors (linear_cross_entropy's backward of none)
    HAS_WEIGHT: tl.constexpr,  # class weights w
    BLOCK_V: tl.constexpr,  # classes per loop step (power of two)
):
    """loss = Q lse - S with Q = sum_c w_c q_c, S = sum_c w_c q_c x_c; grad = scale (Q softmax - w q)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * V
    q_ptr = Probs + row * V
    cols = tl.arange(0, BLOCK_V)
    off_value = label_smoothing / V
    m = float("-inf")
    s = 0.0
    sum_q = 0.0
    sum_qx = 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        q = tl.load(q_ptr + start + cols, mask=mask, other=0.0) * (1.0 - label_smoothing) + off_value
        if HAS_WEIGHT:
            q = q * tl.load(ClassWeight + start + cols, mask=mask, other=0.0)
        q = tl.where(mask, q, 0.0)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        sum_q += tl.sum(q, axis=0)
        sum_qx += tl.sum(q * tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(LossRows + row, sum_q * lse - sum_qx)
    if COMPUTE_GRAD:
        if SCALE_PER_ROW:
            scale = tl.load(GradScale + row).to(tl.float32)
        else:
            scale = tl.load(GradScale).to(tl.float32)
        grad_ptr = Grad + row * V
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            x = tl.load(row_ptr + c, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_ptr + c, mask=mask, other=0.0) * (1.0 - label_smoothing) + off_value
            if HAS_WEIGHT:
                q = q * tl.load(ClassWeight + c, mask=mask, other=0.0)
            g = (tl.exp(x - lse) * sum_q - q) * scale
            tl.store(grad_ptr + c, g.to(Grad.dtype.element_ty), mask=mask)


def _launch_config(V: int) -> Tuple[int, int]:
    """(BLOCK_V, num_warps): up to MAX_BLOCK_V classes per step; 4 warps up to 1024, else 8."""
    block_v = min(next_power_of_2(V), MAX_BLOCK_V)
    return block_v, (4 if block_v <= 1024 else 8)


def _launch(logits, target, loss_rows, grad, grad_scale, ignore_index, label_smoothing,
            compute_grad, scale_per_row, class_weight=None, weight_sum=None):
    """Run the kernel on (n, V) logits; grad may be logits (in place) or unused. class_weight
    (V,) fp32 and weight_sum (its sum, () fp32) or both None."""
    n, V = logits.shape
    if n == 0:
        return
    block_v, warps = _launch_config(V)
    has_weight = class_weight is not None
    kernel(_cross_entropy_fwd)[(n,)](
        logits, target, loss_rows, grad, grad_scale, class_weight if has_weight else grad_scale,
        weight_sum if has_weight else grad_scale, V, ignore_index, label_smoothing,
        COMPUTE_GRAD=compute_grad, SCALE_PER_ROW=scale_per_row, HAS_WEIGHT=has_weight, BLOCK_V=block_v,
        num_warps=warps, num_stages=1)


def _launch_soft(logits, probs, loss_rows, grad, grad_scale, label_smoothing, compute_grad, scale_per_row,
                 class_weight=None):
    """Run the probability-target kernel on (n, V) logits and probabilities; grad may be logits
    (in place) or unused. class_weight (V,) fp32 or None."""
    n, V = logits.shape
    if n == 0:
        return
    block_v, warps = _launch_config(V)
    kernel(_soft_cross_entropy_fwd)[(n,)](
        logits, probs, loss_rows, grad, grad_scale, class_weight if class_weight is not None else grad_scale, V,
        label_smoothing, COMPUTE_GRAD=compute_grad, SCALE_PER_ROW=scale_per_row,
        HAS_WEIGHT=class_weight is not None, BLOCK_V=block_v, num_warps=warps, num_stages=1)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    check_float(name, t, ndim, f"have {ndim} dimensions")


def _check_reduction(reduction: int) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")


def _grad_scale(target: torch.Tensor, ignore_index: int, reduction: int, class_weight=None):
    """(the factor of every row's gradient, the mean's divisor), both on device: no host sync.
    The divisor is the number of non-ignored rows, or with class weights the sum of their
    targets' weights. mean divides by it (inf when every row is ignored: those rows' gradients
    are 0 and the loss is 0 / 0 = nan, as torch gives; NaN when weighted rows' weights sum to 0,
    as torch)."""
    valid = target != ignore_index
    if class_weight is None:
        divisor = valid.sum().to(torch.float32)
    else:
        # a target outside [0, V) (the op checks the values, except under torch.compile) adds
        # nothing and is never used as an index, as in the kernel
        counts = valid & (target >= 0) & (target < class_weight.shape[0])
        divisor = torch.where(counts, class_weight[torch.where(counts, target, 0)], 0.0).sum()
    if reduction == 1:
        if class_weight is None:
            return 1.0 / divisor, divisor
        return torch.where(divisor != 0, 1.0 / divisor, torch.nan), divisor
    return torch.ones((), dtype=torch.float32, device=target.device), divisor


def _reduce(loss_rows: torch.Tensor, divisor: torch.Tensor, reduction: int, dtype: torch.dtype):
    if reduction == 0:
        return loss_rows.to(dtype)
    if reduction == 2:
        return loss_rows.sum().to(dtype)
    # 0 / 0 = nan without weights; with them a sum over a zero divisor is NaN too (torch)
    return torch.where(divisor != 0, loss_rows.sum() / divisor, torch.nan).to(dtype)


def _check_class_weight(class_weight: Optional[torch.Tensor], V: int, ref: torch.Tensor):
    """class_weight: (V,) fp32 on ref's device, or None. Returns (class_weight, its sum) or Nones."""
    if class_weight is None:
        return None, None
    check_tensor("class_weight", class_weight, (V,), torch.float32)
    if class_weight.device != ref.device:
        raise ValueError(f"class_weight is on {class_weight.device} but the logits are on {ref.device}")
    return class_weight, class_weight.sum()


@on_device_of_first_tensor
def _cross_entropy_fwd_impl(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                            ignore_index: int, reduction: int, compute_grad: bool,
                            class_weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_float("logits", logits, 2)
    _check_reduction(reduction)
    N, V = logits.shape
    class_weight, weight_sum = _check_class_weight(class_weight, V, logits)
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)  # (N, V)
    if target.is_floating_point():  # class probabilities: every row counts 1 in the mean (torch's)
        check_tensor("target", target, (N, V), torch.float32)
        n_rows = torch.full((), float(N), dtype=torch.float32, device=logits.device)
        scale = 1.0 / n_rows if reduction == 1 else torch.ones((), dtype=torch.float32, device=logits.device)
        _launch_soft(logits, target, loss_rows, grad if compute_grad else logits, scale, label_smoothing,
                     compute_grad, False, class_weight)
        return _reduce(loss_rows, n_rows, reduction, logits.dtype), grad
    check_tensor("target", target, (N,), torch.int64)
    scale, n_valid = _grad_scale(target, ignore_index, reduction, class_weight)
    _launch(logits, target, loss_rows, grad if compute_grad else logits, scale, ignore_index,
            label_smoothing, compute_grad, False, class_weight, weight_sum)
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
                                 grad_scale, scale_per_row, compute_grad, class_weight=None, weight_sum=None):
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
        if target.is_floating_point():  # class probabilities (n, V)
            _launch_soft(logits, target.narrow(0, start, n), loss_rows, logits, scale, label_smoothing,
                         compute_grad, scale_per_row, class_weight)  # with compute_grad: logits := dlogits
        else:
            _launch(logits, target.narrow(0, start, n), loss_rows, logits, scale, ignore_index,
                    label_smoothing, compute_grad, scale_per_row, class_weight,
                    weight_sum)  # with compute_grad: logits := dlogits
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
    if target.is_floating_point():  # class probabilities (torch's soft targets)
        check_tensor("target", target, (N, V), torch.float32)
    else:
        check_tensor("target", target, (N,), torch.int64)


@on_device_of_first_tensor
def _linear_cross_entropy_fwd_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                   target: torch.Tensor, label_smoothing: float, ignore_index: int,
                                   reduction: int, compute_grad: bool, class_weight: Optional[torch.Tensor] = None
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_linear(hidden, weight, bias, target)
    _check_reduction(reduction)
    class_weight, weight_sum = _check_class_weight(class_weight, weight.shape[0], hidden)
    if target.is_floating_point():  # class probabilities: every row counts 1 in the mean (torch's)
        n_valid = torch.full((), float(hidden.shape[0]), dtype=torch.float32, device=hidden.device)
        scale = 1.0 / n_valid if reduction == 1 else torch.ones((), dtype=torch.float32, device=hidden.device)
    else:
        scale, n_valid = _grad_scale(target, ignore_index, reduction, class_weight)
    loss_rows, dh, dw, db = _linear_cross_entropy_chunks(
        hidden, weight, bias, target, label_smoothing, ignore_index, scale, False, compute_grad,
        class_weight, weight_sum)
    loss = _reduce(loss_rows, n_valid, reduction, hidden.dtype)
    if not compute_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0), weight.new_empty(0)
    db = db.to(bias.dtype) if bias is not None else weight.new_empty(0)
    return loss, dh, dw.to(weight.dtype), db


@on_device_of_first_tensor
def _linear_cross_entropy_bwd_impl(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                   bias: Optional[torch.Tensor], target: torch.Tensor,
                                   label_smoothing: float, ignore_index: int,
                                   class_weight: Optional[torch.Tensor] = None
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_linear(hidden, weight, bias, target)
    check_tensor("grad_loss", grad_loss, (hidden.shape[0],), torch.float32)
    class_weight, weight_sum = _check_class_weight(class_weight, weight.shape[0], hidden)
    _, dh, dw, db = _linear_cross_entropy_chunks(
        hidden, weight, bias, target, label_smoothing, ignore_index, grad_loss, True, True,
        class_weight, weight_sum)
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
    linear_cross_entropy's backward with one factor per row), each with and without class weights."""
    specs = []
    flag_sets = ((True, False), (False, False), (True, True))  # (COMPUTE_GRAD, SCALE_PER_ROW)
    for dtype, t in _TL_DTYPE.items():
        for block_v in (1024, MAX_BLOCK_V):
            warps = 4 if block_v <= 1024 else 8
            for (compute_grad, per_row), has_weight in (
                    [(f, w) for f in (flag_sets if block_v == MAX_BLOCK_V else flag_sets[:1]) for w in (False, True)]):
                specs.append(dict(
                    name=f"_cross_entropy_fwd_{t}_V{block_v}_w{warps}_g{int(compute_grad)}_r{int(per_row)}"
                         f"_cw{int(has_weight)}",
                    fn=_cross_entropy_fwd,
                    signature={"Logits": f"*{t}", "Target": "*i64", "LossRows": "*fp32",
                               "Grad": f"*{t}", "GradScale": "*fp32", "ClassWeight": "*fp32",
                               "WeightSum": "*fp32", "V": "i32",
                               "ignore_index": "i32", "label_smoothing": "fp32",
                               "COMPUTE_GRAD": "constexpr", "SCALE_PER_ROW": "constexpr",
                               "HAS_WEIGHT": "constexpr", "BLOCK_V": "constexpr"},
                    constexprs={"COMPUTE_GRAD": compute_grad, "SCALE_PER_ROW": per_row,
                                "HAS_WEIGHT": has_weight, "BLOCK_V": block_v},
                    # a row chunk's target / per-row scales are views at any offset
                    divisible_by_16=("Logits", "LossRows", "Grad", "V") if per_row else
                    ("Logits", "Target", "LossRows", "Grad", "GradScale", "V"),
                    num_warps=warps, num_stages=1))
    # probability targets: with and without the gradient, and linear_cross_entropy's backward with
    # one factor per row
    for dtype, t in _TL_DTYPE.items():
        for block_v in (1024, MAX_BLOCK_V):
            warps = 4 if block_v <= 1024 else 8
            for compute_grad, per_row in (flag_sets if block_v == MAX_BLOCK_V else flag_sets[:2]):
                for has_weight in (False, True):
                    specs.append(dict(
                        name=f"_soft_cross_entropy_fwd_{t}_V{block_v}_w{warps}_g{int(compute_grad)}_r{int(per_row)}"
                             f"_cw{int(has_weight)}",
                        fn=_soft_cross_entropy_fwd,
                        signature={"Logits": f"*{t}", "Probs": "*fp32", "LossRows": "*fp32", "Grad": f"*{t}",
                                   "GradScale": "*fp32", "ClassWeight": "*fp32", "V": "i32",
                                   "label_smoothing": "fp32", "COMPUTE_GRAD": "constexpr",
                                   "SCALE_PER_ROW": "constexpr", "HAS_WEIGHT": "constexpr",
                                   "BLOCK_V": "constexpr"},
                        constexprs={"COMPUTE_GRAD": compute_grad, "SCALE_PER_ROW": per_row,
                                    "HAS_WEIGHT": has_weight, "BLOCK_V": block_v},
                        # a row chunk's probabilities / per-row scales are views at any offset
                        divisible_by_16=("Logits", "LossRows", "Grad", "V") if per_row else
                        ("Logits", "Probs", "LossRows", "Grad", "GradScale", "V"),
                        num_warps=warps, num_stages=1))
    return specs
