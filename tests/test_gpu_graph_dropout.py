"""Capture and replay with dropout (``make gpu-check``'s ``graph-dropout`` step): a small model
with dropout, its training step (forward, loss, backward) captured with ``torch.cuda.graph``,
must draw a FRESH dropout mask on every replay, and that mask must be the one eager code draws
at the same generator state: after ``torch.manual_seed(s)``, replay ``i`` gives the loss and the
gradients of the ``i``-th eager step after ``torch.manual_seed(s)``.

torch's own layer is the control (its CUDA generator is graph-safe: a replay reads the
generator's offset when it runs); fastformer's layer twin runs on each GPU backend and on
``auto``. A dropout seed read on the host while capturing would be baked into the graph: every
replay would then repeat the capture's mask, and the test says so.

Marked ``gpu``: skipped, with the reason, where there is no CUDA GPU (tests/conftest.py and the
``skipif`` below) or where a backend cannot run.
"""
import contextlib

import pytest
import torch

import fastformer
from fastformer import backends

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="torch.cuda.graph captures CUDA work: needs a CUDA GPU "
                                        "(torch.cuda.is_available() is False)")]

SEED, D, HEADS, FFN, P = 1234, 64, 4, 128, 0.1


def _providers():
    yield pytest.param("torch", id="torch")
    yield pytest.param("auto", id="fastformer-auto")
    for name in ("triton", "cuda"):
        avail = backends.availability(name, "cuda")
        yield pytest.param(name, id=f"fastformer-{name}",
                           marks=pytest.mark.skipif(not avail, reason=avail.reason or ""))


def _model(provider: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = torch.nn.TransformerEncoderLayer if provider == "torch" else fastformer.nn.TransformerEncoderLayer
    return cls(D, HEADS, FFN, dropout=P, batch_first=True).cuda().train()


def _context(provider: str):
    if provider in ("torch", "auto"):
        return contextlib.nullcontext()
    return fastformer.use_backend(provider)


def capture_and_replay(model: torch.nn.Module, x: torch.Tensor, context, replays: int = 2):
    """(replays, eager steps): ``replays`` replays of the captured step and as many eager steps,
    each started from ``torch.manual_seed(SEED)``; each entry is (loss, linear1's weight gradient)."""
    params = list(model.parameters())
    weight = model.linear1.weight

    def step():
        loss = model(x).float().square().mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), context():
        for _ in range(3):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with context(), torch.cuda.graph(graph):
        static_loss = step()
    static_grad = weight.grad  # the graph writes each replay's gradient here

    torch.manual_seed(SEED)
    replayed = []
    for _ in range(replays):
        graph.replay()
        replayed.append((static_loss.detach().clone(), static_grad.clone()))
    torch.cuda.synchronize()

    torch.manual_seed(SEED)
    eager = []
    with context():
        for _ in range(replays):
            for p in params:
                p.grad = None
            loss = step()
            eager.append((loss.detach().clone(), weight.grad.clone()))
    torch.cuda.synchronize()
    return replayed, eager


@pytest.mark.parametrize("provider", list(_providers()))
def test_each_replay_draws_a_fresh_mask_equal_to_eagers(provider):
    model = _model(provider)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 16, D, device="cuda", generator=g)
    replayed, eager = capture_and_replay(model, x, lambda: _context(provider))
    (l1, g1), (l2, g2) = eager
    assert not torch.equal(g1, g2), "eager steps drew the same mask twice: the check itself is void"
    (r1, h1), (r2, h2) = replayed
    assert not torch.equal(h1, h2) and not torch.equal(r1, r2), (
        f"{provider}: two replays of the captured step gave the same loss and gradient: the dropout "
        f"mask drawn while capturing is replayed every time (its seed was read on the host then)")
    for i, ((r, h), (e, ge)) in enumerate(zip(replayed, eager)):
        torch.testing.assert_close(r, e, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, i=i: f"{provider}: replay {i}'s loss is not eager step {i}'s: {m}")
        torch.testing.assert_close(h, ge, rtol=1e-3, atol=1e-5,
                                   msg=lambda m, i=i: f"{provider}: replay {i}'s gradient is not eager step {i}'s: {m}")
