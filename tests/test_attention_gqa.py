"""Grouped-query attention (k and v with H_kv heads dividing q's H; multi-query with H_kv = 1) in
attention and attention_varlen, on every backend: values and every gradient against PyTorch's
F.scaled_dot_product_attention(..., enable_gqa=True) (fp32: FlashAttention's rule, the backend's
error against an fp64 truth at most twice PyTorch's own fp32 error; fp64 where the backend takes
it), masks, dropout bit-equal to the reference on the same Philox pair, packed k/v, and bad head
counts (clear errors naming the argument)."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import backends, philox
from fastformer.ops import attention, attention_varlen, attention_varlen_kvpacked, reference
from utils import assert_close_lowp, device_for, kernel_backends, max_err

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends("cpu", "triton", "cuda")
FP64 = ("reference", "cpu")  # the backends that take fp64
# FlashAttention's rule for fp32: error <= FACTOR x PyTorch's fp32 error (both against fp64) + ATOL.
FACTOR = 2.0
ATOL = {"out": 1e-6, "grad": 5e-6}
NAMES = ("out", "dq", "dk", "dv")

# name: (B, H, H_kv, Sq, Sk, D, key padding, causal). Causal cases keep Sq <= Sk and padding keeps
# a key, so every row sees a key (SDPA's fully masked rows are NaN, the ops' are 0: see below).
DENSE = {
    "g2": (2, 4, 2, 7, 7, 40, False, False),
    "g4_causal_kpm": (2, 8, 2, 33, 65, 24, True, True),
    "mqa": (2, 4, 1, 17, 9, 64, False, False),
    "mqa_q1_kpm": (3, 6, 1, 1, 29, 24, True, False),
    "g2_causal_d24": (1, 4, 2, 65, 65, 24, False, True),
    "g1": (2, 3, 3, 9, 13, 32, True, True),  # no group: the plain path
}
# name: (H, H_kv, D, query lengths, key lengths, causal)
VARLEN = {
    "g2": (4, 2, 40, [7, 1, 33], [7, 5, 33], False),
    "g4_causal": (8, 2, 24, [9, 17, 1], [9, 30, 4], True),
    "mqa_empty": (4, 1, 64, [5, 0, 12], [7, 3, 12], False),
    "g1": (3, 3, 32, [6, 11], [6, 11], True),
}
# The emulated backends (Triton's interpreter, the SIMT harness) are slow: a subset each.
EMULATED = {"dense": ("g2", "g4_causal_kpm", "mqa_q1_kpm"), "varlen": ("g2", "g4_causal")}


def _params(cases, kind):
    return list(_iter_params(cases, kind))


def _iter_params(cases, kind):
    for backend in BACKENDS:
        name = backend.values[0]
        for case in cases:
            if name in ("triton", "cuda") and case not in EMULATED[kind]:
                continue
            yield pytest.param(name, case, marks=backend.marks, id=f"{backend.id}-{case}")


def _grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _check(got, truth, torch_fp32):
    """FlashAttention's rule, output and every gradient."""
    for name, g, t, p in zip(NAMES, got, truth, torch_fp32):
        assert g.shape == t.shape, f"{name}: shape {tuple(g.shape)} != {tuple(t.shape)}"
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        err, ref_err = max_err(g, t), max_err(p, t)
        atol = ATOL["out" if name == "out" else "grad"]
        assert err <= FACTOR * ref_err + atol, (
            f"{name}: error {err:.3e} > {FACTOR} x PyTorch's fp32 error {ref_err:.3e} + {atol:.0e}")


# fp64 (atol, rtol): fp64 end to end, the cpu kernels' log-sum-exp included
FP64_TOL = {"reference": (1e-10, 1e-9), "cpu": (1e-10, 1e-9)}


def _check_fp64(backend, got, truth):
    atol, rtol = FP64_TOL[backend]
    for name, g, t in zip(NAMES, got, truth):
        assert g.dtype == torch.float64 and g.shape == t.shape, name
        torch.testing.assert_close(g, t, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- dense


def _dense_inputs(case, device, dtype):
    B, H, H_kv, Sq, Sk, D, padded, causal = DENSE[case]
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(B, H, Sq, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H_kv, Sk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    kpm = None
    if padded:  # right padding, at least one key left
        lengths = torch.randint(1, Sk + 1, (B,), generator=gen)
        kpm = torch.arange(Sk)[None, :] >= lengths[:, None]
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return [to(t) for t in (q, k, v)], to(dout), (None if kpm is None else kpm.to(device)), causal


def _sdpa(q, k, v, kpm, causal):
    """PyTorch's attention with its own GQA; the bottom-right causal mask and the padding as one
    bool mask (True = visible)."""
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    visible = torch.ones(B, 1, Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (torch.arange(Sk, device=q.device)[None, :]
                             <= torch.arange(Sq, device=q.device)[:, None] + Sk - Sq)
    if kpm is not None:
        visible = visible & ~kpm[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


def _dense_torch(case, dtype):
    (q, k, v), dout, kpm, causal = _dense_inputs(case, "cpu", dtype)
    return _grads(lambda q, k, v: _sdpa(q, k, v, kpm, causal), (q, k, v), dout)


def _dense_op(backend, case, dtype):
    (q, k, v), dout, kpm, causal = _dense_inputs(case, device_for(backend), dtype)
    with fastformer.use_backend(backend):
        got = _grads(lambda q, k, v: attention(q, k, v, key_padding_mask=kpm, is_causal=causal), (q, k, v), dout)
    return [t.cpu() for t in got]


@pytest.mark.parametrize("backend,case", _params(DENSE, "dense"))
def test_dense_fp32_against_sdpa(backend, case):
    got = _dense_op(backend, case, torch.float32)
    _check(got, _dense_torch(case, torch.float64), _dense_torch(case, torch.float32))


@pytest.mark.parametrize("backend", FP64)
@pytest.mark.parametrize("case", list(DENSE))
def test_dense_fp64_against_sdpa(backend, case):
    _check_fp64(backend, _dense_op(backend, case, torch.float64), _dense_torch(case, torch.float64))


@pytest.mark.parametrize("backend", FP64)
def test_gradcheck_float64(backend):
    """Every gradient against finite differences, padding, causal and dropout included."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kpm = torch.tensor([[False] * 4 + [True] * 2, [True] + [False] * 5])

    def fn(q, k, v):
        torch.manual_seed(42)  # the same dropout mask on every evaluation
        with fastformer.use_backend(backend):
            return attention(q, k, v, key_padding_mask=kpm, is_causal=True, dropout_p=0.2)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3)


def test_reference_is_attention_on_repeated_kv():
    """The definition: each k/v head serves H // H_kv query heads in a row, masks per query head."""
    (q, k, v), _, kpm, causal = _dense_inputs("g4_causal_kpm", "cpu", torch.float64)
    G = q.shape[1] // k.shape[1]
    am = torch.randn(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=torch.float64)
    got = reference.attention(q, k, v, key_padding_mask=kpm, attn_mask=am, is_causal=causal)
    want = reference.attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), key_padding_mask=kpm,
                               attn_mask=am, is_causal=causal)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_attn_mask_per_query_head(backend):
    """A float mask of (B, H, Sq, Sk) is read per query head, not per k/v head."""
    (q, k, v), dout, _, _ = _dense_inputs("g2", device_for(backend), torch.float32)
    gen = torch.Generator().manual_seed(1)
    am = torch.randn(q.shape[0], q.shape[1], q.shape[2], k.shape[2], generator=gen).to(q.device)
    with fastformer.use_backend(backend):
        got = _grads(lambda q, k, v: attention(q, k, v, attn_mask=am), (q, k, v), dout)
    f64 = [t.double() for t in (q, k, v)]
    truth = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=am.double(), enable_gqa=True),
                   f64, dout.double())
    torch_fp32 = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=am, enable_gqa=True),
                        (q, k, v), dout)
    _check(got, truth, torch_fp32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_rows_without_keys_are_zero(backend):
    """Causal with Sq > Sk: the leading rows see no key; they output 0 and get no gradient, as
    without groups (the reference on repeated k/v)."""
    gen = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 4, 9, 24, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 5, 24, generator=gen) for _ in range(2))
    dev = device_for(backend)
    q, k, v, dout = (t.to(dev) for t in (q, k, v, dout))
    with fastformer.use_backend(backend):
        got = _grads(lambda q, k, v: attention(q, k, v, is_causal=True), (q, k, v), dout)
    want = _grads(lambda q, k, v: reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                      is_causal=True), (q, k, v), dout)
    assert torch.equal(got[0][:, :, :4].cpu(), torch.zeros(1, 4, 4, 24))
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, atol=5e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_dropout_matches_the_reference(backend):
    """With the Philox pair the op drew, the reference on repeated k/v drops the same elements
    (per batch entry, query head, query, key)."""
    (q, k, v), dout, kpm, causal = _dense_inputs("g4_causal_kpm", device_for(backend), torch.float32)
    G = q.shape[1] // k.shape[1]

    def op(q, k, v):
        torch.manual_seed(7)
        with fastformer.use_backend(backend):
            return attention(q, k, v, key_padding_mask=kpm, is_causal=causal, dropout_p=0.3)

    def ref(q, k, v):
        torch.manual_seed(7)
        rng = philox.next_seed()  # the pair the op drew
        return reference.attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), key_padding_mask=kpm,
                                   is_causal=causal, dropout_p=0.3, rng=rng)

    got, want = _grads(op, (q, k, v), dout), _grads(ref, (q, k, v), dout)
    assert torch.equal(got[0] == 0, want[0] == 0)  # the same rows dropped to nothing (none, here)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- varlen


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _varlen_inputs(case, device, dtype):
    H, H_kv, D, lq, lk, causal = VARLEN[case]
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lk), H_kv, D, generator=gen, dtype=torch.float64) for _ in range(2))
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    lengths = (_cu(lq, device), _cu(lk, device), max(lq), max(lk))
    return [to(t) for t in (q, k, v)], to(dout), lengths, causal


def _sdpa_varlen(q, k, v, cu_q, cu_k, causal):
    """Each sequence through PyTorch's attention with its own GQA."""
    pieces = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qb, kb, vb = (t[c[b]:c[b + 1]].transpose(0, 1)[None] for t, c in ((q, cq), (k, ck), (v, ck)))
        pieces.append(_sdpa(qb, kb, vb, None, causal)[0].transpose(0, 1))
    return torch.cat(pieces)


def _varlen_torch(case, dtype):
    (q, k, v), dout, (cu_q, cu_k, _, _), causal = _varlen_inputs(case, "cpu", dtype)
    return _grads(lambda q, k, v: _sdpa_varlen(q, k, v, cu_q, cu_k, causal), (q, k, v), dout)


def _varlen_op(backend, case, dtype):
    (q, k, v), dout, lengths, causal = _varlen_inputs(case, device_for(backend), dtype)
    with fastformer.use_backend(backend):
        got = _grads(lambda q, k, v: attention_varlen(q, k, v, *lengths, is_causal=causal), (q, k, v), dout)
    return [t.cpu() for t in got]


@pytest.mark.parametrize("backend,case", _params(VARLEN, "varlen"))
def test_varlen_fp32_against_sdpa(backend, case):
    got = _varlen_op(backend, case, torch.float32)
    _check(got, _varlen_torch(case, torch.float64), _varlen_torch(case, torch.float32))


@pytest.mark.parametrize("backend", FP64)
@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_fp64_against_sdpa(backend, case):
    _check_fp64(backend, _varlen_op(backend, case, torch.float64), _varlen_torch(case, torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_kvpacked(backend):
    """kv (total_k, 2, H_kv, D): the same as k and v given apart; its gradient one tensor."""
    (q, k, v), dout, lengths, causal = _varlen_inputs("g4_causal", device_for(backend), torch.float32)
    kv = torch.stack((k, v), 1)
    with fastformer.use_backend(backend):
        got = _grads(lambda q, kv: attention_varlen_kvpacked(q, kv, *lengths, is_causal=causal), (q, kv), dout)
        want = _grads(lambda q, k, v: attention_varlen(q, k, v, *lengths, is_causal=causal), (q, k, v), dout)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[2], torch.stack(want[2:], 1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_dropout_matches_the_reference(backend):
    (q, k, v), dout, lengths, causal = _varlen_inputs("g4_causal", device_for(backend), torch.float32)
    G = q.shape[1] // k.shape[1]

    def op(q, k, v):
        torch.manual_seed(5)
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, *lengths, is_causal=causal, dropout_p=0.4)

    def ref(q, k, v):
        torch.manual_seed(5)
        rng = philox.next_seed()
        return reference.attention_varlen(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), *lengths,
                                          is_causal=causal, dropout_p=0.4, rng=rng)

    got, want = _grads(op, (q, k, v), dout), _grads(ref, (q, k, v), dout)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- 16-bit


LOWP = kernel_backends("cpu", "triton", "cuda")
# FlashAttention's rule against the fp32 reference; Triton's interpreter rounds fp32 -> bf16 by
# truncation (tests/test_attention.py), so it gets twice the factor there
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}


@pytest.mark.parametrize("backend", LOWP)
def test_bf16_against_the_reference(backend):
    """bf16 (on the cuda backend: the tensor-core kernels, forward and backward): error against
    the fp32 reference at most LOWP_FACTOR x the bf16 reference's own, dense and packed."""
    dev = device_for(backend)
    (q, k, v), dout, kpm, causal = _dense_inputs("g4_causal_kpm", dev, torch.float32)
    dense = lambda q, k, v: attention(q, k, v, key_padding_mask=kpm, is_causal=causal)  # noqa: E731
    (vq, vk, vv), vdout, lengths, vcausal = _varlen_inputs("g4_causal", dev, torch.float32)
    packed = lambda q, k, v: attention_varlen(q, k, v, *lengths, is_causal=vcausal)  # noqa: E731
    for fn, inputs, up in ((dense, (q, k, v), dout), (packed, (vq, vk, vv), vdout)):
        lowp = [t.bfloat16() for t in inputs]
        with fastformer.use_backend(backend):
            got = _grads(fn, lowp, up.bfloat16())
        with fastformer.use_backend("reference"):
            ref_lowp = _grads(fn, lowp, up.bfloat16())
            ref = _grads(fn, inputs, up)
        for name, g, lp, r in zip(NAMES, got, ref_lowp, ref):
            assert g.dtype == torch.bfloat16, name
            assert_close_lowp(name, g.float(), r, lp.float(), factor=LOWP_FACTOR[backend])


# ---------------------------------------------------------------- hostile


def _dense(H, H_kv, H_v=None):
    q = torch.randn(1, H, 3, 8)
    k = torch.randn(1, H_kv, 4, 8)
    v = torch.randn(1, H_kv if H_v is None else H_v, 4, 8)
    return q, k, v


@pytest.mark.parametrize("backend", ["reference", *kernel_backends("cpu")])
def test_heads_not_dividing_are_refused(backend):
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match=r"k has 3 heads, which must divide q's 4 heads"):
            attention(*_dense(4, 3))
        with pytest.raises(ValueError, match=r"v must have shape \(1, 2, 4, 8\)"):
            attention(*_dense(4, 2, H_v=1))  # k and v with different head counts
        with pytest.raises(ValueError, match=r"k has 8 heads, which must divide q's 4 heads"):
            attention(*_dense(4, 8))  # more k/v heads than query heads
        q = torch.randn(5, 4, 8)
        cu = torch.tensor([0, 5], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"k has 3 heads, which must divide q's 4 heads"):
            attention_varlen(q, torch.randn(5, 3, 8), torch.randn(5, 3, 8), cu, cu, 5, 5)
        with pytest.raises(ValueError, match=r"v must have shape \(5, 2, 8\)"):
            attention_varlen(q, torch.randn(5, 2, 8), torch.randn(5, 1, 8), cu, cu, 5, 5)
        with pytest.raises(ValueError, match=r"kv has 3 heads, which must divide q's 4 heads"):
            attention_varlen_kvpacked(q, torch.randn(5, 2, 3, 8), cu, cu, 5, 5)


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_kernels_refuse_heads_not_dividing(backend):
    """The C++ ops check for themselves (the fast path leaves it to them)."""
    kern = backends.Kernels(backend)
    q, k, v = _dense(4, 3)
    with pytest.raises(RuntimeError, match=r"attention_fwd: k has 3 heads, which must divide q's 4 heads"):
        kern.attention_fwd(q, k, v, None, None, False, 0.5, 0.0, philox.pack(0, 0))
    q, k, v = _dense(4, 2, H_v=1)
    with pytest.raises(RuntimeError, match=r"attention_fwd: v must have k's shape"):
        kern.attention_fwd(q, k, v, None, None, False, 0.5, 0.0, philox.pack(0, 0))
    q, cu = torch.randn(5, 4, 8), torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"attention_varlen_fwd: k has 3 heads, which must divide q's 4"):
        kern.attention_varlen_fwd(q, torch.randn(5, 3, 8), torch.randn(5, 3, 8), cu, cu, 5, 5, False, 0.5, 0.0,
                                  philox.pack(0, 0))


def test_fast_path_refuses_heads_not_dividing():
    """The unchecked fast path gives the checked path's error, not a kernel's or a ZeroDivisionError."""
    for H_kv in (3, 0):
        with pytest.raises(ValueError, match=rf"k has {H_kv} heads, which must divide q's 4 heads"):
            attention(*_dense(4, H_kv))


def test_gradients_have_the_shapes_of_k_and_v():
    (q, k, v), dout, kpm, causal = _dense_inputs("mqa", "cpu", torch.float32)
    out, dq, dk, dv = _grads(lambda q, k, v: attention(q, k, v), (q, k, v), dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
