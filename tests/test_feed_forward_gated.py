"""feed_forward's gated form (``w3``: GeGLU / ReGLU / SwiGLU) and the tanh-approximate GELU
(``"gelu_tanh"``): the reference against torch's composition and transformers' T5 feed-forward,
then every kernel backend against the reference (forward and every gradient, fp32 / bf16 / fp64),
dropout bits, odd shapes, gradcheck, opcheck."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import feed_forward, reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
NAMES = ("x", "w1", "b1", "w2", "b2", "w3", "b3")
TORCH_ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
             "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

# name: (has b1, has b2, has b3, activation, dropout_p); None: the plain form with that activation
CONFIGS = {
    "geglu_tanh_t5": (False, False, False, "gelu_tanh", 0.0),  # T5 v1.1 / Flan-T5
    "geglu_tanh_dropout": (True, True, True, "gelu_tanh", 0.2),
    "swiglu": (False, False, False, "silu", 0.0),  # LLaMA
    "swiglu_b3_dropout": (False, True, True, "silu", 0.3),
    "reglu_b1_dropout": (True, False, False, "relu", 0.1),
    "geglu_erf": (True, True, True, "gelu", 0.0),
    "plain_gelu_tanh": (True, True, None, "gelu_tanh", 0.0),
    "plain_gelu_tanh_dropout": (False, True, None, "gelu_tanh", 0.25),
}
# (x shape, F): E = 1, F = 1023, a single row, odd rows and widths. The broad sweep runs on cpu;
# the emulated backends (Triton's interpreter, the SIMT harness) take two shapes and fewer configs.
SHAPES = [((1, 64), 1023), ((7, 1), 29), ((5, 3, 40), 72), ((113, 33), 17)]
EMULATED_SHAPES = [((5, 7), 29), ((1, 1, 40), 16)]  # F 16: the CUDA kernels' 8-wide vector path
EMULATED_CONFIGS = ("geglu_tanh_t5", "geglu_tanh_dropout", "swiglu_b3_dropout", "plain_gelu_tanh_dropout")


def _cases():
    for backend in BACKENDS:
        name = backend.values[0]
        emulated = name != "cpu" and not torch.cuda.is_available()
        shapes = EMULATED_SHAPES if emulated else SHAPES
        configs = EMULATED_CONFIGS if emulated else tuple(CONFIGS)
        for shape in shapes:
            for config in configs:
                for dtype, dt in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    if dtype == torch.bfloat16 and shape[0][-1] == 1:
                        # E = 1 in bf16: a gradient element is a sum of a few rounded products, and
                        # the reference's own error one draw of rounding luck, too few for the rule
                        # (fp32 and fp64 keep E = 1)
                        continue
                    yield pytest.param(name, *shape, config, dtype, marks=backend.marks,
                                       id=f"{backend.id}-{'x'.join(map(str, shape[0]))}-F{shape[1]}-{config}-{dt}")


def _inputs(shape, F_, config, device="cpu", dtype=torch.float32, seed=0):
    has_b1, has_b2, has_b3, _, _ = CONFIGS[config]
    E = shape[-1]
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    x, w1, w2 = r(*shape), r(F_, E) / math.sqrt(E), r(E, F_) / math.sqrt(F_)
    b1, b2 = (0.5 * r(F_) if has_b1 else None), (0.5 * r(E) if has_b2 else None)
    w3 = r(F_, E) / math.sqrt(E) if has_b3 is not None else None
    b3 = 0.5 * r(F_) if has_b3 else None
    return [x, w1, b1, w2, b2, w3, b3]


def _forward_backward(fn, inputs, upstream):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    present = [(n, leaf) for n, leaf in zip(NAMES, leaves) if leaf is not None]
    grads = torch.autograd.grad(out, [leaf for _, leaf in present], upstream)
    return out.detach(), {n: gr for (n, _), gr in zip(present, grads)}


def _op(activation, p, backend=None, rng_seed=1234):
    def fn(x, w1, b1, w2, b2, w3, b3):
        torch.manual_seed(rng_seed)  # the op draws the (seed, offset) _ref_rng gives
        with fastformer.use_backend(backend) if backend else contextlib.nullcontext():
            return feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=p, w3=w3, b3=b3)
    return fn


def _ref(activation, p, rng_seed=1234):
    torch.manual_seed(rng_seed)
    rng = philox.next_seed()

    def fn(x, w1, b1, w2, b2, w3, b3):
        return reference.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=p, rng=rng, w3=w3, b3=b3)
    return fn


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reference_matches_torch_composition(config):
    _, _, has_b3, activation, p = CONFIGS[config]
    inputs = _inputs((3, 5, 24), 40, config)
    upstream = torch.randn(3, 5, 24)
    rng = (77, 3)

    def torch_version(x, w1, b1, w2, b2, w3, b3):
        h = TORCH_ACT[activation](F.linear(x, w1, b1))
        if w3 is not None:
            h = h * F.linear(x, w3, b3)
        if p > 0:  # the shared Philox mask over (rows, F), applied by hand
            h = h * philox.keep_mask(h.shape, p, *rng).to(h.dtype) / (1 - p)
        return F.linear(h, w2, b2)

    def ref(x, w1, b1, w2, b2, w3, b3):
        return reference.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=p, rng=rng, w3=w3, b3=b3)

    out, grads = _forward_backward(ref, inputs, upstream)
    want, want_grads = _forward_backward(torch_version, inputs, upstream)
    assert_close("out", out, want, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(want_grads)
    for name in grads:
        assert_close(f"d{name}", grads[name], want_grads[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("proj, activation, gated", [("gated-gelu", "gelu_tanh", True), ("relu", "relu", False),
                                                     ("gated-silu", "silu", True)])
def test_reference_is_transformers_t5_feed_forward(proj, activation, gated):
    """T5 v1.1 / Flan-T5 (T5DenseGatedActDense, gelu_new) and T5 v1.0 (T5DenseActDense, relu) as
    transformers computes them, weights wi_0 -> w1, wi_1 -> w3, wo -> w2, no biases."""
    from transformers import T5Config
    from transformers.models.t5 import modeling_t5

    torch.manual_seed(0)
    config = T5Config(d_model=24, d_ff=40, feed_forward_proj=proj, dropout_rate=0.0)
    layer = (modeling_t5.T5DenseGatedActDense if gated else modeling_t5.T5DenseActDense)(config).eval()
    x = torch.randn(2, 5, 24, requires_grad=True)
    want = layer(x)
    want.backward(torch.ones_like(want))
    w1 = (layer.wi_0 if gated else layer.wi).weight
    w3 = layer.wi_1.weight if gated else None
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, layer.wo.weight)]
    w3_leaf = w3.detach().clone().requires_grad_() if gated else None
    out = reference.feed_forward(leaves[0], leaves[1], None, leaves[2], None, activation=activation, w3=w3_leaf)
    out.backward(torch.ones_like(out))
    assert_close("out", out.detach(), want.detach(), atol=1e-5, rtol=1e-5)
    assert_close("dx", leaves[0].grad, x.grad, atol=1e-5, rtol=1e-5)
    assert_close("dwi_0", leaves[1].grad, w1.grad, atol=1e-5, rtol=1e-5)
    assert_close("dwo", leaves[2].grad, layer.wo.weight.grad, atol=1e-5, rtol=1e-5)
    if gated:
        assert_close("dwi_1", w3_leaf.grad, w3.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- kernels against the reference


def _run(backend, shape, F_, config, dtype):
    _, _, _, activation, p = CONFIGS[config]
    inputs = _inputs(shape, F_, config, device_for(backend))
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(inputs[0].device)
    cast = [None if t is None else t.to(dtype) for t in inputs]
    out = _forward_backward(_op(activation, p, backend), cast, upstream.to(dtype))
    lowp = _forward_backward(_ref(activation, p), cast, upstream.to(dtype))
    truth = _forward_backward(_ref(activation, p), [None if t is None else t.double() for t in cast],
                              upstream.to(dtype).double())
    return out, lowp, truth


@pytest.mark.parametrize("backend, shape, F_, config, dtype", list(_cases()))
def test_forward_and_every_gradient(backend, shape, F_, config, dtype):
    """FlashAttention's rule against an fp64 truth: the kernel's error at most 2x (+ a small atol)
    the reference's own error in the same precision, forward and every gradient."""
    (out, grads), (lp, lp_grads), (truth, truth_grads) = _run(backend, shape, F_, config, dtype)
    assert out.dtype == dtype and out.shape == truth.shape

    def slack(t):
        # plus one ulp at the tensor's largest magnitude: with a single row or E = 1 a tensor has a
        # handful of elements, each the end of a few roundings (the GEMM's, pre's, the product's)
        # taken in another order than the reference's, whose own error is then one draw of luck
        return t.abs().max().item() * (2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8) if t.numel() else 0.0

    assert_close_lowp("out", out, truth, lp, factor=2.0, atol=1e-6 + slack(truth))
    assert set(grads) == set(truth_grads)
    for name in truth_grads:
        assert grads[name].dtype == dtype
        assert_close_lowp(f"d{name}", grads[name], truth_grads[name], lp_grads[name], factor=2.0,
                          atol=1e-6 + slack(truth_grads[name]))


@pytest.mark.parametrize("shape, F_", [((13, 33), 65), ((7, 1), 29), ((1, 40), 1023)],
                         ids=["13x33-F65", "7x1-F29", "1x40-F1023"])
@pytest.mark.parametrize("config", ["geglu_tanh_dropout", "swiglu", "reglu_b1_dropout", "plain_gelu_tanh_dropout"])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_float64_is_the_reference(backend, config, shape, F_):
    (out, grads), _, (truth, truth_grads) = _run(backend, shape, F_, config, torch.float64)
    assert_close("out", out, truth, atol=1e-10, rtol=1e-10)
    for name in truth_grads:
        assert_close(f"d{name}", grads[name], truth_grads[name], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keeps_the_reference_bits(backend):
    """Identity weights and relu: out = h = keep / (1 - p) exactly where the shared Philox mask
    keeps, with (rows, F) the same as the plain form; dx carries the same mask."""
    device = device_for(backend)
    N, F_, p = 9, 40, 0.5
    x, eye = torch.ones(N, F_, device=device), torch.eye(F_, device=device)
    kern = backends.Kernels(backend)
    rng = philox.pack(11, 2**32 - 30)  # the counter's low word wraps inside the tensor
    out, pre = kern.feed_forward_fwd(x, eye, None, eye, None, "relu", p, rng, eye, None)
    keep = philox.keep_mask((N, F_), p, 11, 2**32 - 30, device=device)
    assert pre.shape == (N, 2 * F_)
    assert torch.equal(out != 0, keep)
    assert_close("kept", out[keep], torch.full_like(out[keep], 1 / (1 - p)), atol=0, rtol=1e-6)
    dx = kern.feed_forward_bwd(torch.ones_like(out), x, eye, eye, pre, False, False, "relu", p, rng, eye, False)[0]
    assert torch.equal(dx != 0, keep)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_keeps_gate_and_up_pre_activations(backend):
    """What the gated forward keeps for backward: [x w1^T + b1 | x w3^T + b3] (N, 2F), for relu too."""
    x, w1, b1, w2, b2, w3, b3 = _inputs((6, 16), 24, "geglu_tanh_dropout", device_for(backend))
    for activation in ("relu", "gelu_tanh"):
        _, pre = backends.Kernels(backend).feed_forward_fwd(x, w1, b1, w2, b2, activation, 0.2, philox.pack(4, 0),
                                                            w3, b3)
        want = torch.cat([x @ w1.t() + b1, x @ w3.t() + b3], dim=1)
        assert_close("pre", pre, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
def test_zero_rows(backend):
    x, w1, b1, w2, b2, w3, b3 = _inputs((0, 8), 16, "geglu_tanh_dropout", device_for(backend))
    out, grads = _forward_backward(_op("gelu_tanh", 0.1, backend), [x, w1, b1, w2, b2, w3, b3],
                                   torch.zeros(0, 8, device=x.device))
    assert out.shape == (0, 8)
    for name in ("w1", "b1", "w2", "b2", "w3", "b3"):
        assert torch.equal(grads[name], torch.zeros_like(grads[name])), name


@pytest.mark.parametrize("b1, b3", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, activation, b1, b3):
    """gelu_tanh's derivative is the tanh form's own (not erf gelu's)."""
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w1, w2, w3, b2 = make(3, 2, 5), make(7, 5), make(5, 7), make(7, 5), make(5)
    bb1, bb3 = (make(7) if b1 else None), (make(7) if b3 else None)
    fn = _op(activation, 0.3, backend, rng_seed=42)
    assert torch.autograd.gradcheck(lambda *t: fn(t[0], t[1], bb1, t[2], b2, t[3], bb3), (x, w1, w2, w3),
                                    eps=1e-6, atol=1e-5, rtol=1e-3)
    if b1 or b3:
        biases = [b for b in (bb1, bb3) if b is not None]
        assert torch.autograd.gradcheck(
            lambda *bs: fn(x, w1, bs[0] if b1 else None, w2, b2, w3, bs[-1] if b3 else None), tuple(biases),
            eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    x, w1, b1, w2, b2, w3, b3 = _inputs((6, 24), 40, "geglu_tanh_dropout", dtype=dtype)
    for activation, p, bias in (("gelu_tanh", 0.2, True), ("silu", 0.0, False)):
        bb1, bb3 = (b1, b3) if bias else (None, None)
        fwd = (x, w1, bb1, w2, b2, activation, p, philox.pack(5, 2), w3, bb3)
        torch.library.opcheck(ops.feed_forward_fwd.default, fwd)
        _, pre = ops.feed_forward_fwd(*fwd)
        bwd = (torch.randn_like(x), x, w1, w2, pre, bias, True, activation, p, philox.pack(5, 2), w3, bias)
        torch.library.opcheck(ops.feed_forward_bwd.default, bwd)


@pytest.mark.parametrize("backend", CPU)
def test_cpp_autograd_op_is_the_python_function(backend):
    """fastformer::feed_forward (the C++ autograd op the eager call takes) and FeedForwardFunction,
    gated, bit for bit, every gradient."""
    from fastformer.autograd import FeedForwardFunction

    kernels = backends.Kernels(backend)
    inputs = _inputs((4, 3, 16), 33, "swiglu_b3_dropout")
    up = torch.randn(4, 3, 16)

    def cpp(x, w1, b1, w2, b2, w3, b3):
        torch.manual_seed(0)  # the draw the Function makes
        rng = philox.draw(0.3, x.device)
        return torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, "silu", 0.3, rng, w3, b3)

    def py(x, w1, b1, w2, b2, w3, b3):
        torch.manual_seed(0)
        return FeedForwardFunction.apply(x.reshape(-1, 16), w1, b1, w2, b2, "silu", 0.3, kernels, w3, b3).view(4, 3, 16)

    a, ga = _forward_backward(cpp, inputs, up)
    b, gb = _forward_backward(py, inputs, up)
    assert torch.equal(a, b)
    assert set(ga) == set(gb) == {"x", "w1", "w2", "b2", "w3", "b3"}
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("backend", CPU)
def test_gated_call_takes_the_fast_path(backend, p, monkeypatch):
    """The eager gated call skips the Python checks (internal/fast.py) and gives the checked path's
    bits, gradients included."""
    import sys

    module = sys.modules["fastformer.ops.feed_forward"]
    inputs = _inputs((2, 3, 16), 32, "geglu_tanh_dropout")
    up = torch.randn(2, 3, 16)

    def checked(x, w1, b1, w2, b2, w3, b3):
        torch.manual_seed(11)
        return module._checked(x, w1, b1, w2, b2, "gelu_tanh", p, w3, b3)

    with fastformer.use_backend(backend):
        want = _forward_backward(checked, inputs, up)
        monkeypatch.setattr(module, "_checked", lambda *a: pytest.fail("the checked path ran"))
        got = _forward_backward(_op("gelu_tanh", p, backend, rng_seed=11), inputs, up)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name
