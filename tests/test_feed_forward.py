"""feed_forward: the reference against torch, then every kernel backend against the reference
(forward and every gradient), dropout exactness and statistics, gradcheck, opcheck, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import feed_forward, reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends, num_threads

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
CUDA = kernel_backends("cuda")
# The cuda backend runs on the SIMT harness without a GPU (CPU tensors).
SIMT = not torch.cuda.is_available()

# (x shape (..., E), F = dim_feedforward): E in 64, 1023, 256, 7; row counts 1, odd, round.
SHAPES = [((1, 64), 256), ((7, 1023), 129), ((203, 256), 512), ((5, 7), 29),
          ((3, 7, 256), 1024), ((1, 1, 1023), 64), ((64, 256), 1023)]
# The Triton interpreter is slow: a subset keeps its part of this file short.
TRITON_SHAPES = [((5, 7), 29), ((3, 7, 256), 72), ((1, 1, 1023), 64)]
# The harness runs every CUDA thread as a host fiber: odd row counts and widths, F % 8 == 0 (the
# 8-element vector path) and not (the scalar tail); every config on one shape, a few on the others.
SIMT_CASES = {((113, 64), 29): None, ((7, 1023), 129): ("gelu_dropout", "no_b2_relu_dropout"),
              ((1, 64), 256): ("relu_dropout", "no_b1_gelu")}
# The interpreter skips silu without dropout: silu_dropout, the tails tests of
# test_feed_forward_triton.py and test_forward_returns_the_pre_activation cover its code.
TRITON_CONFIGS_SKIPPED = ("no_b2_silu",)


def _shapes_and_configs(name):
    if name == "cuda" and SIMT:
        return [(shape, F_, configs or tuple(CONFIGS)) for (shape, F_), configs in SIMT_CASES.items()]
    if name == "triton":
        configs = tuple(c for c in CONFIGS if c not in TRITON_CONFIGS_SKIPPED)
        return [(shape, F_, configs) for shape, F_ in TRITON_SHAPES]
    return [(shape, F_, tuple(CONFIGS)) for shape, F_ in SHAPES]

# fp32 tolerances per backend: (atol, rtol) for the output and for gradients. Triton on a GPU may
# run fp32 dots in tf32, hence its looser numbers there.
_TF32 = torch.cuda.is_available()
FP32_TOL = {
    "cpu": {"out": (1e-4, 1e-4), "grad": (2e-4, 1e-4)},
    "triton": {"out": (2e-2, 1e-2), "grad": (5e-2, 1e-2)} if _TF32 else
              {"out": (1e-4, 1e-4), "grad": (2e-4, 1e-4)},
    "cuda": {"out": (1e-4, 1e-4), "grad": (2e-4, 1e-4)},
}
# bf16: FlashAttention's rule, kernel error <= LOWP_FACTOR x the bf16 reference's error (+ atol).
# (Triton's interpreter truncates fp32 -> bf16; the feed-forward kernels round to nearest even
# there as the hardware does, so Triton keeps the factor 2 without a GPU too.)
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0, "cuda": 2.0}

# name: (has b1, has b2, activation, dropout_p)
CONFIGS = {
    "relu": (True, True, "relu", 0.0),
    "gelu": (True, True, "gelu", 0.0),
    "relu_dropout": (True, True, "relu", 0.3),
    "gelu_dropout": (True, True, "gelu", 0.1),
    "no_biases_relu_dropout": (False, False, "relu", 0.2),
    "no_b1_gelu": (False, True, "gelu", 0.0),
    "no_b2_relu_dropout": (True, False, "relu", 0.5),
    "silu_dropout": (True, True, "silu", 0.2),
    "no_b2_silu": (True, False, "silu", 0.0),
}
INPUT_NAMES = ("x", "w1", "b1", "w2", "b2")


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        for shape, F_, configs in _shapes_and_configs(name):
            for config in configs:
                yield pytest.param(name, shape, F_, config, marks=backend.marks,
                                   id=f"{backend.id}-{'x'.join(map(str, shape))}-F{F_}-{config}")


def _make_inputs(shape, F_, has_b1, has_b2, device, dtype=torch.float32):
    E = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype)
    w1 = torch.randn(F_, E, device=device, dtype=dtype) / math.sqrt(E)
    b1 = 0.5 * torch.randn(F_, device=device, dtype=dtype) if has_b1 else None
    w2 = torch.randn(E, F_, device=device, dtype=dtype) / math.sqrt(F_)
    b2 = 0.5 * torch.randn(E, device=device, dtype=dtype) if has_b2 else None
    return x, w1, b1, w2, b2


def _forward_backward(fn, inputs, upstream):
    """fn's output and the gradient of every given input for the upstream gradient."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    present = [leaf for leaf in leaves if leaf is not None]
    grads = iter(torch.autograd.grad(out, present, upstream))
    named = {n: next(grads) for n, leaf in zip(INPUT_NAMES, leaves) if leaf is not None}
    return out.detach(), named


def _run_case(backend, shape, F_, config, dtype):
    """(kernel, reference in dtype, reference in fp32) output and gradients, same dropout mask."""
    has_b1, has_b2, activation, p = CONFIGS[config]
    inputs = _make_inputs(shape, F_, has_b1, has_b2, device_for(backend))
    upstream = torch.randn(shape, device=inputs[0].device)
    torch.manual_seed(1234)
    rng = philox.next_seed()

    def kernel(*args):
        torch.manual_seed(1234)  # the Function draws the same (seed, offset) as rng
        with fastformer.use_backend(backend):
            return feed_forward(*args, activation=activation, dropout_p=p)

    def ref(*args):
        return reference.feed_forward(*args, activation=activation, dropout_p=p, rng=rng)

    cast = [None if t is None else t.to(dtype) for t in inputs]
    out = _forward_backward(kernel, cast, upstream.to(dtype))
    ref_lowp = _forward_backward(ref, cast, upstream.to(dtype))
    ref_fp32 = _forward_backward(ref, [None if t is None else t.float() for t in cast],
                                 upstream.to(dtype).float())
    return out, ref_lowp, ref_fp32


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("shape,F_", [((5, 7), 29), ((3, 7, 64), 256)])
def test_reference_matches_torch_linear_composition(shape, F_, activation, p):
    inputs = _make_inputs(shape, F_, True, True, "cpu")
    upstream = torch.randn(shape)
    rng = (321, 5)
    act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation]

    def torch_version(x, w1, b1, w2, b2):
        a = act(F.linear(x, w1, b1))
        if p > 0:  # the shared Philox mask, applied by hand
            a = a * philox.keep_mask(a.shape, p, *rng).to(a.dtype) / (1 - p)
        return F.linear(a, w2, b2)

    def ref(*args):
        return reference.feed_forward(*args, activation=activation, dropout_p=p, rng=rng)

    out_ref, g_ref = _forward_backward(ref, inputs, upstream)
    out_torch, g_torch = _forward_backward(torch_version, inputs, upstream)
    assert_close("out", out_ref, out_torch, atol=1e-5, rtol=1e-5)
    for name in INPUT_NAMES:
        assert_close(f"d{name}", g_ref[name], g_torch[name], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,shape,F_,config", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, shape, F_, config):
    (out, grads), _, (ref, ref_grads) = _run_case(backend, shape, F_, config, torch.float32)
    atol, rtol = FP32_TOL[backend]["out"]
    assert_close("out", out, ref, atol=atol, rtol=rtol)
    atol, rtol = FP32_TOL[backend]["grad"]
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend,shape,F_,config", list(_cases()))
def test_bf16_forward_and_every_gradient(backend, shape, F_, config):
    (out, grads), (lp, lp_grads), (ref, ref_grads) = _run_case(backend, shape, F_, config,
                                                               torch.bfloat16)
    factor = LOWP_FACTOR[backend]
    assert out.dtype == torch.bfloat16
    assert_close_lowp("out", out, ref, lp, factor=factor)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert grads[name].dtype == torch.bfloat16
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name], factor=factor)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_returns_the_pre_activation(backend, activation):
    """What forward keeps for backward: pre = x w1^T + b1, except the CPU's relu, which keeps
    a = dropout(relu(pre)) over pre (its backward reads relu' * keep as a > 0)."""
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((9, 40), 72, True, True, device)
    out, pre = backends.Kernels(backend).feed_forward_fwd(x, w1, b1, w2, b2, activation, 0.2, philox.pack(4, 0))
    tol = FP32_TOL[backend]["out"]
    want = x @ w1.t() + b1
    if activation == "relu" and backend == "cpu":
        want = philox.dropout(torch.relu(want), 0.2, 4, 0)
    assert_close("pre", pre, want, atol=tol[0], rtol=tol[1])
    ref = reference.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=0.2, rng=(4, 0))
    assert_close("out", out, ref, atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("backend", CUDA)
@pytest.mark.parametrize("activation, dropout_p, has_b1, in_epilogue", [
    ("relu", 0.0, True, True), ("relu", 0.3, True, False), ("gelu", 0.0, True, False),
    ("relu", 0.0, False, False)], ids=["relu", "relu_dropout", "gelu", "relu_no_b1"])
def test_cuda_relu_without_dropout_runs_in_the_gemm_epilogue(backend, activation, dropout_p, has_b1, in_epilogue):
    """bias + relu in at::_addmm_activation (cuBLASLt's epilogue on a GPU) where that is exact: relu,
    no dropout, a b1 (cuBLASLt's gelu is the tanh form); forward and every gradient as the reference."""
    device = device_for(backend)
    inputs = _make_inputs((9, 40), 72, has_b1, True, device)
    kern = backends.Kernels(backend)
    rng = philox.pack(4, 0)
    with torch.profiler.profile() as prof:
        out, pre = kern.feed_forward_fwd(*inputs, activation, dropout_p, rng)
    ran = any(e.name == "aten::_addmm_activation" for e in prof.events())
    assert ran == in_epilogue
    x, w1, b1, w2, b2 = inputs
    ref_inputs = [t if t is None else t.cpu() for t in inputs]
    tol = FP32_TOL[backend]
    ref = reference.feed_forward(*ref_inputs, activation=activation, dropout_p=dropout_p, rng=(4, 0))
    assert_close("out", out.cpu(), ref, *tol["out"])
    dout = torch.randn_like(out)
    got = kern.feed_forward_bwd(dout, x, w1, w2, pre, has_b1, True, activation, dropout_p, rng)
    _, want = _forward_backward(lambda *t: reference.feed_forward(*t, activation=activation, dropout_p=dropout_p,
                                                                  rng=(4, 0)), ref_inputs, dout.cpu())
    for name, g in zip(INPUT_NAMES, got):
        if name in want:
            assert_close(f"d{name}", g.cpu(), want[name], *tol["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_gradient_is_zero_at_exactly_zero(backend):
    """F.relu's rule: a pre-activation of exactly 0 passes no gradient (kernels and reference agree)."""
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((6, 16), 24, True, True, device)
    with torch.no_grad():
        x[2].zero_()  # row 2's pre-activation is b1 ...
        b1.zero_()    # ... which is exactly 0 everywhere
    grads = {}
    for name in ("reference", backend):
        ts = [t.detach().clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        with fastformer.use_backend(name):
            feed_forward(*ts, activation="relu").sum().backward()
        grads[name] = [t.grad for t in ts]
    assert grads["reference"][0][2].abs().max() == 0  # the oracle itself follows F.relu
    for i, name in enumerate(("x", "w1", "b1", "w2", "b2")):
        tol = FP32_TOL[backend]["out"]
        assert_close(f"d{name}", grads[backend][i], grads["reference"][i], atol=tol[0], rtol=tol[1])


# ---------------------------------------------------------------- dropout statistics


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics_and_backward_mask(backend, p):
    """Identity weights expose the mask: out = keep * scale, and dx = the same in backward."""
    device = device_for(backend)
    N, C = (32, 64) if backend == "triton" or (backend == "cuda" and SIMT) else (256, 512)
    kern = backends.Kernels(backend)
    x = torch.ones(N, C, device=device)
    eye = torch.eye(C, device=device)
    out, pre = kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, philox.pack(11, 0))
    kept = out != 0
    n = kept.numel()
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), f"keep rate {rate} for p={p}"
    assert torch.equal(kept, philox.keep_mask((N, C), p, 11, 0, device=device))
    assert_close("kept values", out[kept], torch.full_like(out[kept], 1 / (1 - p)), atol=0, rtol=1e-3)
    # same seed: same mask; another seed or offset: another mask
    assert torch.equal(kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, philox.pack(11, 0))[0], out)
    assert not torch.equal(kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, philox.pack(12, 0))[0] != 0, kept)
    assert not torch.equal(kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, philox.pack(11, 1))[0] != 0, kept)
    # backward regenerates the same mask: dout = 1, w2 = I -> dpre = keep * scale -> dx = dpre
    dx, dw1, db1, dw2, db2 = kern.feed_forward_bwd(torch.ones_like(out), x, eye, eye, pre, False, False,
                                                   "relu", p, philox.pack(11, 0))
    assert torch.equal(dx != 0, kept)
    assert_close("dx", dx, out, atol=0, rtol=1e-3)
    assert db1.numel() == 0 and db2.numel() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_counters_past_32_bits(backend):
    """Group counters offset + r * G + g whose low word wraps use the high word as philox.py defines."""
    device = device_for(backend)
    x, eye = torch.ones(3, 48, device=device), torch.eye(48, device=device)
    offset = 2**32 - 9  # 6 counters a row: the wrap falls inside the second row
    out, _ = backends.Kernels(backend).feed_forward_fwd(x, eye, None, eye, None, "relu", 0.5, philox.pack(9, offset))
    assert torch.equal(out != 0, philox.keep_mask((3, 48), 0.5, 9, offset, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("F_", [1, 7, 8, 9, 63, 64, 65, 1023])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_dropout_mask_is_the_reference_mask_for_odd_rows(backend, F_, dtype):
    """Rows of any length F (the forward's chunks of 2048 elements cross rows), offsets whose low
    word wraps mid-tensor: out = keep * scale forward, dx the same mask backward."""
    N = 19
    kern = backends.Kernels(backend)
    x, eye = torch.ones(N, F_, dtype=dtype), torch.eye(F_, dtype=dtype)
    G = (F_ + 7) // 8
    for p, seed, offset in ((0.1, 3, 0), (0.5, 2**40 + 9, 2**32 - N * G // 2), (0.9, 2**62 - 1, 2**32 - 1)):
        out, pre = kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, philox.pack(seed, offset))
        keep = philox.keep_mask((N, F_), p, seed, offset)
        assert torch.equal(out != 0, keep), f"forward mask, p={p} offset={offset}"
        assert_close("kept values", out[keep], torch.full_like(out[keep], 1 / (1 - p)), atol=0, rtol=1e-6)
        dx = kern.feed_forward_bwd(torch.ones_like(out), x, eye, eye, pre, False, False, "relu", p, philox.pack(seed, offset))[0]
        assert torch.equal(dx != 0, keep), f"backward mask, p={p} offset={offset}"


def test_functional_op_draws_seed_from_torch_generator():
    x, w1, b1, w2, b2 = _make_inputs((4, 16), 24, True, True, "cpu")
    torch.manual_seed(3)
    y1 = feed_forward(x, w1, b1, w2, b2, dropout_p=0.5)
    torch.manual_seed(3)
    y2 = feed_forward(x, w1, b1, w2, b2, dropout_p=0.5)
    torch.manual_seed(3)
    rng = philox.next_seed()
    assert torch.equal(y1, y2)
    assert_close("out", y1, reference.feed_forward(x, w1, b1, w2, b2, dropout_p=0.5, rng=rng),
                 atol=1e-5, rtol=1e-5)
    assert not torch.equal(feed_forward(x, w1, b1, w2, b2, dropout_p=0.5), y1)


# ---------------------------------------------------------------- gradcheck, opcheck, edge cases


@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, activation, p, biases):
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w1, w2 = make(3, 2, 5), make(7, 5), make(5, 7)
    b1, b2 = (make(7), make(5)) if biases else (None, None)

    def fn(x, w1, b1, w2, b2):
        torch.manual_seed(42)  # the same dropout mask on every evaluation
        with fastformer.use_backend(backend):
            return feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=p)

    assert torch.autograd.gradcheck(fn, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    x, w1, b1, w2, b2 = _make_inputs((6, 24), 40, True, True, "cpu", dtype)
    for activation, p, biases in (("relu", 0.2, True), ("gelu", 0.0, False), ("gelu", 0.3, True),
                                  ("silu", 0.1, False)):
        bb1, bb2 = (b1, b2) if biases else (None, None)
        torch.library.opcheck(ops.feed_forward_fwd.default, (x, w1, bb1, w2, bb2, activation, p, philox.pack(5, 2)))
        _, pre = ops.feed_forward_fwd(x, w1, bb1, w2, bb2, activation, p, philox.pack(5, 2))
        args = (torch.randn_like(x), x, w1, w2, pre, biases, biases, activation, p, philox.pack(5, 2))
        torch.library.opcheck(ops.feed_forward_bwd.default, args)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_any_thread_count(backend, threads):
    """Rows split over 1 or 3 threads (per-thread db1 / db2 partial sums) give the same answer."""
    with num_threads(threads):
        (out, grads), _, (ref, ref_grads) = _run_case(backend, (203, 256), 512, "gelu_dropout",
                                                      torch.float32)
    assert_close("out", out, ref, *FP32_TOL[backend]["out"])
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@pytest.mark.parametrize("backend", CPU)
def test_zero_rows(backend):
    x = torch.randn(0, 8, requires_grad=True)
    w1, b1 = torch.randn(16, 8, requires_grad=True), torch.randn(16, requires_grad=True)
    w2, b2 = torch.randn(8, 16, requires_grad=True), torch.randn(8, requires_grad=True)
    with fastformer.use_backend(backend):
        out = feed_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.1)
    out.sum().backward()
    assert out.shape == (0, 8)
    for t in (w1, b1, w2, b2):
        assert torch.equal(t.grad, torch.zeros_like(t))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((4, 8), 16, True, True, device)
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match="w1 must have shape"):
            feed_forward(x, torch.randn(16, 9, device=device), b1, w2, b2)
        with pytest.raises(ValueError, match="w2 must have shape"):
            feed_forward(x, w1, b1, torch.randn(16, 8, device=device), b2)
        with pytest.raises(ValueError, match="b1 must have shape"):
            feed_forward(x, w1, torch.randn(8, device=device), w2, b2)
        with pytest.raises(ValueError, match="b2 must have shape"):
            feed_forward(x, w1, b1, w2, torch.randn(16, device=device))
        with pytest.raises(ValueError, match="w1 must have 2 dimensions"):
            feed_forward(x, torch.randn(16, device=device), b1, w2, b2)
        with pytest.raises(TypeError, match="w1 has dtype"):
            feed_forward(x, w1.to(torch.bfloat16), b1, w2, b2)
        with pytest.raises(ValueError, match="activation must be one of"):
            feed_forward(x, w1, b1, w2, b2, activation="tanh")
        for p in (1.0, -0.1, 2):
            with pytest.raises(ValueError, match="dropout_p must be a number in"):
                feed_forward(x, w1, b1, w2, b2, dropout_p=p)


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("rows, E, F, large", [(9, 40, 72, False), (256, 256, 256, True)])
def test_cpu_fp32_products_go_to_mkl_on_intel_and_to_onednn_elsewhere(backend, rows, E, F, large):
    """The fp32 GEMMs of the CPU feed-forward: MKL's sgemm (aten::addmm / aten::mm) on an Intel CPU,
    where it is the faster one, oneDNN's linear elsewhere (AMD: MKL's sgemm without its AVX-512 path),
    but only from 2^23 multiply-adds a product: below, oneDNN's fixed cost a call loses everywhere."""
    vendor = _cpu_vendor()
    if not vendor:
        pytest.skip("no vendor_id in /proc/cpuinfo (not Linux on x86): the rule has nothing to read here")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: every product goes to ATen's BLAS")
    inputs = _make_inputs((rows, E), F, True, True, "cpu")
    with torch.profiler.profile() as prof:
        out, saved = backends.Kernels(backend).feed_forward_fwd(*inputs, "relu", 0.1, philox.pack(4, 0))
        backends.Kernels(backend).feed_forward_bwd(torch.ones_like(out), inputs[0], inputs[1], inputs[3], saved,
                                                   True, True, "relu", 0.1, philox.pack(4, 0))
    names = [e.name for e in prof.events()]
    onednn = names.count("mkldnn::_linear_pointwise")
    if vendor == "GenuineIntel" or not large:
        assert onednn == 0, f"{onednn} products went to oneDNN ({vendor}, {rows * E * F} multiply-adds a product)"
    else:
        assert onednn == 4, f"{onednn} of the 4 forward / input-gradient products went to oneDNN on {vendor}"
    assert names.count("aten::mm") + names.count("aten::addmm") >= (2 if large and vendor != "GenuineIntel" else 6)


@pytest.mark.parametrize("backend", CPU)
def test_cpu_kernel_checks_name_the_argument(backend):
    kern = backends.Kernels(backend)
    x, w1, b1, w2, b2 = _make_inputs((4, 8), 16, True, True, "cpu")
    Z = philox.pack(0, 0)  # (seed, offset) of the calls without dropout
    _, pre = kern.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.0, Z)
    fwd_cases = [
        ((torch.randn(8), w1, b1, w2, b2, "relu", 0.0, Z), "x must be 2-D"),
        ((x.double(), w1, b1, w2, b2, "relu", 0.0, Z), "w1 must have the dtype of x"),
        ((x.half(), w1.half(), None, w2.half(), None, "relu", 0.0, Z),
         "x must be float32, float64 or bfloat16"),
        ((x, torch.randn(16, 7), b1, w2, b2, "relu", 0.0, Z), r"w1 must have shape \(F, E\)"),
        ((x, w1, b1, torch.randn(8, 15), b2, "relu", 0.0, Z), r"w2 must have shape \(E, F\)"),
        ((x, w1.t().contiguous().t(), b1, w2, b2, "relu", 0.0, Z), "w1 must be contiguous"),
        ((x, w1, torch.randn(15), w2, b2, "relu", 0.0, Z), r"b1 must have shape \(16,\)"),
        ((x, w1, b1, w2, b2.double(), "relu", 0.0, Z), "b2 must have the dtype of x"),
        ((x, w1, b1, w2, b2, "tanh", 0.0, Z), "activation must be \"relu\", \"gelu\", \"silu\" or \"gelu_tanh\""),
        ((x, w1, b1, w2, b2, "relu", 1.0, Z), r"dropout_p must be in \[0, 1\)"),
        ((x, w1, b1, w2, b2, "relu", 0.5, torch.tensor([0, -3])), r"the philox offset philox\[1\] must be >= 0"),
        ((x, w1, b1, w2, b2, "relu", 0.5, torch.zeros(4, dtype=torch.int64)[::2]), "philox must be contiguous"),
    ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.feed_forward_fwd(*args)
    dout = torch.randn(4, 8)
    bwd_cases = [
        ((torch.randn(4, 9), x, w1, w2, pre, True, True, "relu", 0.0, Z), r"dout must have shape \(N, E\)"),
        ((dout, x, w1, w2, pre[:, :5], True, True, "relu", 0.0, Z), r"pre must have shape \(N, F\)"),
        ((dout, x, w1, w2, pre.double(), True, True, "relu", 0.0, Z), "pre must have the dtype of x"),
        ((dout, x, w1, w2, pre, True, True, "swish", 0.0, Z), "activation must be"),
        ((dout, x, w1, w2, pre, True, True, "relu", -0.2, Z), r"dropout_p must be in \[0, 1\)"),
    ]
    for args, message in bwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.feed_forward_bwd(*args)


# ---------------------------------------------------------------- the cuda backend's own checks


@pytest.mark.parametrize("F_", [1, 9, 64, 65])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_dropout_equals_the_cpu_backend(backend, F_):
    """Same seed and offset: the cuda kernels drop exactly the elements the cpu backend drops,
    forward and backward (odd widths take the scalar path, F % 8 == 0 the vector path; the
    offset makes the group counters' low word wrap mid-tensor)."""
    if _ext.load_error() is not None:
        pytest.skip(f"the cpu backend is needed as the oracle: {_ext.load_error()}")
    N, p, seed = 13, 0.4, 2**40 + 3
    offset = 2**32 - N * ((F_ + 7) // 8) // 2
    x = torch.ones(N, F_)
    eye = torch.eye(F_)
    cuda, cpu = backends.Kernels(backend), backends.Kernels("cpu")
    device = device_for(backend)
    out, pre = cuda.feed_forward_fwd(x.to(device), eye.to(device), None, eye.to(device), None, "relu", p,
                                     philox.pack(seed, offset))
    want, want_pre = cpu.feed_forward_fwd(x, eye, None, eye, None, "relu", p,
                                          philox.pack(seed, offset))
    assert torch.equal(out.cpu(), want), "forward: another mask or another scale"
    dout = torch.ones_like(out)
    dx = cuda.feed_forward_bwd(dout, x.to(device), eye.to(device), eye.to(device), pre, False, False, "relu",
                               p, philox.pack(seed, offset))[0]
    want_dx = cpu.feed_forward_bwd(dout.cpu(), x, eye, eye, want_pre, False, False, "relu", p,
                                   philox.pack(seed, offset))[0]
    assert torch.equal(dx.cpu(), want_dx), "backward: another mask"


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_float16_and_determinism(backend):
    """fp16 (CUDA only) follows the low-precision rule; two runs agree bit for bit (db1 and db2
    are fixed-order two-stage sums, no atomics)."""
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((37, 40), 72, True, True, device)
    upstream = torch.randn(37, 40, device=device)
    rng = (77, 3)

    def kernel(*args):
        out, pre = backends.Kernels(backend).feed_forward_fwd(*args, "gelu", 0.2, philox.pack(*rng))
        grads = backends.Kernels(backend).feed_forward_bwd(upstream.to(args[0].dtype), args[0], args[1],
                                                           args[3], pre, True, True, "gelu", 0.2,
                                                           philox.pack(*rng))
        return out, dict(zip(INPUT_NAMES, grads))

    def ref(*args):
        return reference.feed_forward(*args, activation="gelu", dropout_p=0.2, rng=rng)

    half = [t.half() for t in (x, w1, b1, w2, b2)]
    out, grads = kernel(*half)
    lp, lp_grads = _forward_backward(ref, half, upstream.half())
    ref_out, ref_grads = _forward_backward(ref, [x, w1, b1, w2, b2], upstream.half().float())
    assert out.dtype == torch.float16
    assert_close_lowp("out", out, ref_out, lp, factor=LOWP_FACTOR[backend])
    for name in INPUT_NAMES:
        assert grads[name].dtype == torch.float16
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name],
                          factor=LOWP_FACTOR[backend])
    out2, grads2 = kernel(*half)
    assert torch.equal(out, out2)
    for name in INPUT_NAMES:
        assert torch.equal(grads[name], grads2[name]), f"d{name} differs between two runs"


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_bias_gradients_over_several_row_parts(backend):
    """300 rows are 3 parts of 100 (not a multiple of the 8 row lanes) for db1's sums in the fused
    backward pass and db2's two-stage column sum: both equal the reference's."""
    (out, grads), _, (ref, ref_grads) = _run_case(backend, (300, 24), 40, "gelu_dropout", torch.float32)
    assert_close("out", out, ref, *FP32_TOL[backend]["out"])
    for name in INPUT_NAMES:
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_nan_propagates_as_the_reference(backend):
    """A NaN in x reaches the output through relu (F.relu keeps NaN) and through a dropped element
    (x * 0 is NaN), exactly where the reference has it; the gradients are NaN where the
    reference's are."""
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((5, 16), 24, True, True, device)
    with torch.no_grad():
        x[3, 2] = float("nan")
    rng = (5, 1)
    for activation in ("relu", "gelu", "silu"):
        def kernel(*args):
            torch.manual_seed(0)
            with fastformer.use_backend(backend):
                return feed_forward(*args, activation=activation, dropout_p=0.5)

        torch.manual_seed(0)
        rng = philox.next_seed()

        def ref(*args):
            return reference.feed_forward(*args, activation=activation, dropout_p=0.5, rng=rng)

        upstream = torch.randn(5, 16, device=device)
        out, grads = _forward_backward(kernel, (x, w1, b1, w2, b2), upstream)
        want, want_grads = _forward_backward(ref, (x, w1, b1, w2, b2), upstream)
        assert torch.equal(out.isnan(), want.isnan()) and out[3].isnan().all()
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4, equal_nan=True)
        for name in INPUT_NAMES:
            assert torch.equal(grads[name].isnan(), want_grads[name].isnan()), f"d{name}: NaN elsewhere"


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_zero_rows_and_zero_width(backend):
    device = device_for(backend)
    kern = backends.Kernels(backend)
    for N, E, F_ in ((0, 8, 16), (4, 8, 0)):
        x, w1, b1, w2, b2 = _make_inputs((N, E), F_, True, True, device)
        out, pre = kern.feed_forward_fwd(x, w1, b1, w2, b2, "gelu", 0.1, philox.pack(1, 0))
        assert out.shape == (N, E) and pre.shape == (N, F_)
        want = reference.feed_forward(x, w1, b1, w2, b2, activation="gelu")
        assert_close("out", out, want, atol=1e-6, rtol=0)
        dx, dw1, db1, dw2, db2 = kern.feed_forward_bwd(torch.ones(N, E, device=device), x, w1, w2, pre, True,
                                                       True, "gelu", 0.1, philox.pack(1, 0))
        assert dx.shape == (N, E) and dw1.shape == (F_, E) and dw2.shape == (E, F_)
        assert torch.equal(db1, torch.zeros(F_, device=device))
        assert torch.equal(db2, torch.full((E,), float(N), device=device))


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_kernel_checks_name_the_argument(backend):
    kern = backends.Kernels(backend)
    device = device_for(backend)
    x, w1, b1, w2, b2 = _make_inputs((4, 8), 16, True, True, device)
    _, pre = kern.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.0, philox.no_dropout())
    fwd_cases = [
        ((x[0], w1, b1, w2, b2, "relu", 0.0, philox.no_dropout()), "x must be 2-D"),
        ((x.double(), w1.double(), None, w2.double(), None, "relu", 0.0, philox.no_dropout()),
         "x must be float32, float16 or bfloat16"),
        ((x.half(), w1, b1, w2, b2, "relu", 0.0, philox.no_dropout()), "w1 must have the dtype of x"),
        ((x, w1[:, :7].contiguous(), b1, w2, b2, "relu", 0.0, philox.no_dropout()), r"w1 must have shape \(F, E\)"),
        ((x, w1, b1, w2[:, :15].contiguous(), b2, "relu", 0.0, philox.no_dropout()), r"w2 must have shape \(E, F\)"),
        ((x, w1.t().contiguous().t(), b1, w2, b2, "relu", 0.0, philox.no_dropout()), "w1 must be contiguous"),
        ((x, w1, b1[:15], w2, b2, "relu", 0.0, philox.no_dropout()), r"b1 must have shape \(16,\)"),
        ((x, w1, b1, w2, b2, "tanh", 0.0, philox.no_dropout()),
         "activation must be \"relu\", \"gelu\", \"silu\" or \"gelu_tanh\""),
        ((x, w1, b1, w2, b2, "relu", 1.0, philox.no_dropout()), r"dropout_p must be in \[0, 1\)"),
        ((x, w1, b1, w2, b2, "relu", 0.5, torch.tensor([-1, 0], device="cpu")),
         r"philox seed philox\[0\] must be >= 0"),
        ((x, w1, b1, w2, b2, "relu", 0.5, torch.tensor([0, -3], device="cpu")),
         r"philox offset philox\[1\] must be >= 0"),
    ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.feed_forward_fwd(*args)
    dout = torch.randn(4, 8, device=device)
    bwd_cases = [
        ((dout[:, :7].contiguous(), x, w1, w2, pre, True, True, "relu", 0.0, philox.no_dropout()),
         r"dout must have shape \(N, E\)"),
        ((dout, x, w1, w2, pre[:, :5].contiguous(), True, True, "relu", 0.0, philox.no_dropout()),
         r"pre must have shape \(N, F\)"),
        ((dout, x, w1, w2, pre.half(), True, True, "relu", 0.0, philox.no_dropout()), "pre must have the dtype of x"),
        ((dout, x, w1, w2, pre, True, True, "swish", 0.0, philox.no_dropout()), "activation must be"),
        ((dout, x, w1, w2, pre, True, True, "relu", -0.2, philox.no_dropout()), r"dropout_p must be in \[0, 1\)"),
    ]
    for args, message in bwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.feed_forward_bwd(*args)
