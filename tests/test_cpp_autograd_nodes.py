"""The hand-written backward nodes of the C++ ops ``fastformer::add_layer_norm``, ``feed_forward`` and
``embedding`` (csrc/autograd/<op>.cpp: a ``torch::autograd::Node`` with ``SavedVariable`` members, as
torch's generated nodes, instead of a ``torch::autograd::Function``): what the Function gave for free
and a hand-written node must do itself. The saved tensors are released after a backward (a second
one raises, ``retain_graph`` keeps them), version-checked (an in-place change to a saved input or
output between forward and backward raises), packed by saved-tensor hooks; the node's edges are the
differentiable inputs only. Gradients are compared with PyTorch's composition (the numbers are
test_cpp_autograd_aln_ffn_emb.py's)."""
import pytest
import torch
import torch.nn.functional as F

from fastformer import _ext, backends, ops, philox
from fastformer.internal import fast

OPS = ("add_layer_norm", "feed_forward", "embedding")


def _missing():
    if _ext.load_error() is not None:
        return _ext.load_error()
    lacking = [op for op in OPS if not hasattr(torch.ops.fastformer, op)]
    return f"the loaded fastformer library lacks {', '.join(lacking)}; rebuild it" if lacking else None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

C, FD, V = 8, 16, 12
RNG = philox.pack(5, 0)


def _leaf(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _cases():
    """name -> (leaves, fastformer call, PyTorch's composition at dropout 0, saved input to modify)."""
    x, r, w, b = _leaf(2, 3, C, seed=1), _leaf(2, 3, C, seed=2), _leaf(C, seed=3), _leaf(C, seed=4)
    w1, b1, w2, b2 = _leaf(FD, C, seed=5), _leaf(FD, seed=6), _leaf(C, FD, seed=7), _leaf(C, seed=8)
    table, ptable = _leaf(V, C, seed=9), _leaf(V, C, seed=10)
    # (N,) int64 ids are saved as given (others as their (N,) int64 copy, which no caller can change)
    ids, pos = torch.tensor([1, 0, 5, 11, 3, 3]), torch.tensor([0, 1, 2, 0, 1, 2])
    nd = philox.NO_DROPOUT
    return {
        "add_layer_norm": ((x, r, w, b),
                           lambda: torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, 0.0, False, nd, None)[0],
                           lambda: F.layer_norm(r + x, (C,), w, b, 1e-5), w),
        "feed_forward": ((x, w1, b1, w2, b2),
                         lambda: torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, "relu", 0.0, nd),
                         lambda: F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), x),
        "embedding": ((table, ptable),
                      lambda: torch.ops.fastformer.embedding(ids, table, ptable, pos, 2.0, 0.0, -1, nd),
                      lambda: F.embedding(ids, table) * 2.0 + F.embedding(pos, ptable), ids),
    }


@pytest.mark.parametrize("op", OPS)
def test_node_gradients_edges_and_name(op):
    leaves, call, composed, _ = _cases()[op]
    out = call()
    node = out.grad_fn
    assert type(node).__name__ == "CppFunction" and node.name() == "".join(
        w.capitalize() for w in op.split("_")) + "Backward", node.name()
    edges = [f for f, _ in node.next_functions if f is not None]
    assert [type(f).__name__ for f in edges] == ["AccumulateGrad"] * len(leaves)
    up = torch.randn(out.shape, dtype=out.dtype)
    got = torch.autograd.grad(out, leaves, up)
    want = torch.autograd.grad(composed(), leaves, up)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("op", OPS)
def test_saved_tensors_released_after_backward(op):
    leaves, call, _, _ = _cases()[op]
    out = call().sum()
    first = torch.autograd.grad(out, leaves, retain_graph=True)
    again = torch.autograd.grad(out, leaves)  # retained: the same gradients
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(out, leaves)


@pytest.mark.parametrize("op", OPS)
def test_in_place_change_of_a_saved_input_is_caught(op):
    leaves, call, _, saved = _cases()[op]
    out = call().sum()
    with torch.no_grad():
        saved.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, leaves)


def test_in_place_change_of_the_saved_prenorm_output_is_caught():
    x, r, w, b = _leaf(2, 3, C, seed=1), _leaf(2, 3, C, seed=2), _leaf(C, seed=3), _leaf(C, seed=4)
    y, h = torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, 0.1, True, RNG, None)
    assert h.grad_fn is y.grad_fn  # both outputs of the one node
    loss = y.sum() + h.sum()
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (x, r, w, b))


@pytest.mark.parametrize("op", OPS)
def test_saved_tensor_hooks_pack_and_unpack(op):
    leaves, call, _, _ = _cases()[op]
    want = torch.autograd.grad(call().sum(), leaves)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return t.clone()  # a copy: the gradients must come from what unpack returns

    def unpack(t):
        unpacked.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = call().sum()
    assert packed, "the node saved nothing through the hooks"
    got = torch.autograd.grad(out, leaves)
    assert len(unpacked) == len(packed)
    for g, e in zip(got, want):
        assert torch.equal(g, e)


@pytest.mark.parametrize("op", OPS)
def test_create_graph_gives_the_plain_first_gradients(op):
    """A double backward's first pass (create_graph) runs the node with grad mode on: the kernels go
    through their autograd, the gradients are the composition's."""
    leaves, call, composed, _ = _cases()[op]
    want = torch.autograd.grad(composed().square().sum(), leaves)
    got = torch.autograd.grad(call().square().sum(), leaves, create_graph=True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("op", OPS)
def test_output_in_the_input_shape_is_no_autograd_view(op):
    """The kernels' (N, C) rows come back in the input's shape through a view made below autograd:
    the output is the node's own, not a differentiable view of a hidden base (whose in-place
    changes autograd would replay on that base)."""
    _, call, _, _ = _cases()[op]
    out = call()
    assert out.dim() == (2 if op == "embedding" else 3)
    assert not out._is_view() and out._base is None
    if op != "embedding":  # the (N,) ids give (N, D) rows as they are: 3-D ids for the view
        return
    ids = torch.tensor([[1, 0, 5], [11, 3, 3]])
    table = torch.randn(V, C, requires_grad=True)
    out = torch.ops.fastformer.embedding(ids, table, None, None, 1.0, 0.0, -1, philox.NO_DROPOUT)
    assert out.shape == (2, 3, C) and not out._is_view()


def test_a_profile_sees_the_add_layer_norm_kernels_and_gradients_are_the_same():
    """add_layer_norm's node calls its CPU kernels itself, past the dispatcher, only where no
    RecordFunction callback would see the dispatcher's call (csrc/autograd/add_layer_norm.cpp,
    dispatches_to_cpu): under the profiler the kernels' calls, forward and backward, go through
    the dispatcher and are in the profile, with the same outputs and gradients as without it."""
    leaves, call, _, _ = _cases()["add_layer_norm"]
    up = torch.randn(2, 3, C, dtype=torch.float64)
    plain = [call()] + list(torch.autograd.grad(call(), leaves, up))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = [call()] + list(torch.autograd.grad(call(), leaves, up))
    names = {e.name for e in prof.events()}
    assert {"fastformer::add_layer_norm_fwd", "fastformer::add_layer_norm_bwd"} <= names, sorted(names)
    for a, b in zip(plain, profiled):
        assert torch.equal(a, b)


def test_the_registered_ops_h_without_prenorm_has_a_storage_of_its_own():
    """Without prenorm the node's CPU call keeps h, mean and rstd in one allocation only where the
    caller drops h (the direct entry's call): the registered op returns h, and it owns its storage; an
    in-place change to it is caught, as to any saved tensor."""
    x, r, w, b = _leaf(2, 3, C, seed=1), _leaf(2, 3, C, seed=2), _leaf(C, seed=3), _leaf(C, seed=4)
    y, h = torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, 0.0, False, philox.NO_DROPOUT, None)
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
    assert not h.requires_grad
    torch.testing.assert_close(h, (r + x).detach())
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), (x, r, w, b))


@pytest.mark.parametrize("rows", [4, 1100])  # 64 elements (the entry keeps the GIL) and 17600 (it releases it)
def test_a_saved_tensor_hook_runs_inside_the_entrys_call(rows, monkeypatch):
    """The direct entry keeps the GIL for a small x: a Python saved-tensor hook still runs inside the
    call (the node saves through it), is handed tensors of their own storage (no shared block where a
    hook sees them), and the gradients come from what it packed."""
    x, r, w, b = (_leaf(*shape, seed=i).detach().float().requires_grad_()
                  for i, shape in enumerate(((rows, C), (rows, C), (C,), (C,))))
    up = torch.randn(rows, C, generator=torch.Generator().manual_seed(5))
    with backends.use_backend("cpu"):  # the same call without a hook: the same kernels, the same bits
        want = torch.autograd.grad(ops.add_layer_norm(x, r, w, b, 1e-5, 0.0), (x, r, w, b), up)
    for g, e in zip(want, torch.autograd.grad(F.layer_norm(r + x, (C,), w, b, 1e-5), (x, r, w, b), up)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)  # (dweight, dbias: sums over rows in another order)
    entry = _ext.module().add_layer_norm_eager
    packed, during = [], []  # during: how many were packed when the entry's call began and ended

    def counted(*args):
        during.append(len(packed))
        out = entry(*args)
        during.append(len(packed))
        return out

    for key, e in list(fast.DIRECT.items()):
        if e is entry:
            monkeypatch.setitem(fast.DIRECT, key, counted)

    def pack(t):
        packed.append(t.untyped_storage().nbytes() == t.numel() * t.element_size())
        return t.clone()

    with backends.use_backend("cpu"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ops.add_layer_norm(x, r, w, b, 1e-5, 0.0)
    assert len(during) == 2 and during[1] - during[0] >= 4, during  # h, weight, mean, rstd packed inside the call
    assert all(packed), packed
    for g, e in zip(torch.autograd.grad(y, (x, r, w, b), up), want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
