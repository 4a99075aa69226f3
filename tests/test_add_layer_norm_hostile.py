"""add_layer_norm's hostile input (the machinery: tests/hostile.py): bad calls to
ops.add_layer_norm with every backend forced, bad arguments to the C++ add_layer_norm_fwd /
add_layer_norm_bwd (in a child process), and empty input."""
import math

import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
import hostile
from hostile import strided as _strided, tensor as _t
from utils import skip_without_kernels


# -------------------------------------------------------------- bad input to ops.add_layer_norm
def _aln(x=None, residual="same", weight="ok", bias="ok", **kw):
    x = _t(4, 6) if x is None else x
    residual = _t(*x.shape) if isinstance(residual, str) else residual
    weight = _t(6) if isinstance(weight, str) else weight
    bias = _t(6) if isinstance(bias, str) else bias
    return lambda: ops.add_layer_norm(x, residual, weight, bias, **kw)


ADD_LAYER_NORM = {
    "x_0d": (_aln(x=torch.tensor(1.0), residual=None, weight=None, bias=None), ValueError,
             "x must have at least 1 dimensions"),
    "x_list": (lambda: ops.add_layer_norm([1.0], None, None, None), TypeError, "x must be a torch.Tensor"),
    "x_int": (_aln(x=_t(4, 6, dtype=torch.int64), residual=None), TypeError, "x must be a floating"),
    "residual_int": (_aln(residual=_t(4, 6, dtype=torch.int64)), TypeError, "residual must be a floating"),
    "residual_shape": (_aln(residual=_t(4, 5)), ValueError, "residual must have shape"),
    "residual_broadcast": (_aln(residual=_t(1, 6)), ValueError, "residual must have shape"),
    "residual_dtype": (_aln(residual=_t(4, 6, dtype=torch.float64)), TypeError, "residual has dtype"),
    "residual_device": (_aln(residual=_t(4, 6, device="meta")), ValueError, "residual is on meta"),
    "weight_shape": (_aln(weight=_t(5)), ValueError, "weight must have shape"),
    "weight_2d": (_aln(weight=_t(1, 6)), ValueError, "weight must have 1 dimensions"),
    "weight_int": (_aln(weight=torch.ones(6, dtype=torch.int64)), TypeError, "weight must be a floating"),
    "weight_device": (_aln(weight=_t(6, device="meta")), ValueError, "weight is on meta"),
    "bias_shape": (_aln(bias=_t(7)), ValueError, "bias must have shape"),
    "hidden_0": (_aln(x=_t(4, 0), residual=None, weight=None, bias=None), ValueError, "x's last dimension"),
    "eps_zero": (_aln(eps=0.0), ValueError, "eps must be a positive"),
    "eps_neg": (_aln(eps=-1e-5), ValueError, "eps must be a positive number \\(and finite\\), got -1e-05"),
    "eps_nan": (_aln(eps=float("nan")), ValueError, "eps"),
    "eps_inf": (_aln(eps=math.inf), ValueError, "eps"),
    "dropout_neg": (_aln(dropout_p=-0.5), ValueError, "dropout_p"),
    "dropout_one": (_aln(dropout_p=1.0), ValueError, "dropout_p"),
    "prenorm_str": (_aln(prenorm="no"), TypeError, "prenorm must be a bool"),
}


BAD_INPUT = {"add_layer_norm": ADD_LAYER_NORM}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)


# ----------------------------------------------------------------- bad arguments to the C++ ops
add_layer_norm_fwd = hostile.kernel_call("add_layer_norm_fwd", lambda: dict(
    x=_t(4, 6), residual=_t(4, 6), weight=_t(6), bias=_t(6), eps=1e-5, dropout_p=0.0))
add_layer_norm_bwd = hostile.kernel_call("add_layer_norm_bwd", lambda: dict(
    dy=_t(4, 6), dh=None, h=_t(4, 6), weight=_t(6), mean=_t(4), rstd=_t(4).abs(), dropout_p=0.0, has_residual=True))

BAD_KERNEL_ARGS = {  # group -> {case: (thunk, text the TORCH_CHECK message must contain)}
    "add_layer_norm": {
        "x_1d": (lambda: add_layer_norm_fwd(x=_t(6), residual=None), "x must be 2-D (N, C)"),
        "x_3d": (lambda: add_layer_norm_fwd(x=_t(2, 2, 6), residual=None), "x must be 2-D"),
        "x_int": (lambda: add_layer_norm_fwd(x=_t(4, 6, dtype=torch.int32), residual=None), "x must be"),
        "x_strided": (lambda: add_layer_norm_fwd(x=_strided(4, 6)), "x must be contiguous"),
        "x_transposed": (lambda: add_layer_norm_fwd(x=_t(6, 4).t(), residual=None), "x must be contiguous"),
        "residual_shape": (lambda: add_layer_norm_fwd(residual=_t(4, 5)), "residual must have the shape of x"),
        "residual_rows": (lambda: add_layer_norm_fwd(residual=_t(3, 6)), "residual must have the shape of x"),
        "residual_dtype": (lambda: add_layer_norm_fwd(residual=_t(4, 6, dtype=torch.float64)), "residual must have the dtype"),
        "residual_strided": (lambda: add_layer_norm_fwd(residual=_strided(4, 6)), "residual must be contiguous"),
        "weight_shape": (lambda: add_layer_norm_fwd(weight=_t(5)), "weight must have shape"),
        "weight_2d": (lambda: add_layer_norm_fwd(weight=_t(1, 6)), "weight must have shape"),
        "weight_dtype": (lambda: add_layer_norm_fwd(weight=_t(6, dtype=torch.bfloat16)), "weight must have the dtype"),
        "weight_strided": (lambda: add_layer_norm_fwd(weight=_strided(6)), "weight must be contiguous"),
        "bias_shape": (lambda: add_layer_norm_fwd(bias=_t(7)), "bias must have shape"),
        "eps_zero": (lambda: add_layer_norm_fwd(eps=0.0), "eps must be"),
        "eps_neg": (lambda: add_layer_norm_fwd(eps=-1.0), "eps must be"),
        "eps_nan": (lambda: add_layer_norm_fwd(eps=float("nan")), "eps must be"),
        "eps_inf": (lambda: add_layer_norm_fwd(eps=float("inf")), "eps must be"),
        "dropout_one": (lambda: add_layer_norm_fwd(dropout_p=1.0), "dropout_p must be in [0, 1)"),
        "seed_neg": (lambda: add_layer_norm_fwd(seed=-1), "the philox seed philox[0] must be >= 0"),
        "philox_int32": (lambda: add_layer_norm_fwd(philox=torch.zeros(2, dtype=torch.int32)), "philox must be int64"),
        "philox_1": (lambda: add_layer_norm_fwd(philox=torch.zeros(1, dtype=torch.int64)), "philox must have shape (2,)"),
        "bwd_philox_strided": (lambda: add_layer_norm_bwd(philox=torch.zeros(4, dtype=torch.int64)[::2]),
                               "philox must be contiguous"),
        "bwd_offset_neg": (lambda: add_layer_norm_bwd(offset=-2), "the philox offset philox[1] must be >= 0"),
        "bwd_dy_shape": (lambda: add_layer_norm_bwd(dy=_t(4, 5)), "dy must have the shape of h"),
        "bwd_dy_dtype": (lambda: add_layer_norm_bwd(dy=_t(4, 6, dtype=torch.float64)), "dy must have the dtype"),
        "bwd_dh_shape": (lambda: add_layer_norm_bwd(dh=_t(5, 6)), "dh must have the shape of h"),
        "bwd_h_strided": (lambda: add_layer_norm_bwd(h=_strided(4, 6)), "h must be contiguous"),
        "bwd_mean_shape": (lambda: add_layer_norm_bwd(mean=_t(3)), "mean must have shape"),
        "bwd_rstd_dtype": (lambda: add_layer_norm_bwd(rstd=_t(4, dtype=torch.float64)), "rstd must be float32"),
        "bwd_weight_shape": (lambda: add_layer_norm_bwd(weight=_t(4)), "weight must have shape"),
        "bwd_dropout_neg": (lambda: add_layer_norm_bwd(dropout_p=-0.5), "dropout_p must be in [0, 1)"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


# ---------------------------------------------------------------------------------- empty input
@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6), (0, 0, 6)], ids=["N0", "B2_S0", "B0_S0"])
@pytest.mark.parametrize("prenorm", [False, True], ids=["postln", "preln"])
def test_empty_input(backend, shape, prenorm):
    skip_without_kernels(backend, "add_layer_norm")
    leaves = hostile.leaves(shape, shape, (6,), (6,))

    def fn(x, r, w, b):
        out = ops.add_layer_norm(x, r, w, b, prenorm=prenorm)
        return torch.cat([out[0], out[1]], -1) if prenorm else out

    def ref(x, r, w, b):
        out = reference.add_layer_norm(x, r, w, b, prenorm=prenorm)
        return torch.cat([out[0], out[1]], -1) if prenorm else out
    hostile.assert_like_reference(backend, fn, ref, leaves)
