"""The tensor-core flash attention forward (csrc/cuda/flash_fwd_mma.cu: mma.sync m16n8k16, ldmatrix,
cp.async) against fastformer/ops/reference.py::attention, on the SIMT harness through its test op
fastformer_simt_selftest::flash_fwd_mma, and the attention op's `cuda` backend, whose 16-bit
forward runs on it wherever it takes the call; so does attention_varlen's (packed rows through
cu_seqlens: odd and empty sequences, Lq != Lk causal per sequence, dropout, clamped cu_seqlens,
against the reference, the padded op and this kernel run per sequence); and fp32 inputs as tf32
(mma m16n8k8) when torch.backends.cuda.matmul.allow_tf32 is set, judged by the same rule with
attention computed through tf32 matmuls (operands rounded to 10 mantissa bits) as the low-precision
reference, else the exact FMA kernel.

bf16 and fp16; Sq, Sk in {1, 7, 64, 113, 130} (one to three 64-row query tiles and key tiles,
Sq != Sk both ways), head dims 16, 40, 59, 64, 80, 128, 200, 256 (the buckets 64 / 128 / 256,
zero-padded columns; 59 has rows that are not 16-byte aligned: the plain-load variant), causal
(bottom-right) and not, key padding with fully padded rows, additive / -inf attention masks with
broadcasting, NaN in q, rows with no visible key (out 0, lse +inf), dropout with the shared Philox
counters, and strided views. Low precision is judged by FlashAttention's rule: the kernel's error
against the fp32 reference at most twice that of the reference computed in the 16-bit dtype, plus
a small floor. Parts of the file run again under the harness's other thread schedules
(tests/simt/simt.h): reverse (last thread first), and warp_ahead / warp_ahead_reverse, where each
of the four warps runs alone to its next __syncthreads (warp 0 first, or warp 3 first) and its
cp.async copies land by then.

The warp_ahead schedules catch missing barriers between warps, which forward and reverse, where
the warps meet at every mma / ldmatrix / shuffle, see only by luck. Deleting the __syncthreads that
ends a key tile (a K / V stage refilled while another warp still reads it) passes all 80 of the
file's other tests under forward and reverse, and fails 16 / 28 under warp_ahead /
warp_ahead_reverse (the head-dim 256 bucket through the early refill by cp.async alone, other
shapes also through the hidden-key words). Deleting the one after the Q tile's wait (one warp's
cp.async landing, another warp's ldmatrix) passes all 80 under forward, fails 53 under reverse
(only because warps 0-1 stop at load_kv's __ballot_sync while warps 2-3 go on to their ldmatrix)
and 61 / 59 under warp_ahead / warp_ahead_reverse. Every other mutation tried (a lax wait_group,
the wrong ldmatrix parity or swizzle, no quad reduction of l, causal off by one, no rescale of O,
the wrong dropout lane, a skipped mask, the wrong hidden-key bit or mask offset) fails the
tests."""
import math
import os

import pytest
import torch

from fastformer.ops import reference
from simt import plugin

pytestmark = pytest.mark.skipif(plugin.load_error() is not None, reason=str(plugin.load_error()))

DTYPES = [torch.bfloat16, torch.float16]
DT_IDS = ["bf16", "f16"]


def flash(q, k, v, kpm=None, am=None, causal=False, scale=None, p=0.0, seed=0, offset=0):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.fastformer_simt_selftest.flash_fwd_mma(q, k, v, kpm, am, causal, scale, p, seed, offset)


def _hidden(Sq, Sk, B, kpm, am, causal):
    """(B or 1, H or 1, Sq, Sk) bool: the keys the masks hide, as the reference builds them."""
    hidden = torch.zeros(1, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        hidden = hidden | (torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + (Sk - Sq))
    if kpm is not None:
        hidden = hidden | kpm[:, None, None, :]
    if am is not None:
        hidden = hidden | (am == float("-inf"))
    return hidden


def ref_lse(q, k, kpm, am, causal, scale):
    """Log-sum-exp of the visible scaled scores per row (+inf where no key is visible), scores
    from q k^T in q's dtype (fp32 after the product, as the reference's)."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    s = torch.matmul(q, k.transpose(-2, -1)).double() * scale
    if am is not None:
        s = s + am.masked_fill(am == float("-inf"), 0.0).double()
    hidden = _hidden(Sq, Sk, B, kpm, am, causal).expand(B, H, Sq, Sk)
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if Sk else torch.full((B, H, Sq), float("-inf"), dtype=torch.double)
    # a NaN score makes the row NaN (logsumexp propagates it); no visible key: +inf
    return torch.where((~hidden).any(-1), lse, torch.full_like(lse, float("inf")))


def check(name, got, want32, want_lowp, atol):
    """Non-finite values exactly where the fp32 reference has them; elsewhere FlashAttention's
    rule: error <= 2 x the low-precision reference's error + atol."""
    assert got.shape == want32.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want32.shape)}"
    got, want32, want_lowp = got.double(), want32.double(), want_lowp.double()
    for what, f in (("NaN", torch.isnan), ("+inf", lambda x: x == float("inf"))):
        bad = f(got) != f(want32)
        assert not bad.any(), f"{name}: {what} at {bad.nonzero()[:5].tolist()} differs from the reference"
    fin = torch.isfinite(want32)
    if not fin.any():
        return
    err = (got[fin] - want32[fin]).abs().max().item()
    ref_err = (want_lowp[fin] - want32[fin]).abs().max().item()
    assert err <= 2.0 * ref_err + atol, f"{name}: error {err:.3e} > 2 x {ref_err:.3e} + {atol:.0e}"


def run_case(dtype, B, H, Sq, Sk, D, causal=False, kpm=None, am=None, p=0.0, scale=None, qkv=None,
             seed=1234, offset=0):
    if qkv is None:
        qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    q, k, v = qkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, lse = flash(q, k, v, kpm, am, causal, scale, p, seed, offset)
    kw = dict(key_padding_mask=kpm, attn_mask=am, is_causal=causal, scale=scale, dropout_p=p,
              rng=(seed, offset))
    ref32 = reference.attention(*(t.float() for t in qkv), **kw)
    ref16 = reference.attention(q, k, v, **kw)
    check("out", out, ref32, ref16, atol=1e-3)
    # lse: the kernel's scores are exact products summed in fp32: far closer than 16-bit scores
    lse32 = ref_lse(*(t.float() for t in (q, k)), kpm, am, causal, scale)
    lse16 = ref_lse(q, k, kpm, am, causal, scale)
    check("lse", lse, lse32, lse16, atol=1e-4)
    assert out.dtype == dtype and lse.dtype == torch.float32
    return out, lse


# ---------------------------------------------------------------- shapes, head dims, causal
SHAPES = [(1, 1), (7, 130), (64, 64), (113, 7), (130, 113), (1, 130), (130, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", SHAPES, ids=[f"q{a}k{b}" for a, b in SHAPES])
def test_shapes(dtype, causal, Sq, Sk):
    run_case(dtype, 2, 2, Sq, Sk, 64, causal=causal)


HEAD_DIMS = [16, 40, 59, 80, 128, 200, 256]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_head_dims(dtype, D):
    """Every bucket (64: 16, 40, 59; 128: 80, 128; 256: 200, 256) across two key tiles and an edge,
    causal with Sq < Sk (the diagonal crosses tiles)."""
    run_case(dtype, 1, 2, 70, 113, D, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_values_far_from_one_and_a_large_scale(dtype):
    """Scores of a few hundred: the online softmax must rescale (max growing across key tiles)."""
    B, H, Sq, Sk, D = 1, 2, 64, 130, 64
    q = (torch.randn(B, H, Sq, D) * 3).to(dtype)
    k = (torch.randn(B, H, Sk, D) * 3 * torch.linspace(0.2, 2.0, Sk)[:, None]).to(dtype)
    v = (torch.randn(B, H, Sk, D) * 10).to(dtype)
    run_case(dtype, B, H, Sq, Sk, D, qkv=[q, k, v], scale=0.5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_negative_scale(causal):
    """A negative scale flips which raw score is a row's largest: unmasked tiles, whose exponent
    folds the scale into one FFMA after the max of the raw scores, must not take it (the kernel
    scales first then, as in masked tiles). Scores spread over a few hundred: subtracting the
    smallest instead of the largest would overflow exp2 to inf (NaN rows)."""
    dtype, B, H, Sq, Sk, D = torch.bfloat16, 1, 2, 70, 130, 64
    qkv = [(torch.randn(B, H, S, D) * 4).to(dtype) for S in (Sq, Sk, Sk)]
    out, _ = run_case(dtype, B, H, Sq, Sk, D, causal=causal, scale=-0.3, qkv=qkv)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- masks and rows that see nothing
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_with_fully_padded_batch(dtype, causal):
    B, H, Sq, Sk = 3, 2, 113, 130
    kpm = torch.rand(B, Sk) < 0.3
    kpm[1] = True    # batch 1 sees nothing: out 0, lse +inf
    kpm[2, :70] = True  # batch 2: the first key tile entirely padded, causal rows < 10 see nothing
    out, lse = run_case(dtype, B, H, Sq, Sk, 64, causal=causal, kpm=kpm)
    assert (out[1] == 0).all() and (lse[1] == float("inf")).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_causal_rows_with_no_visible_key(dtype):
    """Sq > Sk bottom-right: the first Sq - Sk rows see no key; a whole 64-row block sees none."""
    out, lse = run_case(dtype, 1, 2, 130, 7, 40, causal=True)
    assert (out[:, :, :123] == 0).all() and (lse[:, :, :123] == float("inf")).all()
    assert torch.isfinite(lse[:, :, 123:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_no_keys_at_all(dtype):
    q = torch.randn(1, 2, 7, 64).to(dtype)
    kv = torch.randn(1, 2, 0, 64).to(dtype)
    out, lse = flash(q, kv, kv)
    assert (out == 0).all() and (lse == float("inf")).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_additive_mask_broadcast_with_minus_inf(dtype):
    B, H, Sq, Sk = 2, 2, 70, 113
    am = torch.randn(1, H, Sq, Sk)  # broadcast over the batch (stride 0)
    am[0, 0, :, 50:] = float("-inf")
    am[0, 1, 5] = float("-inf")  # a row that sees nothing
    out, lse = run_case(dtype, B, H, Sq, Sk, 64, am=am, causal=True)
    assert (out[:, 1, 5] == 0).all() and (lse[:, 1, 5] == float("inf")).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_bool_mask_as_additive_per_query_broadcast(dtype):
    B, H, Sq, Sk = 2, 1, 64, 130
    bool_mask = torch.rand(B, 1, 1, Sk) < 0.4  # (B, 1, 1, Sk): broadcast over heads and queries
    am = torch.zeros(B, 1, 1, Sk).masked_fill(bool_mask, float("-inf"))
    run_case(dtype, B, H, Sq, Sk, 128, am=am)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_additive_mask_constant_per_query_shifts_only_lse(dtype):
    """A (1, H, Sq, 1) mask (broadcast over keys: materialised with a unit key stride) adds a
    constant to a row: out unchanged, lse shifted by it; -inf there hides the whole row."""
    B, H, Sq, Sk, D = 1, 2, 70, 75, 64
    qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    am = torch.randn(1, H, Sq, 1) * 4
    am[0, 0, 3] = float("-inf")
    out, lse = run_case(dtype, B, H, Sq, Sk, D, am=am, qkv=qkv)
    out0, lse0 = flash(*qkv)
    fin = torch.isfinite(am.expand(B, H, Sq, 1))[..., 0]
    torch.testing.assert_close(out[fin], out0[fin], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[fin], (lse0 + am[..., 0])[fin], atol=1e-4, rtol=1e-5)
    assert (out[0, 0, 3] == 0).all() and lse[0, 0, 3] == float("inf")


# ---------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_q_makes_only_its_row_nan(dtype, causal):
    B, H, Sq, Sk, D = 1, 2, 70, 130, 64
    qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    qkv[0][0, 1, 3, 5] = float("nan")
    qkv[0][0, 0, 66, 0] = float("nan")  # in the second query tile
    out, lse = run_case(dtype, B, H, Sq, Sk, D, causal=causal, qkv=qkv)
    assert out[0, 1, 3].isnan().all() and lse[0, 1, 3].isnan() and lse[0, 0, 66].isnan()
    assert out.isnan().sum() == 2 * D


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nan_at_a_hidden_key_changes_nothing(dtype):
    """A NaN score at a padded key is hidden (-inf by select, not by adding a mask)."""
    B, H, Sq, Sk, D = 1, 1, 64, 64, 64
    qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    qkv[1][0, 0, 9, :] = float("nan")
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[0, 9] = True
    out, lse = run_case(dtype, B, H, Sq, Sk, D, kpm=kpm, qkv=qkv)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ---------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D,Sq,Sk,causal", [(64, 70, 130, True), (256, 33, 75, False), (59, 113, 7, False)])
def test_dropout_drops_what_the_reference_drops(dtype, D, Sq, Sk, causal):
    out, _ = run_case(dtype, 2, 2, Sq, Sk, D, causal=causal, p=0.3, seed=987654321, offset=77)
    # and a different seed drops something else
    out2, _ = run_case(dtype, 2, 2, Sq, Sk, D, causal=causal, p=0.3, seed=123, offset=77)
    assert not torch.equal(out, out2)


# ---------------------------------------------------------------- layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D,aligned", [(40, True), (40, False), (128, True)], ids=["d40-aligned", "d40-offset", "d128-aligned"])
def test_strided_views(dtype, D, aligned):
    """q / k / v as views: (B, S, H, D)-major transposes (row stride H D), and with `aligned` False
    a one-element offset into a wider last dim, whose rows are not 16-byte aligned."""
    B, H, Sq, Sk = 2, 3, 70, 113
    lo = 0 if aligned else 1
    wide = D + 8

    def view(S):
        base = torch.randn(B, S, H, wide).to(dtype)
        return base[..., lo:lo + D].transpose(1, 2)

    qkv = [view(Sq), view(Sk), view(Sk)]
    assert qkv[0].stride(-1) == 1 and not qkv[0].is_contiguous()
    out, lse = run_case(dtype, B, H, Sq, Sk, D, causal=True, qkv=qkv)
    # the same as on contiguous copies
    out_c, lse_c = flash(*(t.contiguous() for t in qkv), causal=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_rejects_float32_and_head_dims_past_256():
    q = torch.randn(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match=r"float32 runs on tensor cores only as tf32, and allow_tf32 is false"):
        flash(q, q, q)
    q = torch.randn(1, 1, 8, 264).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"head dim must be in \[1, 256\]"):
        flash(q, q, q)


def test_a_wrong_kernel_would_fail_these_checks():
    """The rule is not vacuous: the output of attention with the keys in another order, or with
    the scale off by 2 %, fails it."""
    dtype, B, H, Sq, Sk, D = torch.bfloat16, 1, 2, 64, 113, 64
    q, k, v = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    scale = 1.0 / math.sqrt(D)
    ref32 = reference.attention(q.float(), k.float(), v.float(), scale=scale)
    ref16 = reference.attention(q, k, v, scale=scale)
    out, _ = flash(q, k, v, scale=scale)
    check("out", out, ref32, ref16, atol=1e-3)
    with pytest.raises(AssertionError):
        check("out", flash(q, k, v, scale=scale * 1.02)[0], ref32, ref16, atol=1e-3)
    with pytest.raises(AssertionError):
        check("out", flash(q, k.flip(2), v, scale=scale)[0], ref32, ref16, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_the_attention_op_runs_16_bit_forwards_here(dtype):
    """fastformer.ops.attention on the cuda backend gives this kernel's bits for a 16-bit input
    (key padding, causal, a per-key additive mask), and falls back to the FMA kernel, still
    within the rule, for an attn_mask without a unit key stride (broadcast along the keys)."""
    import fastformer
    from fastformer.ops import attention

    B, H, Sq, Sk, D = 2, 2, 70, 113, 40
    g = torch.Generator().manual_seed(3)
    q, k, v = [torch.randn(B, H, S, D, generator=g).to(dtype) for S in (Sq, Sk, Sk)]
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[1, 90:] = True
    am = torch.randn(1, 1, Sq, Sk, generator=g)
    with fastformer.use_backend("cuda"):
        got = attention(q, k, v, key_padding_mask=kpm, attn_mask=am, is_causal=True)
    want, _ = flash(q, k, v, kpm=kpm, am=am, causal=True)
    assert torch.equal(got, want)

    per_query = torch.randn(1, 1, Sq, 1, generator=g)  # key stride 0: not this kernel's layout
    with fastformer.use_backend("cuda"):
        got = attention(q, k, v, key_padding_mask=kpm, attn_mask=per_query)
    ref32 = reference.attention(q.float(), k.float(), v.float(), key_padding_mask=kpm, attn_mask=per_query)
    ref16 = reference.attention(q, k, v, key_padding_mask=kpm, attn_mask=per_query.to(dtype))
    check("out", got, ref32, ref16, atol=1e-3)


# ---------------------------------------------------------------- varlen: attention_varlen's rows
def cu_seqlens(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def varlen_kernel(q, k, v, lq, lk, causal=False, p=0.0, seed=0, offset=0, max_q=None, max_k=None):
    """The cuda backend's attention_varlen forward on the harness (its glue picks the kernel):
    (out, lse)."""
    from fastformer import backends, philox

    max_q = max(lq) if max_q is None else max_q
    max_k = max(lk) if max_k is None else max_k
    kern = backends.Kernels("cuda", "cpu")
    return kern.attention_varlen_fwd(q, k, v, cu_seqlens(lq), cu_seqlens(lk), max_q, max_k, causal,
                                     q.shape[-1] ** -0.5, p, philox.pack(seed, offset))


def packed(lengths, H, D, dtype, gen):
    return torch.randn(sum(lengths), H, D, generator=gen).to(dtype)


def heads(x, lengths, b):
    """Sequence b of packed rows (total, H, D) as a (1, H, L, D) view."""
    start = sum(lengths[:b])
    return x[start:start + lengths[b]].transpose(0, 1).unsqueeze(0)


# Odd lengths (1, 7, 113), Lq != Lk both ways (causal rows that see nothing), empty query and key
# sequences, a sequence of two full query tiles and one crossing three key tiles.
VARLEN_LQ = [1, 7, 113, 0, 70, 128, 5]
VARLEN_LK = [7, 113, 1, 9, 0, 130, 5]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [40, 128], ids=["d40", "d128"])
def test_varlen_against_the_reference(dtype, causal, D):
    H, gen = 2, torch.Generator().manual_seed(D + causal)
    q, k, v = (packed(n, H, D, dtype, gen) for n in (VARLEN_LQ, VARLEN_LK, VARLEN_LK))
    out, lse = varlen_kernel(q, k, v, VARLEN_LQ, VARLEN_LK, causal)
    kw = dict(cu_seqlens_q=cu_seqlens(VARLEN_LQ), cu_seqlens_k=cu_seqlens(VARLEN_LK), max_seqlen_q=max(VARLEN_LQ),
              max_seqlen_k=max(VARLEN_LK), is_causal=causal, scale=D ** -0.5)
    check("out", out, reference.attention_varlen(q.float(), k.float(), v.float(), **kw),
          reference.attention_varlen(q, k, v, **kw), atol=1e-3)
    assert out.dtype == dtype and lse.shape == (H, sum(VARLEN_LQ))
    for b, (Lq, Lk) in enumerate(zip(VARLEN_LQ, VARLEN_LK)):  # lse per sequence, as the padded rule
        if Lq == 0:
            continue
        qb, kb = heads(q, VARLEN_LQ, b), heads(k, VARLEN_LK, b)
        start = sum(VARLEN_LQ[:b])
        got = lse[:, start:start + Lq].unsqueeze(0)
        check(f"lse of sequence {b}", got, ref_lse(qb.float(), kb.float(), None, None, causal, D ** -0.5),
              ref_lse(qb, kb, None, None, causal, D ** -0.5), atol=1e-4)
        if Lk == 0 or (causal and Lq > Lk):  # rows that see no key: 0 and +inf
            hidden = Lq if Lk == 0 else Lq - Lk
            assert (got[..., :hidden] == float("inf")).all()
            assert (out[start:start + hidden] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_runs_on_tensor_cores(dtype, causal):
    """The routing: every sequence of the varlen op's 16-bit forward has exactly the bits (out and
    lse) of this kernel called on that sequence alone as a padded (1, H, Lq, D) problem; the FMA
    kernel's bits differ (so the check fails if the glue stops routing here)."""
    import fastformer
    from fastformer.ops import attention

    H, D, gen = 2, 64, torch.Generator().manual_seed(7)
    q, k, v = (packed(n, H, D, dtype, gen) for n in (VARLEN_LQ, VARLEN_LK, VARLEN_LK))
    out, lse = varlen_kernel(q, k, v, VARLEN_LQ, VARLEN_LK, causal)
    differs = False
    for b, Lq in enumerate(VARLEN_LQ):
        if Lq == 0:
            continue
        qb, kb, vb = heads(q, VARLEN_LQ, b), heads(k, VARLEN_LK, b), heads(v, VARLEN_LK, b)
        want, want_lse = flash(qb, kb, vb, causal=causal)
        start = sum(VARLEN_LQ[:b])
        assert torch.equal(out[start:start + Lq], want[0].transpose(0, 1)), f"sequence {b}: out"
        assert torch.equal(lse[:, start:start + Lq], want_lse[0]), f"sequence {b}: lse"
        if VARLEN_LK[b] > 8:
            # the FMA kernel (the padded op's fallback for an attn_mask of key stride 0; + 0 is exact)
            zero = torch.zeros(1, 1, Lq, 1)
            with fastformer.use_backend("cuda"):
                fma = attention(qb, kb, vb, attn_mask=zero, is_causal=causal)
            differs = differs or not torch.equal(fma, want)
    assert differs, "the FMA kernel gave the tensor-core kernel's bits: this test would not see the routing"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_varlen_equals_the_padded_op_with_its_dropout(dtype):
    """Right-padded to (B, H, max_q, max_k) with the padding as key_padding_mask, the padded op (on
    this kernel too) gives the varlen rows' bits, dropout included: the same Philox counters; and
    both are the reference's dropout (the bits every backend shares). max_seqlen above the longest
    sequence moves the counters of both alike."""
    from fastformer import backends, philox

    H, D, gen = 2, 59, torch.Generator().manual_seed(11)
    lq, lk = [1, 7, 113, 0, 30], [113, 7, 1, 9, 0]
    max_q, max_k = max(lq) + 3, max(lk) + 5
    q, k, v = (packed(n, H, D, dtype, gen) for n in (lq, lk, lk))
    seed, offset, p = 987654321, 64, 0.3
    out, lse = varlen_kernel(q, k, v, lq, lk, p=p, seed=seed, offset=offset, max_q=max_q, max_k=max_k)
    kw = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max_q, max_seqlen_k=max_k,
              scale=D ** -0.5, dropout_p=p, rng=(seed, offset))
    check("out", out, reference.attention_varlen(q.float(), k.float(), v.float(), **kw),
          reference.attention_varlen(q, k, v, **kw), atol=1e-3)
    B = len(lq)
    pad = [torch.zeros(B, H, S, D, dtype=dtype) for S in (max_q, max_k, max_k)]
    kpm = torch.ones(B, max_k, dtype=torch.bool)
    for b in range(B):
        for t, x, n in zip(pad, (q, k, v), (lq, lk, lk)):
            t[b, :, :n[b]] = heads(x, n, b)[0]
        kpm[b, :lk[b]] = False
    pout, plse = backends.Kernels("cuda", "cpu").attention_fwd(*pad, kpm, None, False, D ** -0.5, p,
                                                                 philox.pack(seed, offset))
    for b in range(B):
        start = sum(lq[:b])
        assert torch.equal(out[start:start + lq[b]], pout[b, :, :lq[b]].transpose(0, 1)), f"sequence {b}"
        assert torch.equal(lse[:, start:start + lq[b]], plse[b, :, :lq[b]]), f"sequence {b}: lse"
    out2, _ = varlen_kernel(q, k, v, lq, lk, p=p, seed=seed + 1, offset=offset, max_q=max_q, max_k=max_k)
    assert not torch.equal(out, out2)


@pytest.mark.parametrize("D", [40, 59], ids=["d40-aligned", "d59-plain-loads"])
def test_varlen_strided_views(D):
    """q / k / v as views of one packed (total, 3, H, D) projection (row stride 3 H D; for D 59 the
    rows are not 16-byte aligned: the plain-load variant): the bits of contiguous copies."""
    dtype, H, gen = torch.bfloat16, 2, torch.Generator().manual_seed(D)
    lq = lk = [1, 70, 0, 7]
    q, k, v = torch.randn(sum(lq), 3, H, D, generator=gen).to(dtype).unbind(1)
    assert not q.is_contiguous() and q.stride(-1) == 1
    out, lse = varlen_kernel(q, k, v, lq, lk, causal=True, p=0.2, seed=5)
    out_c, lse_c = varlen_kernel(q.contiguous(), k.contiguous(), v.contiguous(), lq, lk, causal=True, p=0.2, seed=5)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    kw = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
              is_causal=True, scale=D ** -0.5, dropout_p=0.2, rng=(5, 0))
    check("out", out, reference.attention_varlen(q.float(), k.float(), v.float(), **kw),
          reference.attention_varlen(q, k, v, **kw), atol=1e-3)


def test_varlen_cu_seqlens_out_of_range_are_clamped():
    """As the FMA kernel: each sequence clamped to [0, total) and to max_seqlen; nothing outside the
    tensors is read (the harness fails on an out-of-bounds access only by luck, so the values are
    checked against the clamped sequences)."""
    from fastformer import backends, philox

    dtype, H, D, gen = torch.bfloat16, 2, 24, torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, H, D, generator=gen).to(dtype) for n in (5, 6, 6))
    bad_q = torch.tensor([0, 3, 500], dtype=torch.int32)   # -> [0, 3), [3, 5)
    bad_k = torch.tensor([-7, 4, 1000], dtype=torch.int32)  # -> [0, 4), [4, 6)
    kern = backends.Kernels("cuda", "cpu")
    out, lse = kern.attention_varlen_fwd(q, k, v, bad_q, bad_k, 3, 4, True, D ** -0.5, 0.0, philox.pack(0, 0))
    kw = dict(cu_seqlens_q=cu_seqlens([3, 2]), cu_seqlens_k=cu_seqlens([4, 2]), max_seqlen_q=3, max_seqlen_k=4,
              is_causal=True, scale=D ** -0.5)
    check("out", out, reference.attention_varlen(q.float(), k.float(), v.float(), **kw),
          reference.attention_varlen(q, k, v, **kw), atol=1e-3)


# ---------------------------------------------------------------- fp32 as tf32 (allow_tf32)
@pytest.fixture
def allow_tf32():
    """torch.backends.cuda.matmul.allow_tf32 on for the test (the glue reads it), then as before."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def tf32(x):
    """x rounded to tf32 (10 mantissa bits, nearest, ties away: cvt.rna), as fp32."""
    bits = x.float().contiguous().view(torch.int32)
    finite = torch.isfinite(x.float())
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(finite, rounded, x.float())


def tf32_reference(q, k, v, scale, causal, p=0.0, rng=None):
    """What attention with torch's tf32 matmuls computes (operands of q k^T and of P v rounded to
    tf32, the rest exact, in fp64): the low-precision reference of FlashAttention's rule."""
    q, k, v = (tf32(t).double() for t in (q, k, v))
    Sq, Sk = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + (Sk - Sq), float("-inf"))
    prob = torch.softmax(s, -1).nan_to_num(0.0)
    if p > 0:
        from fastformer import philox
        prob = prob * philox.attention_keep_mask(prob.shape, p, *rng).double() * philox.attention_keep_scale(p)
    return tf32(prob.float()).double() @ v


def padded_kernel(q, k, v, causal=False, p=0.0, seed=0, offset=0):
    from fastformer import backends, philox

    return backends.Kernels("cuda", "cpu").attention_fwd(q, k, v, None, None, causal, q.shape[-1] ** -0.5, p,
                                                         philox.pack(seed, offset))


# (B, H, Sq, Sk, D, causal): the three buckets (D 32, 64, 128 in halves 64, 128, 256), D 59's
# plain-load rows
TF32_CASES = [(1, 2, 70, 113, 64, True), (2, 1, 130, 64, 32, False), (1, 2, 7, 130, 128, True),
              (1, 1, 64, 70, 59, True)]


@pytest.mark.parametrize("B,H,Sq,Sk,D,causal", TF32_CASES, ids=[f"q{c[2]}k{c[3]}d{c[4]}" for c in TF32_CASES])
def test_fp32_runs_as_tf32_when_allowed(allow_tf32, B, H, Sq, Sk, D, causal):
    """With allow_tf32 the fp32 forward runs on tensor cores (mma m16n8k8 .tf32): its error against
    the exact (fp64) reference is at most twice that of attention computed with tf32 matmuls, and
    far above the exact FMA kernel's (so the routing shows); without it, the FMA kernel's bits."""
    gen = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    scale = D ** -0.5
    out, lse = padded_kernel(q, k, v, causal)
    exact = reference.attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)
    check("out", out, exact, tf32_reference(q, k, v, scale, causal), atol=1e-5)
    check("lse", lse, ref_lse(q.double(), k.double(), None, None, causal, scale),
          ref_lse(tf32(q).double(), tf32(k).double(), None, None, causal, scale), atol=1e-5)
    torch.backends.cuda.matmul.allow_tf32 = False
    fma, fma_lse = padded_kernel(q, k, v, causal)
    fma_err, tc_err = (fma.double() - exact).abs().max().item(), (out.double() - exact).abs().max().item()
    assert fma_err < 1e-5 and tc_err > 8 * fma_err, f"tf32 error {tc_err:.2e}, exact FMA {fma_err:.2e}"


def test_tf32_dropout_varlen_and_the_autograd_op(allow_tf32):
    """tf32 with dropout (the shared Philox bits), on varlen rows, and under the attention op with
    its backward (FMA, fp32, reading the tf32 forward's out and lse): gradients within tf32 error."""
    import fastformer
    from fastformer.ops import attention

    gen = torch.Generator().manual_seed(1)
    B, H, Sq, Sk, D, p = 2, 2, 70, 113, 40, 0.3
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    out, _ = padded_kernel(q, k, v, True, p, 77, 5)
    exact = reference.attention(q.double(), k.double(), v.double(), is_causal=True, dropout_p=p, rng=(77, 5))
    check("out", out, exact, tf32_reference(q, k, v, D ** -0.5, True, p, (77, 5)), atol=1e-5)
    # varlen: every sequence as the padded kernel on it alone (same tiles), no dropout
    lq, lk = [1, 70, 0, 7], [113, 7, 5, 0]
    qv, kv, vv = (torch.randn(sum(n), H, D, generator=gen) for n in (lq, lk, lk))
    vout, _ = varlen_kernel(qv, kv, vv, lq, lk, causal=True)
    for b, Lq in enumerate(lq):
        if Lq == 0:
            continue
        want, _ = padded_kernel(heads(qv, lq, b), heads(kv, lk, b), heads(vv, lk, b), True)
        start = sum(lq[:b])
        assert torch.equal(vout[start:start + Lq], want[0].transpose(0, 1)), f"sequence {b}"
    # the op, forward and backward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with fastformer.use_backend("cuda"):
        got = attention(*leaves, is_causal=True)
    dout = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad(got, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*ref_leaves, is_causal=True)
    want_grads = torch.autograd.grad(want, ref_leaves, dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        err, size = (g.double() - w).abs().max().item(), w.abs().max().item()
        assert err < 4e-3 * size, f"{name}: error {err:.2e} against a largest value of {size:.2e}"


def test_tf32_falls_back_past_head_dim_128(allow_tf32):
    """D > 128 in fp32 runs the exact FMA kernel even with allow_tf32 (its fp32 tile would not fit)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, S, 160, generator=gen) for S in (20, 33, 33))
    out, _ = padded_kernel(q, k, v, True)
    exact = reference.attention(q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - exact).abs().max().item() < 1e-5


# ---------------------------------------------------------------- the other thread orders
def _rerun_under(schedule, subset):
    plugin.rerun_under(os.path.abspath(__file__), schedule, subset)


_OTHER_SCHEDULE = os.environ.get("FF_SIMT_SCHEDULE", "") not in ("", "forward")


@pytest.mark.skipif(_OTHER_SCHEDULE, reason="another schedule already, not from within it")
def test_reversed_thread_schedule():
    """The same kernels with the harness's threads run last to first (FF_SIMT_SCHEDULE=reverse),
    which shows the other half of a missing barrier within a warp's reach of the forward order."""
    _rerun_under("reverse", "(test_shapes and q130k113) or (test_head_dims and (d59 or d128 or d256)) or "
                            "dropout or key_padding or strided or (test_varlen_against and causal) or tf32")


@pytest.mark.skipif(_OTHER_SCHEDULE, reason="another schedule already, not from within it")
@pytest.mark.parametrize("schedule", ["warp_ahead", "warp_ahead_reverse"])
def test_warp_ahead_schedules(schedule):
    """The same kernels with each warp run alone to its next __syncthreads (first warp first, last
    warp first): a missing barrier between warps (the Q tile's, the end of a key tile's) fails
    this subset under either."""
    _rerun_under(schedule, "(test_head_dims and (d59 or d128 or d256)) or (test_key_padding and full) or "
                           "(test_strided and d40-offset) or (test_varlen_against and causal and d40) or "
                           "(tf32 and (q70k113d64 or q64k70d59))")
