from typing import Optional

import torch

from .. import backends
from ..autograd import CrossEntropyFunction, LinearCrossEntropyFunction
from ..internal import validation
from ..internal.eager import eager
from ..internal.rows import as_rows
from . import reference

# The reductions, and the codes the kernels take for them (csrc/schemas.h: 0 none, 1 mean, 2 sum).
REDUCTION_CODE = {"none": 0, "mean": 1, "sum": 2}
REDUCTIONS = tuple(REDUCTION_CODE)
# ignore_index=None (torch's F.linear_cross_entropy: nothing is ignored) as an index no class has.
_IGNORE_NOTHING = -(2 ** 63)

def _check_loss_args(label_smoothing, reduction, ignore_index):
    validation.unit_interval("label_smoothing", label_smoothing)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_target(target, want_shape, probs_shape, ignore_index, **input_):
    """``target`` must be int64 class indices of ``want_shape`` on the device of ``input_`` (one
    name=tensor pair; their values: :func:`_check_target_values`), or class probabilities: a
    floating tensor of ``probs_shape`` (torch's soft targets, without ignore_index). Returns whether
    it holds probabilities."""
    validation.tensor("target", target)
    if target.dtype != torch.int64:
        if not target.is_floating_point() or target.shape != probs_shape:
            raise TypeError(f"target must hold class indices as int64 (shape {tuple(want_shape)}) or class "
                            f"probabilities of shape {tuple(probs_shape)}, got {target.dtype} of shape "
                            f"{tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError(f"ignore_index is not supported for probability targets (as torch), got {ignore_index}")
        validation.same_device(**input_, target=target)
        return True
    validation.shape("target", target, want_shape, "one class index per row of the input")
    validation.same_device(**input_, target=target)
    return False


def _check_target_values(target, num_classes, ignore_index):
    """Each target in ``[0, num_classes)`` or equal to ``ignore_index``."""
    if torch.compiler.is_compiling() or target.numel() == 0:
        return  # a value check would read the data (a graph break); the kernels check it too
    ignored = target == ignore_index
    lo = int(torch.where(ignored, 0, target).min())
    hi = int(torch.where(ignored, 0, target).max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"target values must be in [0, {num_classes}) or equal ignore_index="
                         f"{ignore_index}; got values in [{lo}, {hi}]")


def _math_dtype(dtype):
    """The dtype the kernels take class weights and probabilities in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_class_weight(weight, num_classes, dtype, **input_):
    """torch's per-class ``weight``: a floating ``(num_classes,)`` tensor on the device of ``input_``
    (one name=tensor pair) that does not require grad (torch's cross_entropy does not differentiate
    it, and refuses one that does). Returns it as the kernels take it: contiguous, in the math type
    of ``dtype`` (fp64 for fp64, else fp32)."""
    validation.tensor("weight", weight, floating=True)
    validation.shape("weight", weight, (num_classes,), "one weight per class")
    validation.same_device(**input_, weight=weight)
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("weight (the class weights) must not require grad: torch's cross_entropy does not "
                         "differentiate it; pass weight.detach()")
    return weight.to(_math_dtype(dtype)).contiguous()


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, weight: Optional[torch.Tensor] = None,
                  label_smoothing: float = 0.0, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Fused label-smoothed cross-entropy with ``F.cross_entropy`` semantics.

    Args:
        logits: ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)`` (class dimension 1, as torch).
        target: int64 class indices of shape ``(N,)``, ``()`` or ``(N, d1, ...)``; or class
            probabilities of the logits' shape (torch's soft targets: ``-sum_c w_c q_c log p_c`` with
            ``q`` smoothed, no ignore_index, ``mean`` over the rows; the kernels take them in fp32,
            fp64 for fp64 logits). Every backend computes them, and probabilities that require
            grad get torch's gradient ``-(1 - eps) w_c log_softmax(x)_c`` per unit of the row's loss.
        weight: torch's class weights ``w``, a floating ``(C,)`` tensor (any floating dtype: the
            kernels take it in fp32, fp64 for fp64 logits), or None. It gets no gradient and must
            not require grad (as torch). Row ``i`` then adds ``(1 - eps) * w[t_i] * nll_i + (eps / C)
            * sum_c w_c * (-log p_c)``, and ``mean`` divides by the non-ignored rows' sum of
            ``w[t_i]`` (NaN when that is 0, as torch).
        label_smoothing: ``eps`` in ``(1 - eps) * nll + eps * mean_c(-log p_c)``.
        ignore_index: target value whose rows add nothing and get zero gradient.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.

    One pass computes log-softmax, smoothing and NLL; when the input requires grad the
    kernel writes the gradient in that same pass, so backward is one multiply.
    """
    validation.tensor("logits", logits, min_ndim=1, floating=True)
    _check_loss_args(label_smoothing, reduction, ignore_index)
    validation.nonempty_dim("logits", logits, 1 if logits.dim() > 1 else 0, "the classes: at least one class")
    want = (logits.shape[0],) + tuple(logits.shape[2:]) if logits.dim() > 1 else ()
    soft = _check_target(target, want, logits.shape, ignore_index, logits=logits)
    C = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    if weight is not None:
        weight = _check_class_weight(weight, C, logits.dtype, logits=logits)

    if soft:
        kernels = backends.select_cached("cross_entropy", logits.device, logits.dtype)
        return _cross_entropy(kernels, logits, target, weight, label_smoothing, ignore_index, reduction)
    kernels = backends.select_cached("cross_entropy", logits.device, logits.dtype)
    return validation.values_checked(kernels, lambda: _check_target_values(target, C, ignore_index),
                                     lambda: _cross_entropy(kernels, logits, target, weight, label_smoothing,
                                                            ignore_index, reduction))


def _cross_entropy(kernels, logits, target, weight, label_smoothing, ignore_index, reduction):
    if kernels is None:
        return reference.cross_entropy(logits, target, weight=weight, label_smoothing=label_smoothing,
                                       ignore_index=ignore_index, reduction=reduction)
    target_grad = False
    if target.dtype == torch.int64:
        logits2d, target1d, shape = reference._class_last(logits, target)  # (M, C), (M,)
    else:  # class probabilities (M, C) as the logits, in their math type
        logits2d, target1d, shape = reference._soft_class_last(logits, target.to(_math_dtype(logits.dtype)))
        # torch differentiates them: the Function gives that gradient (the C++ op does not)
        target_grad = target.requires_grad
    logits2d, target1d = logits2d.contiguous(), target1d.contiguous()
    with validation.autocast_off(logits.device):
        if torch.is_grad_enabled() and (logits.requires_grad or target_grad):
            if kernels.cross_entropy is not None and eager() and not target_grad:  # the backward in C++
                loss = kernels.cross_entropy(logits2d, target1d, float(label_smoothing), ignore_index,
                                             REDUCTION_CODE[reduction], weight)
            else:
                loss = CrossEntropyFunction.apply(logits2d, target1d, float(label_smoothing), ignore_index,
                                                  REDUCTION_CODE[reduction], kernels, weight)
        else:  # no gradient wanted (evaluation, no_grad): the kernel skips writing it
            loss, _ = kernels.cross_entropy_fwd(logits2d, target1d, float(label_smoothing), ignore_index,
                                                REDUCTION_CODE[reduction], False, weight)
    return loss.reshape(shape) if reduction == "none" else loss


def linear_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                         linear_bias: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
                         reduction: str = "mean", ignore_index: Optional[int] = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """``cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)`` without the full logits.

    Arguments as torch's own ``torch.nn.functional.linear_cross_entropy``:

    Args:
        input: ``(..., D)`` final hidden states.
        linear_weight: ``(V, D)`` output projection (``nn.Linear`` layout).
        target: int64 ``(...)``, input's leading shape; or class probabilities ``(..., V)``, as
            :func:`cross_entropy`'s (differentiated when they require grad).
        linear_bias: ``(V,)`` or None.
        weight: torch's class weights ``(V,)`` or None, as :func:`cross_entropy`'s ``weight``.
        reduction, label_smoothing: as :func:`cross_entropy`.
        ignore_index: as :func:`cross_entropy` (default -100, as ``F.cross_entropy``); None ignores nothing.

    Rows are processed in chunks, so at most a chunk of the ``(N, V)`` logits exists at a
    time; the weight gradient is accumulated chunk by chunk.
    """
    if ignore_index is None:
        ignore_index = _IGNORE_NOTHING
    validation.tensor("input", input, min_ndim=1, floating=True)
    validation.tensor("linear_weight", linear_weight, ndim=2, floating=True)
    validation.nonempty_dim("input", input, -1, "the hidden size D")
    V, D = linear_weight.shape
    if input.shape[-1] != D:
        raise ValueError(f"input's last dimension must equal linear_weight.shape[1] = {D}, got shape "
                         f"{tuple(input.shape)}")
    if linear_bias is not None:
        validation.tensor("linear_bias", linear_bias, ndim=1, floating=True)
        validation.shape("linear_bias", linear_bias, (V,), "(V,) with V = linear_weight.shape[0]")
    validation.nonempty_dim("linear_weight", linear_weight, 0, "V, the classes: at least one class")
    _check_loss_args(label_smoothing, reduction, ignore_index)
    validation.same_device(input=input, linear_weight=linear_weight, linear_bias=linear_bias)
    soft = _check_target(target, input.shape[:-1], input.shape[:-1] + (V,),
                         -100 if ignore_index == _IGNORE_NOTHING else ignore_index, input=input)

    lowp = validation.autocast_dtype(input.device)
    hidden, w, b = (validation.cast(t, lowp) for t in (input, linear_weight, linear_bias))
    validation.same_dtype(input=hidden, linear_weight=w, linear_bias=b)
    if weight is not None:
        weight = _check_class_weight(weight, V, hidden.dtype, input=input)

    kernels = backends.select_cached("linear_cross_entropy", hidden.device, hidden.dtype)
    if soft:  # class probabilities: no values to check
        return _linear_cross_entropy(kernels, hidden, w, b, target, weight, D, label_smoothing, ignore_index,
                                     reduction, soft=True)
    return validation.values_checked(kernels, lambda: _check_target_values(target, V, ignore_index),
                                     lambda: _linear_cross_entropy(kernels, hidden, w, b, target, weight, D,
                                                                   label_smoothing, ignore_index, reduction))


def _linear_cross_entropy(kernels, hidden, w, b, target, weight, D, label_smoothing, ignore_index, reduction,
                          soft=False):
    if kernels is None:
        return reference.linear_cross_entropy(hidden, w, target, linear_bias=b, weight=weight,
                                              label_smoothing=label_smoothing, ignore_index=ignore_index,
                                              reduction=reduction)
    hidden2d, w = as_rows(hidden, D), w.contiguous()  # (N, D), (V, D)
    if soft:  # class probabilities (N, V) in the math type; torch differentiates them (the Function does)
        target1d = target.reshape(-1, w.shape[0]).to(_math_dtype(hidden.dtype)).contiguous()
        shape, target_grad = target.shape[:-1], target.requires_grad
    else:
        target1d, shape, target_grad = target.reshape(-1).contiguous(), target.shape, False  # (N,)
    code = REDUCTION_CODE[reduction]
    with validation.autocast_off(hidden.device):
        if torch.is_grad_enabled() and (target_grad or any(t is not None and t.requires_grad
                                                           for t in (hidden, w, b))):
            if kernels.linear_cross_entropy is not None and eager() and not target_grad:  # the backward in C++
                loss = kernels.linear_cross_entropy(hidden2d, w, b, target1d, float(label_smoothing), ignore_index,
                                                    code, weight)
            else:
                loss = LinearCrossEntropyFunction.apply(hidden2d, w, b, target1d, float(label_smoothing),
                                                        ignore_index, code, kernels, weight)
        else:  # no gradient wanted: the logits chunks are reduced to the loss, nothing else is kept
            loss = kernels.linear_cross_entropy_fwd(hidden2d, w, b, target1d, float(label_smoothing),
                                                    ignore_index, code, False, weight)[0]
    return loss.reshape(shape) if reduction == "none" else loss
