"""fp64 end to end: every op, on every backend that takes fp64, matches PyTorch's own fp64
composition to fp64 precision, gradients included, with large scores (inputs in [-9, 9]).

Statistics kept in fp32 under fp64 inputs (the attention log-sum-exp, the LayerNorm mean and
rstd) pass the forward and fail here by ~1e-5 in the gradients; fp64 end to end is ~1e-13.
"""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops

from utils import device_for, forward_backward, max_err

# (an fp64 result is held to a few hundred ulps of its own magnitude)
RTOL = 1e-11


def _fp64_backends():
    names = ["reference"]
    for name in ("cpu", "triton", "cuda"):
        dev = fastformer.backends.BACKENDS[name].device(device_for(name))
        if dev is not None and torch.float64 in dev.dtypes:
            names.append(name)
    return names


FP64 = _fp64_backends()
NOT_FP64 = [n for n in ("cpu", "triton", "cuda") if n not in FP64]


def _uniform(*shape, lo=-9.0, hi=9.0, gen):
    return torch.rand(*shape, dtype=torch.float64, generator=gen) * (hi - lo) + lo


def _check(name, got, want):
    """Each output and gradient within RTOL of the largest magnitude of PyTorch's."""
    (outs, grads), (ref_outs, ref_grads) = got, want
    pairs = list(zip(outs, ref_outs)) + [(grads[k], ref_grads[k]) for k in ref_grads]
    for i, (a, b) in enumerate(pairs):
        assert a.dtype == torch.float64, f"{name}[{i}]: dtype {a.dtype}"
        scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
        assert max_err(a, b) <= RTOL * scale, f"{name}[{i}]: error {max_err(a, b):.3e} (scale {scale:.3e})"


def _run(backend, fn, ref_fn, inputs, upstream, names):
    with fastformer.use_backend(backend):
        got = forward_backward(fn, inputs, upstream, names)
    return got, forward_backward(ref_fn, inputs, upstream, names)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _sdpa_bottom_right(q, k, v, kpm, causal):
    Sq, Sk = q.shape[2], k.shape[2]
    keep = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        keep = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq)
    keep = keep & ~kpm[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("backend", FP64)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_fp64(backend, causal, gen):
    B, H, Sq, Sk, D = 2, 3, 17, 23, 8
    q, k, v = (_uniform(B, H, S, D, gen=gen) for S in (Sq, Sk, Sk))
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[1, 20:] = True
    dout = _uniform(B, H, Sq, D, gen=gen)
    got, want = _run(backend, lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm, is_causal=causal),
                     lambda q, k, v: _sdpa_bottom_right(q, k, v, kpm, causal), (q, k, v), (dout,), "qkv")
    _check(f"attention[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
def test_attention_varlen_fp64(backend, gen):
    H, D = 3, 8
    lq, lk = (7, 10), (9, 12)
    cu_q = torch.tensor([0, lq[0], sum(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, lk[0], sum(lk)], dtype=torch.int32)
    q, k, v = _uniform(sum(lq), H, D, gen=gen), _uniform(sum(lk), H, D, gen=gen), _uniform(sum(lk), H, D, gen=gen)
    dout = _uniform(sum(lq), H, D, gen=gen)

    def per_sequence(q, k, v):  # (L, H, D) -> (1, H, L, D) per sequence, bottom-right causal
        outs = []
        for b in range(2):
            qs, ks, vs = (t[c[b]:c[b + 1]].transpose(0, 1)[None] for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
            outs.append(_sdpa_bottom_right(qs, ks, vs, torch.zeros(1, ks.shape[2], dtype=torch.bool), True)[0]
                        .transpose(0, 1))
        return torch.cat(outs)

    got, want = _run(backend, lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                                   is_causal=True),
                     per_sequence, (q, k, v), (dout,), "qkv")
    _check(f"attention_varlen[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
def test_add_layer_norm_fp64(backend, gen):
    # rows with a large mean and a small spread: an fp32 mean or rstd loses the gradients' digits
    N, C = 6, 37
    x = _uniform(N, C, gen=gen) + 1e4
    res, w, b = _uniform(N, C, gen=gen), _uniform(C, gen=gen), _uniform(C, gen=gen)
    dy = _uniform(N, C, gen=gen)
    got, want = _run(backend, lambda x, r, w, b: ops.add_layer_norm(x, r, w, b),
                     lambda x, r, w, b: F.layer_norm(x + r, (C,), w, b), (x, res, w, b), (dy,), "xrwb")
    _check(f"add_layer_norm[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
def test_feed_forward_fp64(backend, gen):
    x, w1, b1 = _uniform(5, 12, gen=gen), _uniform(40, 12, gen=gen), _uniform(40, gen=gen)
    w2, b2, dy = _uniform(12, 40, gen=gen), _uniform(12, gen=gen), _uniform(5, 12, gen=gen)
    got, want = _run(backend, lambda *a: ops.feed_forward(*a, activation="gelu"),
                     lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
                     (x, w1, b1, w2, b2), (dy,), ["x", "w1", "b1", "w2", "b2"])
    _check(f"feed_forward[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
def test_embedding_fp64(backend, gen):
    ids = torch.randint(0, 50, (4, 9), generator=gen)
    weight, pos, dy = _uniform(50, 16, gen=gen), _uniform(9, 16, gen=gen), _uniform(4, 9, 16, gen=gen)
    got, want = _run(backend, lambda w, p: ops.embedding(ids, w, scale=4.0, positional=p),
                     lambda w, p: F.embedding(ids, w) * 4.0 + p, (weight, pos), (dy,), ["weight", "positional"])
    _check(f"embedding[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_fp64(backend, reduction, gen):
    logits = _uniform(8, 300, gen=gen) * 30  # scores of a few hundred
    target = torch.randint(0, 300, (8,), generator=gen)
    target[3] = -100
    up = _uniform(8, gen=gen) if reduction == "none" else torch.tensor(1.0, dtype=torch.float64)
    kw = dict(label_smoothing=0.1, reduction=reduction)
    got, want = _run(backend, lambda x: ops.cross_entropy(x, target, **kw),
                     lambda x: F.cross_entropy(x, target, **kw), (logits,), (up,), ["logits"])
    _check(f"cross_entropy[{backend}]", got, want)


@pytest.mark.parametrize("backend", FP64)
def test_linear_cross_entropy_fp64(backend, gen):
    h, W, b = _uniform(8, 16, gen=gen), _uniform(300, 16, gen=gen), _uniform(300, gen=gen)
    target = torch.randint(0, 300, (8,), generator=gen)
    one = torch.tensor(1.0, dtype=torch.float64)
    got, want = _run(backend, lambda h, W, b: ops.linear_cross_entropy(h, W, target, linear_bias=b,
                                                                         label_smoothing=0.1),
                     lambda h, W, b: F.cross_entropy(F.linear(h, W, b), target, label_smoothing=0.1),
                     (h, W, b), (one,), "hWb")
    _check(f"linear_cross_entropy[{backend}]", got, want)


@pytest.mark.parametrize("backend", NOT_FP64)
def test_fp64_refused_by_name(backend):
    """A backend without fp64 kernels says so when forced (auto picks one that has them)."""
    q = torch.zeros(1, 1, 2, 8, dtype=torch.float64, device=device_for(backend))
    with fastformer.use_backend(backend), pytest.raises(RuntimeError, match="float64"):
        ops.attention(q, q, q)
