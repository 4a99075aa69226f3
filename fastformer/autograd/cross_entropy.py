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


class CrossEntropyFunction(torch.autograd.Function):
    """Fused log-softmax + label smoothing + NLL; the gradient is written in the forward pass."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction_code, kernels, class_weight=None):
        loss, grad = kernels.cross_entropy_fwd(logits, target, label_smoothing, ignore_index,
                                               reduction_code, logits.requires_grad, class_weight)
        ctx.save_for_backward(grad)  # (N, V): d(loss)/d(logits) for an upstream gradient of 1
        _unscaled(ctx, 1)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return _scale_rows(ctx, 0, grad, grad_loss), None, None, None, None, None, None  # class_weight: none


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``cross_entropy(hidden @ weight^T + bias)`` in row chunks: the (N, V) logits never exist.

    For ``mean``/``sum`` the gradients are computed in the forward pass; for ``none`` the
    backward recomputes the chunks with the per-row upstream gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, label_smoothing, ignore_index, reduction_code, kernels,
                class_weight=None):
        needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        in_forward = needs_grad and reduction_code != 0  # "none": the backward recomputes per row
        loss, dh, dw, db = kernels.linear_cross_entropy_fwd(
            hidden, weight, bias, target, label_smoothing, ignore_index, reduction_code, in_forward, class_weight)
        if in_forward:
            ctx.save_for_backward(dh, dw, db if bias is not None else None)
            _unscaled(ctx, 3)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, class_weight)
        ctx.in_forward = in_forward
        ctx.has_bias = bias is not None
        ctx.config = (label_smoothing, ignore_index)
        ctx.kernels = kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.in_forward:
            dh, dw, db = ctx.saved_tensors
            dh, dw = _scale_rows(ctx, 0, dh, grad_loss), _scale_rows(ctx, 1, dw, grad_loss)
            db = _scale_rows(ctx, 2, db, grad_loss) if db is not None else None
        else:
            hidden, weight, bias, target, class_weight = ctx.saved_tensors
            dh, dw, db = ctx.kernels.linear_cross_entropy_bwd(
                grad_loss.reshape(-1).float().contiguous(), hidden, weight, bias, target, *ctx.config, class_weight)
            db = db if ctx.has_bias else None
        return dh, dw, db, None, None, None, None, None, None
