import torch

_REDUCTION_CODE = {"none": 0, "mean": 1, "sum": 2}


def _scale_rows(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """The stored d(loss)/d(input) times the upstream gradient (a scalar, or one per row).

    An upstream gradient of exactly 1 (``loss.backward()`` on CPU, outside torch.compile)
    returns the stored gradient itself: no (N, V) multiply and no new (N, V) allocation."""
    if grad_loss.dim() == 0:
        if (grad_loss.device.type == "cpu" and not torch.compiler.is_compiling()
                and grad_loss.item() == 1.0):
            return grad
        return grad * grad_loss.to(grad.dtype)
    return grad * grad_loss.reshape(-1, 1).to(grad.dtype)


class CrossEntropyFunction(torch.autograd.Function):
    """Fused log-softmax + label smoothing + NLL; the gradient is written in the forward pass."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, reduction, kernels):
        loss, grad = kernels.cross_entropy_fwd(logits, target, label_smoothing, ignore_index,
                                               _REDUCTION_CODE[reduction], logits.requires_grad)
        ctx.save_for_backward(grad)  # (N, V): d(loss)/d(logits) for an upstream gradient of 1
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return _scale_rows(grad, grad_loss), None, None, None, None, None


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``cross_entropy(hidden @ weight^T + bias)`` in row chunks: the (N, V) logits never exist.

    For ``mean``/``sum`` the gradients are computed in the forward pass; for ``none`` the
    backward recomputes the chunks with the per-row upstream gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, label_smoothing, ignore_index, reduction, kernels):
        needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        in_forward = needs_grad and reduction != "none"
        loss, dh, dw, db = kernels.linear_cross_entropy_fwd(
            hidden, weight, bias, target, label_smoothing, ignore_index,
            _REDUCTION_CODE[reduction], in_forward)
        if in_forward:
            ctx.save_for_backward(dh, dw, db if bias is not None else None)
        else:
            ctx.save_for_backward(hidden, weight, bias, target)
        ctx.in_forward = in_forward
        ctx.has_bias = bias is not None
        ctx.config = (label_smoothing, ignore_index)
        ctx.kernels = kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.in_forward:
            dh, dw, db = ctx.saved_tensors
            dh, dw = _scale_rows(dh, grad_loss), _scale_rows(dw, grad_loss)
            db = _scale_rows(db, grad_loss) if db is not None else None
        else:
            hidden, weight, bias, target = ctx.saved_tensors
            dh, dw, db = ctx.kernels.linear_cross_entropy_bwd(
                grad_loss.reshape(-1).float().contiguous(), hidden, weight, bias, target, *ctx.config)
            db = db if ctx.has_bias else None
        return dh, dw, db, None, None, None, None, None
