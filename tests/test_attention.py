"""attention: the reference against torch, then every kernel backend against the reference
(forward, dq, dk and dv in fp32 and bf16), every mask kind and their combinations, rows with no
visible key, strided inputs, dropout exactness and statistics, gradcheck, opcheck, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import attention, reference
from utils import assert_close, assert_close_lowp, backend_cases, device_for, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")

# fp32 (atol, rtol) per backend: outputs, then gradients (sums over up to 203 keys / queries).
FP32_TOL = {
    "cpu": {"out": (1e-5, 1e-4), "grad": (5e-5, 1e-4)},
    "triton": {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)},
    "cuda": {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)},
}
# bf16: FlashAttention's rule, kernel error <= LOWP_FACTOR x the bf16 reference's error (+ atol).
# Triton's interpreter (no GPU) converts fp32 -> bf16 by truncation, not round-to-nearest as the
# hardware does, so it gets twice the factor there.
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}

# name: (B, H, Sq, Sk, D, masks). Masks: "kpm" right padding with random lengths (at least one
# key left), "kpm_lead" left padding, "kpm_rand" random keys; "causal" (bottom-right);
# attn_mask "bool", "float" (Sq, Sk) broadcast, "bool_b1" / "float_b1" (B, 1, Sq, Sk).
CASES = {
    "1x1_d64": (1, 1, 1, 1, 64, ()),
    "7x7_d40_kpm": (2, 3, 7, 7, 40, ("kpm",)),
    "113x203_d59": (2, 2, 113, 203, 59, ()),
    "203x113_d80_causal": (1, 2, 203, 113, 80, ("causal",)),  # Sq > Sk: leading rows see nothing
    "113x203_d111_causal_kpm": (2, 1, 113, 203, 111, ("causal", "kpm")),  # Sq < Sk
    "7x113_d128_bool": (2, 2, 7, 113, 128, ("bool",)),
    "203x7_d64_float": (2, 2, 203, 7, 64, ("float",)),
    "113x113_d80_float_b1_kpm_lead": (3, 2, 113, 113, 80, ("float_b1", "kpm_lead")),
    "64x64_d64_causal_kpm_float": (2, 4, 64, 64, 64, ("causal", "kpm", "float")),
    "1x203_d111_causal_kpm_rand": (2, 2, 1, 203, 111, ("causal", "kpm_rand")),
    "203x1_d40": (2, 1, 203, 1, 40, ()),
    "113x7_d59_bool_b1_causal": (2, 2, 113, 7, 59, ("bool_b1", "causal")),
    "203x203_d128_causal_float_b1": (1, 2, 203, 203, 128, ("causal", "float_b1")),
}
# The Triton interpreter is slow: a subset keeps its part of this file to a few minutes.
TRITON_CASES = ("7x7_d40_kpm", "203x1_d40", "1x203_d111_causal_kpm_rand", "113x7_d59_bool_b1_causal",
                "64x64_d64_causal_kpm_float")
# The SIMT harness (the cuda backend without a GPU) runs all of CASES; tests/test_attention_cuda.py
# adds D = 256, rows of many key tiles, fp16, the memory claim and the glue.


def _cases():
    return backend_cases(BACKENDS, CASES, TRITON_CASES)


def _masks(B, H, Sq, Sk, kinds, gen):
    kpm = None
    if "kpm" in kinds or "kpm_lead" in kinds:
        lengths = torch.randint(1, Sk + 1, (B,), generator=gen)
        kpm = torch.arange(Sk)[None, :] >= lengths[:, None]  # right padding
        if "kpm_lead" in kinds:
            kpm = kpm.flip(-1)
    elif "kpm_rand" in kinds:
        kpm = torch.rand(B, Sk, generator=gen) < 0.3
    am = None
    if "bool" in kinds:
        am = torch.rand(Sq, Sk, generator=gen) < 0.2
    elif "bool_b1" in kinds:
        am = torch.rand(B, 1, Sq, Sk, generator=gen) < 0.2
    elif "float" in kinds:
        am = torch.randn(Sq, Sk, generator=gen)
    elif "float_b1" in kinds:
        am = torch.randn(B, 1, Sq, Sk, generator=gen)
    return kpm, am, "causal" in kinds


def _inputs(case, device, seed=0):
    B, H, Sq, Sk, D, kinds = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    dout = torch.randn(B, H, Sq, D, generator=gen)
    kpm, am, causal = _masks(B, H, Sq, Sk, kinds, gen)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (to(q), to(k), to(v), to(dout)), dict(key_padding_mask=to(kpm), attn_mask=to(am), is_causal=causal)


def _grads(fn, qkv, dout):
    """fn's output and the gradients of q, k, v for the upstream gradient dout."""
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _kernel(backend, qkv, dout, masks, p=0.0, seed=1234):
    def fn(q, k, v):
        torch.manual_seed(seed)  # the Function draws its (seed, offset) from torch's generator
        with fastformer.use_backend(backend):
            return attention(q, k, v, dropout_p=p, **masks)
    return _grads(fn, qkv, dout)


def _reference(qkv, dout, masks, p=0.0, seed=1234, dtype=torch.float32):
    torch.manual_seed(seed)
    rng = philox.next_seed() if p > 0 else None  # the very pair the kernel's Function drew
    cast = [t.to(dtype) for t in qkv]
    return _grads(lambda q, k, v: reference.attention(q, k, v, dropout_p=p, rng=rng, **masks),
                  cast, dout.to(dtype))


def _check_fp32(backend, got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        atol, rtol = FP32_TOL[backend]["out" if name == "out" else "grad"]
        assert_close(name, g, w, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- the reference against torch


def _sdpa_mask(kpm, am, causal, B, Sq, Sk):
    """The masks as one bool (True = visible) for F.scaled_dot_product_attention, whose own
    is_causal is top-left aligned: the bottom-right causal mask is spelt out."""
    visible = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        visible = visible & (torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + Sk - Sq)
    if kpm is not None:
        visible = visible & ~kpm[:, None, None, :]
    if am is not None and am.dtype == torch.bool:
        visible = visible & ~am
    return visible


@pytest.mark.parametrize("case", ["7x7_d40_kpm", "113x203_d59", "203x113_d80_causal", "7x113_d128_bool",
                                  "113x113_d80_float_b1_kpm_lead", "64x64_d64_causal_kpm_float",
                                  "113x7_d59_bool_b1_causal"])
def test_reference_matches_torch_sdpa(case):
    """Forward and gradients against F.scaled_dot_product_attention on the rows that see a key;
    rows that see none are 0 in the reference (SDPA gives NaN there) with zero gradient."""
    B, H, Sq, Sk, D, _ = CASES[case]
    (q, k, v, dout), masks = _inputs(case, "cpu")
    kpm, am, causal = masks["key_padding_mask"], masks["attn_mask"], masks["is_causal"]
    visible = _sdpa_mask(kpm, am, causal, B, Sq, Sk)  # (B, 1, Sq, Sk)
    if am is not None and am.dtype != torch.bool:
        visible = visible & (am > float("-inf"))
    sees_a_key = visible.any(-1, keepdim=True)  # (B, 1, Sq, 1)
    # SDPA would make NaN of a row that sees nothing (and NaN gradients through it): such rows
    # see every key there, and their output is replaced by 0 afterwards
    float_mask = torch.zeros(B, 1, Sq, Sk).masked_fill(~(visible | ~sees_a_key), float("-inf"))
    if am is not None and am.dtype != torch.bool:
        float_mask = float_mask + torch.where(sees_a_key, am, torch.zeros_like(am))
    sees_a_key = sees_a_key.expand(B, H, Sq, 1)
    out, dq, dk, dv = _reference((q, k, v), dout, masks)

    def sdpa(q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask.expand(B, H, Sq, Sk))
        return torch.where(sees_a_key, o, torch.zeros_like(o))
    want = _grads(sdpa, (q, k, v), dout)
    assert_close("out", out, want[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(out * ~sees_a_key, torch.zeros_like(out))
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want[1:]):
        assert_close(name, g, w, atol=5e-5, rtol=1e-4)
    assert torch.equal(dq * ~sees_a_key, torch.zeros_like(dq))


def test_reference_causal_is_sdpa_causal_when_square():
    q, k, v = torch.randn(3, 2, 3, 37, 24).unbind(0)
    assert_close("out", reference.attention(q, k, v, is_causal=True),
                 F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_reference_matches_explicit_softmax_composition(p):
    """softmax(q k^T scale + mask) -> shared Philox dropout -> @ v, written out by hand."""
    case = "64x64_d64_causal_kpm_float"  # right padding, a length >= 1: every row sees key 0
    (q, k, v, dout), masks = _inputs(case, "cpu")
    B, H, Sq, Sk, D, _ = CASES[case]
    rng = (77, 5)
    scale = 0.3

    def explicit(q, k, v):
        s = q @ k.transpose(-2, -1) * scale + masks["attn_mask"]
        causal = torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None]  # (Sq, Sk), square
        hidden = causal | masks["key_padding_mask"][:, None, None, :]
        probs = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
        if p > 0:
            probs = probs * philox.attention_keep_mask(probs.shape, p, *rng) * philox.attention_keep_scale(p)
        return probs @ v

    got = _grads(lambda q, k, v: reference.attention(q, k, v, scale=scale, dropout_p=p, rng=rng, **masks),
                 (q, k, v), dout)
    want = _grads(explicit, (q, k, v), dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g, w, atol=5e-5, rtol=1e-4)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,case", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, case):
    qkv_dout, masks = _inputs(case, device_for(backend))
    got = _kernel(backend, qkv_dout[:3], qkv_dout[3], masks)
    _check_fp32(backend, got, _reference(qkv_dout[:3], qkv_dout[3], masks))


@pytest.mark.parametrize("backend,case", list(_cases()))
def test_bf16_forward_and_every_gradient(backend, case):
    (q, k, v, dout), masks = _inputs(case, device_for(backend))
    qkv = [t.to(torch.bfloat16) for t in (q, k, v)]
    dout = dout.to(torch.bfloat16)
    got = _kernel(backend, qkv, dout, masks)
    lowp = _reference(qkv, dout, masks, dtype=torch.bfloat16)
    fp32 = _reference(qkv, dout, masks, dtype=torch.float32)
    for name, g, lp, r in zip(("out", "dq", "dk", "dv"), got, lowp, fp32):
        assert g.dtype == torch.bfloat16, f"{name}: dtype {g.dtype}"
        assert_close_lowp(name, g, r, lp, factor=LOWP_FACTOR[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_matches_the_reference_exactly(backend):
    """With the kernel's (seed, offset) the reference drops the very same elements: forward and
    every gradient agree to fp32 rounding, masks included, through the op and the kernel functions."""
    device = device_for(backend)
    case = "64x64_d64_causal_kpm_float" if backend == "triton" else "113x203_d111_causal_kpm"
    (q, k, v, dout), masks = _inputs(case, device)
    for p in (0.1, 0.5):
        got = _kernel(backend, (q, k, v), dout, masks, p=p, seed=7)
        _check_fp32(backend, got, _reference((q, k, v), dout, masks, p=p, seed=7))
    # the kernel functions with a chosen (seed, offset), mask as the functional op prepares it
    kern = backends.Kernels(backend)
    scale = 1.0 / math.sqrt(q.shape[-1])
    am = masks["attn_mask"]
    am4 = None if am is None else am.float().expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    seed, offset = 2**40 + 11, 12345
    out, lse = kern.attention_fwd(q, k, v, masks["key_padding_mask"], am4, masks["is_causal"], scale, 0.3,
                                  philox.pack(seed, offset))
    dq, dk, dv, _ = kern.attention_bwd(dout, q, k, v, out, lse, masks["key_padding_mask"], am4,
                                    masks["is_causal"], scale, 0.3, philox.pack(seed, offset))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*leaves, scale=scale, dropout_p=0.3, rng=(seed, offset), **masks)
    want = (ref.detach(), *torch.autograd.grad(ref, leaves, dout))
    _check_fp32(backend, (out, dq, dk, dv), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_is_the_log_sum_exp_of_the_visible_scores(backend):
    (q, k, v, _), masks = _inputs("1x203_d111_causal_kpm_rand", device_for(backend))
    masks["key_padding_mask"][0] = True  # batch 0 sees no key at all
    B, H, Sq, Sk, D, _ = CASES["1x203_d111_causal_kpm_rand"]
    scale = 0.2
    _, lse = backends.Kernels(backend).attention_fwd(q, k, v, masks["key_padding_mask"], None, True, scale,
                                                     0.0, philox.pack(0, 0))
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    causal = torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + Sk - Sq  # (Sq, Sk)
    hidden = masks["key_padding_mask"][:, None, None, :] | causal
    want = torch.logsumexp(s.masked_fill(hidden, float("-inf")), dim=-1)
    want = torch.where(torch.isneginf(want), torch.full_like(want, float("inf")), want).float()
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Sq)
    assert torch.equal(torch.isinf(lse), torch.isinf(want)) and torch.isinf(lse[0]).all()
    assert_close("lse", lse, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- rows with no visible key


def _hide_rows(B, H, Sq, Sk, D, device):
    """Inputs whose masks hide every key from some rows, each in a different way (B >= 2, Sq > Sk)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(device) for S in (Sq, Sk, Sk))
    dout = torch.randn(B, H, Sq, D, generator=gen).to(device)
    kpm = torch.zeros(B, Sk, dtype=torch.bool, device=device)
    kpm[0] = True  # batch 0: every key padded
    am = torch.randn(B, 1, Sq, Sk, device=device)
    am[1, :, Sq - Sk + 2] = float("-inf")  # batch 1: -inf on every key of the float mask
    am[1, :, Sq - Sk + 3, : Sk // 2] = float("-inf")  # the next row: half the keys, still visible
    masks = dict(key_padding_mask=kpm, attn_mask=am, is_causal=True)  # causal: the first Sq - Sk rows
    hidden = torch.zeros(B, 1, Sq, 1, dtype=torch.bool, device=device)
    hidden[0] = True
    hidden[1, :, Sq - Sk + 2] = True
    hidden[:, :, : Sq - Sk] = True
    return (q, k, v, dout), masks, hidden.expand(B, H, Sq, 1)


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_no_visible_key_output_zero_and_get_zero_gradient(backend, p):
    shape = (2, 2, 33, 7, 40) if backend == "triton" else (2, 3, 203, 113, 80)
    (q, k, v, dout), masks, hidden = _hide_rows(*shape, device_for(backend))
    out, dq, dk, dv = _kernel(backend, (q, k, v), dout, masks, p=p)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name}: non-finite values"
    assert torch.equal(out * hidden, torch.zeros_like(out)), "hidden rows must output exactly 0"
    assert torch.equal(dq * hidden, torch.zeros_like(dq)), "hidden rows must get zero gradient"
    assert torch.equal(dk[0], torch.zeros_like(dk[0])) and torch.equal(dv[0], torch.zeros_like(dv[0]))
    assert (out * ~hidden).abs().amax() > 0
    _check_fp32(backend, (out, dq, dk, dv), _reference((q, k, v), dout, masks, p=p))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_attn_mask_hiding_whole_rows(backend):
    (q, k, v, dout), masks = _inputs("7x113_d128_bool", device_for(backend))
    am = masks["attn_mask"].clone()
    am[3] = True  # query 3 of every head sees nothing
    masks["attn_mask"] = am
    out, dq, dk, dv = _kernel(backend, (q, k, v), dout, masks)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))
    _check_fp32(backend, (out, dq, dk, dv), _reference((q, k, v), dout, masks))


# ---------------------------------------------------------------- strided inputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    """q, k, v as transposed (B, S, H, D) views, v broadcast over heads (stride 0), a sliced
    upstream gradient, and an attn_mask that is a transposed view."""
    device = device_for(backend)
    B, H, Sq, Sk, D = (2, 2, 7, 33, 40) if backend == "triton" else (2, 3, 113, 203, 59)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, Sq, H, D, generator=gen).to(device).transpose(1, 2)
    k = torch.randn(B, Sk, H, D, generator=gen).to(device).transpose(1, 2)
    v = torch.randn(B, 1, Sk, D, generator=gen).to(device).expand(B, H, Sk, D)
    dout = torch.randn(B, H, Sq, 2 * D, generator=gen).to(device)[..., ::2]
    am = torch.randn(B, 1, Sk, Sq, generator=gen).to(device).transpose(-2, -1)
    kpm = torch.rand(B, Sk, generator=gen).to(device) < 0.2
    masks = dict(key_padding_mask=kpm, attn_mask=am, is_causal=True)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(1) == 0
    want = _reference((q, k, v), dout.contiguous(), masks, p=0.1)

    def fn(q, k, v):
        torch.manual_seed(1234)
        with fastformer.use_backend(backend):
            return attention(q, k, v, dropout_p=0.1, **masks)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # views, not copies
    out = fn(*leaves)
    got = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    _check_fp32(backend, got, want)


# ---------------------------------------------------------------- dropout


def _dropout_probe(backend, B, H, Sq, Sk, p, seed, offset):
    """The dropout keep-mask read back through the kernel: with q = 0 every visible key gets
    probability 1 / Sk, and v = identity makes out[b, h, i, j] = keep[b, h, i, j] attention_keep_scale(p) / Sk."""
    device = device_for(backend)
    q = torch.zeros(B, H, Sq, Sk, device=device)
    k = torch.randn(B, H, Sk, Sk, device=device)
    v = torch.eye(Sk, device=device).expand(B, H, Sk, Sk)
    out, _ = backends.Kernels(backend).attention_fwd(q, k, v, None, None, False, 1.0, p, philox.pack(seed, offset))
    scaled = out * Sk / philox.attention_keep_scale(p)
    keep = scaled > 0.5
    assert_close("kept values", scaled[keep], torch.ones_like(scaled[keep]), atol=1e-5, rtol=1e-5)
    return keep


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics_and_repeatability(backend, p):
    B, H, Sq, Sk = (1, 2, 16, 32) if backend == "triton" else (4, 4, 96, 128)
    keep = _dropout_probe(backend, B, H, Sq, Sk, p, 11, 0)
    n = keep.numel()
    rate = keep.double().mean().item()
    drop = philox.attention_drop_rate(p)  # the rate the 8-bit threshold realises
    assert abs(rate - (1 - drop)) < 5 * math.sqrt(drop * (1 - drop) / n), f"keep rate {rate} for p={p}"
    assert torch.equal(keep.cpu(), philox.attention_keep_mask((B, H, Sq, Sk), p, 11, 0))
    # same seed: same mask; another seed or offset: another mask
    assert torch.equal(_dropout_probe(backend, B, H, Sq, Sk, p, 11, 0), keep)
    assert not torch.equal(_dropout_probe(backend, B, H, Sq, Sk, p, 12, 0), keep)
    assert not torch.equal(_dropout_probe(backend, B, H, Sq, Sk, p, 11, 1), keep)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_counters_past_32_bits(backend):
    """Tile counters offset + ((bh QB + qb) KB + kb) 32 + lane whose low word wraps carry into the
    high word (philox.py)."""
    B, H, Sq, Sk = 1, 2, 3, 40
    offset = 2**32 - 45  # 2 tiles of 32 counters a head: the wrap falls at lane 13 of head 0's second tile
    keep = _dropout_probe(backend, B, H, Sq, Sk, 0.5, 9, offset)
    assert torch.equal(keep.cpu(), philox.attention_keep_mask((B, H, Sq, Sk), 0.5, 9, offset))


def _visible(B, Sq, Sk, kpm, causal):
    """(B, 1, Sq, Sk) bool: key j visible to query i (the reference's masks, no attn_mask)."""
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    hidden = (j > i + (Sk - Sq)) if causal else torch.zeros(Sq, Sk, dtype=torch.bool)
    return ~(hidden[None, None] | kpm[:, None, None, :])


def _dropout_masks(B, H, Sq, Sk, p, seed, offset, causal):
    """The keep-masks the CPU forward and backward apply, read back exactly, with left key padding
    (so key blocks start at keys that are not a multiple of 8 or 32) and, optionally, the causal mask.
    Forward: q = 0 gives every visible key probability 1 / nvis, and v[j, d] = 2**(j % 8) where
    d = j // 8 sums each group of eight keys' keep bits into one exact integer of out[..., d].
    Backward: dout = I (D = Sq) makes dv[j, i] = P[i, j] Z[i, j]."""
    gen = torch.Generator().manual_seed(Sk)
    kpm = torch.arange(Sk)[None, :] < torch.tensor([min(5, Sk - 1), min(3, Sk - 1)])[:B, None]
    vis = _visible(B, Sq, Sk, kpm, causal)  # (B, 1, Sq, Sk)
    nvis = vis.sum(-1, keepdim=True).clamp(min=1).double()  # (B, 1, Sq, 1)
    kern = backends.Kernels("cpu")
    G = (Sk + 7) // 8
    j = torch.arange(Sk)
    v = torch.zeros(Sk, G)
    v[j, j // 8] = (2.0 ** (j % 8)).float()
    k = torch.randn(B, H, Sk, G, generator=gen)
    out, _ = kern.attention_fwd(torch.zeros(B, H, Sq, G), k, v.expand(B, H, Sk, G), kpm, None, causal,
                                1.0, p, philox.pack(seed, offset))
    scale = philox.attention_keep_scale(p)
    sums = (out.double() * nvis / scale).round().long()  # (B, H, Sq, G): 8 keep bits per group
    fwd = ((sums.repeat_interleave(8, dim=-1)[..., :Sk] >> (j % 8)) & 1).bool()
    D = Sq
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    q.zero_()
    o, lse = kern.attention_fwd(q, k, v, kpm, None, causal, 1.0, p, philox.pack(seed, offset))
    dout = torch.eye(Sq).expand(B, H, Sq, Sq).contiguous()
    _, _, dv, _ = kern.attention_bwd(dout, q, k, v, o, lse, kpm, None, causal, 1.0, p, philox.pack(seed, offset))
    bwd = dv.transpose(-1, -2) != 0  # (B, H, Sq, Sk)
    assert_close("kept dv", (dv.transpose(-1, -2).double() * nvis / scale)[bwd],
                 torch.ones(int(bwd.sum()), dtype=torch.float64), atol=1e-5, rtol=1e-5)
    return fwd, bwd, vis


@pytest.mark.parametrize("Sk", [1, 7, 8, 9, 63, 64, 65, 1023])
@pytest.mark.parametrize("backend", CPU)
@pytest.mark.slow
def test_cpu_dropout_mask_is_the_reference_mask_for_odd_rows(backend, Sk):
    """Rows of Sk keys of any length (partial 16 x 32 tiles at the ends of both dimensions), key
    blocks starting off a tile boundary, Sq != Sk, causal or not, offsets whose low word wraps
    mid-tensor: forward and backward apply exactly philox.attention_keep_mask on the visible keys."""
    B, H, Sq = 2, 3, 70  # Sq > kBlockQ: two query blocks, the last 16-row group partial
    used = philox.attention_counters_used((B, H, Sq, Sk))
    for p, seed, offset, causal in ((0.3, 5, 0, False), (0.5, 2**40 + 1, 2**32 - used // 2, True),
                                    (0.9, 77, 2**33 - 7, Sk > 8)):
        fwd, bwd, vis = _dropout_masks(B, H, Sq, Sk, p, seed, offset, causal)
        want = philox.attention_keep_mask((B, H, Sq, Sk), p, seed, offset) & vis
        assert torch.equal(fwd, want), f"forward mask, p={p} offset={offset} causal={causal}"
        assert torch.equal(bwd, want), f"backward mask, p={p} offset={offset} causal={causal}"


def test_functional_op_draws_seed_from_torch_generator():
    """torch.manual_seed makes the op repeatable; the reference with the recovered rng agrees."""
    (q, k, v, _), masks = _inputs("7x7_d40_kpm", "cpu")
    torch.manual_seed(3)
    y1 = attention(q, k, v, dropout_p=0.5, **masks)
    torch.manual_seed(3)
    y2 = attention(q, k, v, dropout_p=0.5, **masks)
    torch.manual_seed(3)
    rng = philox.next_seed()
    assert torch.equal(y1, y2)
    want = reference.attention(q, k, v, dropout_p=0.5, rng=rng, **masks)
    assert_close("out", y1, want, atol=1e-5, rtol=1e-4)
    assert not torch.equal(attention(q, k, v, dropout_p=0.5, **masks), y1)


# ---------------------------------------------------------------- the CPU kernels' schedules


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads", [(1, 1), (3, 3)])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_backward_schedules(backend, heads, threads, restore_threads):
    """Few heads on several threads take the two-pass backward (dK/dV per key block, then dQ per
    query block); otherwise one task per head computes all three. Both against the reference."""
    torch.set_num_threads(threads)
    B, H = heads
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, S, 80, generator=gen) for S in (203, 203, 203))
    dout = torch.randn(B, H, 203, 80, generator=gen)
    kpm = torch.arange(203)[None, :] >= torch.tensor([150, 203, 90][:B])[:, None]
    masks = dict(key_padding_mask=kpm, attn_mask=None, is_causal=True)
    got = _kernel(backend, (q, k, v), dout, masks, p=0.2)
    _check_fp32(backend, got, _reference((q, k, v), dout, masks, p=0.2))


@pytest.mark.parametrize("backend", CPU)
def test_cpu_never_reads_keys_past_the_padding(backend):
    """Keys outside [first, last] unpadded key are skipped, not masked: NaN there changes nothing."""
    (q, k, v, dout), masks = _inputs("113x113_d80_float_b1_kpm_lead", "cpu")
    kpm = torch.zeros(3, 113, dtype=torch.bool)
    kpm[0, :40] = True
    kpm[1, 70:] = True
    kpm[2, :5] = True
    kpm[2, 100:] = True
    masks["key_padding_mask"] = kpm
    want = _reference((q, k, v), dout, masks)
    padded = kpm[:, None, :, None]  # (B, 1, Sk, 1)
    k_nan, v_nan = k.masked_fill(padded, float("nan")), v.masked_fill(padded, float("nan"))
    got = _kernel(backend, (q, k_nan, v_nan), dout, masks)
    _check_fp32(backend, got, want)
    for name, g in (("dk", got[2]), ("dv", got[3])):
        assert not g.masked_select(padded).any(), f"{name} of padded keys must be 0"


@pytest.mark.parametrize("backend", CPU)
def test_cpu_empty_sizes(backend):
    kern = backends.Kernels(backend)
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 0, 16)
    out, lse = kern.attention_fwd(q, k, k, None, None, False, 0.25, 0.1, philox.pack(1, 0))  # no keys at all
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()
    dq, dk, dv, _ = kern.attention_bwd(torch.randn_like(q), q, k, k, out, lse, None, None, False, 0.25, 0.1,
                                    philox.pack(1, 0))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == k.shape
    q0 = torch.randn(0, 3, 5, 16, requires_grad=True)
    with fastformer.use_backend(backend):
        out0 = attention(q0, q0, q0)
    out0.sum().backward()
    assert out0.shape == (0, 3, 5, 16) and q0.grad.shape == q0.shape


# ---------------------------------------------------------------- gradcheck, opcheck


GRADCHECK_CONFIGS = {
    "plain": dict(),
    "causal_kpm": dict(is_causal=True, kpm=True),
    "float_mask": dict(attn_mask="float"),
    "bool_mask_causal_q_gt_k": dict(attn_mask="bool", is_causal=True, Sq=9),
    "dropout_kpm": dict(kpm=True, p=0.3),
    "dropout_causal_float_mask": dict(is_causal=True, attn_mask="float", p=0.4),
}


@pytest.mark.parametrize("config", list(GRADCHECK_CONFIGS))
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, config):
    cfg = GRADCHECK_CONFIGS[config]
    B, H, Sq, Sk, D = 2, 2, cfg.get("Sq", 5), 6, 3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for S in (Sq, Sk, Sk))
    kpm = torch.tensor([[False] * 4 + [True] * 2, [True] + [False] * 5]) if cfg.get("kpm") else None
    am = None
    if cfg.get("attn_mask") == "float":
        am = torch.randn(Sq, Sk, generator=gen, dtype=torch.float64)
    elif cfg.get("attn_mask") == "bool":
        am = torch.rand(B, 1, Sq, Sk, generator=gen) < 0.3
    p = cfg.get("p", 0.0)

    def fn(q, k, v):
        torch.manual_seed(42)  # the same dropout mask on every evaluation
        with fastformer.use_backend(backend):
            return attention(q, k, v, key_padding_mask=kpm, attn_mask=am,
                             is_causal=cfg.get("is_causal", False), dropout_p=p)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    B, H, Sq, Sk, D = 2, 3, 7, 13, 40
    q = torch.randn(B, Sq, H, D, dtype=dtype).transpose(1, 2)  # a strided view
    k, v = torch.randn(B, H, Sk, D, dtype=dtype), torch.randn(B, H, Sk, D, dtype=dtype)
    kpm = torch.rand(B, Sk) < 0.3
    am = torch.randn(Sq, Sk).expand(B, H, Sq, Sk)
    for masks, causal, p in (((None, None), False, 0.0), ((kpm, None), True, 0.2), ((kpm, am), False, 0.1),
                             ((None, am), True, 0.0)):
        args = (q, k, v, *masks, causal, 0.3, p, philox.pack(7, 3))
        torch.library.opcheck(ops.attention_fwd.default, args)
        out, lse = ops.attention_fwd(*args)
        dout = torch.randn_like(out)
        bwd_args = (dout, q, k, v, out, lse, *masks, causal, 0.3, p, philox.pack(7, 3))
        torch.library.opcheck(ops.attention_bwd.default, bwd_args)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend)
    q, k, v = (torch.randn(2, 3, S, 8, device=device) for S in (5, 7, 7))
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match="q must have 4 dimensions"):
            attention(q[0], k, v)
        with pytest.raises(ValueError, match="k has 4 heads, which must divide q's 3 heads"):
            attention(q, torch.randn(2, 4, 7, 8, device=device), v)  # H_kv does not divide H
        with pytest.raises(ValueError, match="k must have shape"):
            attention(q, torch.randn(3, 3, 7, 8, device=device), v)  # B differs
        with pytest.raises(ValueError, match="k must have shape"):
            attention(q, torch.randn(2, 3, 7, 9, device=device), v)  # D differs
        with pytest.raises(ValueError, match="v must have shape"):
            attention(q, k, torch.randn(2, 3, 6, 8, device=device))
        with pytest.raises(ValueError, match="key_padding_mask must have shape"):
            attention(q, k, v, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device=device))
        with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
            attention(q, k, v, key_padding_mask=torch.zeros(2, 7, device=device))
        with pytest.raises(ValueError, match="attn_mask of shape"):
            attention(q, k, v, attn_mask=torch.zeros(5, 6, device=device))
        with pytest.raises(TypeError, match="attn_mask must be bool or floating point"):
            attention(q, k, v, attn_mask=torch.zeros(5, 7, dtype=torch.long, device=device))
        with pytest.raises(TypeError, match="k has dtype"):
            attention(q, k.to(torch.bfloat16), v)
        with pytest.raises(TypeError, match="q must be a floating-point tensor"):
            attention(q.long(), k, v)
        with pytest.raises(ValueError, match="k is on meta"):
            attention(q, k.to("meta"), v)
        with pytest.raises(ValueError, match="attn_mask is on meta"):
            attention(q, k, v, attn_mask=torch.zeros(5, 7, device="meta"))
        for p in (1.0, -0.1):
            with pytest.raises(ValueError, match="dropout_p must be a number in"):
                attention(q, k, v, dropout_p=p)
        with pytest.raises(ValueError, match="scale must be a positive number"):
            attention(q, k, v, scale=0.0)
        # the forced backend's error names it and the declared limit that rejected the call
        with pytest.raises(RuntimeError, match=rf"backend '{backend}' was forced .*head dim 300 > 256, "
                                               rf"the {backend} backend's limit"):
            attention(*(torch.randn(1, 1, 2, 300, device=device) for _ in range(3)))


def check_bwd_glue(bwd, q, k, v, out, lse, wrong_dtype, rng):
    """attention_bwd's glue (``bwd``, a backend's kernel) names what is wrong with its arguments
    (fp32 q, k, v and the forward's out, lse); shared with tests/test_attention_cuda.py."""
    dtype_name = {torch.float64: "Double", torch.float16: "Half"}[wrong_dtype]
    bwd_cases = [
        ((out[:, :, :4], q, k, v, out, lse), "dout must have q's shape"),
        ((out, q, k, v, out.to(wrong_dtype), lse), f"out has dtype {dtype_name} but q has dtype Float"),
        ((out, q, k, v, out, lse.double()), "lse must be float32"),
        ((out, q, k, v, out, lse[:, :, :4]), r"lse must have shape \(B, H, Sq\)"),
        ((out.transpose(-2, -1).contiguous().transpose(-2, -1), q, k, v, out, lse),
         "dout must have a contiguous last dimension"),
    ]
    for args, message in bwd_cases:
        with pytest.raises(RuntimeError, match=message):
            bwd(*args, None, None, False, 0.5, 0.0, rng)


@pytest.mark.parametrize("backend", CPU)
def test_cpu_kernel_checks_name_the_argument(backend):
    fwd = backends.Kernels(backend).attention_fwd
    bwd = backends.Kernels(backend).attention_bwd
    q, k, v = (torch.randn(2, 3, S, 8) for S in (5, 7, 7))
    kpm, am = torch.zeros(2, 7, dtype=torch.bool), torch.zeros(2, 3, 5, 7)
    fwd_cases = [
        ((q[0], k, v, None, None), "q must be 4-D"),
        ((q, torch.randn(2, 4, 7, 8), v, None, None), r"k has 4 heads, which must divide q's 3 heads"),
        ((q, k, torch.randn(2, 3, 6, 8), None, None), "v must have k's shape"),
        ((q, k.double(), v, None, None), "k has dtype Double but q has dtype Float"),
        ((q.half(), k.half(), v.half(), None, None), "q must be float32, float64 or bfloat16"),
        ((torch.randn(2, 3, 5, 16)[..., ::2], k, v, None, None), "q must have a contiguous last dimension"),
        ((*(torch.randn(1, 1, 2, 300) for _ in range(3)), None, None), r"head dim D must be in \[1, 256\]"),
        ((q, k, v, kpm.float(), None), "key_padding_mask must be bool"),
        ((q, k, v, kpm[:, :6], None), r"key_padding_mask must have shape \(B, Sk\)"),
        ((q, k, v, None, am.double()), "attn_mask must be float32"),
        ((q, k, v, None, am[0]), "attn_mask must be a 4-D view"),
        ((q, k, v, None, torch.zeros(2, 3, 4, 7)), "attn_mask of shape .* does not broadcast"),
    ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            fwd(*args, False, 0.5, 0.0, philox.pack(0, 0))
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        fwd(q, k, v, None, None, False, 0.5, 1.0, philox.pack(0, 0))
    with pytest.raises(RuntimeError, match=r"the philox seed philox\[0\] must be >= 0, got -1"):
        fwd(q, k, v, None, None, False, 0.5, 0.1, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match=r"philox must have shape \(2,\) = \(seed, offset\), got \[3\]"):
        fwd(q, k, v, None, None, False, 0.5, 0.1, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="scale must be finite"):
        fwd(q, k, v, None, None, False, float("nan"), 0.0, philox.pack(0, 0))
    out, lse = fwd(q, k, v, None, None, False, 0.5, 0.0, philox.pack(0, 0))
    check_bwd_glue(bwd, q, k, v, out, lse, torch.float64, philox.pack(0, 0))
