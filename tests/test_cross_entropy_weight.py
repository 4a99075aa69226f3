"""Class weights (``weight=``) in cross_entropy and linear_cross_entropy: the reference against
torch's own ``F.cross_entropy(..., weight=w)`` / ``F.linear_cross_entropy(..., weight=w)`` (fp64),
then every kernel backend against the reference and torch (loss and every gradient: logits, or
input, linear weight and linear bias), every reduction, with and without ignored rows and label
smoothing, fp32 (the 2x rule against an fp64 truth), fp64 (cpu) and bf16; torch's edge cases (all
rows ignored, zero weights, a zero weight sum); bad weights. Determinism: the weighted cases of
test_cross_entropy_determinism.py and test_linear_cross_entropy_determinism.py."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops
from fastformer.ops import reference
import hostile
from hostile import tensor as _t
from utils import assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends, max_err

BACKENDS = kernel_backends("cpu", "triton", "cuda")
REDUCTIONS = ("none", "mean", "sum")
# (N, C): one row of 1023 classes, odd sizes, a round one; cpu also a larger one
SHAPES = [(1, 1023), (7, 13), (113, 203)]
LCE_SHAPES = [(1, 7, 1023), (13, 24, 203)]  # (N, D, V)


def _simt(backend):
    return backend == "cuda" and not torch.cuda.is_available()


def _weights(C, device, dtype=torch.float32, zeros=True):
    """Positive weights in [0.1, 2], with a few zeros (a class that counts for nothing)."""
    g = torch.Generator().manual_seed(C)
    w = 0.1 + 1.9 * torch.rand(C, generator=g, dtype=torch.float64)
    if zeros and C > 3:
        w[2::5] = 0.0
    return w.to(device=device, dtype=dtype)


def _targets(N, C, device, ignore):
    g = torch.Generator().manual_seed(N * 31 + C)
    t = torch.randint(0, C, (N,), generator=g)
    if ignore and N > 1:
        t[1::3] = -100
    return t.to(device)


def _upstream(reduction, shape, device, dtype=torch.float32):
    if reduction == "none":
        return torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device, dtype)
    return torch.tensor(1.0 if reduction == "mean" else 0.37, dtype=dtype, device=device)


def _ce_run(backend, x, t, w, up, **kw):
    """(loss, {"logits": grad}) of cross_entropy on ``backend`` (None: torch's F.cross_entropy;
    "ref": fastformer's reference)."""
    def fn(a):
        if backend is None:
            return F.cross_entropy(a, t, weight=w.to(a.dtype), **kw)
        if backend == "ref":
            return reference.cross_entropy(a, t, weight=w, **kw)
        with fastformer.use_backend(backend):
            return ops.cross_entropy(a, t, weight=w, **kw)
    (loss,), grads = forward_backward(fn, [x], [up], ["logits"])
    return loss, grads


def _lce_run(backend, h, lw, lb, t, w, up, **kw):
    def fn(a, b, c):
        if backend is None:
            return F.linear_cross_entropy(a, b, t, linear_bias=c, weight=w.to(a.dtype), ignore_index=-100, **kw)
        if backend == "ref":
            return reference.linear_cross_entropy(a, b, t, linear_bias=c, weight=w, **kw)
        with fastformer.use_backend(backend):
            return ops.linear_cross_entropy(a, b, t, linear_bias=c, weight=w, **kw)
    (loss,), grads = forward_backward(fn, [h, lw, lb], [up], ["input", "linear_weight", "linear_bias"])
    return loss, grads


def _assert_2x(name, out, truth, torch_out, floor=1e-6):
    """The 2x rule: the kernel's error against the fp64 truth is at most ~2x PyTorch's own fp32
    error (plus a floor for values PyTorch happens to hit exactly)."""
    assert out.shape == truth.shape, f"{name}: shape {tuple(out.shape)} != {tuple(truth.shape)}"
    err, torch_err = max_err(out, truth), max_err(torch_out, truth)
    scale = truth.abs().max().item() if truth.numel() else 0.0
    assert err <= 2.0 * torch_err + floor * max(1.0, scale), (
        f"{name}: error {err:.3e} > 2 x torch's fp32 error {torch_err:.3e} + floor")


def _lowp_factor(backend):
    """bf16's factor of the 2x rule: 3 as test_cross_entropy.py's (the saved bf16 gradient times a
    non-unit upstream gradient is rounded twice); Triton's interpreter truncates fp32 -> bf16 (up
    to 1 ulp, against the reference's 0.5), which the weights' wider range of gradients (w up to 2)
    shows at up to ~4.5x: 6 there."""
    return 6.0 if backend == "triton" and not torch.cuda.is_available() else 3.0


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(9, 13), (13,), (4, 13, 5), (1, 1023)])
@pytest.mark.parametrize("ignore", [False, True])
def test_reference_matches_torch(shape, eps, reduction, ignore):
    x = 2.0 * torch.randn(shape, dtype=torch.float64)
    C = shape[1] if len(shape) > 1 else shape[0]
    t_shape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, C, t_shape)
    if ignore and t.dim() > 0:
        t.view(-1)[1::3] = -100
    w = _weights(C, "cpu", torch.float64)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, t_shape, "cpu", torch.float64)
    loss, g = _ce_run("ref", x, t, w, up, **kw)
    want, want_g = _ce_run(None, x, t, w, up, **kw)
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    assert_close("grad", g["logits"], want_g["logits"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_linear_reference_matches_torch(eps, reduction):
    h, lw, lb = torch.randn(10, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64), \
        torch.randn(11, dtype=torch.float64)
    t = torch.randint(0, 11, (10,))
    t[1::2] = -100
    w = _weights(11, "cpu", torch.float64)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (10,), "cpu", torch.float64)
    loss, g = _lce_run("ref", h, lw, lb, t, w, up, **kw)
    want, want_g = _lce_run(None, h, lw, lb, t, w, up, **kw)
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    for name in g:
        assert_close(name, g[name], want_g[name], atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------- kernels: cross_entropy


def _ce_cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for N, C in SHAPES:
            for eps in (0.0, 0.1):
                for reduction in REDUCTIONS:
                    for ignore in (False, True):
                        if name in ("triton", "cuda") and (N, C) == (113, 203) and (eps, ignore) != (0.1, True):
                            continue  # the interpreter / the SIMT harness: the large shape once per reduction
                        yield pytest.param(name, N, C, eps, reduction, ignore, marks=backend.marks,
                                           id=f"{name}-{N}x{C}-ls{eps}-{reduction}-{'ign' if ignore else 'all'}")


@pytest.mark.parametrize("backend,N,C,eps,reduction,ignore", list(_ce_cases()))
def test_cross_entropy_fp32(backend, N, C, eps, reduction, ignore):
    device = device_for(backend)
    gen = torch.Generator().manual_seed(N + C)
    x = (3.0 * torch.randn(N, C, generator=gen, dtype=torch.float64)).to(device)
    t, w = _targets(N, C, device, ignore), _weights(C, device)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (N,), device, torch.float64)
    truth, truth_g = _ce_run(None, x, t, w.double(), up, **kw)
    tl, tg = _ce_run(None, x.float(), t, w, up.float(), **kw)
    loss, g = _ce_run(backend, x.float(), t, w, up.float(), **kw)
    assert loss.dtype == torch.float32
    _assert_2x("loss", loss, truth, tl)
    _assert_2x("grad", g["logits"], truth_g["logits"], tg["logits"])
    if ignore and N > 1:
        assert torch.equal(g["logits"][1::3], torch.zeros_like(g["logits"][1::3])), "ignored rows get no gradient"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_class_dim_layout(backend, reduction):
    """(N, C, d1) logits, as torch."""
    device = device_for(backend)
    x = 2.0 * torch.randn(3, 13, 5, device=device)
    t = torch.randint(0, 13, (3, 5), device=device)
    t[0, ::2] = -100
    w = _weights(13, device)
    kw = dict(label_smoothing=0.1, reduction=reduction)
    up = _upstream(reduction, (3, 5), device)
    loss, g = _ce_run(backend, x, t, w, up, **kw)
    want, want_g = _ce_run(None, x, t, w, up, **kw)
    assert loss.shape == want.shape
    assert_close("loss", loss, want, atol=1e-5, rtol=1e-5)
    assert_close("grad", g["logits"], want_g["logits"], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "cpu"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_fp64(backend, eps, reduction):
    x = 3.0 * torch.randn(29, 203, dtype=torch.float64)
    t, w = _targets(29, 203, "cpu", True), _weights(203, "cpu", torch.float64)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (29,), "cpu", torch.float64)
    loss, g = _ce_run(backend, x, t, w, up, **kw)
    want, want_g = _ce_run(None, x, t, w, up, **kw)
    assert loss.dtype == torch.float64
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    assert_close("grad", g["logits"], want_g["logits"], atol=1e-13, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_bf16(backend, eps, reduction):
    """FlashAttention's rule against the fp32 reference (factor 3 / 4 as test_cross_entropy.py's)."""
    device = device_for(backend)
    x = (3.0 * torch.randn(13, 203)).to(device, torch.bfloat16)
    t, w = _targets(13, 203, device, True), _weights(203, device)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (13,), device)
    factor = _lowp_factor(backend)
    loss, g = _ce_run(backend, x, t, w, up.bfloat16(), **kw)
    lp, lp_g = _ce_run("ref", x, t, w, up.bfloat16(), **kw)
    ref, ref_g = _ce_run("ref", x.float(), t, w, up, **kw)
    assert loss.dtype == torch.bfloat16
    assert_close_lowp("loss", loss, ref, lp, factor=factor)
    assert_close_lowp("grad", g["logits"], ref_g["logits"], lp_g["logits"], factor=factor)


# ---------------------------------------------------------------- kernels: linear_cross_entropy


def _lce_cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for N, D, V in LCE_SHAPES:
            for eps in (0.0, 0.1):
                for reduction in REDUCTIONS:
                    for ignore in (False, True):
                        if name in ("triton", "cuda") and N > 1 and (eps, ignore) != (0.1, True):
                            continue
                        yield pytest.param(name, N, D, V, eps, reduction, ignore, marks=backend.marks,
                                           id=f"{name}-{N}x{D}x{V}-ls{eps}-{reduction}-{'ign' if ignore else 'all'}")


def _lce_inputs(N, D, V, device, dtype=torch.float64):
    gen = torch.Generator().manual_seed(N * D + V)
    h = torch.randn(N, D, generator=gen, dtype=torch.float64)
    lw = 0.3 * torch.randn(V, D, generator=gen, dtype=torch.float64)
    lb = 0.1 * torch.randn(V, generator=gen, dtype=torch.float64)
    return [a.to(device, dtype) for a in (h, lw, lb)]


@pytest.mark.parametrize("backend,N,D,V,eps,reduction,ignore", list(_lce_cases()))
def test_linear_cross_entropy_fp32(backend, N, D, V, eps, reduction, ignore):
    device = device_for(backend)
    h, lw, lb = _lce_inputs(N, D, V, device)
    t, w = _targets(N, V, device, ignore), _weights(V, device)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (N,), device, torch.float64)
    truth, truth_g = _lce_run(None, h, lw, lb, t, w.double(), up, **kw)
    f32 = [a.float() for a in (h, lw, lb)]
    tl, tg = _lce_run(None, *f32, t, w, up.float(), **kw)
    loss, g = _lce_run(backend, *f32, t, w, up.float(), **kw)
    assert loss.dtype == torch.float32
    _assert_2x("loss", loss, truth, tl)
    for name in truth_g:
        _assert_2x(name, g[name], truth_g[name], tg[name])


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "cpu"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_linear_cross_entropy_fp64(backend, eps, reduction):
    h, lw, lb = _lce_inputs(13, 24, 203, "cpu")
    t, w = _targets(13, 203, "cpu", True), _weights(203, "cpu", torch.float64)
    kw = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, (13,), "cpu", torch.float64)
    loss, g = _lce_run(backend, h, lw, lb, t, w, up, **kw)
    want, want_g = _lce_run(None, h, lw, lb, t, w, up, **kw)
    assert loss.dtype == torch.float64
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    # reduction none's backward takes the per-row upstream gradient in fp32 (as without weights)
    atol, rtol = (1e-7, 1e-6) if reduction == "none" else (1e-12, 1e-10)
    for name in want_g:
        assert_close(name, g[name], want_g[name], atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_bf16(backend, reduction):
    device = device_for(backend)
    h, lw, lb = _lce_inputs(13, 24, 203, device, torch.float32)
    t, w = _targets(13, 203, device, True), _weights(203, device)
    kw = dict(label_smoothing=0.1, reduction=reduction)
    up = _upstream(reduction, (13,), device)
    bf = [a.bfloat16() for a in (h, lw, lb)]
    factor = _lowp_factor(backend)
    loss, g = _lce_run(backend, *bf, t, w, up.bfloat16(), **kw)
    lp, lp_g = _lce_run("ref", *bf, t, w, up.bfloat16(), **kw)
    ref, ref_g = _lce_run("ref", *[a.float() for a in bf], t, w, up, **kw)
    assert loss.dtype == torch.bfloat16
    assert_close_lowp("loss", loss, ref, lp, factor=factor)
    for name in ref_g:
        assert_close_lowp(name, g[name], ref_g[name], lp_g[name], factor=factor, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] == "cpu"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy_several_chunks(backend, reduction):
    """More rows than one chunk (at least 256 rows a chunk on cpu): the mean's divisor and the
    weighted rows span chunks."""
    h, lw, lb = _lce_inputs(600, 16, 64, "cpu", torch.float32)
    t, w = _targets(600, 64, "cpu", True), _weights(64, "cpu")
    kw = dict(label_smoothing=0.1, reduction=reduction)
    up = _upstream(reduction, (600,), "cpu")
    loss, g = _lce_run(backend, h, lw, lb, t, w, up, **kw)
    want, want_g = _lce_run(None, h, lw, lb, t, w, up, **kw)
    assert_close("loss", loss, want, atol=1e-5, rtol=1e-5)
    for name in want_g:
        assert_close(name, g[name], want_g[name], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- torch's edge cases


# (weights of 5 classes, targets of 6 rows)
EDGE_WEIGHTS = {
    "all_ignored": (torch.tensor([0.3, 1.0, 1.0, 2.0, 0.5]), torch.full((6,), -100)),
    "target_weights_zero": (torch.tensor([0.0, 0.0, 1.0, 2.0, 0.5]), torch.tensor([0, 1] * 3)),
    "some_zero": (torch.tensor([0.0, 1.0, 1.0, 2.0, 0.5]), torch.arange(6) % 5),
    "all_zero": (torch.zeros(5), torch.arange(6) % 5),
}


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
@pytest.mark.parametrize("case", list(EDGE_WEIGHTS))
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_edge_cases_are_torch(backend, case, eps):
    """What torch gives: NaN loss (0 / 0) and zero gradient when every row is ignored; NaN loss
    and NaN gradient when rows count but their weights sum to 0 (mean); sum and none as the rows."""
    device = device_for(backend)
    w, t = (a.to(device) for a in EDGE_WEIGHTS[case])
    x = torch.randn(6, 5, device=device)
    for reduction in REDUCTIONS:
        kw = dict(label_smoothing=eps, reduction=reduction)
        up = _upstream(reduction, (6,), device)
        run = "ref" if backend == "reference" else backend
        loss, g = _ce_run(run, x, t, w, up, **kw)
        want, want_g = _ce_run(None, x, t, w, up, **kw)
        torch.testing.assert_close(loss, want, equal_nan=True, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g["logits"], want_g["logits"], equal_nan=True, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- the weight's own rules


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
def test_weight_gets_no_gradient_and_any_float_dtype(backend):
    """weight is not differentiated (torch refuses one that requires grad; so does fastformer,
    with grad enabled, and takes it under no_grad); an fp64 or bf16 weight is cast to the math type."""
    device = device_for(backend)
    x, t = torch.randn(4, 5, device=device), torch.tensor([0, 1, 2, 3], device=device)
    w = torch.rand(5, device=device)
    with fastformer.use_backend(backend):
        want = ops.cross_entropy(x, t, weight=w)
        for other in (w.double(), w.bfloat16().float()):
            assert_close("loss", ops.cross_entropy(x, t, weight=other), F.cross_entropy(x, t, weight=other.float()),
                         atol=1e-6, rtol=1e-5)
        with torch.no_grad():
            assert_close("no_grad", ops.cross_entropy(x, t, weight=w.clone().requires_grad_()), want, 0, 0)
        with pytest.raises(ValueError, match="weight .*must not require grad"):
            ops.cross_entropy(x, t, weight=w.clone().requires_grad_())
        with pytest.raises(ValueError, match="weight .*must not require grad"):
            ops.linear_cross_entropy(x, torch.randn(5, 5, device=device), t, weight=w.clone().requires_grad_())


def test_weight_none_is_the_unweighted_call():
    x, t = torch.randn(7, 13), torch.randint(0, 13, (7,))
    with fastformer.use_backend("cpu"):
        a = ops.cross_entropy(x, t, label_smoothing=0.1)
        b = ops.cross_entropy(x, t, label_smoothing=0.1, weight=torch.ones(13))
    assert_close("ones", b, a, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- bad weights


def _ce(weight, logits=None):
    logits = _t(4, 7) if logits is None else logits
    return lambda: ops.cross_entropy(logits, torch.tensor([0, 3, 6, 1]), weight=weight)


def _lce(weight):
    return lambda: ops.linear_cross_entropy(_t(4, 5), _t(7, 5), torch.tensor([0, 3, 6, 1]), weight=weight)


BAD_WEIGHT = {
    "cross_entropy": {
        "weight_shape": (_ce(torch.ones(6)), ValueError, "weight must have shape \\(7,\\)"),
        "weight_2d": (_ce(torch.ones(1, 7)), ValueError, "weight must have shape"),
        "weight_int": (_ce(torch.ones(7, dtype=torch.int64)), TypeError, "weight must be a floating"),
        "weight_list": (_ce([1.0] * 7), TypeError, "weight must be a torch.Tensor"),
        "weight_device": (_ce(torch.ones(7, device="meta")), ValueError, "weight is on meta"),
        "weight_requires_grad": (_ce(torch.ones(7, requires_grad=True)), ValueError, "weight .*must not require"),
    },
    "linear_cross_entropy": {
        "weight_shape": (_lce(torch.ones(6)), ValueError, "weight must have shape \\(7,\\)"),
        "weight_int": (_lce(torch.ones(7, dtype=torch.int64)), TypeError, "weight must be a floating"),
        "weight_device": (_lce(torch.ones(7, device="meta")), ValueError, "weight is on meta"),
    },
}
test_bad_weight_raises_naming_it = hostile.bad_input_test(**BAD_WEIGHT)

cross_entropy_fwd = hostile.kernel_call("cross_entropy_fwd", lambda: dict(
    logits=_t(4, 7), target=torch.tensor([0, 6, 3, -100]), label_smoothing=0.1, ignore_index=-100, reduction=1,
    compute_grad=True, class_weight=torch.ones(7)))
linear_cross_entropy_fwd = hostile.kernel_call("linear_cross_entropy_fwd", lambda: dict(
    hidden=_t(4, 5), weight=_t(7, 5), bias=None, target=torch.tensor([0, 6, 3, -100]), label_smoothing=0.1,
    ignore_index=-100, reduction=1, compute_grad=True, class_weight=torch.ones(7)))

BAD_KERNEL_ARGS = {
    "cross_entropy_class_weight": {
        "shape": (lambda: cross_entropy_fwd(class_weight=torch.ones(6)), "class_weight must have shape (7,)"),
        "dtype_bf16": (lambda: cross_entropy_fwd(class_weight=torch.ones(7, dtype=torch.bfloat16)),
                       "class_weight must be Float"),
        "dtype_fp64": (lambda: cross_entropy_fwd(class_weight=torch.ones(7, dtype=torch.float64)),
                       "class_weight must be Float"),
        "strided": (lambda: cross_entropy_fwd(class_weight=torch.ones(14)[::2]), "class_weight must be contiguous"),
    },
    "linear_cross_entropy_class_weight": {
        "shape": (lambda: linear_cross_entropy_fwd(class_weight=torch.ones(8)), "class_weight must have shape (7,)"),
        "dtype": (lambda: linear_cross_entropy_fwd(class_weight=torch.ones(7, dtype=torch.int64)),
                  "class_weight must be Float"),
    },
}
test_cpp_ops_reject_bad_class_weight = hostile.cpp_checks_test(__name__)
