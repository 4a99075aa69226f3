"""linear_cross_entropy: the reference against F.cross_entropy(F.linear(...)), then every kernel
backend against the reference (loss and the gradients of hidden, weight and bias; every
reduction, smoothing, ignore_index, bias None, several chunks), gradcheck, opcheck, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends
from fastformer.ops import linear_cross_entropy, reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends, max_err

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
CUDA = kernel_backends("cuda")
# The cuda backend runs on the SIMT harness without a GPU (CPU tensors).
SIMT = not torch.cuda.is_available()
REDUCTIONS = ("none", "mean", "sum")
SMOOTHING = (0.0, 0.1, 1.0)
INPUT_NAMES = ("hidden", "weight", "bias")

# (N, D, V): rows 1, 7, 113; hidden 16..64; classes 1, 7, 1023, 8000. (1100, 16, 8000) spans
# several 16 MB row chunks of the CPU kernel (3 in fp32, 2 in bf16), the last one partial.
SHAPES = [(1, 16, 1), (7, 32, 7), (113, 64, 1023), (7, 40, 8000), (1100, 16, 8000)]
# The Triton interpreter is slow: a subset keeps its part of this file short.
TRITON_SHAPES = [(7, 32, 7), (113, 64, 1023)]
# The harness runs every CUDA thread as a host fiber: the shapes without the (1100, 16, 8000)
# giant (test_cuda_several_chunks covers the chunk loop with fewer elements), every combination
# on (7, 32, 7) and these (smoothing, reduction, bias) on the others.
SIMT_SHAPES = [(1, 16, 1), (7, 32, 7), (113, 64, 1023), (7, 40, 8000)]
SIMT_COMBOS = {(0.0, "none", True), (0.1, "mean", True), (0.1, "mean", False), (1.0, "sum", True)}


def _shapes(name):
    if name == "triton":
        return TRITON_SHAPES
    if name == "cuda" and SIMT:
        return SIMT_SHAPES
    return SHAPES

# fp32 (atol, rtol) per backend for the loss and the gradients.
FP32_TOL = {
    "cpu": {"loss": (1e-5, 1e-5), "grad": (1e-5, 1e-4)},
    "triton": {"loss": (1e-5, 1e-5), "grad": (1e-5, 1e-4)},
    "cuda": {"loss": (1e-5, 1e-5), "grad": (1e-5, 1e-4)},
}
# bf16: kernel error <= factor x the bf16 reference's error (FlashAttention's rule). The GPU
# kernels may round the bf16 gradients twice (kernel output, then a non-unit upstream gradient)
# where the reference rounds once, and Triton's interpreter truncates fp32 -> bf16 instead of
# rounding: they get a larger factor.
LOWP_FACTOR = {"cpu": 2.0, "triton": 3.0 if torch.cuda.is_available() else 4.0, "cuda": 3.0}


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        simt = name == "cuda" and SIMT
        for N, D, V in _shapes(name):
            for eps in SMOOTHING:
                for reduction in REDUCTIONS:
                    for has_bias in (True, False):
                        if (name == "triton" or N > 1000) and eps == 1.0:
                            continue
                        if N > 1000 and eps == 0.0 and reduction != "mean":
                            continue
                        if (name == "triton" or simt) and not has_bias and reduction != "mean":
                            continue
                        if simt and V != 7 and (eps, reduction, has_bias) not in SIMT_COMBOS:
                            continue
                        yield pytest.param(
                            name, (N, D, V), eps, reduction, has_bias, marks=backend.marks,
                            id=f"{name}-{N}x{D}x{V}-ls{eps}-{reduction}-{'bias' if has_bias else 'nobias'}")


def _inputs(N, D, V, has_bias, device, lead=None):
    """hidden (lead or N, D), weight (V, D), bias (V,) scaled so logits are O(1..3); every third
    target ignored."""
    gen = torch.Generator().manual_seed(N * 7919 + D * 31 + V)
    shape = lead if lead is not None else (N,)
    hidden = torch.randn(*shape, D, generator=gen)
    weight = 2.0 * torch.randn(V, D, generator=gen) / D ** 0.5
    bias = torch.randn(V, generator=gen) if has_bias else None
    target = torch.randint(0, V, shape, generator=gen)
    target.view(-1)[1::3] = -100
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(hidden), move(weight), move(bias), move(target)


def _upstream(reduction, shape, device):
    """A non-uniform per-row gradient for none; 1 (loss.backward()) for mean; 0.37 for sum."""
    if reduction == "none":
        return torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(device)
    return torch.tensor(1.0 if reduction == "mean" else 0.37, device=device)


def _loss_and_grads(fn, inputs, upstream):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    loss = fn(*leaves)
    present = [leaf for leaf in leaves if leaf is not None]
    grads = iter(torch.autograd.grad(loss, present, upstream.to(loss.dtype)))
    named = {n: next(grads) for n, leaf in zip(INPUT_NAMES, leaves) if leaf is not None}
    return loss.detach(), named


def _kernel_fn(backend, target, **kwargs):
    def fn(h, w, b):
        with fastformer.use_backend(backend):
            return linear_cross_entropy(h, w, target, linear_bias=b, **kwargs)
    return fn


def _reference_fn(target, **kwargs):
    return lambda h, w, b: reference.linear_cross_entropy(h, w, target, linear_bias=b, **kwargs)


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", SMOOTHING)
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("lead", [(9,), (2, 5), ()])
def test_reference_matches_torch(lead, has_bias, eps, reduction):
    h, w, b, t = _inputs(9, 12, 17, has_bias, "cpu", lead=lead)
    h, w, b = (None if a is None else a.double() for a in (h, w, b))
    kwargs = dict(label_smoothing=eps, reduction=reduction)
    up = _upstream(reduction, t.shape, "cpu").double()

    def torch_version(h, w, b):
        logits = F.linear(h, w, b)  # (..., V)
        return F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), **kwargs).reshape(
            t.shape if reduction == "none" else ())

    ref_loss, ref_grads = _loss_and_grads(_reference_fn(t, **kwargs), (h, w, b), up)
    want_loss, want_grads = _loss_and_grads(torch_version, (h, w, b), up)
    assert_close("loss", ref_loss, want_loss, atol=1e-6, rtol=1e-6)  # the reference works in fp32
    for name in want_grads:
        assert_close(f"d{name}", ref_grads[name], want_grads[name], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,shape,eps,reduction,has_bias", list(_cases()))
def test_fp32_loss_and_every_gradient(backend, shape, eps, reduction, has_bias):
    device = device_for(backend)
    h, w, b, t = _inputs(*shape, has_bias, device)
    up = _upstream(reduction, t.shape, device)
    kwargs = dict(label_smoothing=eps, reduction=reduction)
    loss, grads = _loss_and_grads(_kernel_fn(backend, t, **kwargs), (h, w, b), up)
    ref_loss, ref_grads = _loss_and_grads(_reference_fn(t, **kwargs), (h, w, b), up)
    assert loss.dtype == torch.float32
    assert_close("loss", loss, ref_loss, *FP32_TOL[backend]["loss"])
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert grads[name].dtype == torch.float32
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@pytest.mark.parametrize("backend,shape,eps,reduction,has_bias", list(_cases()))
def test_bf16_loss_and_every_gradient(backend, shape, eps, reduction, has_bias):
    device = device_for(backend)
    inputs = [None if a is None else a.to(torch.bfloat16) for a in _inputs(*shape, has_bias, device)[:3]]
    t = _inputs(*shape, has_bias, device)[3]
    up = _upstream(reduction, t.shape, device)
    kwargs = dict(label_smoothing=eps, reduction=reduction)
    loss, grads = _loss_and_grads(_kernel_fn(backend, t, **kwargs), inputs, up)
    lp_loss, lp_grads = _loss_and_grads(_reference_fn(t, **kwargs), inputs, up)
    ref_loss, ref_grads = _loss_and_grads(_reference_fn(t, **kwargs),
                                          [None if a is None else a.float() for a in inputs], up)
    factor = LOWP_FACTOR[backend]
    assert loss.dtype == torch.bfloat16
    assert_close_lowp("loss", loss, ref_loss, lp_loss, factor=factor)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert grads[name].dtype == torch.bfloat16
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name], factor=factor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_only_some_inputs_requiring_grad(backend):
    device = device_for(backend)
    h, w, b, t = _inputs(6, 16, 30, True, device, lead=(2, 3))
    for reduction in REDUCTIONS:
        kwargs = dict(label_smoothing=0.1, reduction=reduction)
        w_leaf = w.clone().requires_grad_()
        with fastformer.use_backend(backend):
            loss = linear_cross_entropy(h, w_leaf, t, linear_bias=b, **kwargs)
        ref = reference.linear_cross_entropy(h, w, t, linear_bias=b, **kwargs)
        assert loss.shape == ref.shape == (t.shape if reduction == "none" else ())
        assert_close("loss", loss.detach(), ref, atol=1e-5, rtol=1e-5)
        up = _upstream(reduction, t.shape, device)
        (dw,) = torch.autograd.grad(loss, w_leaf, up)
        w_ref = w.clone().requires_grad_()
        (dw_ref,) = torch.autograd.grad(reference.linear_cross_entropy(h, w_ref, t, linear_bias=b, **kwargs), w_ref, up)
        assert_close("dweight", dw, dw_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored_gives_what_torch_gives(backend):
    device = device_for(backend)
    h, w, b, _ = _inputs(5, 8, 11, True, device)
    t = torch.full((5,), -100, device=device)
    for reduction in REDUCTIONS:
        leaves = [a.clone().requires_grad_() for a in (h, w, b)]
        with fastformer.use_backend(backend):
            loss = linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], label_smoothing=0.1,
                                            reduction=reduction)
        want = F.cross_entropy(F.linear(h, w, b), t, label_smoothing=0.1, reduction=reduction)
        assert torch.equal(loss.isnan(), want.isnan()) and torch.equal(loss.nan_to_num(), want.nan_to_num())
        up = torch.ones_like(loss)
        for name, g in zip(INPUT_NAMES, torch.autograd.grad(loss, leaves, up)):
            assert torch.equal(g, torch.zeros_like(g)), f"d{name} must be 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_returns_empty_gradients_without_compute_grad(backend):
    device = device_for(backend)
    h, w, b, t = _inputs(7, 16, 20, True, device)
    loss, dh, dw, db = backends.Kernels(backend).linear_cross_entropy_fwd(h, w, b, t, 0.1, -100, 1, False)
    assert dh.numel() == dw.numel() == db.numel() == 0
    assert_close("loss", loss, reference.linear_cross_entropy(h, w, t, linear_bias=b, label_smoothing=0.1),
                 atol=1e-5, rtol=1e-5)
    _, _, _, db = backends.Kernels(backend).linear_cross_entropy_fwd(h, w, None, t, 0.1, -100, 2, True)
    assert db.numel() == 0


# ---------------------------------------------------------------- gradcheck, opcheck


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, eps, has_bias, reduction):
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    h, w = make(6, 5), make(9, 5)
    b = make(9) if has_bias else None
    t = torch.tensor([0, 8, -100, 3, 3, 1])

    def fn(h, w, b):
        with fastformer.use_backend(backend):
            return linear_cross_entropy(h, w, t, linear_bias=b, label_smoothing=eps, reduction=reduction)

    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    h, w, b, t = (a if a.dtype == torch.int64 else a.to(dtype) for a in _inputs(11, 8, 37, True, "cpu"))
    for bias in (b, None):
        for reduction, compute_grad in ((0, False), (1, False), (1, True), (2, True)):
            torch.library.opcheck(ops.linear_cross_entropy_fwd.default,
                                  (h, w, bias, t, 0.1, -100, reduction, compute_grad))
        grad_loss = torch.randn(11)
        torch.library.opcheck(ops.linear_cross_entropy_bwd.default, (grad_loss, h, w, bias, t, 0.1, -100))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend)
    h, w, b, t = _inputs(4, 8, 10, True, device)
    t = torch.tensor([0, 1, 9, -100], device=device)
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match=r"target values must be in \[0, 10\)"):
            linear_cross_entropy(h, w, torch.tensor([0, 10, 1, 2], device=device), linear_bias=b)
        with pytest.raises(TypeError, match="target must hold class indices as int64"):
            linear_cross_entropy(h, w, t.int(), linear_bias=b)
        with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
            linear_cross_entropy(h, w, t[:2], linear_bias=b)
        with pytest.raises(ValueError, match="input's last dimension must equal linear_weight.shape"):
            linear_cross_entropy(h[:, :7], w, t, linear_bias=b)
        with pytest.raises(ValueError, match=r"linear_bias must have shape \(10,\)"):
            linear_cross_entropy(h, w, t, linear_bias=b[:9])
        with pytest.raises(TypeError, match="linear_weight has dtype"):
            linear_cross_entropy(h, w.double(), t, linear_bias=None)
        with pytest.raises(ValueError, match="reduction must be one of"):
            linear_cross_entropy(h, w, t, linear_bias=b, reduction="batchmean")
        with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\]"):
            linear_cross_entropy(h, w, t, linear_bias=b, label_smoothing=2.0)
        with pytest.raises(ValueError, match="linear_weight must have 2 dimensions"):
            linear_cross_entropy(h, w[0], t, linear_bias=b)


@pytest.mark.parametrize("backend", CPU + CUDA)
def test_kernel_checks_name_the_argument(backend):
    """The cpu and the cuda glue, called directly, name what is wrong; each its own dtypes."""
    kern = backends.Kernels(backend)
    device = device_for(backend)
    h, w, b, t = _inputs(4, 8, 10, True, device)
    t = torch.tensor([0, 1, 9, -100], device=device)
    g = torch.randn(4, device=device)
    out_of_range = torch.tensor([0, 1, 10, 2], device=device)
    fwd_cases = [
        ((h[0], w, b, t, 0.0, -100, 1, False), "hidden must have 2 dimensions"),
        ((torch.randn(8, 4, device=device).t(), w, b, t, 0.0, -100, 1, False), "hidden must be contiguous"),
        ((h, w[:, :7].contiguous(), b, t, 0.0, -100, 1, False), r"weight must have shape \(V, 8\)"),
        ((h, w, b[:9], t, 0.0, -100, 1, False), r"bias must have shape \(10,\)"),
        ((h, w, b, t[:3], 0.0, -100, 1, False), r"target must have shape \(4,\)"),
        ((h, w, b, t.int(), 0.0, -100, 1, False), "target must be int64"),
        ((h, w, b, t, 0.0, -100, 7, False), r"reduction must be 0 \(none\), 1 \(mean\) or 2 \(sum\)"),
        ((h, w, b, t, 1.01, -100, 1, False), r"label_smoothing must be in \[0, 1\]"),
        ((h, w, b, t, 0.0, -100, 0, True), "compute_grad needs reduction mean"),
    ]
    bwd_cases = [
        ((g[:3], h, w, b, t, 0.0, -100), r"grad_loss must have shape \(4,\)"),
        ((g.long(), h, w, b, t, 0.0, -100), "grad_loss must be a floating-point tensor"),
        ((g, h, w[:, :7].contiguous(), b, t, 0.0, -100), r"weight must have shape \(V, 8\)"),
    ]
    if backend == "cpu":
        fwd_cases += [
            ((h.long(), w, b, t, 0.0, -100, 1, False), "hidden must be float32, float64 or bfloat16"),
            ((h, w.double(), b, t, 0.0, -100, 1, False), "weight has dtype"),
            ((h, w, b.double(), t, 0.0, -100, 1, False), "bias has dtype"),
            ((h, w, b, out_of_range, 0.0, -100, 1, False), r"target\[2\] = 10 is out of range"),
        ]
        bwd_cases += [((g, h, w, b, out_of_range, 0.0, -100), r"target\[2\] = 10 is out of range")]
    else:
        fwd_cases += [
            ((h.double(), w.double(), None, t, 0.0, -100, 1, False), "hidden must be float32, float16 or bfloat16"),
            ((h, w.half(), b, t, 0.0, -100, 1, False), "weight has dtype"),
        ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.linear_cross_entropy_fwd(*args)
    for args, message in bwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.linear_cross_entropy_bwd(*args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ("none", "mean"))
def test_nan_in_hidden_propagates_as_in_the_reference(backend, reduction):
    """A NaN in one row of hidden makes that row's loss NaN (and the mean NaN), its dhidden row
    NaN and dweight/dbias NaN, as in the reference: the fused kernel never hides it."""
    device = device_for(backend)
    hidden, weight, bias, target = _inputs(7, 24, 37, True, device)
    target = target.clone()
    target[2] = 5  # a row that is not ignored
    hidden = hidden.clone()
    hidden[2, 11] = float("nan")
    up = _upstream(reduction, target.shape, device)
    loss, grads = _loss_and_grads(_kernel_fn(backend, target, label_smoothing=0.1, reduction=reduction),
                                  (hidden, weight, bias), up)
    want, want_grads = _loss_and_grads(_reference_fn(target, label_smoothing=0.1, reduction=reduction),
                                       (hidden, weight, bias), up)
    assert want.isnan().any(), "the probe must give a NaN loss"
    torch.testing.assert_close(loss, want, equal_nan=True, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        assert torch.equal(grad.isnan(), want_grads[name].isnan()), f"{name}: NaN positions differ"


# ---------------------------------------------------------------- the cuda backend's own checks


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_several_chunks(backend):
    """257 rows of 16400 fp32 logits are two chunks (256 rows, then 1): the loss rows, dhidden
    rows, dweight and the dbias column sums of both chunks add up (dbias through the accumulating
    two-stage column sum), for the fused mean gradient and for reduction none's backward."""
    device = device_for(backend)
    h, w, b, t = _inputs(257, 4, 16400, True, device)
    kern = backends.Kernels(backend)
    loss, dh, dw, db = kern.linear_cross_entropy_fwd(h, w, b, t, 0.1, -100, 1, True)
    one = torch.tensor(1.0, device=device)
    ref_loss, ref = _loss_and_grads(_reference_fn(t, label_smoothing=0.1), (h, w, b), one)
    assert_close("loss", loss, ref_loss, *FP32_TOL[backend]["loss"])
    for name, got in zip(INPUT_NAMES, (dh, dw, db)):
        assert_close(f"d{name}", got, ref[name], *FP32_TOL[backend]["grad"])
    up = _upstream("none", t.shape, device)
    dh, dw, db = kern.linear_cross_entropy_bwd(up, h, w, b, t, 0.1, -100)
    _, ref = _loss_and_grads(_reference_fn(t, label_smoothing=0.1, reduction="none"), (h, w, b), up)
    for name, got in zip(INPUT_NAMES, (dh, dw, db)):
        assert_close(f"d{name}", got, ref[name], *FP32_TOL[backend]["grad"])


# The harness has no device memory unless a test models some: the glue then sizes chunks by the
# CPU rule; with memory modelled it takes a GPU's rule (linear_cross_entropy_device_chunk_rows).
HARNESS_ONLY = pytest.mark.skipif(not SIMT, reason="the SIMT harness's modelled device (a GPU has its own)")


@pytest.fixture
def free_memory():
    """set(bytes): the harness's modelled free device memory for the rest of the test (a GPU has
    its own: nothing to set there)."""
    if not SIMT:
        yield lambda _bytes: None
        return
    ops = torch.ops.fastformer_simt_selftest
    previous = ops.set_free_memory(-1)
    yield ops.set_free_memory
    ops.set_free_memory(previous)


@HARNESS_ONLY
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_chunks_are_sized_for_the_device(backend):
    """4096 rows where memory allows (V 32k or 128k in bf16 on an 80 GB GPU); fewer, in multiples
    of 64, when the (rows, V) logits would pass 1/8 of the free memory; never under 256 rows or
    over n."""
    rows = torch.ops.fastformer_simt_selftest.lce_device_chunk_rows
    assert rows(100_000, 32_000, 2, 80 << 30) == 4096
    assert rows(100_000, 128_256, 2, 80 << 30) == 4096
    assert rows(100_000, 32_000, 2, 1 << 30) == 2048  # 2^30 / 8 / 64000 = 2097 rows
    assert rows(100_000, 32_000, 4, 1 << 30) == 1024  # fp32: twice the bytes a row
    assert rows(100_000, 32_000, 2, 0) == 256
    assert rows(1000, 32_000, 2, 80 << 30) == 1000
    assert rows(100, 32_000, 2, 0) == 100


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_bf16_dweight_accumulates_in_fp32_across_chunks(backend, free_memory):
    """16 chunks, bf16: of 256 rows on the harness (no spare device memory modelled: the GPU
    rule's smallest chunks), of 4096 on a GPU (there through cuBLAS's fp32-output GEMM). Chunk
    2j + 1 repeats chunk 2j's rows with upstream gradient -3/4 instead of 1, so each pair adds
    only a quarter of either partial product; weight 0 and V = 64 make every dlogits value
    (1/64 - onehot) * g exact in bf16, so the reference's only error is dweight's final rounding.
    Rounding each chunk's (V, D) product to bf16 before adding it (the old scheme, also computed
    here) errs ~3x as much and breaks FlashAttention's 2x bound; accumulating in fp32 inside the
    GEMM keeps it."""
    free_memory(0)
    device = device_for(backend)
    chunk, pairs, D, V = 256 if SIMT else 4096, 8, 32, 64
    gen = torch.Generator().manual_seed(21)
    h = torch.randn(pairs, chunk, D, generator=gen).to(torch.bfloat16)
    t = torch.randint(0, V, (pairs, chunk), generator=gen)
    hidden = torch.stack([h, h], 1).reshape(-1, D).to(device)  # (16 chunk, D): 2j and 2j + 1 equal
    target = torch.stack([t, t], 1).reshape(-1).to(device)
    up = torch.tensor([1.0, -0.75]).repeat_interleave(chunk).repeat(pairs).to(device)  # (16 chunk,)
    weight = torch.zeros(V, D, dtype=torch.bfloat16, device=device)
    kern = backends.Kernels(backend)
    _, dw, _ = kern.linear_cross_entropy_bwd(up, hidden, weight, None, target, 0.0, -100)

    def reference_dw(dtype):
        w = weight.to(dtype).requires_grad_()
        loss = reference.linear_cross_entropy(hidden.to(dtype), w, target, reduction="none")
        return torch.autograd.grad(loss, w, up.to(dtype))[0]

    ref, lowp = reference_dw(torch.float32), reference_dw(torch.bfloat16)
    assert dw.dtype == torch.bfloat16
    assert_close_lowp("dweight", dw, ref, lowp, factor=2.0)
    dlogits = up[:, None] * (1 / V - F.one_hot(target, V).float())  # exact in bf16
    old = sum(torch.mm(dlogits[k:k + chunk].t().bfloat16(), hidden[k:k + chunk]).float()
              for k in range(0, len(target), chunk)).bfloat16()
    assert max_err(old, ref) > 2.0 * max_err(lowp, ref) + 1e-5, "the test no longer tells the schemes apart"


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_float16_and_determinism(backend):
    """fp16 (CUDA only) follows the low-precision rule; two runs agree bit for bit."""
    device = device_for(backend)
    h, w, b, t = _inputs(37, 24, 531, True, device)
    half = [a.half() for a in (h, w, b)]
    kern = backends.Kernels(backend)
    out = kern.linear_cross_entropy_fwd(*half, t, 0.1, -100, 1, True)
    one = torch.tensor(1.0, device=device)
    lp_loss, lp = _loss_and_grads(_reference_fn(t, label_smoothing=0.1), half, one)
    ref_loss, ref = _loss_and_grads(_reference_fn(t, label_smoothing=0.1), (h, w, b), one)
    assert all(a.dtype == torch.float16 for a in out)
    assert_close_lowp("loss", out[0], ref_loss, lp_loss, factor=LOWP_FACTOR[backend])
    for name, got in zip(INPUT_NAMES, out[1:]):
        assert_close_lowp(f"d{name}", got, ref[name], lp[name], factor=LOWP_FACTOR[backend])
    again = kern.linear_cross_entropy_fwd(*half, t, 0.1, -100, 1, True)
    for name, a, c in zip(("loss",) + INPUT_NAMES, out, again):
        assert torch.equal(a, c), f"{name} differs between two runs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_no_grad_loss_is_the_reference_loss(backend, reduction):
    """Under no_grad (evaluation) no gradient is computed or kept; the loss must not change."""
    hidden, weight, bias, target = _inputs(37, 48, 1023, True, device_for(backend))
    for t in (hidden, weight, bias):
        t.requires_grad_(True)
    with torch.no_grad(), fastformer.use_backend(backend):
        loss = linear_cross_entropy(hidden, weight, target, linear_bias=bias, label_smoothing=0.1, reduction=reduction)
    assert not loss.requires_grad and loss.grad_fn is None
    ref = reference.linear_cross_entropy(hidden.detach(), weight.detach(), target, linear_bias=bias.detach(),
                                         label_smoothing=0.1, reduction=reduction)
    assert_close("loss", loss, ref, 1e-5, 1e-5)


@pytest.mark.parametrize("backend", ["reference"] + CPU)
@pytest.mark.parametrize("kwargs", [dict(label_smoothing=0.1, reduction="sum"), dict(ignore_index=None),
                                    dict(ignore_index=3, reduction="none")])
def test_takes_torchs_own_call(backend, kwargs):
    """A call written for torch's F.linear_cross_entropy (argument order, linear_bias=, ignore_index=None
    for "ignore nothing") gives torch's loss and gradients."""
    h, w, b, t = _inputs(6, 8, 10, True, "cpu")
    t = t.clamp(min=0)  # torch rejects -100 with ignore_index=None
    t[1] = 3
    leaves = [x.detach().double().requires_grad_(True) for x in (h, w, b)]
    want = F.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], **kwargs)
    want_grads = torch.autograd.grad(want.sum(), leaves)
    mine = [x.detach().requires_grad_(True) for x in (h, w, b)]
    with fastformer.use_backend(backend):
        got = linear_cross_entropy(mine[0], mine[1], t, linear_bias=mine[2], **kwargs)
    got_grads = torch.autograd.grad(got.sum(), mine)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for name, g, r in zip(("input", "linear_weight", "linear_bias"), got_grads, want_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
