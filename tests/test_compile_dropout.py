"""``torch.compile(fullgraph=True)`` with dropout on: one graph, and the eager results.

Each op with dropout draws its Philox ``(seed, offset)`` as a (2,) int64 CPU tensor from the
custom op ``fastformer::next_seed`` (fastformer/philox.py), never with ``.item()``, so dynamo
traces every op, and the whole model's loss, as ONE graph with no break. The draw is an opaque
op tagged ``nondeterministic_seeded``: the compiled graph makes the same draws from torch's
generator, in the same order, as eager code, so the same ``torch.manual_seed`` gives the same
masks.

Compiled with ``backend="aot_eager"``: AOTAutograd traces forward and backward (fake
implementations, functionalisation, the joint graph and its partition into forward and
backward, which must keep the drawn tensor for backward instead of drawing again) and then runs
the very kernels eager code runs, so the results must be bitwise equal. Inductor is left out
of the per-op tests because its compile time here (about a minute an op on two shared cores)
would break the suite's budget; one test runs the cpu backend's ops through inductor.
"""
import pytest
import torch

import fastformer
from fastformer import ops
from utils import device_for, kernel_backends

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends("cpu", "triton")
P = 0.1


def _attention(device):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, S, 16, generator=g).to(device) for S in (5, 9, 9))
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    kpm = kpm.to(device)
    return (q, k, v), lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm, is_causal=True, dropout_p=P)


def _add_layer_norm(device):
    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(2, 3, 20, generator=g).to(device) for _ in range(2))
    w, b = (torch.randn(20, generator=g).to(device) for _ in range(2))
    return (x, r, w, b), lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5, P)


def _feed_forward(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 12, generator=g).to(device)
    w1, b1 = torch.randn(40, 12, generator=g).to(device), torch.randn(40, generator=g).to(device)
    w2, b2 = torch.randn(12, 40, generator=g).to(device), torch.randn(12, generator=g).to(device)
    return (x, w1, b1, w2, b2), lambda *a: ops.feed_forward(*a, activation="gelu", dropout_p=P)


OPS = {"attention": _attention, "add_layer_norm": _add_layer_norm, "feed_forward": _feed_forward}


def _loss_and_grads(fn, inputs, seed):
    """fn's output and the gradients of a weighted sum of it, after ``torch.manual_seed(seed)``;
    and the generator state afterwards (the draws made)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    out = fn(*leaves)
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return (out.detach(), *grads), torch.get_rng_state()


def _assert_one_graph(fn, *args):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), (
        f"{explanation.graph_count} graphs, {explanation.graph_break_count} breaks: "
        f"{[str(r.reason) for r in explanation.break_reasons]}")
    return explanation


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_with_dropout_compiles_to_one_graph_equal_to_eager(backend, op):
    inputs, fn = OPS[op](device_for(backend))
    with fastformer.use_backend(backend):
        _assert_one_graph(fn, *inputs)
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        want, rng_eager = _loss_and_grads(fn, inputs, seed=11)
        got, rng_compiled = _loss_and_grads(compiled, inputs, seed=11)
        other, _ = _loss_and_grads(compiled, inputs, seed=12)
    names = ("out",) + tuple(f"grad {i}" for i in range(len(inputs)))
    for name, g, w in zip(names, got, want):
        assert torch.equal(g, w), f"{name}: compiled differs from eager by {(g - w).abs().max().item():.3e}"
    assert torch.equal(rng_compiled, rng_eager), "compiled and eager drew differently from the generator"
    assert not torch.equal(other[0], got[0]), "another seed must give another dropout mask"
