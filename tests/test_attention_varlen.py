"""attention_varlen: the reference against the padded op and torch SDPA, then every kernel backend
against the reference (forward, dq, dk, dv in fp32 and bf16), sequences of length 0, causal with
Lq != Lk, dropout bits equal to the reference's (and so to the padded op's), the log-sum-exp, NaN,
opcheck on the C++ op, hypothesis over lengths, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import attention, attention_varlen, reference
from utils import assert_close, assert_close_lowp, backend_cases, device_for, kernel_backends, skip_without_kernels

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPP = kernel_backends("cpu", "cuda")

FP32_TOL = {"cpu": {"out": (1e-5, 1e-4), "grad": (5e-5, 1e-4)},
            "triton": {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)},
            "cuda": {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)}}
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}

# name: (H, D, query lengths, key lengths, is_causal); a length 0 is an empty sequence.
CASES = {
    "one_1x1_d64": (1, 64, [1], [1], False),
    "odd_d40": (3, 40, [7, 1, 113], [7, 1, 113], False),
    "self_causal_d59": (2, 59, [7, 113, 1, 30], [7, 113, 1, 30], True),
    "cross_d80": (2, 80, [113, 7, 1], [7, 113, 50], False),
    "causal_lq_ne_lk_d111": (1, 111, [113, 7, 20, 1], [7, 113, 20, 9], True),  # Lq > Lk: leading rows see nothing
    "empty_sequences_d128": (2, 128, [0, 7, 3, 0, 1], [5, 0, 3, 0, 7], False),
    "empty_causal_d64": (2, 64, [9, 0, 4], [0, 6, 4], True),
    "d256": (1, 256, [17, 3], [5, 21], True),
}
TRITON_CASES = ("one_1x1_d64", "odd_d40", "causal_lq_ne_lk_d111", "empty_causal_d64")


def _cases():
    return backend_cases(BACKENDS, CASES, TRITON_CASES)


def cu_seqlens(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()),
                        dtype=torch.int32, device=device)


def _inputs(case, device, dtype=torch.float32, seed=0):
    H, D, lq, lk, causal = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lq), H, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=gen) for _ in range(2))
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    lengths = dict(cu_seqlens_q=cu_seqlens(lq, device), cu_seqlens_k=cu_seqlens(lk, device),
                   max_seqlen_q=max(lq, default=0), max_seqlen_k=max(lk, default=0))
    return (to(q), to(k), to(v)), to(dout), lengths, causal


def _grads(fn, qkv, dout):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _kernel(backend, qkv, dout, lengths, causal, p=0.0, seed=1234):
    def fn(q, k, v):
        torch.manual_seed(seed)  # the Function draws its (seed, offset) from torch's generator
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, **lengths, is_causal=causal, dropout_p=p)
    return _grads(fn, qkv, dout)


def _reference(qkv, dout, lengths, causal, p=0.0, seed=1234, dtype=torch.float32):
    torch.manual_seed(seed)
    rng = philox.next_seed() if p > 0 else None  # the very pair the kernel's Function drew
    lengths = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in lengths.items()}
    cast = [t.cpu().to(dtype) for t in qkv]
    return _grads(lambda q, k, v: reference.attention_varlen(q, k, v, **lengths, is_causal=causal,
                                                             dropout_p=p, rng=rng),
                  cast, dout.cpu().to(dtype))


def _padded(case, qkv, dout, p=0.0, rng=None):
    """The same sequences right-padded to (B, H, max_q / max_k, D) through the padded reference op, with
    the per-sequence causal mask spelt out; its outputs and gradients packed again."""
    H, D, lq, lk, causal = CASES[case]
    B, mq, mk = len(lq), max(lq), max(lk)
    cq, ck = cu_seqlens(lq).tolist(), cu_seqlens(lk).tolist()

    def pad(t, c, lengths, m):
        out = t.new_zeros(B, m, H, D)
        for b in range(B):
            out[b, :lengths[b]] = t[c[b]:c[b + 1]]
        return out.transpose(1, 2)  # (B, H, m, D)

    kpm = torch.arange(mk)[None, :] >= torch.tensor(lk)[:, None]  # (B, mk)
    am = None
    if causal:
        i, j = torch.arange(mq)[:, None], torch.arange(mk)[None, :]
        am = torch.stack([j > i + lk[b] - lq[b] for b in range(B)])[:, None]  # (B, 1, mq, mk)

    def fn(q, k, v):
        o = reference.attention(pad(q, cq, lq, mq), pad(k, ck, lk, mk), pad(v, ck, lk, mk), key_padding_mask=kpm,
                                attn_mask=am, dropout_p=p, rng=rng).transpose(1, 2)  # (B, mq, H, D)
        return torch.cat([o[b, :lq[b]] for b in range(B)])
    return _grads(fn, qkv, dout)


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_is_the_padded_op_on_the_same_sequences(case, p):
    """Forward and every gradient, dropout included (the same bits: the padded op's counters)."""
    qkv, dout, lengths, causal = _inputs(case, "cpu", torch.float64)
    rng = philox.pack(99, 7)
    got = _grads(lambda q, k, v: reference.attention_varlen(q, k, v, **lengths, is_causal=causal, dropout_p=p,
                                                            rng=rng), qkv, dout)
    want = _padded(case, qkv, dout, p=p, rng=rng)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g, w, atol=1e-12, rtol=1e-12)


def test_reference_matches_torch_sdpa_per_sequence():
    case = "causal_lq_ne_lk_d111"
    (q, k, v), dout, lengths, causal = _inputs(case, "cpu")
    out = reference.attention_varlen(q, k, v, **lengths, is_causal=True)
    cq, ck = lengths["cu_seqlens_q"].tolist(), lengths["cu_seqlens_k"].tolist()
    for b in range(len(cq) - 1):
        qb, kb, vb = (t[c[b]:c[b + 1]].transpose(0, 1) for t, c in ((q, cq), (k, ck), (v, ck)))
        Lq, Lk = qb.shape[1], kb.shape[1]
        visible = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + Lk - Lq
        sees = visible.any(-1)  # SDPA gives NaN for a row that sees nothing; the op gives 0
        want = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible | ~sees[:, None])
        want = torch.where(sees[None, :, None], want, torch.zeros_like(want)).transpose(0, 1)
        assert_close(f"sequence {b}", out[cq[b]:cq[b + 1]], want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,case", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, case):
    skip_without_kernels(backend, "attention_varlen")
    qkv, dout, lengths, causal = _inputs(case, device_for(backend))
    got = _kernel(backend, qkv, dout, lengths, causal)
    want = _reference(qkv, dout, lengths, causal)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        atol, rtol = FP32_TOL[backend]["out" if name == "out" else "grad"]
        assert_close(name, g.cpu(), w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend,case", [c for c in _cases() if c.values[1] in ("odd_d40", "causal_lq_ne_lk_d111",
                                                                                  "empty_causal_d64")])
def test_bf16_forward_and_every_gradient(backend, case):
    skip_without_kernels(backend, "attention_varlen")
    qkv, dout, lengths, causal = _inputs(case, device_for(backend), torch.bfloat16)
    got = _kernel(backend, qkv, dout, lengths, causal)
    want = _reference(qkv, dout, lengths, causal, dtype=torch.float32)
    lowp = _reference(qkv, dout, lengths, causal, dtype=torch.bfloat16)
    for name, g, w, lp in zip(("out", "dq", "dk", "dv"), got, want, lowp):
        assert g.dtype == torch.bfloat16, f"{name} must stay bf16, got {g.dtype}"
        assert_close_lowp(name, g.cpu().float(), w, lp.float(), factor=LOWP_FACTOR[backend], atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_matches_the_reference_exactly(backend):
    """p = 0.5 with the Function's own draw: any bit that differs from the reference's (the padded
    op's counters) changes an output far beyond the tolerance."""
    skip_without_kernels(backend, "attention_varlen")
    case = "causal_lq_ne_lk_d111" if backend != "triton" else "empty_causal_d64"
    qkv, dout, lengths, causal = _inputs(case, device_for(backend))
    got = _kernel(backend, qkv, dout, lengths, causal, p=0.5)
    want = _reference(qkv, dout, lengths, causal, p=0.5)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        atol, rtol = FP32_TOL[backend]["out" if name == "out" else "grad"]
        assert_close(name, g.cpu(), w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_layout_and_rows_without_keys(backend):
    """lse (H, total_q) is the log-sum-exp of the visible scaled scores, +inf for a row that sees no
    key; such a row outputs 0 and gets zero gradient."""
    skip_without_kernels(backend, "attention_varlen")
    case = "empty_causal_d64"
    device = device_for(backend)
    (q, k, v), dout, lengths, causal = _inputs(case, device)
    with fastformer.use_backend(backend):
        kernels = backends.select("attention_varlen", torch.device(device), torch.float32)
    out, lse = kernels.attention_varlen_fwd(q, k, v, *lengths.values(), causal, 0.25, 0.0, philox.pack(0, 0))
    H, D, lq, lk, _ = CASES[case]
    assert lse.shape == (H, sum(lq)) and lse.dtype == torch.float32
    cq, ck = cu_seqlens(lq).tolist(), cu_seqlens(lk).tolist()
    for b in range(len(lq)):
        qb, kb = q[cq[b]:cq[b + 1]].cpu().transpose(0, 1), k[ck[b]:ck[b + 1]].cpu().transpose(0, 1)
        s = qb @ kb.transpose(-2, -1) * 0.25  # (H, Lq, Lk)
        i, j = torch.arange(lq[b])[:, None], torch.arange(lk[b])[None, :]
        s = s.masked_fill(j > i + lk[b] - lq[b], float("-inf"))
        want = torch.logsumexp(s, -1) if lk[b] else torch.full((H, lq[b]), float("-inf"))
        want = torch.where(torch.isinf(want), torch.full_like(want, float("inf")), want)  # no key: +inf
        assert_close(f"lse of sequence {b}", lse[:, cq[b]:cq[b + 1]].cpu(), want, atol=1e-5, rtol=1e-5)
    blind = torch.zeros(sum(lq), dtype=torch.bool)
    blind[cq[0]:cq[1]] = True  # sequence 0 has no keys
    assert torch.equal(out.cpu()[blind], torch.zeros_like(out.cpu()[blind]))
    got = _kernel(backend, (q, k, v), dout, lengths, causal)
    assert torch.equal(got[1].cpu()[blind], torch.zeros_like(got[1].cpu()[blind]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stays_in_its_sequence(backend):
    skip_without_kernels(backend, "attention_varlen")
    (q, k, v), dout, lengths, causal = _inputs("odd_d40", device_for(backend))
    k = k.clone()
    k[3, 1, 5] = float("nan")  # sequence 0 (rows 0..6), head 1
    with fastformer.use_backend(backend):
        out = attention_varlen(q, k, v, **lengths).cpu()
    want = reference.attention_varlen(q.cpu(), k.cpu(), v.cpu(), *(t.cpu() if isinstance(t, torch.Tensor) else t
                                                                   for t in lengths.values()))
    assert torch.isnan(out[:7, 1]).all(), "every query of the sequence sees the NaN key"
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.isfinite(out[7:]).all() and torch.isfinite(out[:7, 0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    skip_without_kernels(backend, "attention_varlen")
    device = device_for(backend)
    with fastformer.use_backend(backend):
        for lq, lk in (([], []), ([0, 0], [0, 3]), ([2, 0], [0, 0])):
            q = torch.randn(sum(lq), 2, 8, device=device, requires_grad=True)
            k = torch.randn(sum(lk), 2, 8, device=device, requires_grad=True)
            v = torch.randn(sum(lk), 2, 8, device=device, requires_grad=True)
            out = attention_varlen(q, k, v, cu_seqlens(lq, device), cu_seqlens(lk, device), max(lq, default=0),
                                   max(lk, default=0), is_causal=True)
            assert out.shape == q.shape and not out.cpu().any()
            out.sum().backward()
            assert not q.grad.cpu().any() and not k.grad.cpu().any() and not v.grad.cpu().any()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "triton"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_hypothesis_lengths(backend, data):
    skip_without_kernels(backend, "attention_varlen")
    B = data.draw(st.integers(0, 4))
    lq = data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    lk = data.draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    D = data.draw(st.integers(1, 72))
    causal, p = data.draw(st.booleans()), data.draw(st.sampled_from([0.0, 0.2]))
    CASES["_hyp"] = (2, D, lq, lk, causal)
    try:
        qkv, dout, lengths, causal = _inputs("_hyp", device_for(backend))
        lengths["max_seqlen_q"] += data.draw(st.integers(0, 3))  # a bound above the longest is allowed
        got = _kernel(backend, qkv, dout, lengths, causal, p=p)
        want = _reference(qkv, dout, lengths, causal, p=p)
    finally:
        del CASES["_hyp"]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        atol, rtol = FP32_TOL[backend]["out" if name == "out" else "grad"]
        assert_close(name, g.cpu(), w, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- the C++ op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    skip_without_kernels(backend, "attention_varlen")
    ops = torch.ops.fastformer
    lq, lk, H, D = [3, 0, 7], [5, 2, 7], 3, 40
    q = torch.randn(H, sum(lq), D, dtype=dtype).transpose(0, 1)  # a strided view
    k, v = (torch.randn(sum(lk), H, D, dtype=dtype) for _ in range(2))
    for causal, p in ((False, 0.0), (True, 0.2)):
        args = (q, k, v, cu_seqlens(lq), cu_seqlens(lk), 7, 7, causal, 0.3, p, philox.pack(7, 3))
        torch.library.opcheck(ops.attention_varlen_fwd.default, args)
        out, lse = ops.attention_varlen_fwd(*args)
        bwd_args = (torch.randn_like(out), q, k, v, out, lse, *args[3:])
        torch.library.opcheck(ops.attention_varlen_bwd.default, bwd_args)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
def test_non_finite_v_at_hidden_keys_varlen(backend):
    """The same for attention_varlen, bf16 (on cuda the tensor-core forward): packed sequences of
    150 queries / 130 keys and 5 / 9, causal; a NaN never crosses into another sequence."""
    device = device_for(backend)
    lq, lk, H, D = [150, 5], [130, 9], 2, 16
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(n), H, D, generator=gen) for n in (lq, lk, lk))
    v[129, 0, 3] = float("nan")  # sequence 0's last key: its last row only
    v[60, 1, 5] = float("nan")   # sequence 0: rows >= 80
    v[130 + 8, 0, 2] = float("nan")  # sequence 1's last key: its last row only
    cu = [torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32) for n in (lq, lk)]

    def run(v):
        t = [x.to(device=device, dtype=torch.bfloat16) for x in (q, k, v)]
        with fastformer.use_backend(backend):
            return attention_varlen(*t, cu[0].to(device), cu[1].to(device), max(lq), max(lk), is_causal=True).cpu()

    out, clean = run(v), run(v.nan_to_num(0.0, 0.0, 0.0))
    got_bad = ~torch.isfinite(out)
    for b in range(2):
        Lq, Lk = lq[b], lk[b]
        rows, keys = slice(sum(lq[:b]), sum(lq[:b + 1])), slice(sum(lk[:b]), sum(lk[:b + 1]))
        visible = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)  # (Lq, Lk)
        bad = ~torch.isfinite(v[keys]).transpose(0, 1)  # (H, Lk, D)
        sees_bad = ((visible.float() @ bad.float()) > 0).transpose(0, 1)  # (Lq, H, D)
        may_be_bad = (bad.any(1, keepdim=True) & visible.any(-1)[None, :, None]).transpose(0, 1)
        assert got_bad[rows][sees_bad].all(), f"sequence {b}: elements that see a NaN are finite"
        assert not (got_bad[rows] & ~may_be_bad).any(), f"sequence {b}: NaN where it may not be"
        if Lq > Lk:
            assert (out[rows][:Lq - Lk] == 0).all(), f"sequence {b}: rows with no visible key must be 0"
    assert got_bad.any()
    assert torch.equal(out[~got_bad], clean[~got_bad])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend) if backend != "reference" else "cpu"
    q, k, v = (torch.randn(n, 2, 8, device=device) for n in (5, 7, 7))
    cq, ck = cu_seqlens([2, 3], device), cu_seqlens([4, 3], device)
    with fastformer.use_backend(backend):
        cases = [
            ((q[0], k, v, cq, ck, 3, 4), ValueError, "q must have 3 dimensions"),
            ((q, torch.randn(7, 3, 8, device=device), v, cq, ck, 3, 4), ValueError,
             "k has 3 heads, which must divide q's 2 heads"),
            ((q, k, v[:6], cq, ck, 3, 4), ValueError, "v must have shape"),
            ((q, k, v, cq.long(), ck, 3, 4), TypeError, "cu_seqlens_q must be an int32 tensor"),
            ((q, k, v, cq, cu_seqlens([4, 3, 0], device), 3, 4), ValueError, "cu_seqlens_k must have cu_seqlens_q's shape"),
            ((q, k, v, cq, ck, -1, 4), ValueError, "max_seqlen_q must be an int >= 0"),
            ((q, k, v, cq, ck, 3.0, 4), TypeError, "max_seqlen_q must be an int"),
            ((q, k.double(), v, cq, ck, 3, 4), TypeError, "k has dtype"),
            ((q, k, v, cq, ck.to("meta"), 3, 4), ValueError, "cu_seqlens_k is on meta"),
        ]
        if q.device.type == "cpu":  # the lengths' values are read on the host only (a GPU's would sync)
            cases += [
                ((q, k, v, cq, ck, 2, 4), ValueError, "max_seqlen_q is 2 but cu_seqlens_q holds a sequence of 3 rows"),
                ((q, k, v, cu_seqlens([2, 2], device), ck, 3, 4), ValueError, r"cu_seqlens_q\[-1\] must equal total_q"),
                ((q, k, v, cq, torch.tensor([1, 4, 7], dtype=torch.int32, device=device), 3, 4), ValueError,
                 r"cu_seqlens_k\[0\] must be 0"),
                ((q, k, v, cq, torch.tensor([0, 5, 6], dtype=torch.int32, device=device), 3, 5), ValueError,
                 r"cu_seqlens_k\[-1\] must equal total_k"),
                ((q, k, v, cq, torch.tensor([0, 8, 7], dtype=torch.int32, device=device), 3, 8), ValueError,
                 "cu_seqlens_k must be non-decreasing"),
            ]
        for args, error, message in cases:
            with pytest.raises(error, match=message):
                attention_varlen(*args)
        with pytest.raises(ValueError, match="dropout_p must be a number in"):
            attention_varlen(q, k, v, cq, ck, 3, 4, dropout_p=1.0)


@pytest.mark.parametrize("backend", CPP)
def test_cpp_kernel_checks_name_the_argument(backend):
    skip_without_kernels(backend, "attention_varlen")
    device = device_for(backend)
    with fastformer.use_backend(backend):
        kernels = backends.select("attention_varlen", torch.device(device), torch.float32)
    fwd = kernels.attention_varlen_fwd
    q, k, v = (torch.randn(n, 2, 8, device=device) for n in (5, 7, 7))
    cq, ck = cu_seqlens([2, 3], device), cu_seqlens([4, 3], device)
    cases = [
        ((q[0], k, v, cq, ck, 3, 4), r"q must be 3-D \(total, H, D\)"),
        ((q, torch.randn(7, 3, 8, device=device), v, cq, ck, 3, 4), r"k has 3 heads, which must divide q's 2 heads"),
        ((q, k, v[:6], cq, ck, 3, 4), "v must have k's shape"),
        ((q, k, v, cq.long(), ck, 3, 4), "cu_seqlens_q must be int32"),
        ((q, k, v, cq, ck[:2], 3, 4), "cu_seqlens_k must have cu_seqlens_q's shape"),
        ((q, k, v, cq, ck, -1, 4), "max_seqlen_q must be >= 0"),
        ((torch.randn(5, 2, 16, device=device)[..., ::2], k, v, cq, ck, 3, 4), "q must have a contiguous last"),
        ((*(torch.randn(2, 1, 300, device=device) for _ in range(3)), cu_seqlens([2], device),
          cu_seqlens([2], device), 2, 2), r"head dim D must be in \[1, 256\]"),
    ]
    if backend == "cpu":  # the host reads a CPU tensor's lengths; a GPU's kernels clamp instead
        cases += [((q, k, v, cq, ck, 2, 4), "sequence 1 has 3 rows by cu_seqlens_q but max_seqlen_q is 2"),
                  ((q, k, v, cu_seqlens([2, 2]), ck, 3, 4), r"cu_seqlens_q\[-1\] must equal total_q")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fwd(*args, False, 0.5, 0.0, philox.pack(0, 0))
