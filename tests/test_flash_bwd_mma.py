"""The tensor-core flash attention backward (csrc/cuda/flash_bwd_mma.cu on mma.sync m16n8k16,
ldmatrix, cp.async: the one-kernel backward at every head dim, its dQ added in key-block order, the
dK / dV and dQ kernels for the plain-load variant at D 64) against the gradients of fastformer/ops/reference.py::
attention, on the SIMT harness through its test op fastformer_simt_selftest::flash_bwd_mma (fed
the tensor-core forward's out and lse), and the attention op's `cuda` backend, whose 16-bit
backward runs on it wherever it takes the call.

bf16 and fp16; Sq != Sk both ways across one to three tiles; head dims 40, 59, 64, 80, 111, 128,
200, 256 (every bucket; 59 and 111 have rows that are not 16-byte aligned: the plain-load
variant, and odd D: gradients stored element by element); causal (bottom-right), key padding
with fully padded batches, additive / -inf masks with broadcasting, rows with no visible key
(zero gradients), NaN in q, dropout with the forward's Philox bits, strided views. Low precision
by FlashAttention's rule (test_flash_mma.check): the error against the fp32 reference's gradient
at most twice that of the reference computed in the 16-bit dtype, plus a small floor. Parts of
the file run again under the harness's reverse and warp_ahead schedules (tests/simt/simt.h).

Mutations tried by hand (each must fail the file; failing tests of its 60-62 under the default
schedule, routing tests aside): P's A fragment with a[1] and a[2] swapped in dV fails 54; the
causal test of the dK dV kernel off by one (j < i + Sk - Sq) 36; its dropout bytes of the two
8-key halves swapped 6 (every dropout test); Dsum left out of dS 59; the .trans ldmatrix parity
of K in the dQ kernel 59; the dQ kernel's dropout bit of the wrong key 6, its causal limit one
key short 35, its lse left in the natural-log domain 59. Deleting the __syncthreads that ends a
tile (a stage refilled while another warp reads it) in either kernel, or the dK dV kernel's one
after its cp.async wait, passes the default and reverse schedules and fails under warp_ahead and
warp_ahead_reverse (test_other_thread_schedules). The one-kernel backward: its dS^T words of
queries 16 kk + 2 t and 16 kk + 8 + 2 t swapped fails 61 (every D <= 128 case, before D 256 ran
here); its dQ phase at D 256 over 2 of its 4 head-dim chunks fails 7 (test_head_dims d200 / d256,
test_dq_from_many_key_blocks at D 200 / 256); the counter released as n instead of n + 1 (the
next key block would wait forever) stops the launch in test_dq_from_many_key_blocks and
test_the_backward_is_deterministic. The D 256 split of S^T / dP^T over a key group's two warps
(its partial sums exchanged through shared memory): the warp's own slot read instead of its
partner's fails 20 of the D 200 / 256 tests here and in the varlen file (the two-kernel ones
too), the exchange barrier left out 23, the __syncwarp before dS^T overwrites the slot 20; dS^T
put in the slot its partner reads fails only test_other_thread_schedules[warp_ahead] (both
files). (The dQ kernel's mutations above date from when it ran at
D 256 too; it now runs only for the plain-load variant at D 64.) A missing __threadfence or
a wait on the wrong key block is not visible here (blocks run one at a time, in order): the GPU
run of test_the_backward_is_deterministic (device cuda) and tests/test_cuda_sass_bwd.py cover
those."""
import math
import os

import pytest
import torch

from fastformer.ops import reference
from simt import plugin
from test_flash_mma import DT_IDS, DTYPES, check, flash

pytestmark = pytest.mark.skipif(plugin.load_error() is not None, reason=str(plugin.load_error()))


def flash_bwd(dout, q, k, v, out, lse, kpm=None, am=None, causal=False, scale=None, p=0.0, seed=0, offset=0,
              two_kernels=False):
    """two_kernels: no dQ workspace, so the two-kernel backward (dK dV kernel, dQ kernel) runs at
    any head dim, as for a caller that gives none."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.fastformer_simt_selftest.flash_bwd_mma(dout, q, k, v, out, lse, kpm, am, causal, scale,
                                                            p, seed, offset, two_kernels)


def ref_grads(qkv, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = reference.attention(*leaves, **kw)
    return torch.autograd.grad(out, leaves, dout)


def run_case(dtype, B, H, Sq, Sk, D, causal=False, kpm=None, am=None, p=0.0, scale=None, qkv=None,
             dout=None, seed=1234, offset=0, atol=2e-3, two_kernels=False):
    """The kernels' dq, dk, dv for the tensor-core forward's out / lse, checked against the
    reference's gradients (fp32 and in dtype); returns them."""
    if qkv is None:
        qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    if dout is None:
        dout = torch.randn(B, H, Sq, D).to(dtype)
    q, k, v = qkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kw = dict(key_padding_mask=kpm, attn_mask=am, is_causal=causal, scale=scale, dropout_p=p,
              rng=(seed, offset))
    out, lse = flash(q, k, v, kpm, am, causal, scale, p, seed, offset)  # the forward's dropout bits (v3)
    grads = flash_bwd(dout, q, k, v, out, lse, kpm, am, causal, scale, p, seed, offset, two_kernels)
    want32 = ref_grads([t.float() for t in qkv], dout.float(), **kw)
    want16 = ref_grads(qkv, dout, **kw)
    for name, got, w32, w16 in zip(("dq", "dk", "dv"), grads, want32, want16):
        assert got.dtype == dtype
        check(name, got, w32, w16, atol=atol)
    return grads


# ---------------------------------------------------------------- shapes, head dims, causal
SHAPES = [(64, 64), (7, 130), (113, 7), (130, 113), (1, 70)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", SHAPES, ids=[f"q{a}k{b}" for a, b in SHAPES])
def test_shapes(dtype, causal, Sq, Sk):
    run_case(dtype, 1, 2, Sq, Sk, 64, causal=causal)


HEAD_DIMS = [40, 59, 80, 111, 128, 200, 256]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_head_dims(dtype, D):
    """Every bucket (64: 40, 59; 128: 80, 111, 128; 256: 200, 256), several query and key tiles,
    causal with Sq < Sk (the diagonal crosses tiles)."""
    run_case(dtype, 1, 1, 70, 100, D, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_values_far_from_one_and_a_large_scale(dtype):
    B, H, Sq, Sk, D = 1, 1, 64, 100, 64
    q = (torch.randn(B, H, Sq, D) * 3).to(dtype)
    k = (torch.randn(B, H, Sk, D) * 3 * torch.linspace(0.2, 2.0, Sk)[:, None]).to(dtype)
    v = (torch.randn(B, H, Sk, D) * 10).to(dtype)
    run_case(dtype, B, H, Sq, Sk, D, qkv=[q, k, v], scale=0.5, atol=1e-2)


# ---------------------------------------------------------------- masks and rows that see nothing
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_padding_with_fully_padded_batch(dtype, causal):
    B, H, Sq, Sk = 3, 1, 70, 100
    kpm = torch.rand(B, Sk) < 0.3
    kpm[1] = True       # batch 1 sees nothing: every gradient 0
    kpm[2, :70] = True  # batch 2: the first key block entirely padded
    dq, dk, dv = run_case(dtype, B, H, Sq, Sk, 64, causal=causal, kpm=kpm)
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[2, :, :70] == 0).all() and (dv[2, :, :70] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_causal_rows_with_no_visible_key(dtype):
    """Sq > Sk bottom-right: the first Sq - Sk rows see no key (a whole 64-row block sees none):
    their dq is 0."""
    dq, dk, dv = run_case(dtype, 1, 2, 130, 7, 40, causal=True)
    assert (dq[:, :, :123] == 0).all() and (dq[:, :, 123:] != 0).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_additive_mask_broadcast_with_minus_inf(dtype):
    B, H, Sq, Sk = 2, 2, 70, 100
    am = torch.randn(1, H, Sq, Sk)  # broadcast over the batch (stride 0)
    am[0, 0, :, 50:] = float("-inf")
    am[0, 1, 5] = float("-inf")  # a row that sees nothing
    dq, dk, dv = run_case(dtype, B, H, Sq, Sk, 64, am=am, causal=True)
    assert (dq[:, 1, 5] == 0).all()
    assert (dk[:, 0, 50:] == 0).all() and (dv[:, 0, 50:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_bool_mask_as_additive_per_query_broadcast(dtype):
    B, H, Sq, Sk = 2, 1, 64, 100
    bool_mask = torch.rand(B, 1, 1, Sk) < 0.4
    am = torch.zeros(B, 1, 1, Sk).masked_fill(bool_mask, float("-inf"))
    run_case(dtype, B, H, Sq, Sk, 128, am=am)


# ---------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nan_in_q_poisons_what_the_reference_poisons(dtype):
    """A NaN in query row 3 of head 1: its dq row, and dk / dv of that head, NaN as the
    reference's (its probability row is NaN at every key); head 0 stays finite."""
    B, H, Sq, Sk, D = 1, 2, 40, 64, 64
    qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    qkv[0][0, 1, 3, 5] = float("nan")
    dq, dk, dv = run_case(dtype, B, H, Sq, Sk, D, qkv=qkv)
    assert dq[0, 1, 3].isnan().all() and dk[0, 1].isnan().all() and dv[0, 1].isnan().all()
    assert torch.isfinite(dq[0, 0]).all() and torch.isfinite(dk[0, 0]).all()


# ---------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D,Sq,Sk,causal", [(64, 70, 130, True), (256, 33, 75, False), (59, 100, 7, False)])
def test_dropout_drops_what_the_reference_drops(dtype, D, Sq, Sk, causal):
    grads = run_case(dtype, 1, 2, Sq, Sk, D, causal=causal, p=0.3, seed=987654321, offset=77)
    # the reference with another seed is far off: the bits matter
    torch.manual_seed(0)
    qkv = [torch.randn(1, 2, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    dout = torch.randn(1, 2, Sq, D).to(dtype)
    out, lse = flash(*qkv, causal=causal, p=0.3, seed=5, offset=77)
    dq, _, dv = flash_bwd(dout, *qkv, out, lse, causal=causal, p=0.3, seed=5, offset=77)
    other = ref_grads([t.float() for t in qkv], dout.float(), is_causal=causal, dropout_p=0.3, rng=(6, 77))
    assert (dv.float() - other[2]).abs().max() > 0.05
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- the one-kernel backward's dQ
# key blocks (64 keys at D <= 128, 32 at D 256) each add their partial dQ of a query tile (64
# queries at D 64, 32 at D 128 and 256) to an fp32 accumulator in key-block order; the last one
# writes dq
MANY = [(64, 70, 330, False, 0.0), (64, 130, 330, True, 0.2), (128, 40, 300, True, 0.0),
        (128, 75, 200, False, 0.2), (40, 200, 140, True, 0.0), (256, 40, 150, True, 0.2),
        (256, 70, 100, False, 0.0), (200, 90, 40, True, 0.0)]


@pytest.mark.parametrize("D,Sq,Sk,causal,p", MANY, ids=[f"d{m[0]}-q{m[1]}k{m[2]}-{'causal' if m[3] else 'full'}"
                                                        + ("-drop" if m[4] else "") for m in MANY])
def test_dq_from_many_key_blocks(D, Sq, Sk, causal, p):
    """Up to 6 key blocks add to one query tile (causal: the prefix that sees it, the tiles before
    the first key block's first one written 0), with and without dropout."""
    dq, _, _ = run_case(torch.bfloat16, 1, 2, Sq, Sk, D, causal=causal, p=p, seed=31, offset=5)
    if causal and Sq > Sk:
        assert (dq[:, :, :Sq - Sk] == 0).all()


# the two-kernel backward where the one kernel runs (a caller that gives no dQ workspace): its dK
# dV kernel at D 256 splits S^T and dP^T over the two warps of a key group as the one kernel does
TWO = [(256, 70, 100, True, 0.2, False), (200, 40, 75, False, 0.0, True), (128, 70, 100, True, 0.0, False)]


@pytest.mark.parametrize("D,Sq,Sk,causal,p,kpm", TWO, ids=[f"d{m[0]}-q{m[1]}k{m[2]}-{'causal' if m[3] else 'full'}"
                                                          + ("-drop" if m[4] else "") + ("-kpm" if m[5] else "")
                                                          for m in TWO])
def test_the_two_kernel_backward(D, Sq, Sk, causal, p, kpm):
    mask = None
    if kpm:
        mask = torch.rand(2, Sk, generator=torch.Generator().manual_seed(4)) < 0.3
        mask[1, :40] = True  # batch 1: the first key block entirely padded
    run_case(torch.bfloat16, 2 if kpm else 1, 2, Sq, Sk, D, causal=causal, kpm=mask, p=p, seed=9, offset=3,
             two_kernels=True)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here: the harness run (cpu) only"))])
def test_the_backward_is_deterministic(device, D):
    """Two runs of the attention op's backward (cuda backend: the one-kernel backward, several key
    blocks a query tile, causal, dropout) give the same bits. On a GPU (device cuda, many blocks
    at once) this is the ordered dQ adds; on the harness (blocks run in order) it catches a
    dependence on the accumulator's contents before key block 0 writes them."""
    import fastformer
    from fastformer.ops import attention

    B, H, Sq, Sk = (1, 2, 100, 260 if D == 64 else 130) if device == "cpu" else (4, 8, 1000, 1100)
    g = torch.Generator().manual_seed(11)
    qkv = [torch.randn(B, H, S, D, generator=g).to(torch.bfloat16).to(device) for S in (Sq, Sk, Sk)]
    dout = torch.randn(B, H, Sq, D, generator=g).to(torch.bfloat16).to(device)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in qkv]
        torch.manual_seed(7)  # the same dropout bits both times
        with fastformer.use_backend("cuda"):
            out = attention(*leaves, is_causal=True, dropout_p=0.1)
        runs.append(torch.autograd.grad(out, leaves, dout))
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two runs"
    assert (runs[0][0] != 0).any()


# ---------------------------------------------------------------- layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D,aligned", [(40, True), (40, False)], ids=["d40-aligned", "d40-offset"])
def test_strided_views(dtype, D, aligned):
    """q / k / v / dout as (B, S, H, D)-major views; with `aligned` False a one-element offset
    into a wider last dim (rows not 16-byte aligned): the same bits as contiguous copies."""
    B, H, Sq, Sk = 1, 2, 70, 100
    lo = 0 if aligned else 1

    def view(S):
        return torch.randn(B, S, H, D + 8).to(dtype)[..., lo:lo + D].transpose(1, 2)

    qkv, dout = [view(Sq), view(Sk), view(Sk)], view(Sq)
    grads = run_case(dtype, B, H, Sq, Sk, D, causal=True, qkv=qkv, dout=dout)
    qc, kc, vc, dc = (t.contiguous() for t in (*qkv, dout))
    out, lse = flash(qc, kc, vc, causal=True)
    for g, gc in zip(grads, flash_bwd(dc, qc, kc, vc, out, lse, causal=True)):
        assert torch.equal(g, gc)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_no_queries_or_no_keys(dtype):
    """Sq = 0: dk and dv are written as zeros (nothing flows); Sk = 0: dq is zeros."""
    kv = torch.randn(1, 2, 70, 64).to(dtype)
    q = torch.randn(1, 2, 0, 64).to(dtype)
    dq, dk, dv = flash_bwd(q, q, kv, kv, q, torch.zeros(1, 2, 0))
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
    q = torch.randn(1, 2, 70, 64).to(dtype)
    kv = torch.randn(1, 2, 0, 64).to(dtype)
    dq, dk, dv = flash_bwd(q, q, kv, kv, q, torch.full((1, 2, 70), float("inf")))
    assert (dq == 0).all() and dk.shape == kv.shape


def _workspace(D, Sq, Sk, offset=0, B=2, H=3):
    """The dQ workspace (fp32 floats, counters) the glue allocates for a call; q, k, v, dout with
    rows `offset` elements into a wider last dim (offset 1: rows not 16-byte aligned)."""
    def t(S):
        return torch.zeros(B, H, S, D + 8, dtype=torch.bfloat16)[..., offset:offset + D]

    return list(torch.ops.fastformer_simt_selftest.flash_bwd_mma_workspace(t(Sq), t(Sq), t(Sk), t(Sk), False))


def test_the_dq_workspace_only_where_the_one_kernel_backward_runs():
    """One fp32 (BM x kD) accumulator tile and a counter a (b, h, query tile) for the one-kernel
    backward (BM 64 at D <= 64, 32 at D 128 and 256: flash_bwd_mma.md); none (no allocation, no
    memset launch) where the two kernels run: the plain-load variant at D <= 64, Sq or Sk 0."""
    B, H = 2, 3
    for D, kD, BM in ((40, 64, 64), (64, 64, 64), (128, 128, 32), (200, 256, 32), (256, 256, 32)):
        tiles = B * H * -(-100 // BM)
        assert _workspace(D, 100, 70) == [tiles * BM * kD, tiles], f"D {D}"
    assert _workspace(111, 100, 70, offset=1) == [B * H * 4 * 32 * 128, B * H * 4]  # plain loads, one kernel
    assert _workspace(64, 100, 70, offset=1) == [0, 0]  # plain-load variant at D 64: two kernels
    assert _workspace(64, 100, 0) == [0, 0] and _workspace(256, 0, 70) == [0, 0]


def test_rejects_float32_and_head_dims_past_256():
    q = torch.randn(1, 1, 8, 64)
    lse = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match=r"flash_bwd_mma: dtype must be 1 \(float16\) or 2 \(bfloat16\)"):
        flash_bwd(q, q, q, q, q, lse)
    q = torch.randn(1, 1, 8, 264).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"flash_bwd_mma: head dim must be in \[1, 256\]"):
        flash_bwd(q, q, q, q, q, lse)


def test_a_wrong_gradient_would_fail_these_checks():
    """The rule is not vacuous: dk from the keys in another order, or dq with the scale off by
    2 %, fails it."""
    dtype, B, H, Sq, Sk, D = torch.bfloat16, 1, 2, 64, 100, 64
    qkv = [torch.randn(B, H, S, D).to(dtype) for S in (Sq, Sk, Sk)]
    dout = torch.randn(B, H, Sq, D).to(dtype)
    q, k, v = qkv
    want32 = ref_grads([t.float() for t in qkv], dout.float())
    want16 = ref_grads(qkv, dout)
    out, lse = flash(q, k, v)
    dq, dk, _ = flash_bwd(dout, q, k, v, out, lse)
    check("dq", dq, want32[0], want16[0], atol=2e-3)
    with pytest.raises(AssertionError):
        check("dk", dk.flip(2), want32[1], want16[1], atol=2e-3)
    out, lse = flash(q, k, v, scale=1.02 / math.sqrt(D))
    with pytest.raises(AssertionError):
        check("dq", flash_bwd(dout, q, k, v, out, lse, scale=1.02 / math.sqrt(D))[0], want32[0], want16[0],
              atol=2e-3)


# ---------------------------------------------------------------- the attention op's routing
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_the_attention_op_runs_16_bit_backwards_here(dtype):
    """fastformer.ops.attention's backward on the cuda backend gives this kernel's bits for a
    16-bit input (key padding, causal, a per-key additive mask), and falls back to the FMA
    kernels, still within the rule, for an attn_mask without a unit key stride."""
    import fastformer
    from fastformer.ops import attention

    B, H, Sq, Sk, D = 2, 2, 70, 100, 40
    g = torch.Generator().manual_seed(3)
    qkv = [torch.randn(B, H, S, D, generator=g).to(dtype) for S in (Sq, Sk, Sk)]
    dout = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[1, 90:] = True
    am = torch.randn(1, 1, Sq, Sk, generator=g)
    leaves = [t.clone().requires_grad_() for t in qkv]
    with fastformer.use_backend("cuda"):
        out = attention(*leaves, key_padding_mask=kpm, attn_mask=am, is_causal=True)
    got = torch.autograd.grad(out, leaves, dout)
    fout, lse = flash(*qkv, kpm=kpm, am=am, causal=True)
    assert torch.equal(out.detach(), fout)
    want = flash_bwd(dout, *qkv, fout, lse, kpm=kpm, am=am, causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: the op's backward is not the tensor-core kernel's"

    per_query = torch.randn(1, 1, Sq, 1, generator=g)  # key stride 0: not this kernel's layout
    leaves = [t.clone().requires_grad_() for t in qkv]
    with fastformer.use_backend("cuda"):
        out = attention(*leaves, key_padding_mask=kpm, attn_mask=per_query)
    got = torch.autograd.grad(out, leaves, dout)
    kw = dict(key_padding_mask=kpm, attn_mask=per_query)
    want32 = ref_grads([t.float() for t in qkv], dout.float(), **kw)
    want16 = ref_grads(qkv, dout, key_padding_mask=kpm, attn_mask=per_query.to(dtype))
    for name, a, w32, w16 in zip(("dq", "dk", "dv"), got, want32, want16):
        check(name, a, w32, w16, atol=2e-3)


# ---------------------------------------------------------------- the other thread orders
_OTHER_SCHEDULE = os.environ.get("FF_SIMT_SCHEDULE", "") not in ("", "forward")


@pytest.mark.skipif(_OTHER_SCHEDULE, reason="another schedule already, not from within it")
@pytest.mark.parametrize("schedule", ["reverse", "warp_ahead", "warp_ahead_reverse"])
def test_other_thread_schedules(schedule):
    """The same kernels with the harness's threads last to first, and with each warp run alone to
    its next __syncthreads (first or last warp first): a missing barrier between warps (a stage
    refilled while another warp reads it, tile copies not yet visible) fails this subset."""
    plugin.rerun_under(os.path.abspath(__file__), schedule,
                       "(test_head_dims and bf16 and (d59 or d111 or d256)) or (test_dropout and bf16 and d64) "
                       "or (test_key_padding and bf16 and full) or test_no_queries_or_no_keys "
                       "or (test_dq_from_many_key_blocks and causal) or (test_the_two_kernel_backward and d256)")
