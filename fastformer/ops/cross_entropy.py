from typing import Optional

import torch

from .. import backends
from ..autograd import CrossEntropyFunction, LinearCrossEntropyFunction
from ..autograd.cross_entropy import REDUCTION_CODE
from . import _checks, reference

REDUCTIONS = ("none", "mean", "sum")


def _check_loss_args(label_smoothing, reduction, ignore_index):
    if not _checks._is_number(label_smoothing) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_target(target, want_shape, num_classes, ignore_index, **input_):
    """``target`` must be int64 class indices of ``want_shape`` on the device of ``input_``
    (one name=tensor pair), each in ``[0, num_classes)`` or equal to ``ignore_index``."""
    _checks.tensor("target", target)
    if target.dtype != torch.int64:
        raise TypeError(f"target must hold class indices as int64, got {target.dtype}")
    _checks.shape("target", target, want_shape, "one class index per row of the input")
    _checks.same_device(**input_, target=target)
    if torch.compiler.is_compiling() or target.numel() == 0:
        return  # a value check would read the data (a graph break); the kernels check it too
    ignored = target == ignore_index
    lo = int(torch.where(ignored, 0, target).min())
    hi = int(torch.where(ignored, 0, target).max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"target values must be in [0, {num_classes}) or equal ignore_index="
                         f"{ignore_index}; got values in [{lo}, {hi}]")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Fused label-smoothed cross-entropy with ``F.cross_entropy`` semantics.

    Args:
        logits: ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)`` (class dimension 1, as torch).
        target: int64 class indices of shape ``(N,)``, ``()`` or ``(N, d1, ...)``.
        label_smoothing: ``eps`` in ``(1 - eps) * nll + eps * mean_c(-log p_c)``.
        ignore_index: target value whose rows add nothing and get zero gradient.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.

    One pass computes log-softmax, smoothing and NLL; when the input requires grad the
    kernel writes the gradient in that same pass, so backward is one multiply.
    """
    _checks.tensor("logits", logits, min_ndim=1, floating=True)
    _check_loss_args(label_smoothing, reduction, ignore_index)
    _checks.nonempty_dim("logits", logits, 1 if logits.dim() > 1 else 0, "the classes: at least one class")
    want = (logits.shape[0],) + tuple(logits.shape[2:]) if logits.dim() > 1 else ()
    _check_target(target, want, logits.shape[1] if logits.dim() > 1 else logits.shape[0], ignore_index,
                  logits=logits)

    kernels = backends.select("cross_entropy", logits.device, logits.dtype)
    if kernels is None:
        return reference.cross_entropy(logits, target, label_smoothing=label_smoothing,
                                       ignore_index=ignore_index, reduction=reduction)
    logits2d, target1d, shape = reference._class_last(logits, target)  # (M, C), (M,)
    logits2d, target1d = logits2d.contiguous(), target1d.contiguous()
    with torch.autocast(logits.device.type, enabled=False):
        if torch.is_grad_enabled() and logits.requires_grad:
            loss = CrossEntropyFunction.apply(logits2d, target1d, float(label_smoothing), ignore_index,
                                              reduction, kernels)
        else:  # no gradient wanted (evaluation, no_grad): the kernel skips writing it
            loss, _ = kernels.cross_entropy_fwd(logits2d, target1d, float(label_smoothing), ignore_index,
                                                REDUCTION_CODE[reduction], False)
    return loss.reshape(shape) if reduction == "none" else loss


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         target: torch.Tensor, *, label_smoothing: float = 0.0,
                         ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the full logits.

    Args:
        hidden: ``(..., D)`` final hidden states.
        weight: ``(V, D)`` output projection (``nn.Linear`` layout), bias ``(V,)`` or None.
        target: int64 ``(...)``, hidden's leading shape.
        label_smoothing, ignore_index, reduction: as :func:`cross_entropy`.

    Rows are processed in chunks, so at most a chunk of the ``(N, V)`` logits exists at a
    time; the weight gradient is accumulated chunk by chunk.
    """
    _checks.tensor("hidden", hidden, min_ndim=1, floating=True)
    _checks.tensor("weight", weight, ndim=2, floating=True)
    _checks.nonempty_dim("hidden", hidden, -1, "the hidden size D")
    V, D = weight.shape
    if hidden.shape[-1] != D:
        raise ValueError(f"hidden's last dimension must equal weight.shape[1] = {D}, got shape "
                         f"{tuple(hidden.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1, floating=True)
        _checks.shape("bias", bias, (V,), "(V,) with V = weight.shape[0]")
    _checks.nonempty_dim("weight", weight, 0, "V, the classes: at least one class")
    _check_loss_args(label_smoothing, reduction, ignore_index)
    _checks.same_device(hidden=hidden, weight=weight, bias=bias)
    _check_target(target, hidden.shape[:-1], V, ignore_index, hidden=hidden)

    lowp = _checks.autocast_dtype(hidden.device)
    hidden, weight, bias = (_checks.cast(t, lowp) for t in (hidden, weight, bias))
    _checks.same_dtype(hidden=hidden, weight=weight, bias=bias)

    kernels = backends.select("linear_cross_entropy", hidden.device, hidden.dtype)
    if kernels is None:
        return reference.linear_cross_entropy(hidden, weight, bias, target, label_smoothing=label_smoothing,
                                              ignore_index=ignore_index, reduction=reduction)
    hidden2d, target1d = hidden.reshape(-1, D).contiguous(), target.reshape(-1).contiguous()  # (N, D), (N,)
    weight = weight.contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
            loss = LinearCrossEntropyFunction.apply(hidden2d, weight, bias, target1d, float(label_smoothing),
                                                    ignore_index, reduction, kernels)
        else:  # no gradient wanted: the logits chunks are reduced to the loss, nothing else is kept
            loss = kernels.linear_cross_entropy_fwd(hidden2d, weight, bias, target1d, float(label_smoothing),
                                                    ignore_index, REDUCTION_CODE[reduction], False)[0]
    return loss.reshape(target.shape) if reduction == "none" else loss
