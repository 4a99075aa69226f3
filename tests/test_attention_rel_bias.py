"""attention and attention_varlen with T5's relative position bias (``relative_attention_bias``):
the bucket function against transformers' own, the reference against SDPA with the dense bias,
and every kernel backend against the reference, forward and every gradient (q, k, v and the
table), with causal masks, key padding, dropout, Sq != Sk and a query offset, grouped heads,
distances past max_distance, packed sequences, fp32 / bf16 / fp64; the table's gradient bit-equal
across runs; bad tables and bad kernel arguments refused by name."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import philox
from fastformer.ops import attention, attention_varlen, reference, relative_position
from utils import (assert_close, assert_close_lowp, device_for, kernel_backends, other_simt_schedules_test,
                   peak_allocated)

BACKENDS = kernel_backends()
TOL = {torch.float32: (2e-5, 1e-4), torch.float64: (1e-10, 1e-10)}
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-10, 1e-10)}


def _t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """transformers' T5 bucket function (an independent copy of the definition)."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    return t5.T5Attention._relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (64, 64), (5, 9)])
def test_buckets_are_t5s_and_saturate_past_max_distance(bidirectional, num_buckets, max_distance):
    if bidirectional and num_buckets < 8:
        pytest.skip("bidirectional tables of fewer than 8 buckets leave a side too few for T5's log buckets")
    r = torch.arange(-3 * max_distance - 5, 3 * max_distance + 6)
    ours = relative_position.relative_position_bucket(r, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, _t5_bucket(r, bidirectional, num_buckets, max_distance))
    # what the kernels' clamp to [-R, R] relies on: past R, a side's bucket is its bucket at R
    R = max_distance
    assert (ours[r >= R] == ours[r == R]).all() and (ours[r <= -R] == ours[r == -R]).all()


def _qkv(B, H, Sq, Sk, D, H_kv=None, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    H_kv = H_kv or H
    q = torch.randn(B, H, Sq, D, generator=gen)
    k, v = (torch.randn(B, H_kv, Sk, D, generator=gen) for _ in range(2))
    dout = torch.randn(B, H, Sq, D, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _table(num_buckets, H, dtype=torch.float32, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_buckets, H, generator=gen) * 0.7).to(device=device, dtype=dtype)


def _run(fn, q, k, v, table, dout):
    """fn's output and the gradients of q, k, v and the table."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def test_reference_is_sdpa_with_the_dense_bias():
    q, k, v, dout = _qkv(2, 3, 9, 11, 8, dtype=torch.float64)
    table = _table(16, 3, dtype=torch.float64)
    kpm = torch.zeros(2, 11, dtype=torch.bool)
    kpm[1, 8:] = True

    def ours(q, k, v, t):
        return reference.attention(q, k, v, key_padding_mask=kpm, scale=1.0, relative_attention_bias=t,
                                   bidirectional=False, relative_attention_max_distance=20, query_offset=5)

    def sdpa(q, k, v, t):
        i = torch.arange(9)[:, None] + 5
        j = torch.arange(11)[None, :]
        bias = t[_t5_bucket(j - i, False, 16, 20)].permute(2, 0, 1)  # (H, Sq, Sk)
        mask = bias[None].masked_fill(kpm[:, None, None, :], float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)

    for name, got, want in zip(("out", "dq", "dk", "dv", "dtable"), _run(ours, q, k, v, table, dout),
                               _run(sdpa, q, k, v, table, dout)):
        assert_close(name, got, want, atol=1e-12, rtol=1e-12)


# (B, H, H_kv, Sq, Sk, D, num_buckets, max_distance, bidirectional, masks, dropout_p, query_offset)
CASES = {
    "encoder": (2, 2, 2, 12, 12, 8, 8, 6, True, {}, 0.0, None),
    "decoder_causal": (2, 2, 2, 13, 13, 8, 8, 6, False, {"is_causal": True}, 0.0, None),
    "padded_dropout": (2, 2, 2, 10, 10, 16, 8, 5, True, {"kpm": True}, 0.2, None),
    "cached_decoding": (1, 2, 2, 3, 17, 8, 8, 7, False, {"is_causal": True}, 0.0, None),
    "query_offset": (1, 2, 2, 5, 9, 8, 8, 5, False, {}, 0.0, 11),
    "grouped_heads": (1, 4, 2, 9, 9, 8, 16, 7, True, {"is_causal": True}, 0.0, None),
    "long_rows": (1, 1, 1, 70, 150, 16, 32, 128, True, {"kpm": True}, 0.1, None),
    "one_query": (1, 1, 1, 1, 1, 4, 4, 3, True, {}, 0.0, None),
    # several query and key tiles of the kernels (64 x 128 on the CPU), both ends clamped in a row
    "tiles": (1, 2, 2, 130, 300, 16, 32, 40, True, {"is_causal": True, "kpm": True}, 0.0, None),
}
TRITON_CASES = ("encoder", "decoder_causal", "padded_dropout", "cached_decoding", "grouped_heads")


def _masks(spec, B, Sk, device):
    masks = {"is_causal": spec.get("is_causal", False)}
    if spec.get("kpm"):
        kpm = torch.zeros(B, Sk, dtype=torch.bool)
        kpm[-1, Sk - Sk // 3:] = True
        masks["key_padding_mask"] = kpm.to(device)
    return masks


def _call(backend, case, dtype, seed=1234):
    B, H, H_kv, Sq, Sk, D, nb, md, bidi, spec, p, offset = CASES[case]
    device = device_for(backend)
    q, k, v, dout = _qkv(B, H, Sq, Sk, D, H_kv, dtype, device)
    table = _table(nb, H, dtype, device)
    masks = _masks(spec, B, Sk, device)
    rel = dict(bidirectional=bidi, relative_attention_max_distance=md, query_offset=offset)

    def kernel(q, k, v, t):
        torch.manual_seed(seed)  # the Function draws (seed, offset) from torch's generator
        with fastformer.use_backend(backend):
            return attention(q, k, v, scale=1.0, dropout_p=p, relative_attention_bias=t, **masks, **rel)

    torch.manual_seed(seed)
    rng = philox.next_seed() if p > 0 else None

    def ref(q, k, v, t):
        return reference.attention(q, k, v, scale=1.0, dropout_p=p, rng=rng, relative_attention_bias=t,
                                   **masks, **rel)
    return kernel, ref, (q, k, v, table, dout)


NAMES = ("out", "dq", "dk", "dv", "dtable")


def _params(dtypes):
    for backend in BACKENDS:
        name = backend.values[0]
        for case in CASES:
            if name == "triton" and case not in TRITON_CASES:
                continue
            for dtype in dtypes:
                if dtype == torch.float64 and name != "cpu":
                    continue
                yield pytest.param(name, case, dtype, marks=backend.marks, id=f"{name}-{case}-{str(dtype)[6:]}")


@pytest.mark.parametrize("backend, case, dtype", list(_params((torch.float32, torch.float64))))
def test_matches_reference(backend, case, dtype):
    kernel, ref, inputs = _call(backend, case, dtype)
    got, want = _run(kernel, *inputs), _run(ref, *inputs)
    for name, g, w in zip(NAMES, got, want):
        atol, rtol = (TOL if name == "out" else GRAD_TOL)[dtype]
        assert_close(name, g, w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend, case, dtype", list(_params((torch.bfloat16,))))
def test_bf16_within_twice_torchs_error(backend, case, dtype):
    kernel, ref, inputs = _call(backend, case, dtype)
    got = _run(kernel, *inputs)
    want_lowp = _run(ref, *inputs)
    want_fp32 = _run(ref, *(t.float() for t in inputs))
    for name, g, w32, wlow in zip(NAMES, got, want_fp32, want_lowp):
        assert_close_lowp(name, g.float(), w32, wlow.float(), atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_gradient_is_deterministic(backend):
    kernel, _, inputs = _call(backend, "padded_dropout" if backend == "triton" else "long_rows", torch.float32)
    first, second = _run(kernel, *inputs)[-1], _run(kernel, *inputs)[-1]
    assert torch.equal(first, second)


def _packed(lengths_q, lengths_k, H, D, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, H, D, generator=gen)
    k, v = (torch.randn(tk, H, D, generator=gen) for _ in range(2))
    dout = torch.randn(tq, H, D, generator=gen)
    cu = [torch.tensor([0] + list(torch.tensor(x).cumsum(0)), dtype=torch.int32, device=device)
          for x in (lengths_q, lengths_k)]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)], cu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
def test_varlen_positions_within_each_sequence(backend, causal):
    """Each packed sequence equals attention on it alone (its query i at position i + Lk - Lq)."""
    _check_varlen(backend, causal, [5, 0, 9, 3], [7, 2, 9, 11])


CPU = [b for b in BACKENDS if b.values[0] == "cpu"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", CPU)
def test_varlen_sequences_of_several_tiles(backend, causal):
    """Sequences longer than the CPU kernels' 64 x 128 tiles, one without queries, one without keys."""
    _check_varlen(backend, causal, [70, 0, 130, 3], [140, 5, 260, 0], nb=16, md=30)


def _check_varlen(backend, causal, lengths_q, lengths_k, H=2, D=8, nb=8, md=5):
    device = device_for(backend)
    (q, k, v, dout), (cq, ck) = _packed(lengths_q, lengths_k, H, D, torch.float32, device)
    table = _table(nb, H, device=device)
    rel = dict(bidirectional=not causal, relative_attention_max_distance=md)

    def packed(q, k, v, t):
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, cq, ck, max(lengths_q), max(lengths_k), is_causal=causal, scale=1.0,
                                    relative_attention_bias=t, **rel)

    def per_sequence(q, k, v, t):
        outs, bq, bk = [], 0, 0
        for Lq, Lk in zip(lengths_q, lengths_k):
            qb, kb, vb = (x[a:a + n].transpose(0, 1)[None] for x, a, n in ((q, bq, Lq), (k, bk, Lk), (v, bk, Lk)))
            if Lq:
                outs.append(reference.attention(qb, kb, vb, is_causal=causal, scale=1.0, relative_attention_bias=t,
                                                **rel)[0].transpose(0, 1))
            bq, bk = bq + Lq, bk + Lk
        return torch.cat(outs)

    for name, g, w in zip(NAMES, _run(packed, q, k, v, table, dout), _run(per_sequence, q, k, v, table, dout)):
        assert_close(name, g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", CPU)
def test_varlen_qkvpacked_gradient_into_packed_rows(backend):
    """attention_varlen_qkvpacked (the backward writing into one packed gradient) as attention_varlen."""
    lengths = [70, 9, 130]
    (q, k, v, dout), (cu, _) = _packed(lengths, lengths, 2, 8, torch.float32, device_for(backend))
    table = _table(16, 2)
    rel = dict(is_causal=True, scale=1.0, relative_attention_bias=None, bidirectional=False,
               relative_attention_max_distance=30)

    def packed(qkv, t):
        with fastformer.use_backend(backend):
            return fastformer.ops.attention_varlen_qkvpacked(qkv, cu, max(lengths), **{**rel, "relative_attention_bias": t})

    def separate(q, k, v, t):
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), **{**rel, "relative_attention_bias": t})
    qkv, t = torch.stack((q, k, v), dim=1).requires_grad_(), table.clone().requires_grad_()
    out = packed(qkv, t)
    dqkv, dtable = torch.autograd.grad(out, (qkv, t), dout)
    want = _run(separate, q, k, v, table, dout)
    for name, g, w in zip(NAMES, (out.detach(), *dqkv.unbind(1), dtable), want):
        assert_close(name, g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_attn_mask_scale_and_both_backward_schedules(backend, dtype):
    """The CPU kernels' other paths with a bias: an additive attn_mask with -inf (the unfused score
    rows), a scale != 1, grouped heads and dropout; the backward's schedules, one task per head (one
    thread) and key-block then query-block passes (two threads): each as the reference, and the
    table's gradient the same bits under both."""
    B, H, H_kv, Sq, Sk, D = 2, 2, 1, 70, 140, 16
    q, k, v, dout = _qkv(B, H, Sq, Sk, D, H_kv, dtype)
    table = _table(32, H, dtype)
    am = torch.randn(1, H, Sq, Sk, generator=torch.Generator().manual_seed(2)) * 0.5
    am[..., ::7] = float("-inf")
    kw = dict(attn_mask=am, scale=0.3, dropout_p=0.1, bidirectional=False, relative_attention_max_distance=20)
    torch.manual_seed(5)
    rng = philox.next_seed()

    def kernel(q, k, v, t):
        torch.manual_seed(5)
        with fastformer.use_backend(backend):
            return attention(q, k, v, relative_attention_bias=t, **kw)

    def ref(q, k, v, t):
        return reference.attention(q, k, v, rng=rng, relative_attention_bias=t, **kw)
    want = _run(ref, q, k, v, table, dout)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(_run(kernel, q, k, v, table, dout))
    finally:
        torch.set_num_threads(threads)
    for got in runs:
        for name, g, w in zip(NAMES, got, want):
            atol, rtol = (TOL if name == "out" else GRAD_TOL)[dtype]
            assert_close(name, g, w, atol=atol, rtol=rtol)
    assert torch.equal(runs[0][-1], runs[1][-1])


@pytest.mark.parametrize("bad, match", [
    (lambda t: t[:, :1], r"relative_attention_bias must have shape \(num_buckets, H\)"),
    (lambda t: t[0], "relative_attention_bias must have 2 dimensions"),
    (lambda t: t.long(), "relative_attention_bias must be a floating"),
    (lambda t: t[:3], "bidirectional buckets need at least 4"),
])
def test_bad_tables_are_refused_by_name(bad, match):
    q, k, v, _ = _qkv(1, 2, 4, 4, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        attention(q, k, v, relative_attention_bias=bad(_table(8, 2)))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(relative_attention_max_distance=2), ValueError, "relative_attention_max_distance must exceed"),
    (dict(relative_attention_max_distance=1.5), TypeError, "relative_attention_max_distance must be an int"),
    (dict(bidirectional=1), TypeError, "bidirectional must be a bool"),
    (dict(query_offset=2.0), TypeError, "query_offset must be an int"),
])
def test_bad_settings_are_refused_by_name(kwargs, error, match):
    q, k, v, _ = _qkv(1, 2, 4, 4, 8)
    with pytest.raises(error, match=match):
        attention(q, k, v, relative_attention_bias=_table(8, 2), **kwargs)


CPP = [b for b in BACKENDS if b.values[0] in ("cpu", "cuda")]


@pytest.mark.parametrize("rel_bias, rel_shift, match", [
    (lambda H: torch.zeros(H, 4), 0, r"rel_bias must have shape \(H, 2R \+ 1\)"),
    (lambda H: torch.zeros(H + 1, 5), 0, r"rel_bias must have shape \(H, 2R \+ 1\)"),
    (lambda H: torch.zeros(H, 5, dtype=torch.float64), 0, "rel_bias must be float32"),
    (lambda H: torch.zeros(5, H).t(), 0, "rel_bias must be contiguous"),
    (lambda H: torch.zeros(H, 5), 1 << 31, r"rel_shift must be in \[-2\^30, 2\^30\]"),
])
@pytest.mark.parametrize("backend", CPP)
def test_kernel_checks_name_the_bad_rel_bias(backend, rel_bias, rel_shift, match):
    device = device_for(backend)
    q, k, v, _ = _qkv(1, 2, 4, 4, 8, device=device)
    kern = fastformer.backends.Kernels(backend)
    with pytest.raises(RuntimeError, match=match):
        kern.attention_fwd(q, k, v, None, None, False, 1.0, 0.0, philox.pack(0, 0), rel_bias(2).to(device), rel_shift)


# ---- the cuda backend's kernels at their tile boundaries: the FMA kernels (attention.cu: a query
# tile of 4096 / kD rows and key tiles of as many, kD = 64, 128, 256 by head dim) and, for 16-bit
# forwards, the tensor-core one (flash_fwd_mma.cu: 64 queries, 64 or 32 keys). The bias of a tile
# is a window of distances, the gradient's bins inside (-R, R) are summed as tile diagonals and the
# two clamped bins in registers, so: many tiles, tiles wholly past R on either side, R = 0 (one
# bin), a rel_shift that puts every distance past R, with key padding and an attn_mask.
CUDA = [b for b in BACKENDS if b.values[0] == "cuda"]

# (B, H, H_kv, Sq, Sk, D, R, rel_shift, causal, masks, dropout_p)
CUDA_TILE_CASES = {
    "d64_small_R_many_tiles": (1, 2, 2, 130, 200, 16, 3, 0, False, False, 0.0),
    "d64_causal_dropout": (2, 2, 1, 70, 140, 64, 40, 5, True, False, 0.1),
    "d128_masks": (2, 1, 1, 45, 70, 100, 20, 0, False, True, 0.0),
    "d256_shift": (1, 2, 2, 40, 33, 200, 6, -17, True, False, 0.0),
    "every_distance_past_R": (1, 1, 1, 20, 20, 16, 4, 1000, False, True, 0.0),
    "R0": (1, 2, 2, 9, 9, 8, 0, 0, False, False, 0.0),
}


def _dense_reference(q, k, v, rel, rel_shift, causal, kpm, am, scale):
    """Attention probabilities (in q's dtype) with the bias gathered densely by clamped distance
    (query i at i + Sk - Sq + rel_shift); differentiable in q, k, v and rel."""
    Sq, Sk, R = q.shape[2], k.shape[2], (rel.shape[1] - 1) // 2
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Sk)[None, :]
    s = scale * q @ k.transpose(-1, -2) + rel[:, ((j - i - (Sk - Sq) - rel_shift).clamp(-R, R) + R)]
    if am is not None:
        s = s + am
    hidden = torch.zeros(Sq, Sk, dtype=torch.bool)
    if causal:
        hidden = hidden | (j > i + Sk - Sq)
    hidden = hidden[None, None] | (kpm[:, None, None, :] if kpm is not None else False)
    hidden = hidden | torch.isneginf(s)
    prob = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
    return prob.masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)  # a row with no visible key: 0


def _tile_params():
    for case in CUDA_TILE_CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # 16-bit: not where one bin takes every score of a row (R = 0, all past R): its exact
            # gradient is a row's sum of dS, 0, which the flash backward's delta (from the rounded
            # out) misses by ~ rows x 2^-8, an error the 2x rule's reference does not make
            if dtype != torch.float32 and case in ("every_distance_past_R", "R0"):
                continue
            if dtype == torch.float16 and case not in ("d64_causal_dropout", "d256_shift"):
                continue
            for backend in CUDA:
                yield pytest.param(backend.values[0], case, dtype, marks=backend.marks,
                                   id=f"{backend.values[0]}-{case}-{str(dtype)[6:]}")


@pytest.mark.parametrize("backend, case, dtype", list(_tile_params()))
def test_cuda_kernels_at_tile_boundaries(backend, case, dtype):
    """fp32: the FMA kernels against an fp64 reference; 16-bit: the tensor-core forward (where a
    GPU, or the harness, takes it) and the FMA backward, FlashAttention's 2x rule."""
    B, H, H_kv, Sq, Sk, D, R, shift, causal, masked, p = CUDA_TILE_CASES[case]
    device = device_for(backend)
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (t.to(dtype) for t in _qkv(B, H, Sq, Sk, D, H_kv, seed=3))
    rel = torch.randn(H, 2 * R + 1, generator=gen, dtype=torch.float64)
    kpm = am = None
    if masked:
        kpm = torch.zeros(B, Sk, dtype=torch.bool)
        kpm[-1, Sk // 2:] = True
        am = torch.randn(B, 1, Sq, Sk, generator=gen, dtype=torch.float64)
        am[..., 1::7] = float("-inf")
    scale = D ** -0.5
    rng = philox.pack(11, 4)
    kern = fastformer.backends.Kernels(backend)

    def dev(t):
        return None if t is None else t.to(device)

    args = (dev(kpm), dev(None if am is None else am.float()), causal, scale, p, rng, dev(rel.float()), shift)
    out, lse = kern.attention_fwd(*(dev(t) for t in (q, k, v)), *args)
    dq, dk, dv, drel = kern.attention_bwd(*(dev(t) for t in (dout, q, k, v, out, lse)), *args)
    again = kern.attention_bwd(*(dev(t) for t in (dout, q, k, v, out, lse)), *args)[3]
    assert torch.equal(drel, again)  # bit-equal: no atomics
    assert drel.dtype == torch.float32 and drel.shape == rel.shape

    def reference_in(ref_dtype):
        leaves = [t.to(ref_dtype).requires_grad_() for t in (q, k, v, rel)]
        group = H // H_kv
        kv = [t.repeat_interleave(group, 1) for t in leaves[1:3]]
        prob = _dense_reference(leaves[0], kv[0], kv[1], leaves[3], shift, causal, kpm,
                                None if am is None else am.to(ref_dtype), scale)
        if p > 0:  # the kernels' mask: attention's dropout v3 over the (B, H, Sq, Sk) probabilities
            keep = philox.attention_keep_mask((B, H, Sq, Sk), p, 11, 4).to(ref_dtype)
            prob = prob * keep * philox.attention_keep_scale(p)
        want = prob @ kv[1]
        return (want, *torch.autograd.grad(want, leaves, dout.to(ref_dtype)))

    got = [t.cpu().double() for t in (out, dq, dk, dv, drel)]
    want = reference_in(torch.float64)
    if dtype == torch.float32:
        for name, g, w in zip(NAMES, got, want):
            assert_close(name, g, w, atol=2e-4, rtol=2e-4)
    else:
        for name, g, w, low in zip(NAMES, got, want, reference_in(dtype)):
            assert_close_lowp(name, g, w.detach(), low.detach().double(), atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_varlen_many_tiles(backend, causal):
    """Packed sequences over several query and key tiles (each its own positions), against the
    reference backend."""
    lengths_q, lengths_k = [70, 0, 130, 1], [90, 5, 129, 64]
    H, D = 2, 16
    device = device_for(backend)
    (q, k, v, dout), (cq, ck) = _packed(lengths_q, lengths_k, H, D, torch.float32, device, seed=4)
    table = _table(8, H, device=device, seed=5)
    rel = dict(bidirectional=not causal, relative_attention_max_distance=9)

    def on(name):
        def fn(q, k, v, t):
            with fastformer.use_backend(name):
                return attention_varlen(q, k, v, cq, ck, max(lengths_q), max(lengths_k), is_causal=causal,
                                        scale=D ** -0.5, relative_attention_bias=t, **rel)
        return fn

    got, want = _run(on(backend), q, k, v, table, dout), _run(on("reference"), q, k, v, table, dout)
    for name, g, w in zip(NAMES, got, want):
        assert_close(name, g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", CUDA)
def test_cuda_varlen_hostile_cu_seqlens(backend):
    """cu_seqlens out of range (clamped on the device, never read on the host) with a rel_bias:
    positions from the clamped lengths, and the gradient's bins stay inside its rows."""
    device = device_for(backend)
    H, D, R = 2, 24, 3
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, H, D, generator=gen).to(device) for n in (5, 6, 6))
    rel = torch.randn(H, 2 * R + 1, generator=gen).to(device)
    kern = fastformer.backends.Kernels(backend)
    bad_q = torch.tensor([0, 3, 500], dtype=torch.int32, device=device)   # -> [0, 3), [3, 5)
    bad_k = torch.tensor([-7, 4, 1000], dtype=torch.int32, device=device)  # -> [0, 4), [4, 6)
    args = (bad_q, bad_k, 3, 4, False, 1.0, 0.0, philox.pack(0, 0), rel)
    out, lse = kern.attention_varlen_fwd(q, k, v, *args)
    dq, dk, dv, drel = kern.attention_varlen_bwd(torch.ones_like(out), q, k, v, out, lse, *args)
    good = [cu.to(device) for cu in (torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32))]
    want = kern.attention_varlen_fwd(q, k, v, *good, *args[2:])
    assert torch.equal(out, want[0])
    want = kern.attention_varlen_bwd(torch.ones_like(out), q, k, v, out, lse, *good, *args[2:])
    for g, w in zip((dq, dk, dv, drel), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("R", [128, 1 << 20])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_no_sq_by_sk_buffer(backend, R):
    """With a rel_bias the backward's partial sums are a row of bins per (b, h, query tile): only
    the bins a score can reach (at most Sq + Sk - 1, even for a huge R), nothing of size Sq x Sk."""
    device = device_for(backend)
    B, H, S, D = 1, 1, 1024, 16
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=gen).to(device) for _ in range(4))
    rel = torch.randn(H, 2 * R + 1, generator=gen).to(device)
    square = S * S * 4  # one fp32 Sq x Sk matrix of one head: 4 MiB
    kern = fastformer.backends.Kernels(backend)
    args = (None, None, True, D ** -0.5, 0.0, philox.no_dropout(), rel, 0)

    def run():
        out, lse = kern.attention_fwd(q, k, v, *args)
        return kern.attention_bwd(dout, q, k, v, out, lse, *args)

    grads, peak = peak_allocated(run, device)
    limit = square / 4 + (2 * R + 1) * 4 * H  # the gradient itself is (H, 2R + 1)
    assert 0 < peak < limit, f"{peak} bytes allocated at once; an Sq x Sk fp32 matrix is {square}"
    assert all(torch.isfinite(g).all() for g in grads)


# The rel_bias kernels under the harness's other thread schedules: reverse the cuda tests of this
# file but bf16, warp_ahead (each warp alone to its next __syncthreads: the diagonal sums of the
# dQ kernel read the other warps' slots) the tile-boundary and varlen tests.
SCHEDULE_SUBSETS = {
    "reverse": "cuda and not thread_schedule and not bf16 and not no_sq_by_sk",
    "warp_ahead": "cuda and (tile_boundaries or varlen_many_tiles or deterministic)",
}

test_other_thread_schedule = other_simt_schedules_test(
    ("test_attention_rel_bias.py",), SCHEDULE_SUBSETS,
    "The rel_bias kernels' subset under the harness's other schedules: a missing barrier within a warp's "
    "reach or between warps fails it.")


TRITON = [b for b in BACKENDS if b.values[0] == "triton"]


def _dense_by_distance(rel, Sq, Sk, pos0):
    """(H, Sq, Sk): rel (H, 2R + 1) gathered at clamp(j - i - pos0, -R, R) + R, differentiable."""
    R = (rel.shape[1] - 1) // 2
    i = torch.arange(Sq, device=rel.device)[:, None] + pos0
    j = torch.arange(Sk, device=rel.device)[None, :]
    return rel[:, (j - i).clamp(-R, R) + R]


# (B, Sq, Sk, R, rel_shift, causal, kpm): rows past R on both sides (whole tiles past each clamp,
# the dK/dV programs' window moving over tiles it skipped), R = 0 (one bin for both clamps), a
# negative and a positive shift, R past every distance; 16 x 16 tiles and non-square ones (the
# dK/dV window's width follows the larger side)
TILE_CASES = {
    "clamped_tiles": (2, 45, 45, 3, 0, False, True),
    "one_bin": (1, 40, 40, 0, 0, False, False),
    "decoding_shift": (1, 19, 50, 5, -7, True, False),
    "past_every_distance": (1, 50, 19, 70, 4, False, False),
}


@pytest.mark.parametrize("case, blocks", [
    ("clamped_tiles", (16, 16)), ("clamped_tiles", (16, 32)), ("clamped_tiles", (32, 16)),
    ("one_bin", (16, 32)), ("decoding_shift", (32, 16)), ("past_every_distance", (16, 16)),
], ids=lambda x: x if isinstance(x, str) else f"m{x[0]}n{x[1]}")
@pytest.mark.parametrize("backend", TRITON)
def test_triton_kernels_across_tiles(backend, case, blocks, monkeypatch):
    """The Triton kernels (attention_fwd / attention_bwd with rel_bias, rel_shift) over many tiles
    against the reference with the same bias made dense as an additive mask: every gradient,
    the bias's too, and the bias's gradient bit-equal across runs."""
    A = pytest.importorskip("fastformer.triton_kernels.attention")
    if A.INTERPRET:
        monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", blocks[0])
        monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_N", blocks[1])
    B, Sq, Sk, R, shift, causal, with_kpm = TILE_CASES[case]
    device = device_for(backend)
    q, k, v, dout = _qkv(B, 2, Sq, Sk, 16, device=device)
    rel = (torch.randn(2, 2 * R + 1, generator=torch.Generator().manual_seed(3)) * 0.7).to(device)
    kpm = None
    if with_kpm:
        kpm = torch.zeros(B, Sk, dtype=torch.bool, device=device)
        kpm[-1, Sk - 9:] = True
    rng = philox.pack(0, 0)

    out, lse = A.attention_fwd(q, k, v, kpm, None, causal, 0.5, 0.0, rng, rel, shift)
    dq, dk, dv, drel = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, causal, 0.5, 0.0, rng, rel, shift)
    again = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, causal, 0.5, 0.0, rng, rel, shift)[3]
    assert torch.equal(drel, again)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, rel)]
    bias = _dense_by_distance(leaves[3], Sq, Sk, Sk - Sq + shift)[None].expand(B, -1, -1, -1)
    want = reference.attention(*leaves[:3], key_padding_mask=kpm, attn_mask=bias, is_causal=causal, scale=0.5)
    grads = torch.autograd.grad(want, leaves, dout)
    for name, g, w in zip(NAMES, (out, dq, dk, dv, drel), (want.detach(), *grads)):
        assert_close(name, g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", TRITON)
def test_triton_varlen_across_tiles(backend, causal, small_blocks):
    """Packed sequences spanning several 16-row tiles, R shorter than the rows: each sequence
    equals attention on it alone, the bias's gradient too."""
    lengths_q, lengths_k = [37, 0, 5, 20], [30, 3, 41, 20]
    H, D = 2, 16
    device = device_for(backend)
    (q, k, v, dout), (cq, ck) = _packed(lengths_q, lengths_k, H, D, torch.float32, device)
    table = _table(8, H, device=device)
    rel = dict(bidirectional=not causal, relative_attention_max_distance=6)

    def packed(q, k, v, t):
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, cq, ck, max(lengths_q), max(lengths_k), is_causal=causal, scale=0.5,
                                    relative_attention_bias=t, **rel)

    def per_sequence(q, k, v, t):
        return reference.attention_varlen(q, k, v, cq, ck, max(lengths_q), max(lengths_k), is_causal=causal,
                                          scale=0.5, relative_attention_bias=t, **rel)

    for name, g, w in zip(NAMES, _run(packed, q, k, v, table, dout), _run(per_sequence, q, k, v, table, dout)):
        assert_close(name, g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rel_bias, rel_shift, error, match", [
    (lambda H: torch.zeros(H, 4), 0, ValueError, r"rel_bias must have shape \(H, 2R \+ 1\)"),
    (lambda H: torch.zeros(H + 1, 5), 0, ValueError, r"rel_bias must have shape \(H, 2R \+ 1\)"),
    (lambda H: torch.zeros(H, 5, dtype=torch.float64), 0, TypeError, "rel_bias must be float32"),
    (lambda H: torch.zeros(5, H).t(), 0, ValueError, "rel_bias must be contiguous"),
    (lambda H: torch.zeros(H, 5), 1 << 31, ValueError, r"rel_shift must be in \[-2\^30, 2\^30\]"),
])
@pytest.mark.parametrize("backend", TRITON)
def test_triton_checks_name_the_bad_rel_bias(backend, rel_bias, rel_shift, error, match):
    device = device_for(backend)
    q, k, v, _ = _qkv(1, 2, 4, 4, 8, device=device)
    kern = fastformer.backends.Kernels(backend)
    with pytest.raises(error, match=match):
        kern.attention_fwd(q, k, v, None, None, False, 1.0, 0.0, philox.pack(0, 0), rel_bias(2).to(device), rel_shift)


@pytest.mark.parametrize("backend", TRITON)
def test_triton_registered_ops_opcheck_with_rel_bias(backend):
    """Schema, fake and dispatch of the Triton ops given a rel_bias (the backward's fourth result
    its gradient), padded and packed."""
    A = pytest.importorskip("fastformer.triton_kernels.attention")
    V = pytest.importorskip("fastformer.triton_kernels.attention_varlen")
    device = device_for(backend)
    q, k, v, dout = _qkv(1, 2, 5, 7, 16, device=device)
    rel = torch.randn(2, 7, device=device)
    fwd_args = (q, k, v, None, None, True, 0.5, 0.0, philox.pack(0, 0), rel, 3)
    torch.library.opcheck(A.attention_fwd.op, fwd_args)
    out, lse = A.attention_fwd(*fwd_args)
    torch.library.opcheck(A.attention_bwd.op, (dout, q, k, v, out, lse, *fwd_args[3:]))
    (q, k, v, dout), (cq, ck) = _packed([3, 4], [5, 2], 2, 16, torch.float32, device)
    args = (q, k, v, cq, ck, 4, 5, False, 0.5, 0.0, philox.pack(0, 0), rel)
    torch.library.opcheck(V.attention_varlen_fwd.op, args)
    out, lse = V.attention_varlen_fwd(*args)
    torch.library.opcheck(V.attention_varlen_bwd.op, (dout, q, k, v, out, lse, *args[3:]))


@pytest.mark.parametrize("backend", TRITON)
def test_triton_aot_specs_cover_the_bias_launches(backend):
    """Every (dtype, BLOCK_D bucket, kernel, autotune config) a launch with a rel_bias can take has
    an ahead-of-time spec of the "rel" class, padded and packed, with the bias's pointers typed."""
    A = pytest.importorskip("fastformer.triton_kernels.attention")
    V = pytest.importorskip("fastformer.triton_kernels.attention_varlen")
    for module, prefix, varlen in ((A, "attention", False), (V, "attention_varlen", True)):
        specs = {s["name"]: s for s in module.aot_specs()}
        # the backward: dK/dV making dQ too (FUSED_DQ, padded and packed), or dK/dV then dQ
        bwd = ("dkdv_dq",) if A.FUSED_DQ else ("dkdv", "dq")
        for dtype, ptr in A._PTR.items():
            elt = torch.empty((), dtype=dtype).element_size()
            for block_d in A.BLOCK_D_BUCKETS:
                for kind in ("fwd", *bwd):
                    for cfg in A._configs(kind, block_d, elt, True, varlen, True):
                        name = (f"{prefix}_{kind.replace('_', '')}_{ptr[1:]}_d{block_d}_rel"
                                f"_m{cfg.kwargs['BLOCK_M']}_n{cfg.kwargs['BLOCK_N']}_w{cfg.num_warps}"
                                f"_s{cfg.num_stages}")
                        spec = specs[name]
                        assert spec["constexprs"]["HAS_REL"] and spec["signature"]["RelBias"] == "*fp32"
                        assert not kind.startswith("dkdv") or spec["signature"]["DRel"] == "*fp32"


@pytest.mark.parametrize("backend", TRITON)
def test_triton_first_choice_tiles(backend, monkeypatch):
    """The interpreter runs the kernels' first-choice GPU tiles of a launch with a bias (fp32 d128:
    dK/dV and dQ 16 x 16, fwd 16 x 32; attention._CONFIGS_FP32's heavy class), lengths ending mid-tile, R shorter
    than the rows, a shift: the bias's gradient sized for and summed over those tiles."""
    A = pytest.importorskip("fastformer.triton_kernels.attention")
    if not A.INTERPRET:
        pytest.skip("the interpreter alone runs a fixed config; a GPU autotunes")
    monkeypatch.setattr(A, "INTERPRET_FIRST_CHOICE", True)
    used = []
    first = A._first_config
    monkeypatch.setattr(A, "_first_config", lambda kind, *a: used.append((kind, *a)) or first(kind, *a))
    Sq, Sk, D, R, shift = 21, 37, 100, 6, 2
    q, k, v, dout = _qkv(1, 1, Sq, Sk, D, device=device_for(backend), seed=5)
    rel = torch.randn(1, 2 * R + 1, generator=torch.Generator().manual_seed(6))
    rng = philox.pack(0, 0)
    out, lse = A.attention_fwd(q, k, v, None, None, True, 0.1, 0.0, rng, rel, shift)
    dq, dk, dv, drel = A.attention_bwd(dout, q, k, v, out, lse, None, None, True, 0.1, 0.0, rng, rel, shift)
    bwd = ["dkdv_dq"] if A.FUSED_DQ else ["dkdv", "dq"]  # dK/dV making dQ too (the default), or two kernels
    assert [u[0] for u in used] == ["fwd", *bwd] and all(u[5] for u in used), used  # rel's configs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, rel)]
    bias = _dense_by_distance(leaves[3], Sq, Sk, Sk - Sq + shift)[None]
    want = reference.attention(*leaves[:3], attn_mask=bias, is_causal=True, scale=0.1)
    for name, g, w in zip(NAMES, (out, dq, dk, dv, drel), (want.detach(), *torch.autograd.grad(want, leaves, dout))):
        assert_close(name, g, w, atol=1e-4, rtol=1e-4)
