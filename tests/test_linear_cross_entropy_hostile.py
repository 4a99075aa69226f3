"""linear_cross_entropy's hostile input (the machinery: tests/hostile.py): bad calls to
ops.linear_cross_entropy with every backend forced, bad arguments to the C++
linear_cross_entropy_fwd / linear_cross_entropy_bwd (in a child process), and empty input."""
import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
import hostile
from hostile import strided as _strided, tensor as _t
from utils import skip_without_kernels


# -------------------------------------------------------- bad input to ops.linear_cross_entropy
def _lce(hidden=None, weight=None, bias="ok", target=None, class_weight=None, **kw):
    hidden = _t(4, 6) if hidden is None else hidden
    weight = _t(9, 6) if weight is None else weight
    bias = _t(9) if isinstance(bias, str) else bias
    target = torch.tensor([0, 3, 8, 1]) if target is None else target
    return lambda: ops.linear_cross_entropy(hidden, weight, target, linear_bias=bias, weight=class_weight, **kw)


LINEAR_CROSS_ENTROPY = {
    "hidden_0d": (_lce(hidden=torch.tensor(1.0), target=torch.tensor(0)), ValueError,
                  "input must have at least 1 dimensions"),
    "hidden_int": (_lce(hidden=torch.ones(4, 6, dtype=torch.int64)), TypeError, "input must be a floating"),
    "hidden_width": (_lce(hidden=_t(4, 5)), ValueError, "input's last dimension must equal"),
    "hidden_width_0": (_lce(hidden=_t(4, 0), weight=_t(9, 0)), ValueError, "input's last dimension \\(the hidden"),
    "weight_1d": (_lce(weight=_t(54)), ValueError, "linear_weight must have 2 dimensions"),
    "weight_int": (_lce(weight=torch.ones(9, 6, dtype=torch.int32)), TypeError, "linear_weight must be a floating"),
    "weight_rows_0": (_lce(weight=_t(0, 6), bias=None, target=torch.full((4,), -100)), ValueError,
                      "at least one class"),
    "weight_dtype": (_lce(weight=_t(9, 6, dtype=torch.float64)), TypeError, "linear_weight has dtype"),
    "weight_device": (_lce(weight=_t(9, 6, device="meta")), ValueError, "linear_weight is on meta"),
    "bias_shape": (_lce(bias=_t(6)), ValueError, "linear_bias must have shape"),
    "bias_dtype": (_lce(bias=_t(9, dtype=torch.bfloat16)), TypeError, "linear_bias has dtype"),
    "target_float": (_lce(target=torch.zeros(4)), TypeError, "target must hold class indices"),
    "target_shape": (_lce(target=torch.zeros(3, dtype=torch.long)), ValueError, "target must have shape"),
    "target_negative": (_lce(target=torch.tensor([0, -5, 1, 1])), ValueError, "target values must be in"),
    "target_too_big": (_lce(target=torch.tensor([0, 9, 1, 1])), ValueError, "target values must be in \\[0, 9\\)"),
    "target_device": (_lce(target=torch.zeros(4, dtype=torch.long, device="meta")), ValueError,
                      "target is on meta"),
    "smoothing_big": (_lce(label_smoothing=1.01), ValueError, "label_smoothing"),
    "reduction": (_lce(reduction=None), ValueError, "reduction must be one of"),
    "class_weight_shape": (_lce(class_weight=_t(8)), ValueError, "weight must have shape \\(9,\\)"),
}

BAD_INPUT = {"linear_cross_entropy": LINEAR_CROSS_ENTROPY}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)


# ----------------------------------------------------------------- bad arguments to the C++ ops
linear_cross_entropy_fwd = hostile.kernel_call("linear_cross_entropy_fwd", lambda: dict(
    hidden=_t(4, 6), weight=_t(9, 6), bias=_t(9), target=torch.tensor([0, 8, 3, -100]), label_smoothing=0.1,
    ignore_index=-100, reduction=1, compute_grad=True))
linear_cross_entropy_bwd = hostile.kernel_call("linear_cross_entropy_bwd", lambda: dict(
    grad_loss=_t(4), hidden=_t(4, 6), weight=_t(9, 6), bias=_t(9), target=torch.tensor([0, 8, 3, 1]),
    label_smoothing=0.0, ignore_index=-100))

BAD_KERNEL_ARGS = {  # group -> {case: (thunk, text the TORCH_CHECK message must contain)}
    "linear_cross_entropy": {
        "hidden_3d": (lambda: linear_cross_entropy_fwd(hidden=_t(1, 4, 6)), "hidden must have 2 dimensions"),
        "hidden_strided": (lambda: linear_cross_entropy_fwd(hidden=_strided(4, 6)), "hidden must be contiguous"),
        "weight_shape": (lambda: linear_cross_entropy_fwd(weight=_t(9, 5)), "weight must have shape (V, 6)"),
        "weight_dtype": (lambda: linear_cross_entropy_fwd(weight=_t(9, 6, dtype=torch.float64)), "weight has dtype"),
        "weight_transposed": (lambda: linear_cross_entropy_fwd(weight=_t(6, 9).t()), "weight must be contiguous"),
        "weight_rows_0": (lambda: linear_cross_entropy_fwd(weight=_t(0, 6), bias=None,
                                                            target=torch.full((4,), -100)), "at least one row"),
        "bias_shape": (lambda: linear_cross_entropy_fwd(bias=_t(8)), "bias must have shape (9,)"),
        "bias_dtype": (lambda: linear_cross_entropy_fwd(bias=_t(9, dtype=torch.bfloat16)), "bias has dtype"),
        "target_shape": (lambda: linear_cross_entropy_fwd(target=torch.tensor([0, 1])), "target must have shape"),
        "target_too_big": (lambda: linear_cross_entropy_fwd(target=torch.tensor([0, 9, 1, 1])), "target[1] = 9"),
        "target_negative": (lambda: linear_cross_entropy_fwd(target=torch.tensor([-7, 1, 1, 1])), "target[0] = -7"),
        "grad_with_none": (lambda: linear_cross_entropy_fwd(reduction=0), "compute_grad needs reduction mean"),
        "smoothing_neg": (lambda: linear_cross_entropy_fwd(label_smoothing=-0.1), "label_smoothing"),
        "bwd_grad_loss_shape": (lambda: linear_cross_entropy_bwd(grad_loss=_t(3)), "grad_loss must have shape (4,)"),
        "bwd_grad_loss_int": (lambda: linear_cross_entropy_bwd(grad_loss=_t(4, dtype=torch.int64)),
                              "grad_loss must be a floating-point"),
        "bwd_target_too_big": (lambda: linear_cross_entropy_bwd(target=torch.tensor([0, 1, 2, 100])), "target[3]"),
        "bwd_hidden_int": (lambda: linear_cross_entropy_bwd(hidden=_t(4, 6, dtype=torch.int32)), "hidden must be"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


# ---------------------------------------------------------------------------------- empty input
@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["N0", "B2_S0"])
def test_empty_input(backend, reduction, lead):
    skip_without_kernels(backend, "linear_cross_entropy")
    leaves = hostile.leaves(lead + (6,), (9, 6), (9,))
    target = torch.zeros(lead, dtype=torch.long)

    def fn(h, w, b):
        return ops.linear_cross_entropy(h, w, target, linear_bias=b, reduction=reduction)

    def ref(h, w, b):
        return reference.linear_cross_entropy(h, w, target, linear_bias=b, reduction=reduction)
    hostile.assert_like_reference(backend, fn, ref, leaves)
