"""The C++ autograd ops ``fastformer::add_layer_norm``, ``feed_forward`` and ``embedding``
(csrc/autograd/<op>.cpp: one differentiable op each, its backward node in C++) against the Python
``torch.autograd.Function`` they replace (fastformer/autograd/<op>.py, with the cpu backend's
kernels): bit-equal forward outputs and every input gradient, with and without dropout (the same
philox tensor on both sides), for each option and odd shapes; the same under ``torch.no_grad()``
and ``torch.inference_mode()``; and one case each against fastformer/ops/reference.py.

Host cost per call, forward + backward, at tiny shapes: 16 chained calls then one backward, thread CPU
time, median of 41 repeats with the three paths interleaved, ``torch.set_num_threads(1)``; measured on
the shared 2-core development machine under load (three runs, the ranges; absolute figures roughly
double those of an idle machine, the ratios hold). ``python tests/test_cpp_autograd_aln_ffn_emb.py``
measures again:

    us per call      C++ op    Python Function    PyTorch composition          C++ / PyTorch
    add_layer_norm   47-53     73-83              55-59  (layer_norm(r + dropout(x)))   0.86-0.91
    feed_forward     69-79     98-115             106-130 (linear(dropout(relu(linear))))  0.55-0.65
    embedding        52-63     77-86              85-112 (embedding * s + embedding, dropout)  0.56-0.60

    (add_layer_norm: x (4, 8) with a residual, postnorm; feed_forward: (4, 8) -> 16 -> 8 with biases, relu;
    embedding: 4 ids of a (32, 8) table plus a (16, 8) positional one; dropout_p 0; each call's output
    added to the chain's running tensor for embedding.)

The C++ op costs 0.6-0.7x the Python Function everywhere. What is left of add_layer_norm is mostly its
two kernels' own glue (csrc/cpu/add_layer_norm.cpp: checks, four output allocations: about 40% of the
op's instructions under callgrind), the Python-to-boxed call of the op (argument parsing, ~15%), and
torch's custom-Function machinery (node, _wrap_outputs, saved variables; CppNode::apply demangles the
node's name on every backward, ~8%). Since then the node is hand-written (a torch::autograd::Node with
SavedVariable members, tests/test_cpp_autograd_nodes.py), without that machinery: the figures above
predate it (benchmarks/results/cpu-amd-epyc-avx512-2t/overhead_hostpath/NOTES.md has the after).
"""
import contextlib
import statistics
import time

import pytest
import torch

import fastformer
from fastformer import _ext, backends, philox
from fastformer.autograd import AddLayerNormFunction, EmbeddingFunction, FeedForwardFunction
from fastformer.ops import reference

OPS = ("add_layer_norm", "feed_forward", "embedding")
SEED = 1234567


def _missing():
    if _ext.load_error() is not None:
        return _ext.load_error()
    lacking = [op for op in OPS if not hasattr(torch.ops.fastformer, op)]
    if lacking:
        return (f"the loaded fastformer library predates csrc/autograd/ ({', '.join(lacking)} missing); "
                "rebuild it")
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def kernels():
    return backends.BACKENDS["cpu"].kernels("cpu")


@pytest.fixture
def rng(monkeypatch):
    """The one philox tensor both paths use: the Python Functions draw it through philox.draw."""
    t = philox.pack(SEED, 0)
    monkeypatch.setattr(philox, "draw", lambda dropout_p, device=None: t)
    return t


def _leaves(tensors, grad=True):
    """Fresh leaf copies (floating ones requiring grad), so both paths start from equal inputs."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        else:
            c = t.detach().clone()
            out.append(c.requires_grad_(grad and c.is_floating_point()))
    return out


def _run(fn, inputs, upstream):
    """fn(*leaves) -> outputs; the gradient of sum(out * up) for each (out, up) with up not None,
    for every input that requires grad (None where an input gets none)."""
    leaves = _leaves(inputs)
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, u) for o, u in zip(outs, upstream) if u is not None]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [u for _, u in pairs], allow_unused=True)
    it = iter(grads)
    return [o.detach() for o in outs], [next(it) if t is not None and t.requires_grad else None for t in leaves]


def _assert_bit_equal(what, a, b):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{i}]: {x is None} vs {y is None} (None)"
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}[{i}]: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
        assert torch.equal(x, y), f"{what}[{i}]: max diff {(x.double() - y.double()).abs().max().item()}"


def _no_grad_modes():
    """Where no graph is recorded: no_grad, inference_mode, and grad mode with no input requiring grad
    (``frozen``); the C++ ops then run the forward kernel without their node."""
    return [pytest.param(torch.no_grad, id="no_grad"), pytest.param(torch.inference_mode, id="inference_mode"),
            pytest.param(contextlib.nullcontext, id="frozen")]


# ------------------------------------------------------------------ add_layer_norm
ALN_SHAPES = [(1, 1023), (5, 64), (3, 7)]


def _aln_inputs(shape, residual, x_bias, dtype=torch.float32):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    C = shape[-1]
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return [r(*shape), r(*shape) if residual else None, 1 + 0.5 * r(C), 0.5 * r(C), r(C) if x_bias else None]


def _aln_cpp(prenorm, p, rng):
    def fn(x, res, w, b, xb):
        return tuple(torch.ops.fastformer.add_layer_norm(x, res, w, b, 1e-5, p, prenorm, rng, xb))
    return fn


def _aln_py(prenorm, p, kernels):
    def fn(x, res, w, b, xb):
        return tuple(AddLayerNormFunction.apply(x, res, w, b, 1e-5, p, prenorm, kernels, xb))
    return fn


@pytest.mark.parametrize("shape", ALN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "prenorm"])
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
@pytest.mark.parametrize("x_bias", [False, True], ids=["", "x_bias"])
def test_add_layer_norm_bit_equal(kernels, rng, shape, p, prenorm, residual, x_bias):
    inputs = _aln_inputs(shape, residual, x_bias)
    g = torch.Generator().manual_seed(5)
    ups = [torch.randn(shape, generator=g), torch.randn(shape, generator=g) if prenorm else None]
    _assert_bit_equal("outputs/grads", sum(_run(_aln_cpp(prenorm, p, rng), inputs, ups), []),
                      sum(_run(_aln_py(prenorm, p, kernels), inputs, ups), []))


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("used", ["y", "h"])
def test_add_layer_norm_prenorm_one_output_used(kernels, rng, p, used):
    """set_materialize_grads(False): the unused output's gradient comes undefined (dy zeros)."""
    inputs = _aln_inputs((4, 33), True, True)
    up = torch.randn(4, 33)
    ups = [up, None] if used == "y" else [None, up]
    _assert_bit_equal("outputs/grads", sum(_run(_aln_cpp(True, p, rng), inputs, ups), []),
                      sum(_run(_aln_py(True, p, kernels), inputs, ups), []))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_add_layer_norm_other_dtypes(kernels, rng, dtype):
    inputs = _aln_inputs((6, 40), True, True, dtype)
    ups = [torch.randn(6, 40, dtype=dtype), torch.randn(6, 40, dtype=dtype)]
    _assert_bit_equal("outputs/grads", sum(_run(_aln_cpp(True, 0.1, rng), inputs, ups), []),
                      sum(_run(_aln_py(True, 0.1, kernels), inputs, ups), []))


def test_add_layer_norm_some_inputs_frozen(kernels, rng):
    """Only some inputs require grad: those get the Python's gradients, the others none."""
    x, res, w, b, xb = _aln_inputs((5, 64), True, True)
    out = []
    for fn in (_aln_cpp(False, 0.1, rng), _aln_py(False, 0.1, kernels)):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, h = fn(xl, res, wl, b, xb)
        assert not h.requires_grad
        y.backward(torch.ones_like(y))
        out.append([y.detach(), h, xl.grad, wl.grad])
    _assert_bit_equal("outputs/grads", *out)


@pytest.mark.parametrize("mode", _no_grad_modes())
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "prenorm"])
def test_add_layer_norm_without_grad(kernels, rng, mode, prenorm):
    inputs = _leaves(_aln_inputs((1, 1023), True, True), grad=mode is not contextlib.nullcontext)
    with mode():
        a = _aln_cpp(prenorm, 0.1, rng)(*inputs)
        b = _aln_py(prenorm, 0.1, kernels)(*inputs)
    assert not any(t.requires_grad for t in a)
    _assert_bit_equal("outputs", list(a), list(b))


def test_add_layer_norm_against_the_reference(rng):
    inputs = _aln_inputs((3, 1023), True, True, torch.float64)
    ups = [torch.randn(3, 1023, dtype=torch.float64), torch.randn(3, 1023, dtype=torch.float64)]
    outs, grads = _run(_aln_cpp(True, 0.1, rng), inputs, ups)
    ref_outs, ref_grads = _run(lambda x, r, w, b, xb: reference.add_layer_norm(
        x, r, w, b, 1e-5, 0.1, prenorm=True, rng=rng, x_bias=xb), inputs, ups)
    for a, b in zip(outs + grads, ref_outs + ref_grads):  # the kernels keep mean / rstd in fp32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ feed_forward
FFN_SHAPES = [(1, 1023, 5), (4, 16, 33), (3, 7, 9)]  # (N, E, F)


def _ffn_inputs(shape, b1, b2, dtype=torch.float32):
    N, E, F_ = shape
    g = torch.Generator().manual_seed(N * 10000 + E * 100 + F_)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return [r(N, E), r(F_, E) / E ** 0.5, r(F_) if b1 else None, r(E, F_) / F_ ** 0.5, r(E) if b2 else None]


def _ffn_cpp(activation, p, rng):
    return lambda x, w1, b1, w2, b2: torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, activation, p, rng)


def _ffn_py(activation, p, kernels):
    return lambda x, w1, b1, w2, b2: FeedForwardFunction.apply(x, w1, b1, w2, b2, activation, p, kernels)


@pytest.mark.parametrize("shape", FFN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("b1", [True, False], ids=["b1", "nob1"])
@pytest.mark.parametrize("b2", [True, False], ids=["b2", "nob2"])
def test_feed_forward_bit_equal(kernels, rng, shape, p, activation, b1, b2):
    inputs = _ffn_inputs(shape, b1, b2)
    ups = [torch.randn(shape[0], shape[1], generator=torch.Generator().manual_seed(3))]
    _assert_bit_equal("outputs/grads", sum(_run(_ffn_cpp(activation, p, rng), inputs, ups), []),
                      sum(_run(_ffn_py(activation, p, kernels), inputs, ups), []))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_feed_forward_other_dtypes(kernels, rng, dtype):
    inputs = _ffn_inputs((5, 24, 40), True, True, dtype)
    ups = [torch.randn(5, 24, dtype=dtype)]
    _assert_bit_equal("outputs/grads", sum(_run(_ffn_cpp("gelu", 0.1, rng), inputs, ups), []),
                      sum(_run(_ffn_py("gelu", 0.1, kernels), inputs, ups), []))


def test_feed_forward_non_contiguous_upstream(kernels, rng):
    """The upstream gradient of out.sum() is an expanded (stride 0) tensor: made contiguous first."""
    inputs = _ffn_inputs((4, 16, 33), True, True)
    res = []
    for fn in (_ffn_cpp("silu", 0.1, rng), _ffn_py("silu", 0.1, kernels)):
        leaves = _leaves(inputs)
        out = fn(*leaves)
        out.sum().backward()
        res.append([out.detach()] + [t.grad for t in leaves])
    _assert_bit_equal("outputs/grads", *res)


@pytest.mark.parametrize("mode", _no_grad_modes())
def test_feed_forward_without_grad(kernels, rng, mode):
    inputs = _leaves(_ffn_inputs((1, 1023, 5), True, True), grad=mode is not contextlib.nullcontext)
    with mode():
        a = _ffn_cpp("gelu", 0.1, rng)(*inputs)
        b = _ffn_py("gelu", 0.1, kernels)(*inputs)
    assert not a.requires_grad
    _assert_bit_equal("outputs", [a], [b])


def test_feed_forward_against_the_reference(rng):
    inputs = _ffn_inputs((3, 1023, 17), True, True, torch.float64)
    ups = [torch.randn(3, 1023, dtype=torch.float64)]
    outs, grads = _run(_ffn_cpp("gelu", 0.1, rng), inputs, ups)
    ref_outs, ref_grads = _run(lambda x, w1, b1, w2, b2: reference.feed_forward(
        x, w1, b1, w2, b2, activation="gelu", dropout_p=0.1, rng=rng), inputs, ups)
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------ embedding
EMB_SHAPES = [(1, 1023), (13, 16), (6, 7)]  # (N, D)


def _emb_inputs(shape, positional, dtype=torch.float32, V=11, P=9):
    N, D = shape
    g = torch.Generator().manual_seed(N * 1000 + D)
    ids = torch.randint(0, V, (N,), generator=g)
    ids[0] = 3  # the padding row of the padded cases is looked up
    weight = torch.randn(V, D, generator=g, dtype=torch.float64).to(dtype)
    if not positional:
        return [ids, weight, None, None]
    return [ids, weight, torch.randn(P, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randint(0, P, (N,), generator=g)]


def _emb_cpp(scale, p, padding_idx, rng):
    return lambda ids, w, pt, pos: torch.ops.fastformer.embedding(ids, w, pt, pos, scale, p, padding_idx, rng)


def _emb_py(scale, p, padding_idx, kernels):
    return lambda ids, w, pt, pos: EmbeddingFunction.apply(ids, w, pt, pos, scale, p, padding_idx, kernels)


@pytest.mark.parametrize("shape", EMB_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("positional", [True, False], ids=["positions", "nopositions"])
@pytest.mark.parametrize("padding_idx", [-1, 3], ids=["nopad", "pad3"])
def test_embedding_bit_equal(kernels, rng, shape, p, positional, padding_idx):
    inputs = _emb_inputs(shape, positional)
    ups = [torch.randn(*shape, generator=torch.Generator().manual_seed(3))]
    _assert_bit_equal("outputs/grads", sum(_run(_emb_cpp(2.5, p, padding_idx, rng), inputs, ups), []),
                      sum(_run(_emb_py(2.5, p, padding_idx, kernels), inputs, ups), []))


@pytest.mark.parametrize("frozen", ["weight", "positional"])
def test_embedding_one_table_frozen(kernels, rng, frozen):
    """needs_input_grad: the frozen table gets no gradient, the other the Python's."""
    ids, w, pt, pos = _emb_inputs((13, 16), True)
    res = []
    for fn in (_emb_cpp(1.5, 0.1, -1, rng), _emb_py(1.5, 0.1, -1, kernels)):
        wl, ptl = w.clone().requires_grad_(frozen != "weight"), pt.clone().requires_grad_(frozen != "positional")
        out = fn(ids, wl, ptl, pos)
        out.backward(torch.ones_like(out))
        res.append([out.detach(), wl.grad, ptl.grad])
    _assert_bit_equal("outputs/grads", *res)


def test_embedding_grad_of_one_table(kernels, rng):
    """torch.autograd.grad for one table only: the C++ node skips the other (the engine asks for one)."""
    ids, w, pt, pos = _emb_inputs((13, 16), True)
    res = []
    for fn in (_emb_cpp(1.5, 0.1, -1, rng), _emb_py(1.5, 0.1, -1, kernels)):
        wl, ptl = w.clone().requires_grad_(), pt.clone().requires_grad_()
        out = fn(ids, wl, ptl, pos)
        res.append(list(torch.autograd.grad(out, [ptl], torch.ones_like(out))))
    _assert_bit_equal("grads", *res)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_embedding_other_dtypes(kernels, rng, dtype):
    inputs = _emb_inputs((13, 16), True, dtype)
    ups = [torch.randn(13, 16, dtype=dtype)]
    _assert_bit_equal("outputs/grads", sum(_run(_emb_cpp(2.0, 0.1, 3, rng), inputs, ups), []),
                      sum(_run(_emb_py(2.0, 0.1, 3, kernels), inputs, ups), []))


@pytest.mark.parametrize("mode", _no_grad_modes())
def test_embedding_without_grad(kernels, rng, mode):
    inputs = _leaves(_emb_inputs((1, 1023), True), grad=mode is not contextlib.nullcontext)
    with mode():
        a = _emb_cpp(2.0, 0.1, 3, rng)(*inputs)
        b = _emb_py(2.0, 0.1, 3, kernels)(*inputs)
    assert not a.requires_grad
    _assert_bit_equal("outputs", [a], [b])


def test_embedding_against_the_reference(rng):
    ids, w, pt, pos = _emb_inputs((9, 1023), True, torch.float64)
    ups = [torch.randn(9, 1023, dtype=torch.float64)]
    outs, grads = _run(_emb_cpp(2.0, 0.1, 3, rng), [ids, w, pt, pos], ups)
    ref_outs, ref_grads = _run(lambda i, w_, pt_, pos_: reference.embedding(
        i, w_, scale=2.0, positional=pt_, positions=pos_, dropout_p=0.1, padding_idx=3, rng=rng),
        [ids, w, pt, pos], ups)
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


# ------------------------------------------------------------------ host cost (not a test)
def _host_cost_us(steps, repeats=41, chain=16):
    """Median microseconds of thread CPU time per call of each step (x -> x), fwd + bwd: ``chain``
    calls, then one backward; the steps interleaved, so a busy machine slows each alike."""
    times = [[] for _ in steps]
    for r in range(repeats + 3):
        for i, step in enumerate(steps):
            t0 = time.thread_time()
            step.run(chain)
            if r >= 3:
                times[i].append(time.thread_time() - t0)
    return [statistics.median(t) / chain * 1e6 for t in times]


class _Chain:
    def __init__(self, call, x):
        self.call, self.x = call, x

    def run(self, n):
        h = self.x
        for _ in range(n):
            h = self.call(h)
        h.sum().backward()


def host_costs():
    torch.set_num_threads(1)
    kern = backends.BACKENDS["cpu"].kernels("cpu")
    rng = philox.NO_DROPOUT
    C = 8
    x = torch.randn(4, C, requires_grad=True)
    w, b = torch.ones(C, requires_grad=True), torch.zeros(C, requires_grad=True)
    w1, b1 = torch.randn(16, C, requires_grad=True), torch.randn(16, requires_grad=True)
    w2, b2 = torch.randn(C, 16, requires_grad=True), torch.randn(C, requires_grad=True)
    ids = torch.randint(0, 32, (4,))
    table, ptable, pos = torch.randn(32, C, requires_grad=True), torch.randn(16, C, requires_grad=True), torch.arange(4)
    F = torch.nn.functional
    rows = {
        "add_layer_norm": (
            lambda h: torch.ops.fastformer.add_layer_norm(h, x, w, b, 1e-5, 0.0, False, rng, None)[0],
            lambda h: AddLayerNormFunction.apply(h, x, w, b, 1e-5, 0.0, False, kern, None)[0],
            lambda h: F.layer_norm(x + F.dropout(h, 0.0), (C,), w, b, 1e-5)),
        "feed_forward": (
            lambda h: torch.ops.fastformer.feed_forward(h, w1, b1, w2, b2, "relu", 0.0, rng),
            lambda h: FeedForwardFunction.apply(h, w1, b1, w2, b2, "relu", 0.0, kern),
            lambda h: F.linear(F.dropout(F.relu(F.linear(h, w1, b1)), 0.0), w2, b2)),
        "embedding": (
            lambda h: h + torch.ops.fastformer.embedding(ids, table, ptable, pos, 2.0, 0.0, -1, rng),
            lambda h: h + EmbeddingFunction.apply(ids, table, ptable, pos, 2.0, 0.0, -1, kern),
            lambda h: h + F.dropout(F.embedding(ids, table) * 2.0 + F.embedding(pos, ptable), 0.0)),
    }
    out = {}
    for name, calls in rows.items():
        out[name] = _host_cost_us([_Chain(c, x) for c in calls])
    return out


if __name__ == "__main__":
    assert _missing() is None, _missing()
    print(f"{'op':16s} {'C++ op':>10s} {'Python Fn':>10s} {'PyTorch':>10s}   (us per call, fwd + bwd)")
    for name, (cpp, py, composed) in host_costs().items():
        print(f"{name:16s} {cpp:10.1f} {py:10.1f} {composed:10.1f}")
