"""linear_cross_entropy with class probabilities as the target (torch's soft targets) on every
backend, against PyTorch's own ``F.cross_entropy(F.linear(x, W, b), probs, ...)`` (fp32 by the 2x
rule against an fp64 truth, fp64 on cpu) and the reference (bf16, leading dimensions): the loss and
the gradients of the input, the linear weight, the bias and, when they require grad, the
probabilities; odd shapes (V = 1, V = 1023, rows = 1, 0 rows), several row chunks, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops
from fastformer.autograd import cross_entropy as ce_autograd
from fastformer.ops import reference
import hostile
from hostile import tensor as _t
from test_cross_entropy_soft import assert_2x_rule
from test_cross_entropy_weight import _lowp_factor
from utils import assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
REDUCTIONS = ("none", "mean", "sum")
NAMES = ["input", "linear_weight", "linear_bias", "target"]
SIMT = not torch.cuda.is_available()

# (rows, D, V): V = 1, rows = 1, V = 1023, odd sizes; every combination on the small ones, these
# (eps, class weights, bias, probabilities require grad) with every reduction on V = 1023
SHAPES = [(1, 8, 1), (7, 16, 13), (113, 32, 1023), (5, 3, 1)]
LARGE = {(0.1, True, True, True), (0.0, False, False, False)}
# the emulated backends (Triton's interpreter, the SIMT harness) are slow: one shape and these
# (eps, reduction, class weights, bias, probabilities require grad)
EMULATED = [(0.1, "mean", True, True, True), (0.0, "none", False, True, True), (0.1, "sum", True, False, False)]


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for shape in SHAPES:
            for eps in (0.0, 0.1):
                for reduction in REDUCTIONS:
                    for weighted in (False, True):
                        for has_bias in (True, False):
                            for target_grad in (False, True):
                                combo = (eps, reduction, weighted, has_bias, target_grad)
                                if name != "cpu" and (shape != (7, 16, 13) or combo not in EMULATED):
                                    continue
                                if shape[2] == 1023 and (eps, weighted, has_bias, target_grad) not in LARGE:
                                    continue
                                yield pytest.param(name, shape, *combo, marks=backend.marks,
                                                   id=f"{name}-{'x'.join(map(str, shape))}-ls{eps}-{reduction}"
                                                      f"-w{int(weighted)}-b{int(has_bias)}-tg{int(target_grad)}")


def _probs(*shape, gen=None):
    return torch.softmax(2.0 * torch.randn(*shape, dtype=torch.float64, generator=gen), dim=-1)


def _inputs(N, D, V, device, weighted=True, has_bias=True):
    """fp64 hidden (N, D), weight (V, D), bias (V,), probabilities (N, V), class weights (V,): logits O(1..3)."""
    gen = torch.Generator().manual_seed(N * 7919 + D * 31 + V)
    h = torch.randn(N, D, dtype=torch.float64, generator=gen)
    w = 2.0 * torch.randn(V, D, dtype=torch.float64, generator=gen) / D ** 0.5
    b = torch.randn(V, dtype=torch.float64, generator=gen) if has_bias else None
    q = _probs(N, V, gen=gen)
    cw = torch.rand(V, dtype=torch.float64, generator=gen) + 0.5 if weighted else None
    return tuple(None if t is None else t.to(device) for t in (h, w, b, q, cw))


def _upstream(reduction, N, device):
    if reduction == "none":
        return torch.randn(N, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    return torch.tensor(1.0 if reduction == "mean" else 0.37, dtype=torch.float64, device=device)


def _torch_lce(h, w, q, linear_bias=None, **kw):
    return F.cross_entropy(F.linear(h, w, linear_bias), q, **kw)


def _kernel_lce(backend):
    def fn(h, w, q, **kw):
        with fastformer.use_backend(backend):
            return ops.linear_cross_entropy(h, w, q, **kw)
    return fn


def _run(fn, inputs, up, dtype, target_grad, **kw):
    """fn's loss and its gradients by name (the probabilities' when target_grad), inputs cast to dtype."""
    h, w, b, q, cw = (None if t is None else t.to(dtype) for t in inputs)
    cw_kw = dict(weight=cw, **kw)

    def call(a, bw, bb, *t):
        return fn(a, bw, t[0] if target_grad else q, linear_bias=bb, **cw_kw)
    names = NAMES if target_grad else NAMES[:3]
    (loss,), g = forward_backward(call, [h, w, b, q][:len(names)], [up.to(dtype)], names)
    return loss, g


@pytest.mark.parametrize("backend, shape, eps, reduction, weighted, has_bias, target_grad", list(_cases()))
def test_fp32_2x_rule_and_fp64(backend, shape, eps, reduction, weighted, has_bias, target_grad):
    """Loss and every gradient in fp32 within ~2x PyTorch's own fp32 error against its fp64 truth;
    fp64 on cpu to ~1e-10."""
    device = device_for(backend)
    N, D, V = shape
    inputs = _inputs(N, D, V, device, weighted, has_bias)
    up = _upstream(reduction, N, device)
    kw = dict(label_smoothing=eps, reduction=reduction)
    truth, truth_g = _run(_torch_lce, inputs, up, torch.float64, target_grad, **kw)
    torch_loss, torch_g = _run(_torch_lce, inputs, up, torch.float32, target_grad, **kw)
    loss, g = _run(_kernel_lce(backend), inputs, up, torch.float32, target_grad, **kw)
    assert set(g) == set(truth_g)
    assert_2x_rule([("loss", loss, truth, torch_loss)] + [(n, g[n], truth_g[n], torch_g[n]) for n in g])
    if backend != "cpu":
        return  # fp64: the cpu backend's alone
    loss, g = _run(_kernel_lce(backend), inputs, up, torch.float64, target_grad, **kw)
    assert_close("fp64 loss", loss, truth, atol=1e-12, rtol=1e-10)
    for n in g:
        assert_close(f"fp64 d{n}", g[n], truth_g[n], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bf16(backend, reduction):
    """bf16 (accumulating in fp32) against the fp32 reference by the 2x rule, every gradient."""
    device = device_for(backend)
    N, D, V = (13, 32, 203) if backend == "cpu" else (5, 16, 37)
    h, w, b, q, cw = _inputs(N, D, V, device)
    up = _upstream(reduction, N, device).float()
    kw = dict(weight=cw.float(), label_smoothing=0.1, reduction=reduction)
    names = NAMES

    def run(fn, dtype, u):
        (loss,), g = forward_backward(lambda a, bw, bb, t: fn(a, bw, t, linear_bias=bb, **kw),
                                      [h.to(dtype), w.to(dtype), b.to(dtype), q.float()], [u], names)
        return loss, g

    loss, g = run(_kernel_lce(backend), torch.bfloat16, up.bfloat16())
    lp, lp_g = run(reference.linear_cross_entropy, torch.bfloat16, up.bfloat16())
    ref, ref_g = run(reference.linear_cross_entropy, torch.float32, up)
    assert loss.dtype == torch.bfloat16 and g["target"].dtype == torch.float32
    factor = _lowp_factor(backend)
    assert_close_lowp("loss", loss, ref, lp, factor=factor)
    for n in names:
        assert_close_lowp(f"d{n}", g[n], ref_g[n], lp_g[n], factor=factor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_leading_dims_and_target_dtype(backend, reduction):
    """input (2, 3, D) with probabilities (2, 3, V) in fp64 for an fp32 input (taken in fp32, their
    gradient given back in fp64): the loss keeps the leading shape for none."""
    device = device_for(backend)
    h, w, b, q, cw = _inputs(6, 8, 11, device)
    h, q = h.reshape(2, 3, 8), q.reshape(2, 3, 11)
    up = (torch.randn(2, 3, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7)).to(device)
    kw = dict(linear_bias=b.float(), weight=cw.float(), label_smoothing=0.1, reduction=reduction)
    (loss,), g = forward_backward(lambda a, t: _kernel_lce(backend)(a, w.float(), t, **kw), [h.float(), q], [up.float()],
                                  ["input", "target"])
    (want,), want_g = forward_backward(lambda a, t: reference.linear_cross_entropy(a, w.float(), t, **kw),
                                       [h.float(), q], [up.float()], ["input", "target"])
    assert g["target"].dtype == torch.float64
    assert_close("loss", loss, want, atol=1e-5, rtol=1e-5)
    for n in want_g:
        assert_close(n, g[n], want_g[n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_input(backend, reduction):
    """No rows: torch's NaN mean, zero sum, empty rows; empty / zero gradients."""
    device = device_for(backend)
    h, w, b, q, cw = (t.float() for t in _inputs(0, 8, 7, device))
    leaves = [t.clone().requires_grad_() for t in (h, w, b, q)]
    with fastformer.use_backend(backend):
        loss = ops.linear_cross_entropy(leaves[0], leaves[1], leaves[3], linear_bias=leaves[2], weight=cw,
                                        label_smoothing=0.1, reduction=reduction)
    loss.sum().backward()
    want = _torch_lce(h, w, q, linear_bias=b, weight=cw, label_smoothing=0.1, reduction=reduction)
    torch.testing.assert_close(loss.detach(), want, equal_nan=True)
    assert [t.grad.shape for t in leaves] == [(0, 8), (7, 8), (7,), (0, 7)]
    assert not leaves[1].grad.any() and not leaves[2].grad.any()


# ---------------------------------------------------------------- several row chunks


def _check_chunks(backend, N, D, V, reductions=REDUCTIONS):
    """Every gradient of (N, D, V) in fp32 against the reference in fp64 (the chunk loops' rows,
    column sums and accumulations add up)."""
    device = device_for(backend)
    inputs = _inputs(N, D, V, device)
    for reduction in reductions:
        up = _upstream(reduction, N, device)
        kw = dict(label_smoothing=0.1, reduction=reduction)
        want, want_g = _run(reference.linear_cross_entropy, inputs, up, torch.float64, True, **kw)
        loss, g = _run(_kernel_lce(backend), inputs, up, torch.float32, True, **kw)
        assert_close(f"{reduction} loss", loss.double(), want, atol=1e-5, rtol=1e-5)
        for n in want_g:
            assert_close(f"{reduction} d{n}", g[n].double(), want_g[n], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_cpu_several_chunks(backend):
    """257 rows of 16400 fp32 logits are two 16 MB chunks of the CPU kernel (256 rows, then 1)."""
    _check_chunks(backend, 257, 4, 16400, ("mean", "none"))


@pytest.mark.parametrize("backend", kernel_backends("triton"))
def test_triton_several_chunks(backend, monkeypatch):
    """Chunks of 2 rows (the last one 1): _CHUNK_ELEMENTS at its smallest."""
    from fastformer.triton_kernels import cross_entropy as triton_ce
    monkeypatch.setattr(triton_ce, "_CHUNK_ELEMENTS", 1)
    assert triton_ce._chunk_rows(7, 2, 5) == 2
    _check_chunks(backend, 7, 2, 5, ("mean", "none"))


@pytest.mark.parametrize("backend", kernel_backends("cuda"))
def test_cuda_several_chunks(backend):
    """257 rows are two chunks (256, then 1): on the harness with a little device memory modelled
    (the GPU rule's smallest chunks), on a GPU with V large enough for the CPU-sized logits."""
    if not SIMT:
        _check_chunks(backend, 257, 4, 16400, ("mean",))
        return
    ops_ = torch.ops.fastformer_simt_selftest
    previous = ops_.set_free_memory(1)
    try:
        assert ops_.lce_device_chunk_rows(257, 13, 4, 1) == 256
        _check_chunks(backend, 257, 4, 13, ("mean", "none"))
    finally:
        ops_.set_free_memory(previous)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + kernel_backends("cpu"))
def test_target_gradient_in_chunks(backend, monkeypatch):
    """The probabilities' gradient, one row per chunk of recomputed logits, equals torch's."""
    monkeypatch.setattr(ce_autograd, "TARGET_GRAD_CHUNK_ELEMENTS", 10)
    inputs = _inputs(5, 4, 7, "cpu")
    for reduction in REDUCTIONS:
        up = _upstream(reduction, 5, "cpu")
        kw = dict(label_smoothing=0.2, reduction=reduction)
        _, want = _run(_torch_lce, inputs, up, torch.float64, True, **kw)
        _, g = _run(_kernel_lce(backend), inputs, up, torch.float64, True, **kw)
        assert_close(f"{reduction} dtarget", g["target"], want["target"], atol=1e-12, rtol=1e-10)
        # the probabilities alone require grad (the linear layer frozen)
        h, w, b, q, cw = inputs
        q = q.clone().requires_grad_()
        loss = _kernel_lce(backend)(h, w, q, linear_bias=b, weight=cw, **kw)
        (dq,) = torch.autograd.grad(loss, q, up)
        assert_close(f"{reduction} dtarget alone", dq, want["target"], atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- bad input


def _soft(target, **kw):
    return lambda: ops.linear_cross_entropy(_t(4, 6), _t(9, 6), target, linear_bias=_t(9), **kw)


LINEAR_CROSS_ENTROPY_PROBABILITIES = {
    "probs_shape": (_soft(torch.full((4, 8), 1 / 8)), TypeError, r"class probabilities of shape \(4, 9\)"),
    "probs_rows": (_soft(torch.full((3, 9), 1 / 9)), TypeError, r"class probabilities of shape \(4, 9\)"),
    "probs_int": (_soft(torch.zeros(4, 9, dtype=torch.int32)), TypeError, "target must hold class indices"),
    "probs_device": (_soft(torch.full((4, 9), 1 / 9, device="meta")), ValueError, "target is on meta"),
    "probs_ignore_index": (_soft(torch.full((4, 9), 1 / 9), ignore_index=0), ValueError,
                           "ignore_index is not supported for probability targets"),
}
BAD_INPUT = {"linear_cross_entropy": LINEAR_CROSS_ENTROPY_PROBABILITIES}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)

linear_cross_entropy_fwd = hostile.kernel_call("linear_cross_entropy_fwd", lambda: dict(
    hidden=_t(4, 6), weight=_t(9, 6), bias=_t(9), target=torch.full((4, 9), 1 / 9), label_smoothing=0.1,
    ignore_index=-100, reduction=1, compute_grad=True))
linear_cross_entropy_bwd = hostile.kernel_call("linear_cross_entropy_bwd", lambda: dict(
    grad_loss=_t(4), hidden=_t(4, 6), weight=_t(9, 6), bias=_t(9), target=torch.full((4, 9), 1 / 9),
    label_smoothing=0.0, ignore_index=-100))

BAD_KERNEL_ARGS = {
    "linear_cross_entropy_probability_target": {
        "fwd_shape": (lambda: linear_cross_entropy_fwd(target=torch.full((4, 8), 1 / 8)),
                      "target (class probabilities) must have shape (4, 9)"),
        "fwd_rows": (lambda: linear_cross_entropy_fwd(target=torch.full((5, 9), 1 / 9)),
                     "target (class probabilities) must have shape (4, 9)"),
        "fwd_bf16": (lambda: linear_cross_entropy_fwd(target=torch.full((4, 9), 1 / 9, dtype=torch.bfloat16)),
                     "target (class probabilities) must be Float (the math type of hidden's Float)"),
        "fwd_fp64_for_fp32": (lambda: linear_cross_entropy_fwd(target=torch.full((4, 9), 1 / 9, dtype=torch.float64)),
                              "target (class probabilities) must be Float"),
        "fwd_strided": (lambda: linear_cross_entropy_fwd(target=torch.full((4, 18), 1 / 9)[:, ::2]),
                        "target must be contiguous"),
        "bwd_shape": (lambda: linear_cross_entropy_bwd(target=torch.full((4, 8), 1 / 8)),
                      "target (class probabilities) must have shape (4, 9)"),
        "bwd_dtype": (lambda: linear_cross_entropy_bwd(target=torch.full((4, 9), 1 / 9, dtype=torch.float64)),
                      "target (class probabilities) must be Float"),
    },
}
test_cpp_ops_reject_bad_probability_targets = hostile.cpp_checks_test(__name__)


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_cpp_autograd_ops_refuse_probabilities_that_require_grad(backend):
    """The C++ differentiable ops give the target no gradient: they refuse one that requires it
    (the public ops take the Python Function for it)."""
    q = torch.full((4, 9), 1 / 9, requires_grad=True)
    with pytest.raises(RuntimeError, match="target \\(class probabilities\\) requires grad"):
        torch.ops.fastformer.linear_cross_entropy(_t(4, 6), _t(9, 6), None, q, 0.0, -100, 1)
    with pytest.raises(RuntimeError, match="target \\(class probabilities\\) requires grad"):
        torch.ops.fastformer.cross_entropy(_t(4, 9), q, 0.0, -100, 1)
    with torch.no_grad():  # nothing to differentiate: computed
        torch.ops.fastformer.linear_cross_entropy(_t(4, 6), _t(9, 6), None, q, 0.0, -100, 1)
