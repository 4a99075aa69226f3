"""Probability ("soft") targets in cross_entropy and linear_cross_entropy, as torch's
``F.cross_entropy(logits, probs)``: the reference against torch (fp64, every layout, reduction,
smoothing, class weights, every gradient); the cpu kernels of cross_entropy against torch (fp32 by
the 2x rule, fp64, bf16) and their argument checks, the Triton and CUDA kernels (fp32, bf16); the
probabilities' own gradient on every backend. linear_cross_entropy's kernels:
test_linear_cross_entropy_soft.py."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops
from fastformer.ops import reference
import hostile
from test_cross_entropy_weight import _lowp_factor
from utils import assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends, max_err

REDUCTIONS = ("none", "mean", "sum")


def _probs(shape, dim):
    return torch.softmax(2.0 * torch.randn(shape, dtype=torch.float64), dim=dim)


def assert_2x_rule(results):
    """Each (name, out, truth, torch's): out's error against the fp64 truth at most ~2x that of
    PyTorch's own result in the same precision."""
    for name, out, t, ref in results:
        assert out.shape == t.shape, f"{name}: shape {tuple(out.shape)} != {tuple(t.shape)}"
        err, torch_err = max_err(out, t), max_err(ref, t)
        assert err <= 2.0 * torch_err + 1e-6 * max(1.0, t.abs().max().item()), f"{name}: {err:.3e} vs {torch_err:.3e}"


def _kernel_ce(backend):
    def fn(a, b, **k):
        with fastformer.use_backend(backend):
            return ops.cross_entropy(a, b, **k)
    return fn


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", [(9, 13), (13,), (4, 13, 5), (1, 1023)])
def test_reference_matches_torch(shape, eps, reduction, weighted):
    C = shape[1] if len(shape) > 1 else shape[0]
    x, q = 2.0 * torch.randn(shape, dtype=torch.float64), _probs(shape, 1 if len(shape) > 1 else 0)
    w = torch.rand(C, dtype=torch.float64) if weighted else None
    kw = dict(weight=w, label_smoothing=eps, reduction=reduction)
    out_shape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    up = torch.randn(out_shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
    (loss,), g = forward_backward(lambda a, b: reference.cross_entropy(a, b, **kw), [x, q], [up], ["logits", "probs"])
    (want,), want_g = forward_backward(lambda a, b: F.cross_entropy(a, b, **kw), [x, q], [up], ["logits", "probs"])
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    for name in want_g:
        assert_close(name, g[name], want_g[name], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_reference_matches_torch(reduction):
    h, lw, lb = (torch.randn(s, dtype=torch.float64) for s in ((10, 8), (11, 8), (11,)))
    q, w = _probs((10, 11), -1), torch.rand(11, dtype=torch.float64)
    kw = dict(weight=w, label_smoothing=0.1, reduction=reduction)
    up = torch.randn(10, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
    names = ["input", "linear_weight", "linear_bias"]
    (loss,), g = forward_backward(lambda a, b, c: reference.linear_cross_entropy(a, b, q, linear_bias=c, **kw),
                                  [h, lw, lb], [up], names)
    (want,), want_g = forward_backward(lambda a, b, c: F.linear_cross_entropy(a, b, q, linear_bias=c, **kw),
                                       [h, lw, lb], [up], names)
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    for name in names:
        assert_close(name, g[name], want_g[name], atol=1e-12, rtol=1e-10)


def test_auto_matches_torch():
    x, q = torch.randn(4, 13, 5), _probs((4, 13, 5), 1).float()
    h, lw = torch.randn(6, 8), torch.randn(13, 8)
    q2 = _probs((6, 13), -1).float()
    assert_close("ce", ops.cross_entropy(x, q, label_smoothing=0.1), F.cross_entropy(x, q, label_smoothing=0.1),
                 atol=1e-6, rtol=1e-5)
    assert_close("lce", ops.linear_cross_entropy(h, lw, q2), F.linear_cross_entropy(h, lw, q2), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + kernel_backends())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("logits_grad", [True, False])
def test_probability_gradient(backend, reduction, logits_grad):
    """Probabilities that require grad get torch's gradient, -(1 - eps) w_c log_softmax(x)_c per unit of
    the row's loss (with and without the logits' gradient): fp32 within ~2x PyTorch's own fp32 error
    against its fp64 truth, fp64 on cpu to ~1e-10. (3, 13, 5): class dimension 1."""
    device = device_for(backend)
    shape = (3, 13, 5)
    x, q = (3.0 * torch.randn(shape, dtype=torch.float64)).to(device), _probs(shape, 1).to(device)
    w = (torch.rand(13, dtype=torch.float64) + 0.5).to(device)
    kw = dict(label_smoothing=0.1, reduction=reduction)
    up = (torch.randn(3, 5, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64))
    up = up.to(device)
    names = ["logits", "probs"] if logits_grad else ["probs"]

    def run(fn, dtype):
        xd, qd, wd = x.to(dtype), q.to(dtype), w.to(dtype)
        call = (lambda a, b: fn(a, b, weight=wd, **kw)) if logits_grad else (lambda b: fn(xd, b, weight=wd, **kw))
        (loss,), g = forward_backward(call, [xd, qd] if logits_grad else [qd], [up.to(dtype)], names)
        return loss, g

    truth, truth_g = run(F.cross_entropy, torch.float64)
    torch_loss, torch_g = run(F.cross_entropy, torch.float32)
    loss, g = run(_kernel_ce(backend), torch.float32)
    assert_2x_rule([("loss", loss, truth, torch_loss)] + [(n, g[n], truth_g[n], torch_g[n]) for n in names])
    if backend not in ("cpu", "reference"):
        return  # fp64: the cpu backend's alone
    loss, g = run(_kernel_ce(backend), torch.float64)
    assert_close("fp64 loss", loss, truth, atol=1e-12, rtol=1e-10)
    for n in names:
        assert_close(f"fp64 d{n}", g[n], truth_g[n], atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- the kernels


@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton", "cuda"))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", [(1, 1023), (7, 13), (113, 203), (3, 13, 5)])
def test_fp32_2x_rule(backend, shape, eps, reduction, weighted):
    """Loss and gradient in fp32 within ~2x PyTorch's own fp32 error against the fp64 truth."""
    C = shape[1]
    device = device_for(backend)
    x, q = (3.0 * torch.randn(shape, dtype=torch.float64)).to(device), _probs(shape, 1).to(device)
    w = torch.rand(C, dtype=torch.float64).to(device) if weighted else None
    kw = dict(label_smoothing=eps, reduction=reduction)
    out_shape = (shape[0],) + shape[2:]
    up = (torch.randn(out_shape, dtype=torch.float64) if reduction == "none"
          else torch.tensor(0.7, dtype=torch.float64)).to(device)

    def run(fn, dtype):
        wd = None if w is None else w.to(dtype)
        (loss,), g = forward_backward(lambda a: fn(a, q.to(dtype), weight=wd, **kw), [x.to(dtype)], [up.to(dtype)],
                                      ["logits"])
        return loss, g["logits"]

    truth, truth_g = run(F.cross_entropy, torch.float64)
    torch_loss, torch_g = run(F.cross_entropy, torch.float32)
    loss, g = run(_kernel_ce(backend), torch.float32)
    assert_2x_rule((("loss", loss, truth, torch_loss), ("grad", g, truth_g, torch_g)))
    if backend != "cpu":
        return  # fp64: the cpu backend's alone
    f64_loss, f64_g = run(_kernel_ce(backend), torch.float64)
    assert_close("fp64 loss", f64_loss, truth, atol=1e-12, rtol=1e-12)
    assert_close("fp64 grad", f64_g, truth_g, atol=1e-13, rtol=1e-10)


@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton", "cuda"))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bf16(backend, reduction):
    device = device_for(backend)
    x, q = (3.0 * torch.randn(13, 203)).bfloat16().to(device), _probs((13, 203), -1).float().to(device)
    w = torch.rand(203, device=device)
    kw = dict(weight=w, label_smoothing=0.1, reduction=reduction)
    up = (torch.randn(13) if reduction == "none" else torch.tensor(1.0)).to(device)

    def run(fn, a, u):
        (loss,), g = forward_backward(lambda t: fn(t, q, **kw), [a], [u], ["logits"])
        return loss, g["logits"]

    loss, g = run(_kernel_ce(backend), x, up.bfloat16())
    lp, lp_g = run(reference.cross_entropy, x, up.bfloat16())
    ref, ref_g = run(reference.cross_entropy, x.float(), up)
    assert loss.dtype == torch.bfloat16
    factor = _lowp_factor(backend)
    assert_close_lowp("loss", loss, ref, lp, factor=factor)
    assert_close_lowp("grad", g, ref_g, lp_g, factor=factor)


cross_entropy_fwd = hostile.kernel_call("cross_entropy_fwd", lambda: dict(
    logits=torch.randn(4, 7), target=torch.full((4, 7), 1 / 7), label_smoothing=0.1, ignore_index=-100, reduction=1,
    compute_grad=True))

BAD_KERNEL_ARGS = {
    "cross_entropy_probability_target": {
        "shape": (lambda: cross_entropy_fwd(target=torch.full((4, 6), 1 / 6)),
                  "target (class probabilities) must have shape"),
        "dtype_bf16": (lambda: cross_entropy_fwd(target=torch.full((4, 7), 1 / 7, dtype=torch.bfloat16)),
                       "target (class probabilities) must be Float"),
        "strided": (lambda: cross_entropy_fwd(target=torch.full((4, 14), 1 / 7)[:, ::2]), "target must be contiguous"),
    },
}
test_cpp_ops_reject_bad_probability_targets = hostile.cpp_checks_test(__name__)


@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton", "cuda"))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_input(backend, reduction):
    """No rows: torch's NaN mean, zero sum, empty rows; an empty gradient."""
    device = device_for(backend)
    x, q = torch.zeros(0, 7, device=device, requires_grad=True), torch.zeros(0, 7, device=device)
    with fastformer.use_backend(backend):
        loss = ops.cross_entropy(x, q, reduction=reduction, label_smoothing=0.1)
    loss.sum().backward()
    want = F.cross_entropy(x.detach(), q, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss.detach(), want, equal_nan=True)
    assert x.grad.shape == (0, 7)
