"""Empty batches and zero-length sequences on every backend: each op returns what the reference
returns (shape and values, NaN where the reference has NaN, e.g. the mean loss of no rows) and
gradients of the inputs' shapes, never a crash."""
import pytest
import torch

import fastformer
from fastformer import ops
from fastformer.ops import reference
from utils import kernel_backends, skip_without_kernels

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()


def _leaves(*shapes):
    return [torch.randn(s, dtype=torch.float32, requires_grad=True) for s in shapes]


def _run(backend, fn, leaves):
    """fn(*leaves) on ``backend``, then the gradients of the leaves for an all-ones upstream."""
    xs = [x.detach().clone().requires_grad_(True) for x in leaves]
    with fastformer.use_backend(backend):
        out = fn(*xs)
        out.backward(torch.ones_like(out))
    return out.detach(), [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def _same(backend, kernel_fn, ref_fn, leaves):
    out, grads = _run(backend, kernel_fn, leaves)
    ref, ref_grads = _run("reference", ref_fn, leaves)
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    torch.testing.assert_close(out, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
    for x, g, rg in zip(leaves, grads, ref_grads):
        assert g.shape == x.shape
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


ATTENTION_SHAPES = {  # (B, H, Sq, Sk, D)
    "B0": (0, 2, 3, 5, 8),
    "H0": (2, 0, 3, 5, 8),
    "Sq0": (2, 2, 0, 5, 8),
    "Sk0": (2, 2, 3, 0, 8),  # no key at all: every row sees nothing and outputs 0
    "Sq0_Sk0": (2, 2, 0, 0, 8),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ATTENTION_SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_empty(backend, case, causal):
    skip_without_kernels(backend, "attention")
    B, H, Sq, Sk, D = ATTENTION_SHAPES[case]
    leaves = _leaves((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D))
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    mask = torch.zeros(Sq, Sk)

    def fn(q, k, v):
        return ops.attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=causal)

    def ref(q, k, v):
        return reference.attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=causal)
    _same(backend, fn, ref, leaves)
    out, _ = _run(backend, fn, leaves)
    assert out.shape == (B, H, Sq, D)
    if case == "Sk0":
        assert (out == 0).all(), "a query with no key must output 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6), (0, 0, 6)], ids=["N0", "B2_S0", "B0_S0"])
@pytest.mark.parametrize("prenorm", [False, True], ids=["postln", "preln"])
def test_add_layer_norm_empty(backend, shape, prenorm):
    skip_without_kernels(backend, "add_layer_norm")
    leaves = _leaves(shape, shape, (6,), (6,))

    def fn(x, r, w, b):
        out = ops.add_layer_norm(x, r, w, b, prenorm=prenorm)
        return torch.cat([out[0], out[1]], -1) if prenorm else out

    def ref(x, r, w, b):
        out = reference.add_layer_norm(x, r, w, b, prenorm=prenorm)
        return torch.cat([out[0], out[1]], -1) if prenorm else out
    _same(backend, fn, ref, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 6), (3, 0, 6)], ids=["N0", "S0"])
def test_feed_forward_empty(backend, shape):
    skip_without_kernels(backend, "feed_forward")
    leaves = _leaves(shape, (10, 6), (10,), (6, 10), (6,))

    def fn(x, w1, b1, w2, b2):
        return ops.feed_forward(x, w1, b1, w2, b2)

    def ref(x, w1, b1, w2, b2):
        return reference.feed_forward(x, w1, b1, w2, b2)
    _same(backend, fn, ref, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_empty(backend, reduction):
    skip_without_kernels(backend, "cross_entropy")
    leaves = _leaves((0, 7))
    target = torch.zeros(0, dtype=torch.long)

    def fn(x):
        return ops.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)

    def ref(x):
        return torch.nn.functional.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    _same(backend, fn, ref, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["N0", "B2_S0"])
def test_linear_cross_entropy_empty(backend, reduction, lead):
    skip_without_kernels(backend, "linear_cross_entropy")
    leaves = _leaves(lead + (6,), (9, 6), (9,))
    target = torch.zeros(lead, dtype=torch.long)

    def fn(h, w, b):
        return ops.linear_cross_entropy(h, w, target, linear_bias=b, reduction=reduction)

    def ref(h, w, b):
        return reference.linear_cross_entropy(h, w, target, linear_bias=b, reduction=reduction)
    _same(backend, fn, ref, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_feed_forward_without_hidden_units(backend):
    """dim_feedforward F = 0: the FFN adds nothing but b2, and b2 gets the whole gradient."""
    skip_without_kernels(backend, "feed_forward")
    leaves = _leaves((3, 6), (0, 6), (0,), (6, 0), (6,))

    def fn(x, w1, b1, w2, b2):
        return ops.feed_forward(x, w1, b1, w2, b2)

    def ref(x, w1, b1, w2, b2):
        return reference.feed_forward(x, w1, b1, w2, b2)
    _same(backend, fn, ref, leaves)
    out, grads = _run(backend, fn, leaves)
    torch.testing.assert_close(out, leaves[4].detach().expand(3, 6))
    torch.testing.assert_close(grads[4], torch.full((6,), 3.0))
