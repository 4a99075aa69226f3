import math

import torch

def _scale_rows(ctx, index: int, grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """The stored d(loss)/d(input) ``grad`` times the upstream gradient (a scalar, or one per row).

    ``grad`` was written by the forward's kernel for an upstream gradient of 1, and only this
    backward reads it, so the first backward scales it in place by a scalar upstream gradient and
    hands it out: no new tensor of its size, one pass over it, none at all for an upstream
    gradient of exactly 1 on the CPU. ``ctx.applied[index]`` keeps the factor applied; a later
    backward through a retained graph never touches what it handed out, but multiplies out of
    place by the ratio (on an accelerator, after a zero first factor, that ratio is not finite and
    so is the gradient: loud, never silently wrong). A factor that could not be undone (zero or
    non-finite, on the CPU), a per-row upstream gradient (reduction ``none``) and a traced
    backward (torch.compile plans its own buffers) multiply out of place."""
    if grad_loss.dim() != 0:
        return grad * grad_loss.reshape(-1, *([1] * (grad.dim() - 1))).to(grad.dtype)
    if torch.compiler.is_compiling():
        return grad * grad_loss.to(grad.dtype)
    applied = ctx.applied[index]
    if applied is not None:  # a retained graph's second backward: scale out of place
        return grad * (grad_loss.to(grad.dtype) / applied)
    if grad_loss.device.type == "cpu":
        factor = grad_loss.item()
        if factor == 0.0 or not math.isfinite(factor):
            return grad * factor
        ctx.applied[index] = factor
        if factor != 1.0:
            _untracked(grad).mul_(factor)
        return grad
    ctx.applied[index] = grad_loss.detach().to(grad.dtype).clone()  # no host synchronisation
    _untracked(grad).mul_(ctx.applied[index])
    return grad


def _untracked(saved: torch.Tensor) -> torch.Tensor:
    """``saved`` with a version counter of its own: scaling it in place is not a modification
    autograd must refuse in a retained graph's second backward (which reads it knowing the factor
    applied, see ``_scale_rows``)."""
    return saved.data


def _unscaled(ctx, count: int) -> None:
    """No factor applied yet to the ``count`` stored gradients."""
    ctx.applied = [None] * count


def _math_dtype(dtype):
    """The dtype of the probabilities (and their gradient): fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Logits elements per chunk when linear_cross_entropy's probability-target gradient recomputes them.
TARGET_GRAD_CHUNK_ELEMENTS = 1 << 22


def _probability_grad(logits, class_weight, label_smoothing, reduction_code, grad_loss, rows, out):
    """d(loss)/d(q) of class probabilities q for ``rows`` (a slice of the call's rows) into ``out``
    (rows, V) in the math type: ``-(1 - eps) w_c log_softmax(x)_c`` times each row's upstream gradient
    (``grad_loss``: one for every row, or the slice's (rows,)), over the call's row count for mean.

    Why here and not in the kernels: torch's gradient needs the log-probabilities, which the kernels
    keep nowhere (they write d/dlogits in place), and only a target that requires grad needs them:
    computing them from the saved logits (or, for linear_cross_entropy, each chunk's recomputed logits)
    leaves every other call's kernels and saved tensors as they are."""
    out.copy_(torch.log_softmax(logits, -1, dtype=out.dtype)).mul_(-(1.0 - label_smoothing))
    if class_weight is not None:
        out.mul_(class_weight)
    scale = grad_loss.to(out.dtype)
    if reduction_code == 1:
        scale = scale / rows
    return out.mul_(scale.reshape(-1, 1) if scale.dim() else scale)


class CrossEntropyFunction(torch.autograd.Function):
    """Fused log-softmax + label smoothing + NLL; the gradient is written in the forward pass.
    Class probabilities (N, V) that require grad get theirs from the saved logits (_probability_grad)."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction_code, kernels, class_weight=None):
        loss, grad = kernels.cross_entropy_fwd(logits, target, label_smoothing, ignore_index,
                                               reduction_code, logits.requires_grad, class_weight)
        if ctx.needs_input_grad[1]:  # probabilities that require grad: the logits too (nothing otherwise)
            ctx.save_for_backward(grad, logits, class_weight)
            ctx.target_grad = (label_smoothing, reduction_code)
        else:
            ctx.save_for_backward(grad)  # (N, V): d(loss)/d(logits) for an upstream gradient of 1
        _unscaled(ctx, 1)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved = ctx.saved_tensors
        dlogits = _scale_rows(ctx, 0, saved[0], grad_loss) if ctx.needs_input_grad[0] else None
        dtarget = None
        if ctx.needs_input_grad[1]:
            logits, class_weight = saved[1:]
            out = torch.empty(logits.shape, dtype=_math_dtype(logits.dtype), device=logits.device)
            dtarget = _probability_grad(logits, class_weight, *ctx.target_grad, grad_loss, logits.shape[0], out)
        return dlogits, dtarget, None, None, None, None, None  # class_weight: none


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``cross_entropy(hidden @ weight^T + bias)`` in row chunks: the (N, V) logits never exist.

    For ``mean``/``sum`` the gradients are computed in the forward pass; for ``none`` the
    backward recomputes the chunks with the per-row upstream gradient. Class probabilities (N, V)
    that require grad get theirs chunk by chunk from recomputed logits (_probability_grad).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, label_smoothing, ignore_index, reduction_code, kernels,
                class_weight=None):
        needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        in_forward = needs_grad and reduction_code != 0  # "none": the backward recomputes per row
        loss, dh, dw, db = kernels.linear_cross_entropy_fwd(
            hidden, weight, bias, target, label_smoothing, ignore_index, reduction_code, in_forward, class_weight)
        if in_forward:
            # probabilities that require grad: the inputs too (nothing more otherwise)
            inputs = (hidden, weight, bias, class_weight) if ctx.needs_input_grad[3] else ()
            ctx.save_for_backward(dh, dw, db if bias is not None else None, *inputs)
            _unscaled(ctx, 3)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, class_weight)
        if ctx.needs_input_grad[3]:
            ctx.reduction_code = reduction_code
        ctx.in_forward = in_forward
        ctx.has_bias = bias is not None
        ctx.config = (label_smoothing, ignore_index)
        ctx.kernels = kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.in_forward:
            dh, dw, db, *inputs = ctx.saved_tensors
            dh, dw = _scale_rows(ctx, 0, dh, grad_loss), _scale_rows(ctx, 1, dw, grad_loss)
            db = _scale_rows(ctx, 2, db, grad_loss) if db is not None else None
        else:
            hidden, weight, bias, target, class_weight = ctx.saved_tensors
            inputs = (hidden, weight, bias, class_weight)
            dh = dw = db = None
            if any(ctx.needs_input_grad[:3]):  # not only the probabilities
                # the upstream gradient in the math type: fp64 keeps fp64 (the cpu kernel scales in fp64)
                up = grad_loss.reshape(-1).to(_math_dtype(hidden.dtype)).contiguous()
                dh, dw, db = ctx.kernels.linear_cross_entropy_bwd(up, hidden, weight, bias, target, *ctx.config,
                                                                  class_weight)
                db = db if ctx.has_bias else None
        dtarget = _linear_probability_grad(*inputs, ctx.config[0], ctx.reduction_code, grad_loss) \
            if ctx.needs_input_grad[3] else None
        return dh, dw, db, dtarget, None, None, None, None, None


def _linear_probability_grad(hidden, weight, bias, class_weight, label_smoothing, reduction_code, grad_loss):
    """The probabilities' gradient (N, V) of linear_cross_entropy, chunk by chunk: each chunk's logits
    are recomputed (as the kernels make them) and turned into its rows of the gradient."""
    N, V = hidden.shape[0], weight.shape[0]
    out = torch.empty((N, V), dtype=_math_dtype(hidden.dtype), device=hidden.device)
    grad_loss = grad_loss.reshape(-1)
    rows = max(1, TARGET_GRAD_CHUNK_ELEMENTS // V)
    for start in range(0, N, rows):
        n = min(rows, N - start)
        h = hidden.narrow(0, start, n)
        logits = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
        up = grad_loss.narrow(0, start, n) if reduction_code == 0 else grad_loss
        _probability_grad(logits, class_weight, label_smoothing, reduction_code, up, N, out.narrow(0, start, n))
    return out
