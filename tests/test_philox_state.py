"""The dropout seeds' bookkeeping (fastformer/philox.py): every op call with dropout draws its
(seed, offset) from torch's generator of the op's device, forward and backward use the very pair
drawn, the generator's saved state replays it, activation checkpointing recomputes the same mask,
and a call without dropout draws nothing and allocates nothing. On a GPU the pair is drawn on the
device (what makes CUDA-graph replays draw afresh): `make gpu-check` runs the capture test
(tests/test_gpu_graph_dropout.py); here the "meta" device stands in for a GPU's placement."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastformer
from fastformer import ops, philox
from fastformer.ops import reference
from utils import kernel_backends, recorded_draws

P = 0.25
BACKENDS = ["reference"] + kernel_backends("cpu")


@pytest.fixture
def drawn():
    """Every pair drawn in the test (utils.recorded_draws: the C++ ops' direct entries, which draw in
    C++ the same pairs (tests/test_eager_entries.py), are set aside, so every draw is seen here)."""
    with recorded_draws() as pairs:
        yield pairs


def _aln_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    return [t.requires_grad_() for t in (x, r, w, b)]


def test_draws_come_from_the_generator_and_advance_it():
    torch.manual_seed(5)
    a = [tuple(philox.draw(P).tolist()) for _ in range(4)]
    torch.manual_seed(5)
    b = [tuple(philox.draw(P).tolist()) for _ in range(4)]
    assert a == b, "torch.manual_seed must make the draws repeatable"
    assert len(set(a)) == 4, "each call must draw a new pair"
    assert all(0 <= s < 2**62 and o == 0 for s, o in a), "on the CPU: (seed, 0), as the seeds always were"
    torch.manual_seed(5)
    assert philox.next_seed() == a[0], "next_seed() is the pair draw() gives at the same generator state"
    torch.manual_seed(5)
    assert a[0][0] == torch.randint(0, 2**62, ()).item(), "the seed is torch.randint(0, 2**62, ())'s draw"


def test_no_dropout_draws_nothing_and_allocates_nothing():
    state = torch.get_rng_state()
    first, second = philox.draw(0.0), philox.draw(0.0)
    assert first is second is philox.NO_DROPOUT
    assert first.tolist() == [0, 0]
    assert torch.equal(torch.get_rng_state(), state), "a call without dropout must not touch the generator"


def test_the_pair_is_drawn_on_the_ops_device():
    """On a GPU the kernels read the pair by pointer: draw() must place it on the op's device
    ("meta" stands in here: a tensor there has a device but no values)."""
    got = philox.draw(P, torch.device("meta"))
    assert got.device.type == "meta" and got.dtype == torch.int64 and got.shape == (2,)
    assert philox.draw(P, torch.device("cpu")).device.type == "cpu"
    assert philox.draw(0.0, torch.device("meta")).device.type == "cpu", "no dropout: the shared CPU (0, 0)"


def test_traced_draw_is_the_device_op():
    """make_fx (as torch.compile's AOTAutograd) sees one next_seed(device) per draw."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def two_draws(x):
        return philox.draw(P, x.device) + philox.draw(P, x.device) + x.sum().long()

    graph = make_fx(two_draws)(torch.ones(3))
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "next_seed" in str(n.target)]
    assert len(calls) == 2
    assert all(n.args == (torch.device("cpu"),) for n in calls)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_use_the_drawn_pair(backend, drawn):
    """Forward and backward of the fused op equal the reference run with the pair the op drew."""
    x, r, w, b = _aln_inputs()
    with fastformer.use_backend(backend):
        y = ops.add_layer_norm(x, r, w, b, 1e-5, P)
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()
    assert len(drawn) == 1
    got = [y.detach()] + [t.grad for t in (x, r, w, b)]
    xs = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    want = reference.add_layer_norm(*xs, 1e-5, P, rng=philox.pack(*drawn[0]))
    (want * torch.arange(want.numel()).view_as(want)).sum().backward()
    for name, g, w_ in zip(("y", "dx", "dresidual", "dweight", "dbias"), got, [want.detach()] + [t.grad for t in xs]):
        torch.testing.assert_close(g, w_, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_generator_state_replays_the_mask(backend):
    x, r, w, b = _aln_inputs()
    with fastformer.use_backend(backend), torch.no_grad():
        state = torch.get_rng_state()
        first = ops.add_layer_norm(x, r, w, b, 1e-5, P)
        second = ops.add_layer_norm(x, r, w, b, 1e-5, P)
        torch.set_rng_state(state)
        replay = ops.add_layer_norm(x, r, w, b, 1e-5, P)
    assert torch.equal(replay, first)
    assert not torch.equal(second, first), "the next call must draw another mask"


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_checkpointing_recomputes_the_same_mask(backend, drawn):
    """torch.utils.checkpoint restores the generator before it recomputes: the recomputed forward
    draws the same pairs, so the gradients equal an uncheckpointed run's at the same seed."""
    g = torch.Generator().manual_seed(1)
    w1, b1 = torch.randn(24, 16, generator=g).requires_grad_(), torch.randn(24, generator=g).requires_grad_()
    w2, b2 = torch.randn(16, 24, generator=g).requires_grad_(), torch.randn(16, generator=g).requires_grad_()
    lw, lb = torch.randn(16, generator=g).requires_grad_(), torch.randn(16, generator=g).requires_grad_()
    x0 = torch.randn(5, 16, generator=g).requires_grad_()
    params = (x0, w1, b1, w2, b2, lw, lb)

    def block(x):
        f = ops.feed_forward(x, w1, b1, w2, b2, dropout_p=P)
        return ops.add_layer_norm(f, x, lw, lb, 1e-5, P)

    def run(checkpointed):
        for t in params:
            t.grad = None
        torch.manual_seed(9)
        out = checkpoint(block, x0, use_reentrant=False) if checkpointed else block(x0)
        out.square().sum().backward()
        return out.detach(), [t.grad.clone() for t in params]

    with fastformer.use_backend(backend):
        want, want_grads = run(False)
        drawn_plain = list(drawn)
        drawn.clear()
        got, got_grads = run(True)
    assert len(drawn_plain) == 2
    assert drawn == drawn_plain + drawn_plain, "the recomputation must draw the forward's very pairs"
    assert torch.equal(got, want)
    for g_, w_ in zip(got_grads, want_grads):
        assert torch.equal(g_, w_)
