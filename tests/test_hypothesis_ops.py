"""Property tests: hypothesis draws shapes, masks, dtypes and dropout rates, and every kernel
backend that can run here must match the reference (forward and every gradient) and must never
produce a NaN or an inf where the reference has none.

The examples are derandomized (the same ones on every run, so CI cannot flake) and few per op:
the hand-picked odd shapes of the per-op test files stay the main check; these search the space
between them. The kernel and the reference draw their dropout seed from the same
``torch.manual_seed``, so both drop the same elements.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastformer
from fastformer import ops
from fastformer.ops import reference
from utils import assert_close_lowp, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
# The Triton interpreter and the CUDA harness are slow: fewer examples there.
EXAMPLES = {"cpu": 30, "triton": 6, "cuda": 6}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# fp32: (atol, rtol) for outputs and gradients. bf16: FlashAttention's rule (error at most
# LOWP_FACTOR x the bf16 reference's error against fp32, + atol); the Triton interpreter rounds
# fp32 -> bf16 by truncation, a whole ulp, so it gets twice the factor.
FP32_TOL = (2e-4, 1e-4)
LOWP_FACTOR = {"cpu": 2.0, "triton": 4.0 if not torch.cuda.is_available() else 2.0, "cuda": 2.0}
LOWP_ATOL = 2e-2


def _settings(backend):
    return settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _run(fn, inputs, seed):
    """fn(*inputs) under torch.manual_seed(seed) and the gradients of every floating input for a
    fixed random upstream gradient: ([output], {index: grad})."""
    leaves = [t.detach().clone().requires_grad_() if t is not None and t.is_floating_point() else t
              for t in inputs]
    torch.manual_seed(seed)
    out = fn(*leaves)
    g = torch.Generator().manual_seed(seed + 1)
    upstream = torch.randn(out.shape, generator=g).to(out.dtype)
    wrt = [(i, t) for i, t in enumerate(leaves) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, [t for _, t in wrt], upstream, allow_unused=True,
                                materialize_grads=True)
    return [out.detach()] + [gr for gr in grads], [i for i, _ in wrt]


def _check(backend, dtype_name, kernel_fn, ref_fn, inputs, seed=7):
    """Kernel (in `backend`) against the reference, forward and every gradient."""
    dtype = DTYPES[dtype_name]
    cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in inputs]

    def kernel(*args):
        with fastformer.use_backend(backend):
            return kernel_fn(*args)

    got, _ = _run(kernel, cast, seed)
    ref_lowp, names = _run(ref_fn, cast, seed)
    labels = ["out"] + [f"grad[{i}]" for i in names]
    if dtype == torch.float32:
        for label, a, b in zip(labels, got, ref_lowp):
            assert torch.isfinite(a).all() or not torch.isfinite(b).all(), f"{label}: non-finite where the reference is finite"
            # NaN where the reference has NaN (an all-ignored mean loss is 0/0, as in torch)
            torch.testing.assert_close(a, b, atol=FP32_TOL[0], rtol=FP32_TOL[1], equal_nan=True,
                                       msg=lambda m, label=label: f"{label}: {m}")
        return
    upcast = [t.float() if t is not None and t.is_floating_point() else t for t in cast]
    ref_fp32, _ = _run(ref_fn, upcast, seed)
    for label, a, b32, blow in zip(labels, got, ref_fp32, ref_lowp):
        a, blow = a.float(), blow.float()
        finite = torch.isfinite(b32)  # NaN and inf exactly where the fp32 reference has them
        torch.testing.assert_close(a[~finite], b32[~finite], atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m, label=label: f"{label}, non-finite entries: {m}")
        assert_close_lowp(label, a[finite], b32[finite], blow[finite], factor=LOWP_FACTOR[backend], atol=LOWP_ATOL)


dtypes = st.sampled_from(sorted(DTYPES))
dropout = st.sampled_from([0.0, 0.0, 0.1, 0.5])


@st.composite
def attention_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Sq, Sk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    D = draw(st.sampled_from([8, 16, 24, 40, 59, 64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(B, H, S, D, generator=g) for S in (Sq, Sk, Sk))
    kpm = None
    if draw(st.booleans()):
        kpm = torch.rand(B, Sk, generator=g) < draw(st.sampled_from([0.2, 0.6, 1.0]))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    attn_mask = None
    if mask_kind != "none":  # broadcast over B and H, as a module's sequence mask is
        hide = torch.rand(1, 1, Sq, Sk, generator=g) < 0.3
        attn_mask = hide if mask_kind == "bool" else torch.randn(1, 1, Sq, Sk, generator=g).masked_fill(hide, float("-inf"))
    causal = draw(st.booleans())
    return (q, k, v), dict(key_padding_mask=kpm, attn_mask=attn_mask, is_causal=causal,
                           dropout_p=draw(dropout))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_matches_reference(backend):
    @_settings(backend)
    @given(case=attention_cases(), dtype=dtypes)
    def check(case, dtype):
        (q, k, v), kw = case
        _check(backend, dtype, lambda q, k, v: ops.attention(q, k, v, **kw),
               lambda q, k, v: reference.attention(q, k, v, **kw), [q, k, v])
    check()


@st.composite
def add_layer_norm_cases(draw):
    N, C = draw(st.integers(1, 50)), draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(N, C, generator=g) * draw(st.sampled_from([1.0, 30.0]))
    residual = torch.randn(N, C, generator=g) if draw(st.booleans()) else None
    weight = 1 + 0.5 * torch.randn(C, generator=g) if draw(st.booleans()) else None
    bias = torch.randn(C, generator=g) if weight is not None and draw(st.booleans()) else None
    return [x, residual, weight, bias], draw(dropout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_layer_norm_matches_reference(backend):
    @_settings(backend)
    @given(case=add_layer_norm_cases(), dtype=dtypes)
    def check(case, dtype):
        inputs, p = case
        _check(backend, dtype, lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5, p),
               lambda x, r, w, b: reference.add_layer_norm(x, r, w, b, 1e-5, p), inputs)
    check()


@st.composite
def feed_forward_cases(draw):
    N, E, F_ = draw(st.integers(1, 40)), draw(st.integers(1, 70)), draw(st.integers(1, 130))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(N, E, generator=g)
    w1, w2 = torch.randn(F_, E, generator=g) / E**0.5, torch.randn(E, F_, generator=g) / F_**0.5
    b1 = torch.randn(F_, generator=g) if draw(st.booleans()) else None
    b2 = torch.randn(E, generator=g) if draw(st.booleans()) else None
    kw = dict(activation=draw(st.sampled_from(["relu", "gelu", "silu"])), dropout_p=draw(dropout))
    return [x, w1, b1, w2, b2], kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_feed_forward_matches_reference(backend):
    @_settings(backend)
    @given(case=feed_forward_cases(), dtype=dtypes)
    def check(case, dtype):
        inputs, kw = case
        _check(backend, dtype, lambda *a: ops.feed_forward(*a, **kw),
               lambda *a: reference.feed_forward(*a, **kw), inputs)
    check()


@st.composite
def cross_entropy_cases(draw):
    N, V = draw(st.integers(1, 60)), draw(st.integers(1, 700))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = torch.randn(N, V, generator=g) * draw(st.sampled_from([1.0, 20.0]))
    target = torch.randint(0, V, (N,), generator=g)
    if draw(st.booleans()):  # some ignored rows (maybe all of them)
        target = target.masked_fill(torch.rand(N, generator=g) < draw(st.sampled_from([0.3, 1.0])), -100)
    kw = dict(label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
              reduction=draw(st.sampled_from(["mean", "sum", "none"])))
    return [logits, target], kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_matches_reference(backend):
    @_settings(backend)
    @given(case=cross_entropy_cases(), dtype=dtypes)
    def check(case, dtype):
        inputs, kw = case
        _check(backend, dtype, lambda lg, t: ops.cross_entropy(lg, t, **kw),
               lambda lg, t: reference.cross_entropy(lg, t, **kw), inputs)
    check()


@st.composite
def linear_cross_entropy_cases(draw):
    N, D, V = draw(st.integers(1, 40)), draw(st.integers(1, 64)), draw(st.integers(1, 500))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) / D**0.5
    bias = torch.randn(V, generator=g) if draw(st.booleans()) else None
    target = torch.randint(0, V, (N,), generator=g)
    if draw(st.booleans()):
        target = target.masked_fill(torch.rand(N, generator=g) < 0.3, -100)
    kw = dict(label_smoothing=draw(st.sampled_from([0.0, 0.1])),
              reduction=draw(st.sampled_from(["mean", "sum", "none"])))
    return [hidden, weight, bias, target], kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_matches_reference(backend):
    @_settings(backend)
    @given(case=linear_cross_entropy_cases(), dtype=dtypes)
    def check(case, dtype):
        inputs, kw = case
        _check(backend, dtype, lambda h, w, b, t: ops.linear_cross_entropy(h, w, t, linear_bias=b, **kw),
               lambda h, w, b, t: reference.linear_cross_entropy(h, w, t, linear_bias=b, **kw), inputs)
    check()


@st.composite
def embedding_cases(draw):
    shape = draw(st.sampled_from([(1,), (7,), (2, 5), (3, 1, 4)]))
    V, D = draw(st.integers(1, 40)), draw(st.integers(1, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(0, V, shape, generator=g)
    weight = torch.randn(V, D, generator=g)
    positional = positions = None
    if draw(st.booleans()):
        P = shape[-1] + draw(st.integers(0, 3))
        positional = torch.randn(P, D, generator=g)  # learned: it gets a gradient too
        if draw(st.booleans()):
            positions = torch.randint(0, P, shape, generator=g)
    kw = dict(scale=draw(st.sampled_from([1.0, 16.0])), dropout_p=draw(dropout),
              padding_idx=draw(st.sampled_from([None, 0])))
    return [ids, weight, positional, positions], kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_matches_reference(backend):
    @_settings(backend)
    @given(case=embedding_cases(), dtype=dtypes)
    def check(case, dtype):
        inputs, kw = case
        _check(backend, dtype, lambda i, w, t, p: ops.embedding(i, w, positional=t, positions=p, **kw),
               lambda i, w, t, p: reference.embedding(i, w, positional=t, positions=p, **kw), inputs)
    check()
