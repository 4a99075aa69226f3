"""cross_entropy's hostile input (the machinery: tests/hostile.py): bad calls to
ops.cross_entropy with every backend forced, bad arguments to the C++ cross_entropy_fwd (in a
child process), and empty input. (Non-finite logits: tests/test_cross_entropy.py.)"""
import pytest
import torch

from fastformer import ops
import hostile
from hostile import strided as _strided, tensor as _t
from utils import skip_without_kernels


# --------------------------------------------------------------- bad input to ops.cross_entropy
def _ce(logits=None, target=None, **kw):
    logits = _t(4, 7) if logits is None else logits
    target = torch.tensor([0, 3, 6, 1]) if target is None else target
    return lambda: ops.cross_entropy(logits, target, **kw)


CROSS_ENTROPY = {
    "logits_0d": (_ce(logits=torch.tensor(1.0), target=torch.tensor(0)), ValueError,
                  "logits must have at least 1 dimensions"),
    "logits_int": (_ce(logits=torch.ones(4, 7, dtype=torch.int64)), TypeError, "logits must be a floating"),
    "logits_list": (_ce(logits=[[0.0] * 7] * 4), TypeError, "logits must be a torch.Tensor"),
    "classes_0": (_ce(logits=_t(4, 0), target=torch.full((4,), -100)), ValueError, "at least one class"),
    "target_float": (_ce(target=torch.zeros(4)), TypeError, "target must hold class indices as int64"),
    "target_int32": (_ce(target=torch.zeros(4, dtype=torch.int32)), TypeError, "target must hold class"),
    "target_probs_shape": (_ce(target=torch.full((4, 6), 1 / 6)), TypeError, "target must hold class"),
    "target_probs_ignore_index": (_ce(target=torch.full((4, 7), 1 / 7), ignore_index=0), ValueError,
                                  "ignore_index is not supported for probability targets"),
    "target_list": (_ce(target=[0, 1, 2, 3]), TypeError, "target must be a torch.Tensor"),
    "target_shape": (_ce(target=torch.zeros(5, dtype=torch.long)), ValueError, "target must have shape"),
    "target_2d": (_ce(target=torch.zeros(4, 1, dtype=torch.long)), ValueError, "target must have shape"),
    "target_negative": (_ce(target=torch.tensor([0, -1, 2, 3])), ValueError, "target values must be in \\[0, 7\\)"),
    "target_too_big": (_ce(target=torch.tensor([0, 7, 2, 3])), ValueError, "got values in \\[0, 7\\]"),
    "target_device": (_ce(target=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "target is on meta"),
    "smoothing_neg": (_ce(label_smoothing=-0.1), ValueError, "label_smoothing must be a number in \\[0, 1\\]"),
    "smoothing_big": (_ce(label_smoothing=1.5), ValueError, "label_smoothing"),
    "smoothing_nan": (_ce(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    "smoothing_str": (_ce(label_smoothing="0.1"), ValueError, "label_smoothing"),
    "reduction": (_ce(reduction="avg"), ValueError, "reduction must be one of"),
    "ignore_index_float": (_ce(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
}


BAD_INPUT = {"cross_entropy": CROSS_ENTROPY}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)


# ----------------------------------------------------------------- bad arguments to the C++ ops
cross_entropy_fwd = hostile.kernel_call("cross_entropy_fwd", lambda: dict(
    logits=_t(4, 7), target=torch.tensor([0, 6, 3, -100]), label_smoothing=0.1, ignore_index=-100, reduction=1,
    compute_grad=True))

BAD_KERNEL_ARGS = {  # group -> {case: (thunk, text the TORCH_CHECK message must contain)}
    "cross_entropy": {
        "logits_1d": (lambda: cross_entropy_fwd(logits=_t(7)), "logits must have 2 dimensions"),
        "logits_int": (lambda: cross_entropy_fwd(logits=_t(4, 7, dtype=torch.int64)), "logits must be"),
        "logits_strided": (lambda: cross_entropy_fwd(logits=_strided(4, 7)), "logits must be contiguous"),
        "classes_0": (lambda: cross_entropy_fwd(logits=_t(4, 0)), "at least one class"),
        "target_shape": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, 2])), "target must have shape (4"),
        "target_2d": (lambda: cross_entropy_fwd(target=torch.zeros(4, 1, dtype=torch.long)), "target must have shape"),
        "target_int32": (lambda: cross_entropy_fwd(target=torch.zeros(4, dtype=torch.int32)), "target must be int64"),
        # a floating target holds class probabilities (N, V): a (N,) one has the wrong shape
        "target_float": (lambda: cross_entropy_fwd(target=torch.zeros(4)),
                         "target (class probabilities) must have shape"),
        "target_strided": (lambda: cross_entropy_fwd(target=torch.zeros(8, dtype=torch.long)[::2]),
                           "target must be contiguous"),
        "target_too_big": (lambda: cross_entropy_fwd(target=torch.tensor([0, 7, 1, 1])), "target[1] = 7"),
        "target_negative": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, -1, 1])), "target[2] = -1"),
        "target_huge": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, 1, 2 ** 40])), "target[3]"),
        "smoothing_big": (lambda: cross_entropy_fwd(label_smoothing=1.5), "label_smoothing"),
        "smoothing_nan": (lambda: cross_entropy_fwd(label_smoothing=float("nan")), "label_smoothing"),
        "reduction_3": (lambda: cross_entropy_fwd(reduction=3), "reduction"),
        "reduction_neg": (lambda: cross_entropy_fwd(reduction=-1), "reduction"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


# ---------------------------------------------------------------------------------- empty input
@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_input(backend, reduction):
    skip_without_kernels(backend, "cross_entropy")
    leaves = hostile.leaves((0, 7))
    target = torch.zeros(0, dtype=torch.long)

    def fn(x):
        return ops.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)

    def ref(x):
        return torch.nn.functional.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    hostile.assert_like_reference(backend, fn, ref, leaves)
