"""The C++ autograd ops ``fastformer::add_layer_norm``, ``feed_forward`` and ``embedding`` on inputs of
any rank: they take the rows of ``(..., C)`` inputs themselves and return the caller's shape, without
the view nodes a reshape in Python records (each a node the backward walks: in a model's ``(B, S, C)``
calls, two or three per call). Checked against the Python Function on the rows (bit-equal outputs
and gradients, in the inputs' shapes), and by the graph: the output's node is the op's own and its
edges lead straight to the inputs."""
import pytest
import torch

from fastformer import backends, philox
from fastformer.autograd import AddLayerNormFunction, EmbeddingFunction, FeedForwardFunction

from test_cpp_autograd_aln_ffn_emb import _missing

pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

RNG = philox.pack(1234567, 0)


@pytest.fixture(scope="module")
def kernels():
    return backends.BACKENDS["cpu"].kernels("cpu")


@pytest.fixture(autouse=True)
def same_pair(monkeypatch):
    """The Python Functions draw their pair through philox.draw: here the C++ op's RNG."""
    monkeypatch.setattr(philox, "draw", lambda dropout_p, device=None: RNG)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _grads(out, leaves, seed=9):
    up = _randn(*out.shape, seed=seed)
    return torch.autograd.grad(out, [t for t in leaves if t is not None], up)


def _assert_straight_to_leaves(out, n_leaves):
    """out's node is the C++ op's, and each of its edges is an input's AccumulateGrad (no ViewBackward
    between them)."""
    node = out.grad_fn
    assert "View" not in type(node).__name__ and "Reshape" not in type(node).__name__, type(node).__name__
    kinds = [type(f).__name__ for f, _ in node.next_functions if f is not None]
    assert kinds == ["AccumulateGrad"] * n_leaves, kinds


@pytest.mark.parametrize("shape", [(2, 3, 16), (1, 1, 1023), (2, 1, 3, 8), (16,), (0, 3, 16)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("prenorm", [False, True], ids=["post", "prenorm"])
def test_add_layer_norm_any_rank(kernels, shape, p, prenorm):
    C = shape[-1]
    x0, r0, w0, b0 = _randn(*shape, seed=1), _randn(*shape, seed=2), 1 + _randn(C, seed=3), _randn(C, seed=4)
    x, r, w, b = (t.clone().requires_grad_() for t in (x0, r0, w0, b0))
    y, h = torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, p, prenorm, RNG, None)
    assert y.shape == h.shape == x.shape
    _assert_straight_to_leaves(y, 4)
    got = _grads(y, [x, r, w, b])

    xr, rr, wr, br = (t.clone().requires_grad_() for t in (x0, r0, w0, b0))
    yr, hr = AddLayerNormFunction.apply(xr.reshape(-1, C), rr.reshape(-1, C), wr, br, 1e-5, p, prenorm, kernels, None)
    want = _grads(yr.reshape(shape), [xr, rr, wr, br])
    assert torch.equal(y, yr.reshape(shape)) and torch.equal(h, hr.reshape(shape))
    for g, gw in zip(got, want):
        assert g.shape == gw.shape and torch.equal(g, gw)


def test_add_layer_norm_non_contiguous_input(kernels):
    x0 = _randn(4, 3, 8, seed=1)
    x = x0.clone().requires_grad_()
    w, b = torch.ones(8), torch.zeros(8)
    y, _ = torch.ops.fastformer.add_layer_norm(x.transpose(0, 1), None, w, b, 1e-5, 0.0, False, RNG, None)
    (gx,) = torch.autograd.grad(y, x, _randn(3, 4, 8, seed=5))
    xr = x0.clone().requires_grad_()
    yr = torch.nn.functional.layer_norm(xr.transpose(0, 1), (8,), w, b, 1e-5)
    (gxr,) = torch.autograd.grad(yr, xr, _randn(3, 4, 8, seed=5))
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(gx, gxr)


def test_add_layer_norm_residual_of_another_shape_is_refused():
    # the same rows, another shape: refused by name, not broadcast or reshaped
    x, r = torch.randn(2, 4, 8), torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="residual must have the shape of x"):
        torch.ops.fastformer.add_layer_norm(x, r, torch.ones(8), torch.zeros(8), 1e-5, 0.0, False, RNG, None)


@pytest.mark.parametrize("shape", [(2, 3, 16), (2, 1, 3, 8), (16,), (0, 2, 16)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_feed_forward_any_rank(kernels, shape, p):
    E, F_ = shape[-1], 24
    init = [_randn(*shape, seed=1), _randn(F_, E, seed=2) / E ** 0.5, _randn(F_, seed=3),
            _randn(E, F_, seed=4) / F_ ** 0.5, _randn(E, seed=5)]
    x, w1, b1, w2, b2 = (t.clone().requires_grad_() for t in init)
    out = torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, "gelu", p, RNG)
    assert out.shape == x.shape
    _assert_straight_to_leaves(out, 5)
    got = _grads(out, [x, w1, b1, w2, b2])

    xr, w1r, b1r, w2r, b2r = (t.clone().requires_grad_() for t in init)
    outr = FeedForwardFunction.apply(xr.reshape(-1, E), w1r, b1r, w2r, b2r, "gelu", p, kernels).reshape(shape)
    want = _grads(outr, [xr, w1r, b1r, w2r, b2r])
    assert torch.equal(out, outr)
    for g, gw in zip(got, want):
        assert g.shape == gw.shape and torch.equal(g, gw)


@pytest.mark.parametrize("ids_shape", [(2, 5), (1, 1), (3, 2, 2), (), (2, 0)], ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_embedding_any_rank(kernels, ids_shape, id_dtype, p):
    V, P, D = 11, 9, 8
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, ids_shape, generator=g).to(id_dtype)
    pos = torch.randint(0, P, ids_shape, generator=g).to(id_dtype)
    w0, t0 = _randn(V, D, seed=1), _randn(P, D, seed=2)
    w, t = w0.clone().requires_grad_(), t0.clone().requires_grad_()
    out = torch.ops.fastformer.embedding(ids, w, t, pos, 2.0, p, 3, RNG)
    assert out.shape == (*ids_shape, D)
    _assert_straight_to_leaves(out, 2)
    got = _grads(out, [w, t])

    wr, tr = w0.clone().requires_grad_(), t0.clone().requires_grad_()
    outr = EmbeddingFunction.apply(ids.reshape(-1).long(), wr, tr, pos.reshape(-1).long(), 2.0, p, 3, kernels)
    want = _grads(outr.reshape(*ids_shape, D), [wr, tr])
    assert torch.equal(out, outr.reshape(*ids_shape, D))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_embedding_positions_must_match_the_ids():
    with pytest.raises(RuntimeError, match="positions must have one row per id"):
        torch.ops.fastformer.embedding(torch.zeros(2, 3, dtype=torch.long), torch.randn(4, 8), torch.randn(4, 8),
                                       torch.zeros(5, dtype=torch.long), 1.0, 0.0, -1, RNG)


def test_embedding_saves_the_callers_ids():
    # (N,) int64 ids are saved as given, so changing them in place before the backward is caught as for
    # any saved tensor, not read silently
    ids = torch.tensor([1, 2, 3])
    w = torch.randn(5, 4, requires_grad=True)
    out = torch.ops.fastformer.embedding(ids, w, None, None, 1.0, 0.0, -1, RNG)
    ids.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
