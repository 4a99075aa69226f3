"""cross_entropy: the reference against F.cross_entropy, then every kernel backend against the
reference (loss and gradient, every reduction, smoothing, ignore_index), gradcheck, opcheck,
determinism, bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends
from fastformer.ops import cross_entropy, reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
CUDA = kernel_backends("cuda")
REDUCTIONS = ("none", "mean", "sum")
REDUCTION_CODE = {"none": 0, "mean": 1, "sum": 2}
SMOOTHING = (0.0, 0.1, 1.0)

# (N, V): rows 1, 7, 113, round; classes 1, 7, 1023, 8000 (odd, not powers of two).
SHAPES = [(1, 1), (7, 7), (113, 1023), (7, 8000), (1, 8000), (113, 1), (64, 256)]
# The Triton interpreter is slow: a subset keeps its part of this file short.
TRITON_SHAPES = [(7, 7), (113, 1023), (1, 8000)]
# The cuda backend without a GPU runs in the SIMT harness (host threads): a subset, odd sizes kept;
# every (smoothing, reduction) on the small shapes, these on the large ones.
SIMT_SHAPES = [(1, 1), (7, 7), (113, 1023), (7, 8000)]
SIMT_COMBOS = {(0.0, "none"), (0.1, "mean"), (1.0, "sum")}


def _shapes(name):
    if name == "triton":
        return TRITON_SHAPES
    if name == "cuda" and _simt():
        return SIMT_SHAPES
    return SHAPES


def _simt():
    """The cuda backend runs on the SIMT harness (CPU tensors) where there is no GPU."""
    return not torch.cuda.is_available()


# fp32 (atol, rtol) per backend for the loss and for the gradient.
FP32_TOL = {
    "cpu": {"loss": (1e-5, 1e-5), "grad": (1e-6, 1e-4)},
    "triton": {"loss": (1e-5, 1e-5), "grad": (1e-6, 1e-4)},
    "cuda": {"loss": (1e-5, 1e-5), "grad": (1e-6, 1e-4)},
}
# bf16: kernel error <= factor x the bf16 reference's error (FlashAttention's rule). The saved
# bf16 gradient times a non-unit upstream gradient is rounded twice (the reference rounds once),
# and Triton's interpreter truncates fp32 -> bf16 instead of rounding: both get a factor 3.
LOWP_FACTOR = {"cpu": 3.0, "triton": 3.0 if torch.cuda.is_available() else 4.0, "cuda": 3.0}


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for N, V in _shapes(name):
            for eps in SMOOTHING:
                for reduction in REDUCTIONS:
                    if name == "cuda" and _simt() and N * V > 100 and (eps, reduction) not in SIMT_COMBOS:
                        continue
                    yield pytest.param(name, N, V, eps, reduction, marks=backend.marks,
                                       id=f"{name}-{N}x{V}-ls{eps}-{reduction}")


def _inputs(N, V, device, ignore_index=-100):
    """Logits with a wide range and targets with every third row ignored."""
    gen = torch.Generator().manual_seed(N * 10007 + V)
    x = 3.0 * torch.randn(N, V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[1::3] = ignore_index
    return x.to(device), t.to(device)


def _upstream(reduction, N, device):
    """A non-uniform per-row gradient for none; 1 (loss.backward()) for mean; 0.37 for sum."""
    if reduction == "none":
        return torch.randn(N, generator=torch.Generator().manual_seed(7)).to(device)
    return torch.tensor(1.0 if reduction == "mean" else 0.37, device=device)


def _loss_and_grad(fn, x, upstream):
    leaf = x.detach().clone().requires_grad_()
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf, upstream.to(loss.dtype))
    return loss.detach(), grad


def _kernel_loss_and_grad(backend, x, t, upstream, **kwargs):
    """``_loss_and_grad`` of ``cross_entropy(x, t, **kwargs)`` on ``backend``."""
    def kernel(a):
        with fastformer.use_backend(backend):
            return cross_entropy(a, t, **kwargs)
    return _loss_and_grad(kernel, x, upstream)


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", SMOOTHING)
@pytest.mark.parametrize("shape", [(9, 13), (13,), (4, 13, 5), (3, 13, 2, 3)])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_reference_matches_torch(shape, eps, reduction, ignore_index):
    """(N, C), (C,) and (N, C, d...) layouts; ignore_index outside and inside [0, C)."""
    x = 2.0 * torch.randn(shape, dtype=torch.float64)
    t_shape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, shape[1] if len(shape) > 1 else shape[0], t_shape)
    if t.dim() > 0:
        t.view(-1)[::4] = ignore_index
    kwargs = dict(label_smoothing=eps, ignore_index=ignore_index, reduction=reduction)
    up = torch.randn(t_shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
    ref_loss, ref_grad = _loss_and_grad(lambda a: reference.cross_entropy(a, t, **kwargs), x, up)
    torch_loss, torch_grad = _loss_and_grad(lambda a: F.cross_entropy(a, t, **kwargs), x, up)
    assert_close("loss", ref_loss, torch_loss, atol=1e-6, rtol=1e-6)  # the reference works in fp32
    assert_close("grad", ref_grad, torch_grad, atol=1e-6, rtol=1e-5)


def test_reference_all_rows_ignored_is_torch():
    x, t = torch.randn(5, 7), torch.full((5,), -100)
    for eps in (0.0, 0.1):
        for reduction in REDUCTIONS:
            kwargs = dict(label_smoothing=eps, reduction=reduction)
            ref = reference.cross_entropy(x, t, **kwargs)
            want = F.cross_entropy(x, t, **kwargs)
            assert torch.equal(ref.isnan(), want.isnan())
            assert_close("loss", ref.nan_to_num(), want.nan_to_num(), atol=0, rtol=0)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,N,V,eps,reduction", list(_cases()))
def test_fp32_loss_and_gradient(backend, N, V, eps, reduction):
    device = device_for(backend)
    x, t = _inputs(N, V, device)
    up = _upstream(reduction, N, device)
    kwargs = dict(label_smoothing=eps, reduction=reduction)

    loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
    ref_loss, ref_grad = _loss_and_grad(lambda a: reference.cross_entropy(a, t, **kwargs), x, up)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    assert_close("loss", loss, ref_loss, *FP32_TOL[backend]["loss"])
    assert_close("grad", grad, ref_grad, *FP32_TOL[backend]["grad"])
    assert torch.equal(grad[1::3], torch.zeros_like(grad[1::3])), "ignored rows get no gradient"


@pytest.mark.parametrize("backend,N,V,eps,reduction", list(_cases()))
def test_bf16_loss_and_gradient(backend, N, V, eps, reduction):
    device = device_for(backend)
    x, t = _inputs(N, V, device)
    x = x.to(torch.bfloat16)
    up = _upstream(reduction, N, device)
    kwargs = dict(label_smoothing=eps, reduction=reduction)

    def ref(a):
        return reference.cross_entropy(a, t, **kwargs)

    loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
    lp_loss, lp_grad = _loss_and_grad(ref, x, up)
    ref_loss, ref_grad = _loss_and_grad(ref, x.float(), up)
    assert loss.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
    factor = LOWP_FACTOR[backend]
    assert_close_lowp("loss", loss, ref_loss, lp_loss, factor=factor)
    assert_close_lowp("grad", grad, ref_grad, lp_grad, factor=factor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(13,), (4, 13, 5), (2, 13, 3, 2)])
def test_class_dim_layouts_match_torch(backend, shape):
    """(C,) and (N, C, d...) go through the kernels as (M, C) rows, then back to torch's shape."""
    device = device_for(backend)
    x = 2.0 * torch.randn(shape, device=device)
    t_shape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, 13, t_shape, device=device)
    for reduction in REDUCTIONS:
        kwargs = dict(label_smoothing=0.1, reduction=reduction)
        up = torch.randn(t_shape, device=device) if reduction == "none" else torch.tensor(1.0, device=device)

        loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
        want_loss, want_grad = _loss_and_grad(lambda a: F.cross_entropy(a, t, **kwargs), x, up)
        assert loss.shape == want_loss.shape
        assert_close("loss", loss, want_loss, atol=1e-5, rtol=1e-5)
        assert_close("grad", grad, want_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_inside_the_class_range(backend):
    device = device_for(backend)
    x = torch.randn(10, 6, device=device)
    t = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 2, 1], device=device)
    for reduction in REDUCTIONS:
        kwargs = dict(label_smoothing=0.1, ignore_index=0, reduction=reduction)
        up = torch.ones(10, device=device) if reduction == "none" else torch.tensor(1.0, device=device)

        loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
        want_loss, want_grad = _loss_and_grad(lambda a: F.cross_entropy(a, t, **kwargs), x, up)
        assert_close("loss", loss, want_loss, atol=1e-5, rtol=1e-5)
        assert_close("grad", grad, want_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored_gives_what_torch_gives(backend):
    """mean over no rows is nan (0 / 0) as in torch; sum is 0; the gradient is 0, never nan."""
    device = device_for(backend)
    x, t = torch.randn(4, 9, device=device), torch.full((4,), -100, device=device)
    for eps in (0.0, 0.1):
        for reduction in REDUCTIONS:
            kwargs = dict(label_smoothing=eps, reduction=reduction)
            up = torch.ones(4, device=device) if reduction == "none" else torch.tensor(1.0, device=device)

            loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
            want = F.cross_entropy(x, t, **kwargs)
            assert torch.equal(loss.isnan(), want.isnan()), f"{reduction}: {loss} vs torch {want}"
            assert torch.equal(loss.nan_to_num(), want.nan_to_num())
            assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", (0.0, 0.1))
@pytest.mark.parametrize("reduction", ("none", "sum"))
def test_non_finite_logits_propagate_as_in_the_reference(backend, eps, reduction):
    """A NaN or +inf logit, or a row of only -inf, gives NaN (never a finite or -inf loss that a
    user's NaN check would miss); a -inf logit elsewhere gives what the reference gives."""
    device = device_for(backend)
    x = torch.randn(6, 37, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([4, 9, 0, 11, 20, 36])
    x[0, 5] = float("nan")     # NaN off the target
    x[1, 2] = float("inf")     # +inf
    x[2, :] = float("-inf")    # no finite logit at all
    x[3, 11] = float("-inf")   # -inf at the target: infinite loss, finite gradient
    x[4, 30] = float("-inf")   # -inf elsewhere: finite loss without smoothing
    x, t = x.to(device), t.to(device)
    up = torch.ones(6, device=device) if reduction == "none" else torch.tensor(1.0, device=device)
    kwargs = dict(label_smoothing=eps, reduction=reduction)

    loss, grad = _kernel_loss_and_grad(backend, x, t, up, **kwargs)
    want_loss, want_grad = _loss_and_grad(lambda a: reference.cross_entropy(a, t, **kwargs), x, up)
    assert want_loss.isnan().any(), "the probe must contain a NaN loss"
    torch.testing.assert_close(loss, want_loss, equal_nan=True, atol=1e-5, rtol=1e-5)
    if reduction == "none":  # per row: the NaN rows' whole gradient is NaN, the others match
        torch.testing.assert_close(grad, want_grad, equal_nan=True, atol=1e-6, rtol=1e-4)
    else:  # the sum is NaN, and so is every gradient row that fed a NaN
        assert grad[:3].isnan().all() and want_grad[:3].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_stay_finite(backend):
    device = device_for(backend)
    x = torch.tensor([[1e4, -1e4, 0.0, 3.0], [-1e4, -1e4, -1e4, -1e4 + 1]], device=device)
    t = torch.tensor([1, 3], device=device)
    with fastformer.use_backend(backend):
        loss = cross_entropy(x, t, label_smoothing=0.1, reduction="none")
    assert_close("loss", loss, F.cross_entropy(x, t, label_smoothing=0.1, reduction="none"),
                 atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_computed_without_requires_grad(backend):
    device = device_for(backend)
    x, t = _inputs(7, 33, device)
    loss, grad = backends.Kernels(backend).cross_entropy_fwd(x, t, 0.1, -100, 1, False)
    assert grad.numel() == 0
    assert_close("loss", loss, reference.cross_entropy(x, t, label_smoothing=0.1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU)
def test_unit_upstream_gradient_and_retained_graph(backend):
    """loss.backward() hands out the stored gradient; a second backward through a retained
    graph still sees it unchanged, and a scaled upstream gradient scales it."""
    x, t = _inputs(9, 50, "cpu")
    x.requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(x, t, label_smoothing=0.1), x)[0]
    with fastformer.use_backend(backend):
        loss = cross_entropy(x, t, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    assert_close("grad", x.grad, want, atol=1e-6, rtol=1e-4)
    loss.backward(retain_graph=True)
    assert_close("grad x2", x.grad, 2 * want, atol=1e-6, rtol=1e-4)
    (3 * loss).backward()
    assert_close("grad x5", x.grad, 5 * want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", CPU)
def test_reduction_is_deterministic_across_thread_counts(backend):
    x, t = _inputs(513, 1000, "cpu")
    kern = backends.Kernels(backend)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [kern.cross_entropy_fwd(x, t, 0.1, -100, r, True) for r in (1, 2)]
        torch.set_num_threads(max(2, threads))
        many = [kern.cross_entropy_fwd(x, t, 0.1, -100, r, True) for r in (1, 2)]
    finally:
        torch.set_num_threads(threads)
    for (l1, g1), (l2, g2) in zip(one, many):
        assert torch.equal(l1, l2) and torch.equal(g1, g2)


# ---------------------------------------------------------------- gradcheck, opcheck


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, eps, reduction):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    x3 = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, -100, 3, 3, 1])
    t3 = torch.tensor([[0, 4, -100], [2, 2, 1]])

    def fn(a, b):
        with fastformer.use_backend(backend):
            kwargs = dict(label_smoothing=eps, reduction=reduction)
            return cross_entropy(a, t, **kwargs), cross_entropy(b, t3, **kwargs)

    assert torch.autograd.gradcheck(fn, (x, x3), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    x, t = _inputs(11, 37, "cpu")
    x = x.to(dtype)
    for reduction in (0, 1, 2):
        for compute_grad in (False, True):
            torch.library.opcheck(torch.ops.fastformer.cross_entropy_fwd.default,
                                  (x, t, 0.1, -100, reduction, compute_grad))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend)
    x, t = torch.randn(4, 8, device=device), torch.tensor([0, 1, 7, -100], device=device)
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match=r"target values must be in \[0, 8\)"):
            cross_entropy(x, torch.tensor([0, 1, 8, 2], device=device))
        with pytest.raises(ValueError, match=r"target values must be in \[0, 8\)"):
            cross_entropy(x, torch.tensor([0, -1, 2, 2], device=device))
        with pytest.raises(TypeError, match="target must hold class indices as int64"):
            cross_entropy(x, t.int())
        with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
            cross_entropy(x, t[:3])
        with pytest.raises(ValueError, match="reduction must be one of"):
            cross_entropy(x, t, reduction="avg")
        for eps in (-0.1, 1.5):
            with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\]"):
                cross_entropy(x, t, label_smoothing=eps)
        with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
            cross_entropy(x.long(), t)
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            cross_entropy(x, t, ignore_index=1.5)


@pytest.mark.parametrize("backend", CPU)
def test_cpu_kernel_checks_name_the_argument(backend):
    kern = backends.Kernels(backend)
    x, t = torch.randn(4, 8), torch.tensor([0, 1, 7, -100])
    cases = [
        ((torch.randn(32), t, 0.0, -100, 1, False), "logits must have 2 dimensions"),
        ((x.long(), t, 0.0, -100, 1, False), "logits must be float32, float64 or bfloat16"),
        ((x.half(), t, 0.0, -100, 1, False), "logits must be float32, float64 or bfloat16"),
        ((torch.randn(8, 4).t(), t, 0.0, -100, 1, False), "logits must be contiguous"),
        ((torch.randn(4, 0), t, 0.0, -100, 1, False), "logits must have at least one class"),
        ((x, t.int(), 0.0, -100, 1, False), "target must be int64"),
        ((x, t[:3], 0.0, -100, 1, False), r"target must have shape \(4,\)"),
        ((x, torch.tensor([0, 1, 8, 2]), 0.0, -100, 1, False), r"target\[2\] = 8 is out of range"),
        ((x, torch.tensor([0, -5, 1, 2]), 0.0, -100, 1, False), r"target\[1\] = -5 is out of range"),
        ((x, t, 0.0, -100, 3, False), "reduction must be 0 \\(none\\), 1 \\(mean\\) or 2 \\(sum\\)"),
        ((x, t, 1.5, -100, 1, False), r"label_smoothing must be in \[0, 1\]"),
        ((x, t, -0.5, -100, 1, False), r"label_smoothing must be in \[0, 1\]"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kern.cross_entropy_fwd(*args)


@pytest.mark.parametrize("path", ["function", "cpp"])
@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton", "cuda"))
def test_scalar_upstream_gradient_scales_the_stored_gradient_in_place(backend, path, monkeypatch):
    """A scalar upstream gradient scales the forward's stored gradient in place (the gradient
    handed out is that very buffer: seen through the Python Function's saved tensors; the C++ op's
    node does not show them), and a second backward through the retained graph leaves the first
    result untouched."""
    device = device_for(backend)
    x, t = _inputs(9, 50, device)
    x.requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(x, t, label_smoothing=0.1), x)[0]
    with fastformer.use_backend(backend):
        kernels = backends.select("cross_entropy", x.device, x.dtype)
        if path == "function":
            monkeypatch.setattr(kernels, "cross_entropy", None)  # the Python Function's path
        elif kernels.cross_entropy is None:
            pytest.skip(f"the {backend} backend has no C++ differentiable op here (Triton, or CUDA emulated)")
        loss = cross_entropy(x, t, label_smoothing=0.1)
    first = torch.autograd.grad(2.5 * loss, x, retain_graph=True)[0]
    if path == "function":
        stored = loss.grad_fn.saved_tensors[0]
        assert first.data_ptr() == stored.data_ptr(), "the stored gradient was copied, not scaled in place"
    assert_close("2.5 x grad", first, 2.5 * want, atol=1e-6, rtol=1e-4)
    second = torch.autograd.grad(-4.0 * loss, x)[0]
    assert second.data_ptr() != first.data_ptr()
    assert_close("-4 x grad", second, -4.0 * want, atol=1e-6, rtol=1e-4)
    assert_close("first result kept", first, 2.5 * want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_kernel_checks_name_the_argument(backend):
    kern = backends.Kernels(backend)
    device = device_for(backend)
    x, t = torch.randn(4, 8, device=device), torch.tensor([0, 1, 7, -100], device=device)
    cases = [
        ((torch.randn(32, device=device), t, 0.0, -100, 1, False), "logits must have 2 dimensions"),
        ((x.long(), t, 0.0, -100, 1, False), "logits must be float32, float16 or bfloat16"),
        ((x.double(), t, 0.0, -100, 1, False), "logits must be float32, float16 or bfloat16"),
        ((torch.randn(8, 4, device=device).t(), t, 0.0, -100, 1, False), "logits must be contiguous"),
        ((torch.randn(4, 0, device=device), t, 0.0, -100, 1, False), "logits must have at least one class"),
        ((x, t.int(), 0.0, -100, 1, False), "target must be int64"),
        ((x, t[:3], 0.0, -100, 1, False), r"target must have shape \(4,\)"),
        ((x, t, 0.0, -100, 3, False), "reduction must be 0 \\(none\\), 1 \\(mean\\) or 2 \\(sum\\)"),
        ((x, t, 1.5, -100, 1, False), r"label_smoothing must be in \[0, 1\]"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kern.cross_entropy_fwd(*args)


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_out_of_range_target_is_never_an_address(backend):
    """The Python layer rejects such targets; the kernel itself gives that row nan (it never reads
    logits[t] for t outside [0, V)) and leaves the other rows exact."""
    device = device_for(backend)
    x = torch.randn(4, 8, device=device)
    bad = torch.tensor([0, 8, -5, -100], device=device)
    loss, grad = backends.Kernels(backend).cross_entropy_fwd(x, bad, 0.0, -100, 0, True)
    assert loss[1].isnan() and loss[2].isnan()
    assert grad[1].isnan().all() and grad[2].isnan().all()
    want = F.cross_entropy(x[:1], bad[:1], reduction="none")
    assert_close("loss", loss[:1], want, atol=1e-5, rtol=1e-5)
    assert loss[3] == 0 and torch.equal(grad[3], torch.zeros_like(grad[3]))


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_float16_and_determinism(backend):
    """fp16 logits (CUDA only) follow the low-precision rule; two runs agree bit for bit."""
    device = device_for(backend)
    x, t = _inputs(37, 1531, device)
    kern = backends.Kernels(backend)
    ref_loss, ref_grad = _loss_and_grad(lambda a: reference.cross_entropy(a, t, label_smoothing=0.1), x,
                                        torch.tensor(1.0, device=device))
    lp_loss, lp_grad = _loss_and_grad(lambda a: reference.cross_entropy(a, t, label_smoothing=0.1),
                                      x.half(), torch.tensor(1.0, device=device))
    loss, grad = kern.cross_entropy_fwd(x.half(), t, 0.1, -100, 1, True)
    assert loss.dtype == grad.dtype == torch.float16
    assert_close_lowp("loss", loss, ref_loss, lp_loss, factor=LOWP_FACTOR[backend])
    assert_close_lowp("grad", grad, ref_grad, lp_grad, factor=LOWP_FACTOR[backend])
    for reduction in (0, 1, 2):
        a = kern.cross_entropy_fwd(x, t, 0.1, -100, reduction, True)
        b = kern.cross_entropy_fwd(x, t, 0.1, -100, reduction, True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_vector_and_scalar_rows_with_non_finite_logits(backend):
    """V = 40 rows move as 8-class vectors; the same logits stored one element off alignment take
    the scalar path. Both give the reference's loss and gradient, NaN / inf where it has them."""
    device = device_for(backend)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    t = torch.tensor([4, 9, 0, 11, 20, 39])
    x[0, 5] = float("nan")
    x[1, 2] = float("inf")
    x[2, :] = float("-inf")
    x[3, 11] = float("-inf")
    x[4, 30] = float("-inf")
    x, t = x.to(device), t.to(device)
    misaligned = torch.empty(x.numel() + 1, device=device)[1:].view(6, 40)  # contiguous, offset 1
    misaligned.copy_(x)
    kern = backends.Kernels(backend)
    for eps in (0.0, 0.1):
        want_loss, want_grad = _loss_and_grad(
            lambda a: reference.cross_entropy(a, t, label_smoothing=eps, reduction="none"), x,
            torch.ones(6, device=device))
        for logits in (x, misaligned):
            loss, grad = kern.cross_entropy_fwd(logits, t, eps, -100, 0, True)
            torch.testing.assert_close(loss, want_loss, equal_nan=True, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(grad, want_grad, equal_nan=True, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_grad_loss_is_the_reference_loss(backend, reduction):
    """Under no_grad (evaluation) the kernel writes no gradient; the loss must not change."""
    device = device_for(backend)
    x, t = _inputs(113, 1023, device)
    x.requires_grad_(True)
    with torch.no_grad(), fastformer.use_backend(backend):
        loss = cross_entropy(x, t, label_smoothing=0.1, reduction=reduction)
    assert not loss.requires_grad and loss.grad_fn is None
    ref = reference.cross_entropy(x.detach(), t, label_smoothing=0.1, reduction=reduction)
    assert_close("loss", loss, ref, *FP32_TOL[backend]["loss"])
