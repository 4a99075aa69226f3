"""add_layer_norm's RMSNorm mode (``rms_norm=True``, T5LayerNorm / LlamaRMSNorm): the reference
against transformers' T5LayerNorm and torch's rms_norm, then every kernel backend against the
reference (forward and every gradient, fp32 / bf16 against an fp64 truth, fp64 on cpu), dropout
bits, odd and empty shapes, the C++ differentiable op and the fast path against the Python Function,
determinism and bad input."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import backends, ops, philox
from fastformer.autograd import AddLayerNormFunction
from fastformer.ops import reference
import determinism
import hostile
from hostile import tensor as _t
from utils import (assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends,
                   other_simt_schedules_test)

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
CPU_CUDA = kernel_backends("cpu", "cuda")

# (..., C): C = 1, 1023, 4097 (odd, and past cuda's warp-per-row and triton's 4096-wide rows)
SHAPES = [(3, 1), (7, 1023), (2, 4097), (2, 5, 64)]
# the emulated backends are slow: few rows, each path once (triton: C = 1 pads to a row of 8;
# cuda: warp rows with the scalar path, block rows, 128-bit loads)
EMULATED_SHAPES = {"triton": [(3, 1), (2, 1023)], "cuda": [(3, 1023), (2, 4097), (2, 64)]}

# name: (has residual, has bias, has x_bias, prenorm, which outputs get a gradient, dropout_p)
CONFIGS = {
    "post": (True, False, False, False, "y", 0.0),
    "post_dropout_x_bias": (True, False, True, False, "y", 0.2),
    "no_residual_dropout": (False, False, False, False, "y", 0.3),
    "bias": (True, True, False, False, "y", 0.0),
    "prenorm_both_dropout": (True, False, False, True, "yh", 0.25),
    "prenorm_h_only": (True, False, True, True, "h", 0.0),
}
# the configs the emulated backends run (every option once between them)
EMULATED_CONFIGS = ("post_dropout_x_bias", "bias", "prenorm_both_dropout")
INPUT_NAMES = ("x", "residual", "weight", "bias", "x_bias")
EPS = 1e-6  # T5's
# bf16 and fp32 against the fp64 truth: at most FACTOR x the reference's own error in that dtype
# (+ a floor). Triton's interpreter rounds fp32 -> bf16 by truncation (a whole ulp, not half).
FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-5}


def _cases(configs=CONFIGS):
    for backend in BACKENDS:
        name = backend.values[0]
        for shape in EMULATED_SHAPES.get(name, SHAPES):
            for config in configs:
                if name in EMULATED_SHAPES and config not in EMULATED_CONFIGS:
                    continue
                yield pytest.param(name, shape, config, marks=backend.marks,
                                   id=f"{backend.id}-{'x'.join(map(str, shape))}-{config}")


def _inputs(shape, config, device, seed=0):
    has_res, has_b, has_xb, _, _, _ = CONFIGS[config]
    g = torch.Generator().manual_seed(seed + shape[-1])
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    C = shape[-1]
    t = [r(*shape), r(*shape) if has_res else None, 1 + 0.5 * r(C), 0.5 * r(C) if has_b else None,
         0.3 * r(C) if has_xb else None]
    return [None if v is None else v.to(device) for v in t]


def _run(backend, shape, config, dtype, inputs):
    """(kernel in dtype, reference in dtype, reference in fp64) outputs and gradients, one mask."""
    _, _, _, prenorm, grad_of, p = CONFIGS[config]
    device = inputs[0].device
    g = torch.Generator().manual_seed(99)
    gy = torch.randn(shape, generator=g, dtype=torch.float64).to(device) if "y" in grad_of else None
    gh = torch.randn(shape, generator=g, dtype=torch.float64).to(device) if "h" in grad_of else None
    upstream = (gy, gh) if prenorm else (gy,)
    torch.manual_seed(4321)
    rng = philox.next_seed()

    def kernel(x, r, w, b, xb):
        torch.manual_seed(4321)  # the op draws the same (seed, offset) as rng
        with fastformer.use_backend(backend):
            return ops.add_layer_norm(x, r, w, b, EPS, p, prenorm=prenorm, x_bias=xb, rms_norm=True)

    def ref(x, r, w, b, xb):
        return reference.add_layer_norm(x, r, w, b, EPS, p, prenorm=prenorm, rng=rng, x_bias=xb, rms_norm=True)

    def cast(ts, dt):
        return [None if t is None else t.to(dt) for t in ts]

    lowp = cast(inputs, dtype)  # every run starts from the same dtype-rounded values
    out = forward_backward(kernel, lowp, cast(upstream, dtype), INPUT_NAMES)
    ref_lowp = forward_backward(ref, lowp, cast(upstream, dtype), INPUT_NAMES)
    truth = forward_backward(ref, cast(lowp, torch.float64), cast(cast(upstream, dtype), torch.float64), INPUT_NAMES)
    return out, ref_lowp, truth


# ---------------------------------------------------------------- the reference against T5 and torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prenorm", [False, True])
def test_reference_is_t5_layer_norm(dtype, prenorm):
    """transformers' T5LayerNorm on h = residual + dropout(x) (the mask applied by hand): the same
    bits forward (bf16 included: the cast before the weight multiply), gradients within rounding."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    C, p, rng = 1023, 0.1, (77, 5)
    norm = T5LayerNorm(C, eps=EPS).to(dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
    inputs = [torch.randn(4, C, generator=g).to(dtype) for _ in range(2)] + [norm.weight.detach()]
    upstream = [torch.randn(4, C, generator=g).to(dtype), torch.randn(4, C, generator=g).to(dtype)]
    upstream = upstream if prenorm else upstream[:1]
    keep = philox.keep_mask((4, C), p, *rng).to(dtype)

    def t5(x, r, w):
        h = r + x * keep * (1.0 / (1.0 - p))  # the dropout as torch writes it
        y = torch.func.functional_call(norm, {"weight": w}, (h,))  # the module's forward, w as its weight
        return (y, h) if prenorm else y

    def ref(x, r, w):
        return reference.add_layer_norm(x, r, w, None, EPS, p, prenorm=prenorm, rng=rng, rms_norm=True)

    names = ("x", "residual", "weight")
    outs, grads = forward_backward(ref, inputs, upstream, names)
    want_outs, want_grads = forward_backward(t5, inputs, upstream, names)
    for name, o, w in zip(("y", "h"), outs, want_outs):
        assert torch.equal(o, w), f"{name} differs from T5LayerNorm's"
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name in names:  # bf16: T5's weight gradient sums in bf16, the reference's in fp32
        assert_close(f"d{name}", grads[name].float(), want_grads[name].float(), **tol)


@pytest.mark.parametrize("shape", [(5, 1), (3, 7, 256), (2, 4097)])
def test_reference_matches_torch_rms_norm_fp32(shape):
    C = shape[-1]
    g = torch.Generator().manual_seed(C)
    inputs = [torch.randn(shape, generator=g), torch.randn(shape, generator=g), 1 + torch.randn(C, generator=g)]
    upstream = [torch.randn(shape, generator=g)]
    names = ("x", "residual", "weight")
    (y, ), grads = forward_backward(
        lambda x, r, w: reference.add_layer_norm(x, r, w, None, EPS, rms_norm=True), inputs, upstream, names)
    (want, ), want_grads = forward_backward(
        lambda x, r, w: F.rms_norm(x + r, (C,), w, EPS), inputs, upstream, names)
    assert_close("y", y, want, atol=1e-5, rtol=1e-5)
    for name in names:
        assert_close(f"d{name}", grads[name], want_grads[name], atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- kernels against the reference


def _floor(backend, dtype, truth):
    """The absolute slack of the 2x rule. bf16: one rounding step at the largest magnitude, since on
    these few elements (C = 1: 3 values) the reference's own rounding can land almost exactly
    where the kernel's fp32 sums, in another order, round to the neighbouring bf16 value; the
    Triton interpreter truncates to bf16 (a whole ulp), so it gets two."""
    if dtype != torch.bfloat16:
        return FLOOR[dtype]
    steps = 2.0 if backend == "triton" and not torch.cuda.is_available() else 1.0
    return FLOOR[dtype] + steps * 2.0**-8 * truth.abs().max().item()


def _check_against_truth(backend, dtype, result):
    (outs, grads), (lp_outs, lp_grads), (truth_outs, truth_grads) = result
    for name, o, lp, t in zip(("y", "h"), outs, lp_outs, truth_outs):
        assert o.dtype == dtype
        assert_close_lowp(name, o, t, lp, factor=FACTOR[backend], atol=_floor(backend, dtype, t))
    assert set(grads) == set(truth_grads)
    for name, t in truth_grads.items():
        assert grads[name].dtype == dtype
        assert_close_lowp(f"d{name}", grads[name], t, lp_grads[name], factor=FACTOR[backend],
                          atol=_floor(backend, dtype, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,shape,config", list(_cases()))
def test_forward_and_every_gradient(backend, shape, config, dtype):
    """fp32 and bf16 against the fp64 truth, at most FACTOR x the reference's own error in the dtype."""
    inputs = _inputs(shape, config, device_for(backend))
    _check_against_truth(backend, dtype, _run(backend, shape, config, dtype, inputs))


@pytest.mark.parametrize("config", ["post_dropout_x_bias", "prenorm_both_dropout"])
@pytest.mark.parametrize("backend", kernel_backends("cuda"))
def test_cuda_fp16_forward_and_every_gradient(backend, config):
    """fp16 (a cuda-only dtype; T5's cast rounds to fp16 there): the same rule as bf16."""
    shape = (3, 1023)
    inputs = _inputs(shape, config, device_for(backend))
    (outs, grads), (lp_outs, lp_grads), (truth_outs, truth_grads) = _run(backend, shape, config, torch.float16, inputs)
    for name, o, lp, t in zip(("y", "h"), outs, lp_outs, truth_outs):
        assert o.dtype == torch.float16
        assert_close_lowp(name, o, t, lp, factor=FACTOR[backend], atol=1e-5 + 2.0**-11 * t.abs().max().item())
    for name, t in truth_grads.items():
        assert_close_lowp(f"d{name}", grads[name], t, lp_grads[name], factor=FACTOR[backend],
                          atol=1e-5 + 2.0**-11 * t.abs().max().item())


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", [(3, 1), (7, 1023), (2, 3, 65)])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_fp64_forward_and_every_gradient(backend, shape, config):
    """fp64 end to end (the statistics too): within 1e-10 of the fp64 reference."""
    inputs = _inputs(shape, config, "cpu", seed=1)
    (outs, grads), (ref_outs, ref_grads), _ = _run(backend, shape, config, torch.float64, inputs)
    for name, o, r in zip(("y", "h"), outs, ref_outs):
        assert o.dtype == torch.float64
        assert_close(name, o, r, atol=1e-10, rtol=1e-10)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_is_zeros_and_rstd_is_the_rms(backend):
    """What the forward kernel returns for RMSNorm: mean zeros (N,), rstd 1 / sqrt(mean(h^2) + eps)."""
    device = device_for(backend)
    x, r = torch.randn(5, 33, device=device), torch.randn(5, 33, device=device)
    w, b = torch.randn(33, device=device), torch.zeros(33, device=device)
    y, h, mean, rstd = backends.Kernels(backend).add_layer_norm_fwd(x, r, w, b, EPS, 0.0, philox.pack(0, 0), True)
    assert torch.equal(mean, torch.zeros(5, device=device))
    assert_close("rstd", rstd, torch.rsqrt(h.double().pow(2).mean(-1) + EPS).float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", kernel_backends("triton"))
def test_triton_chunked_backward(backend, monkeypatch):
    """Rows with BLOCK_C >= SPLIT_BLOCK_C (C > 8192) take the column-chunked backward: forced here
    on rows of 45 in chunks of 16 (a ragged last one), with a residual, dropout and dh."""
    from fastformer.triton_kernels import add_layer_norm as aln
    monkeypatch.setattr(aln, "SPLIT_BLOCK_C", 16)
    monkeypatch.setattr(aln, "_CHUNK_C", 16)
    monkeypatch.setattr(aln, "_PART_BLOCK_N", 32)
    monkeypatch.setattr(aln, "_add_layer_norm_bwd", None)  # fails if the row kernel is taken
    device = device_for(backend)
    g = torch.Generator().manual_seed(8)
    x, r, dy, dh = (torch.randn(3, 45, generator=g, dtype=torch.float64) for _ in range(4))
    w = 1 + 0.5 * torch.randn(45, generator=g, dtype=torch.float64)
    rng = (2**33 + 1, 5)
    y, h, mean, rstd = aln.add_layer_norm_fwd(*(t.float().to(device) for t in (x, r, w, torch.zeros_like(w))), EPS,
                                              0.25, philox.pack(*rng), True)
    dx, dres, dw, _ = aln.add_layer_norm_bwd(dy.float().to(device), dh.float().to(device), h, w.float().to(device),
                                             mean, rstd, 0.25, philox.pack(*rng), True, True)
    leaves = [t.clone().requires_grad_() for t in (x.float().double(), r.float().double(), w.float().double())]
    y_ref, h_ref = reference.add_layer_norm(*leaves[:2], leaves[2], None, EPS, 0.25, prenorm=True, rng=rng,
                                            rms_norm=True)
    want = torch.autograd.grad([y_ref, h_ref], [leaves[0], leaves[1], leaves[2]], [dy.float().double(),
                                                                                  dh.float().double()])
    assert_close("y", y.double().cpu(), y_ref, atol=2e-5, rtol=1e-5)
    for name, got, ref in zip(("dx", "dresidual", "dweight"), (dx, dres, dw), want):
        assert_close(name, got.double().cpu(), ref, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- dropout bits


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_exactly_the_reference_mask(backend):
    """Same (seed, offset) as the reference: identical h; the backward regenerates the same mask
    (dy = 0, dh = 1: dx is exactly keep * scale)."""
    device = device_for(backend)
    x = torch.randn(6, 300, device=device)
    w, b = torch.ones(300, device=device), torch.zeros(300, device=device)
    kern = backends.Kernels(backend)
    for seed, offset in ((5, 0), (2**40 + 3, 17)):
        y, h, mean, rstd = kern.add_layer_norm_fwd(x, None, w, b, EPS, 0.4, philox.pack(seed, offset), True)
        y_ref, h_ref = reference.add_layer_norm(x, None, None, None, EPS, 0.4, prenorm=True, rng=(seed, offset),
                                                rms_norm=True)
        assert torch.equal(h, h_ref)
        assert_close("y", y, y_ref, atol=2e-5, rtol=1e-5)
        dx, _, _, _ = kern.add_layer_norm_bwd(torch.zeros_like(h), torch.ones_like(h), h, w, mean, rstd, 0.4,
                                              philox.pack(seed, offset), False, True)
        assert torch.equal(dx, (h_ref != 0).float() / 0.6)


# ---------------------------------------------------------------- empty input


@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "prenorm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows(backend, prenorm):
    d = device_for(backend)
    x = torch.randn(0, 16, device=d, requires_grad=True)
    r = torch.randn(0, 16, device=d, requires_grad=True)
    w = torch.randn(16, device=d, requires_grad=True)
    with fastformer.use_backend(backend):
        out = ops.add_layer_norm(x, r, w, None, dropout_p=0.1, prenorm=prenorm, rms_norm=True)
    y = out[0] if prenorm else out
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16, device=d))
    assert x.grad.shape == (0, 16) and r.grad.shape == (0, 16)


# ---------------------------------------------------------------- the C++ op and the fast path


def _cpp_missing():
    from test_cpp_autograd_aln_ffn_emb import _missing
    return _missing()


@pytest.mark.skipif(_cpp_missing() is not None, reason=str(_cpp_missing()))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "prenorm"])
@pytest.mark.parametrize("x_bias", [False, True], ids=["", "x_bias"])
def test_cpp_op_is_bit_equal_to_the_function(monkeypatch, p, prenorm, x_bias):
    """fastformer::add_layer_norm(..., rms_norm=True) (csrc/autograd) against AddLayerNormFunction
    with the cpu kernels: the same bits, outputs and every gradient."""
    from test_cpp_autograd_aln_ffn_emb import _assert_bit_equal, _aln_inputs, _run as run
    kernels = backends.BACKENDS["cpu"].kernels("cpu")
    rng = philox.pack(1234567, 0)
    monkeypatch.setattr(philox, "draw", lambda dropout_p, device=None: rng)
    shape = (5, 67)
    inputs = _aln_inputs(shape, True, x_bias)
    g = torch.Generator().manual_seed(5)
    ups = [torch.randn(shape, generator=g), torch.randn(shape, generator=g) if prenorm else None]

    def cpp(x, res, w, b, xb):
        return tuple(torch.ops.fastformer.add_layer_norm(x, res, w, b, 1e-5, p, prenorm, rng, xb, True))

    def py(x, res, w, b, xb):
        return tuple(AddLayerNormFunction.apply(x, res, w, b, 1e-5, p, prenorm, kernels, xb, True))

    _assert_bit_equal("outputs/grads", sum(run(cpp, inputs, ups), []), sum(run(py, inputs, ups), []))


@pytest.mark.skipif(_cpp_missing() is not None, reason=str(_cpp_missing()))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_the_common_call_takes_the_fast_path(monkeypatch, p, bias):
    """T5's call (no bias) and one with a bias: the fast path is taken and gives the checked
    path's bits, gradients and generator state included."""
    module = __import__("sys").modules["fastformer.ops.add_layer_norm"]
    g = torch.Generator().manual_seed(7)
    leaves = [torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g), 1 + torch.randn(16, generator=g),
              torch.randn(16, generator=g) if bias else None]

    def run(call):
        ts = [None if t is None else t.clone().requires_grad_() for t in leaves]
        torch.manual_seed(11)
        out = call(*ts)
        grads = torch.autograd.grad(out, [t for t in ts if t is not None], torch.ones_like(out))
        return out.detach(), grads, torch.get_rng_state()

    with fastformer.use_backend("cpu"):
        want = run(lambda x, r, w, b: module._checked(x, r, w, b, 1e-5, p, False, None, True))
        original = module._checked

        def refuse(*args):
            raise AssertionError("the checked path ran")

        monkeypatch.setattr(module, "_checked", refuse)
        got = run(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5, p, rms_norm=True))
        monkeypatch.setattr(module, "_checked", original)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    assert torch.equal(got[2], want[2])


@pytest.mark.slow  # a compile: the slow tier, as the compile suites are
@pytest.mark.parametrize("backend", CPU)
def test_compiles_to_one_graph_equal_to_eager(backend):
    """torch.compile through the kernels' fakes (fake_ops.py, rms_norm included): one graph, the
    eager bits, dropout included."""
    from test_compile_dropout import _assert_one_graph, _loss_and_grads
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(2, 3, 20, generator=g), torch.randn(2, 3, 20, generator=g), torch.randn(20, generator=g)]

    def fn(x, r, w):
        return ops.add_layer_norm(x, r, w, None, EPS, 0.2, prenorm=True, rms_norm=True)[0]

    with fastformer.use_backend(backend):
        _assert_one_graph(fn, *inputs)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        want, _ = _loss_and_grads(fn, inputs, seed=11)
        got, _ = _loss_and_grads(compiled, inputs, seed=11)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output/grad {i}: compiled differs from eager"


# ---------------------------------------------------------------- determinism


def _rms_case(prenorm):
    def case(g, dev, big):
        x, res = (torch.randn(600 if big else 9, 64, generator=g).to(dev) for _ in range(2))
        w = (1 + 0.1 * torch.randn(64, generator=g)).to(dev)

        def run(x, res, w):
            out = ops.add_layer_norm(x, res, w, None, dropout_p=0.1, prenorm=prenorm, rms_norm=True)
            return torch.cat([t.flatten() for t in out]) if prenorm else out
        return (x, res, w), run
    return case


DETERMINISM = {"add_layer_norm_rms": _rms_case(False), "add_layer_norm_rms_prenorm": _rms_case(True)}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("add_layer_norm", DETERMINISM, dropout=DETERMINISM))


# ---------------------------------------------------------------- bad input


def _rms(rms_norm, **kw):
    return lambda: ops.add_layer_norm(_t(4, 6), _t(4, 6), _t(6), None, rms_norm=rms_norm, **kw)


RMS_BAD_INPUT = {
    "rms_norm_int": (_rms(1), TypeError, "rms_norm must be a bool, got int 1"),
    "rms_norm_str": (_rms("yes"), TypeError, "rms_norm must be a bool, got str"),
    "rms_norm_none": (_rms(None), TypeError, "rms_norm must be a bool, got NoneType"),
    "rms_norm_tensor": (_rms(torch.tensor(True)), TypeError, "rms_norm must be a bool, got Tensor"),
    "rms_weight_shape": (lambda: ops.add_layer_norm(_t(4, 6), None, _t(5), None, rms_norm=True), ValueError,
                         "weight must have shape"),
    "rms_bias_shape": (lambda: ops.add_layer_norm(_t(4, 6), None, _t(6), _t(7), rms_norm=True), ValueError,
                       "bias must have shape"),
    "rms_weight_2d": (lambda: ops.add_layer_norm(_t(4, 6), None, _t(1, 6), None, rms_norm=True), ValueError,
                      "weight must have 1 dimensions"),
}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(add_layer_norm=RMS_BAD_INPUT)

_fwd = hostile.kernel_call("add_layer_norm_fwd", lambda: dict(
    x=_t(4, 6), residual=_t(4, 6), weight=_t(6), bias=_t(6), eps=1e-5, dropout_p=0.0, rms_norm=True))
_bwd = hostile.kernel_call("add_layer_norm_bwd", lambda: dict(
    dy=_t(4, 6), dh=None, h=_t(4, 6), weight=_t(6), mean=_t(4), rstd=_t(4).abs(), dropout_p=0.0,
    has_residual=True, rms_norm=True))

BAD_KERNEL_ARGS = {  # the C++ checks hold in RMSNorm mode too
    "add_layer_norm_rms": {
        "x_1d": (lambda: _fwd(x=_t(6), residual=None), "x must be 2-D (N, C)"),
        "weight_shape": (lambda: _fwd(weight=_t(5)), "weight must have shape"),
        "bias_dtype": (lambda: _fwd(bias=_t(6, dtype=torch.float64)), "bias must have the dtype"),
        "eps_zero": (lambda: _fwd(eps=0.0), "eps must be"),
        "bwd_mean_shape": (lambda: _bwd(mean=_t(3)), "mean must have shape"),
        "bwd_rstd_dtype": (lambda: _bwd(rstd=_t(4, dtype=torch.float64)), "rstd must be float32"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


# ---------------------------------------------------------------- the cuda kernels' other thread orders
_SCHEDULED = "cuda and (forward_and_every_gradient or dropout_is_exactly) and not bf16"
test_other_thread_schedule = other_simt_schedules_test(
    ("test_add_layer_norm_rms.py",), {"reverse": _SCHEDULED, "warp_ahead": _SCHEDULED},
    """The RMSNorm kernels' row sums (warp shuffles, block reductions for C = 4097) with the SIMT
    harness's threads run last to first and warp by warp to each barrier: the fp32 cases and the
    dropout bits in a fresh process each.""")
