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
from torch._dynamo.testing import CompileCounterWithBackend

import fastformer
from fastformer import ops
from utils import device_for, kernel_backends, recorded_draws

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


def _embedding(device):
    g = torch.Generator().manual_seed(4)
    ids, positions = torch.randint(0, 10, (2, 7), generator=g).to(device), torch.randint(0, 9, (2, 7), generator=g).to(device)
    weight, table = torch.randn(10, 12, generator=g).to(device), torch.randn(9, 12, generator=g).to(device)
    return (weight, table), lambda w, t: ops.embedding(ids, w, scale=2.0, positional=t, positions=positions,
                                                       dropout_p=P, padding_idx=3)


OPS = {"attention": _attention, "add_layer_norm": _add_layer_norm, "feed_forward": _feed_forward,
       "embedding": _embedding}


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


# ------------------------------------------------------------------ the model's loss and backward
def _model_and_batch():
    torch.manual_seed(0)
    model = fastformer.Seq2SeqTransformer(11, 13, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=P, max_len=16,
                                          skip_padding=False)  # compiled, the padding is computed too
    g = torch.Generator().manual_seed(5)
    src, tgt = torch.randint(3, 11, (2, 7), generator=g), torch.randint(3, 13, (2, 6), generator=g)
    src[1, 5:] = 0  # padding: pad_idx 0
    tgt[1, 4:] = 0
    return model, src, tgt


def _model_step(loss_fn, model, src, tgt, seed, entries=False):
    """The loss and the gradient of every parameter after ``torch.manual_seed(seed)``, and the
    seeds the fused ops drew (utils.recorded_draws: the C++ ops' direct eager entries, which draw in
    C++ unseen, are set aside unless ``entries``; then nothing is recorded for the ops that have one)."""
    with recorded_draws(entries) as drawn:
        torch.manual_seed(seed)
        loss = loss_fn(src, tgt)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads, drawn


# the source and target embeddings, then 1 + 1 layers: encoder self-attention, add_layer_norm,
# feed_forward, add_layer_norm; decoder self-attention, add_layer_norm, cross-attention,
# add_layer_norm, feed_forward, add_layer_norm
MODEL_DRAWS = 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_loss_and_backward_with_dropout_compile_to_one_graph_equal_to_eager(backend):
    """The whole loss (embedding dropout, every fused op with dropout 0.1, the fused output
    projection + loss) is one graph with no break; compiled forward and backward equal eager
    bitwise, each fused op drawing its own seed in eager order (AOTAutograd's CSE must not merge
    the draws), the two embeddings' dropouts (ops.embedding) included.
    The model computes its padded positions (``skip_padding=False``) as a compiled loss does:
    skipping them in eager would draw the dropout masks over other rows.
    ``fullgraph=True`` raises at any graph break, and one graph is compiled; ``explain`` (a third
    trace of the model: seconds here) runs on the cpu backend only."""
    model, src, tgt = _model_and_batch()
    assert model.training

    def loss_fn(src, tgt):
        return model.loss(src, tgt)

    with fastformer.use_backend(backend):
        if backend == "cpu":
            explanation = _assert_one_graph(loss_fn, src, tgt)
            print(f"\nexplain, cpu backend: {explanation.graph_count} graph, {explanation.graph_break_count} "
                  f"breaks, {explanation.op_count} ops")
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(loss_fn, fullgraph=True, backend=counter)
        want_loss, want_grads, want_drawn = _model_step(loss_fn, model, src, tgt, seed=3)
        got_loss, got_grads, got_drawn = _model_step(compiled, model, src, tgt, seed=3)
        # eager through the direct entries (the C++ draw) too: the same loss and gradients
        entry_loss, entry_grads, _ = _model_step(loss_fn, model, src, tgt, seed=3, entries=True)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"
    assert len(want_drawn) == MODEL_DRAWS
    assert torch.equal(entry_loss, want_loss), "eager through the direct entries differs"
    assert all(torch.equal(e, w) for e, w in zip(entry_grads, want_grads)), "eager through the entries differs"
    assert got_drawn == want_drawn, "the compiled step drew other seeds, or fewer, than eager"
    assert torch.equal(got_loss, want_loss), f"loss {got_loss.item()} != eager {want_loss.item()}"
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        assert torch.equal(g, w), f"grad of {name}: compiled differs from eager by {(g - w).abs().max().item():.3e}"


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_inductor_compiles_the_fused_ops_with_dropout_equal_to_eager(backend):
    """Through inductor, the default backend: the draws stay opaque custom-op calls (inductor
    does not swap in its own RNG) and the kernels are the eager ones, so forward and backward of
    attention followed by feed_forward, each with dropout, equal eager bitwise."""
    (q, k, v), attention = _attention("cpu")
    g = torch.Generator().manual_seed(4)
    w1, w2 = torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g)

    def fn(q, k, v, w1, w2):
        return ops.feed_forward(attention(q, k, v), w1, None, w2, None, dropout_p=P)  # (B, H, Sq, D)

    with fastformer.use_backend(backend):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        want, rng_eager = _loss_and_grads(fn, (q, k, v, w1, w2), seed=21)
        got, rng_compiled = _loss_and_grads(compiled, (q, k, v, w1, w2), seed=21)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i}: inductor differs from eager by {(g - w).abs().max().item():.3e}"
    assert torch.equal(rng_compiled, rng_eager), "inductor and eager drew differently from the generator"
