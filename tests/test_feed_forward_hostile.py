"""feed_forward's hostile input (the machinery: tests/hostile.py): bad calls to
ops.feed_forward with every backend forced, bad arguments to the C++ feed_forward_fwd /
feed_forward_bwd (in a child process), empty input and no hidden units."""
import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
import hostile
from hostile import strided as _strided, tensor as _t
from utils import skip_without_kernels


# ---------------------------------------------------------------- bad input to ops.feed_forward
def _ffn(x=None, w1=None, b1="ok", w2=None, b2="ok", **kw):  # w3 / b3 (the gated form) through kw
    E, F = 6, 10
    x = _t(3, E) if x is None else x
    w1 = _t(F, E) if w1 is None else w1
    w2 = _t(E, F) if w2 is None else w2
    b1 = _t(F) if isinstance(b1, str) else b1
    b2 = _t(E) if isinstance(b2, str) else b2
    return lambda: ops.feed_forward(x, w1, b1, w2, b2, **kw)


FEED_FORWARD = {
    "x_0d": (_ffn(x=torch.tensor(1.0)), ValueError, "x must have at least 1 dimensions"),
    "x_int": (_ffn(x=_t(3, 6, dtype=torch.int64)), TypeError, "x must be a floating"),
    "x_width": (_ffn(x=_t(3, 5)), ValueError, "w1 must have shape"),
    "w1_1d": (_ffn(w1=_t(60)), ValueError, "w1 must have 2 dimensions"),
    "w1_int": (_ffn(w1=torch.ones(10, 6, dtype=torch.int64)), TypeError, "w1 must be a floating"),
    "w2_shape": (_ffn(w2=_t(10, 6)), ValueError, "w2 must have shape"),
    "w2_list": (_ffn(w2=[[0.0]]), TypeError, "w2 must be a torch.Tensor"),
    "b1_shape": (_ffn(b1=_t(6)), ValueError, "b1 must have shape"),
    "b2_shape": (_ffn(b2=_t(10)), ValueError, "b2 must have shape"),
    "b2_2d": (_ffn(b2=_t(1, 6)), ValueError, "b2 must have 1 dimensions"),
    "width_0": (_ffn(x=_t(3, 0), w1=_t(10, 0), w2=_t(0, 10), b2=_t(0)), ValueError, "x's last dimension"),
    "w1_dtype": (_ffn(w1=_t(10, 6, dtype=torch.float64)), TypeError, "w1 has dtype"),
    "b2_dtype": (_ffn(b2=_t(6, dtype=torch.bfloat16)), TypeError, "b2 has dtype"),
    "w2_device": (_ffn(w2=_t(6, 10, device="meta")), ValueError, "w2 is on meta"),
    "b1_device": (_ffn(b1=_t(10, device="meta")), ValueError, "b1 is on meta"),
    "activation": (_ffn(activation="tanh"), ValueError, "activation must be one of"),
    "activation_none": (_ffn(activation=None), ValueError, "activation must be one of"),
    "dropout_neg": (_ffn(dropout_p=-0.1), ValueError, "dropout_p"),
    "dropout_big": (_ffn(dropout_p=2), ValueError, "dropout_p"),
    # the gated form (w3, b3)
    "w3_shape": (_ffn(w3=_t(6, 10)), ValueError, "w3 must have shape"),
    "w3_1d": (_ffn(w3=_t(60)), ValueError, "w3 must have 2 dimensions"),
    "w3_dtype": (_ffn(w3=_t(10, 6, dtype=torch.float64)), TypeError, "w3 has dtype"),
    "w3_int": (_ffn(w3=torch.ones(10, 6, dtype=torch.int64)), TypeError, "w3 must be a floating"),
    "w3_device": (_ffn(w3=_t(10, 6, device="meta")), ValueError, "w3 is on meta"),
    "b3_without_w3": (_ffn(b3=_t(10)), ValueError, "b3 was given without w3"),
    "b3_shape": (_ffn(w3=_t(10, 6), b3=_t(6)), ValueError, "b3 must have shape"),
    "b3_dtype": (_ffn(w3=_t(10, 6), b3=_t(10, dtype=torch.bfloat16)), TypeError, "b3 has dtype"),
    "gated_activation": (_ffn(w3=_t(10, 6), activation="gelu_new"), ValueError, "activation must be one of"),
}


BAD_INPUT = {"feed_forward": FEED_FORWARD}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)


# ----------------------------------------------------------------- bad arguments to the C++ ops
feed_forward_fwd = hostile.kernel_call("feed_forward_fwd", lambda: dict(
    x=_t(3, 6), w1=_t(10, 6), b1=_t(10), w2=_t(6, 10), b2=_t(6), activation="relu", dropout_p=0.0))
feed_forward_bwd = hostile.kernel_call("feed_forward_bwd", lambda: dict(
    dout=_t(3, 6), x=_t(3, 6), w1=_t(10, 6), w2=_t(6, 10), pre=_t(3, 10), has_b1=True, has_b2=True,
    activation="gelu", dropout_p=0.0))

BAD_KERNEL_ARGS = {  # group -> {case: (thunk, text the TORCH_CHECK message must contain)}
    "feed_forward": {
        "x_3d": (lambda: feed_forward_fwd(x=_t(1, 3, 6)), "x must be 2-D (N, E)"),
        "x_int": (lambda: feed_forward_fwd(x=_t(3, 6, dtype=torch.int64)), "x must be"),
        "x_strided": (lambda: feed_forward_fwd(x=_strided(3, 6)), "x must be contiguous"),
        "w1_shape": (lambda: feed_forward_fwd(w1=_t(10, 7)), "w1 must have shape"),
        "w1_1d": (lambda: feed_forward_fwd(w1=_t(60)), "w1 must have shape"),
        "w1_dtype": (lambda: feed_forward_fwd(w1=_t(10, 6, dtype=torch.float64)), "w1 must have the dtype of x"),
        "w1_transposed": (lambda: feed_forward_fwd(w1=_t(6, 10).t()), "w1 must be contiguous"),
        "w2_shape": (lambda: feed_forward_fwd(w2=_t(10, 6)), "w2 must have shape"),
        "b1_shape": (lambda: feed_forward_fwd(b1=_t(6)), "b1 must have shape"),
        "b2_dtype": (lambda: feed_forward_fwd(b2=_t(6, dtype=torch.bfloat16)), "b2 must have the dtype of x"),
        "b2_strided": (lambda: feed_forward_fwd(b2=_strided(6)), "b2 must be contiguous"),
        "activation": (lambda: feed_forward_fwd(activation="tanh"), "activation"),
        "dropout_neg": (lambda: feed_forward_fwd(dropout_p=-0.1), "dropout_p must be in [0, 1)"),
        "offset_neg": (lambda: feed_forward_fwd(offset=-1), "the philox offset philox[1] must be >= 0"),
        "philox_float": (lambda: feed_forward_fwd(philox=torch.zeros(2, dtype=torch.float64)), "philox must be int64"),
        "philox_empty": (lambda: feed_forward_fwd(philox=torch.zeros(0, dtype=torch.int64)), "philox must have shape (2,)"),
        "bwd_seed_neg": (lambda: feed_forward_bwd(seed=-5), "the philox seed philox[0] must be >= 0"),
        "bwd_philox_2d": (lambda: feed_forward_bwd(philox=torch.zeros(2, 1, dtype=torch.int64)), "philox must have shape"),
        "bwd_dout_shape": (lambda: feed_forward_bwd(dout=_t(3, 7)), "dout must have shape"),
        "bwd_dout_rows": (lambda: feed_forward_bwd(dout=_t(4, 6)), "dout must have shape"),
        "bwd_pre_shape": (lambda: feed_forward_bwd(pre=_t(3, 9)), "pre must have shape"),
        "bwd_pre_dtype": (lambda: feed_forward_bwd(pre=_t(3, 10, dtype=torch.float64)), "pre must have the dtype"),
        "bwd_pre_strided": (lambda: feed_forward_bwd(pre=_strided(3, 10)), "pre must be contiguous"),
        "bwd_w2_shape": (lambda: feed_forward_bwd(w2=_t(6, 11)), "w2 must have shape"),
        "bwd_activation": (lambda: feed_forward_bwd(activation=""), "activation"),
        # the gated form (w3, b3; pre (N, 2F))
        "w3_shape": (lambda: feed_forward_fwd(w3=_t(10, 7)), "w3 must have shape (F, E)"),
        "w3_dtype": (lambda: feed_forward_fwd(w3=_t(10, 6, dtype=torch.float64)), "w3 must have the dtype of x"),
        "w3_strided": (lambda: feed_forward_fwd(w3=_strided(10, 6)), "w3 must be contiguous"),
        "b3_without_w3": (lambda: feed_forward_fwd(b3=_t(10)), "b3 was given without w3"),
        "b3_shape": (lambda: feed_forward_fwd(w3=_t(10, 6), b3=_t(6)), "b3 must have shape"),
        "gated_activation": (lambda: feed_forward_fwd(w3=_t(10, 6), activation="gelu_new"), "activation"),
        "bwd_gated_pre_shape": (lambda: feed_forward_bwd(w3=_t(10, 6)), "pre must have shape (N, 2F)"),
        "bwd_w3_shape": (lambda: feed_forward_bwd(w3=_t(6, 10), pre=_t(3, 20)), "w3 must have shape"),
        "bwd_b3_without_w3": (lambda: feed_forward_bwd(has_b3=True), "has_b3 is true without w3"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


# ---------------------------------------------------------------------------------- empty input
@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("shape", [(0, 6), (3, 0, 6)], ids=["N0", "S0"])
def test_empty_input(backend, shape):
    skip_without_kernels(backend, "feed_forward")
    leaves = hostile.leaves(shape, (10, 6), (10,), (6, 10), (6,))
    hostile.assert_like_reference(backend, ops.feed_forward, reference.feed_forward, leaves)


@pytest.mark.parametrize("backend", hostile.BACKENDS)
def test_feed_forward_without_hidden_units(backend):
    """dim_feedforward F = 0: the FFN adds nothing but b2, and b2 gets the whole gradient."""
    skip_without_kernels(backend, "feed_forward")
    leaves = hostile.leaves((3, 6), (0, 6), (0,), (6, 0), (6,))
    hostile.assert_like_reference(backend, ops.feed_forward, reference.feed_forward, leaves)
    out, grads = hostile.run(backend, ops.feed_forward, leaves)
    torch.testing.assert_close(out, leaves[4].detach().expand(3, 6))
    torch.testing.assert_close(grads[4], torch.full((6,), 3.0))
