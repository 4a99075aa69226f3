"""The Triton varlen attention beyond tests/test_attention_varlen.py: it runs the padded op's
kernels with VARLEN, so here what is its own: the launch grids (over the longest sequence, B
entries, early exit past a sequence's end), sequences spanning many tiles of every shape the GPU
runs first (BLOCK_M != BLOCK_N), dropout on 64-bit counters with a max_seqlen above the longest
sequence (the padded op's rows), row-strided packed inputs (views of a (total, 3, H, D)
projection), clamped cu_seqlens, int64 offsets, the registered ops (opcheck, torch.compile) and
the ahead-of-time compile specs.

Without a GPU everything runs in Triton's interpreter on CPU tensors (tests/conftest.py)."""
import math

import pytest
import torch

from fastformer import philox
from fastformer.ops import reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends, spy_launches

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
V = pytest.importorskip("fastformer.triton_kernels.attention_varlen", reason="triton is not installed")
DEVICE = device_for("triton")

TOL = {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)}  # fp32 (atol, rtol), as the padded op's
LOWP_FACTOR = 2.0


def _cu(lengths):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=DEVICE)


def _inputs(H, D, lq, lk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lq), H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    return q, k, v, dout


def _kernels(q, k, v, dout, lq, lk, causal, scale, p=0.0, seed=0, offset=0, max_q=None, max_k=None,
             cu_q=None, cu_k=None):
    cu_q = _cu(lq) if cu_q is None else cu_q
    cu_k = _cu(lk) if cu_k is None else cu_k
    max_q = max(lq, default=0) if max_q is None else max_q
    max_k = max(lk, default=0) if max_k is None else max_k
    lengths = (cu_q, cu_k, max_q, max_k)
    out, lse = V.attention_varlen_fwd(q, k, v, *lengths, causal, scale, p, philox.pack(seed, offset))
    dq, dk, dv, _ = V.attention_varlen_bwd(dout, q, k, v, out, lse, *lengths, causal, scale, p, philox.pack(seed, offset))
    return out, lse, dq, dk, dv


def _reference(q, k, v, dout, lq, lk, causal, scale, p=0.0, seed=0, offset=0, max_q=None, max_k=None,
               dtype=torch.float32):
    """The reference's output and gradients (from the inputs cast to ``dtype``) and, computed
    here per sequence, the lse (H, total_q): +inf for a row that sees no key."""
    max_q = max(lq, default=0) if max_q is None else max_q
    max_k = max(lk, default=0) if max_k is None else max_k
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
    out = reference.attention_varlen(*leaves, _cu(lq).cpu(), _cu(lk).cpu(), max_q, max_k, is_causal=causal,
                                     scale=scale, dropout_p=p, rng=(seed, offset))
    grads = torch.autograd.grad(out, leaves, dout.cpu().to(dtype))
    H = q.shape[1]
    lse = torch.full((H, sum(lq)), float("inf"))
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        if lq[b] == 0 or lk[b] == 0:
            continue
        qb = q[cq[b]:cq[b + 1]].cpu().double().transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].cpu().double().transpose(0, 1)
        s = qb @ kb.transpose(-2, -1) * scale
        if causal:
            i, j = torch.arange(lq[b])[:, None], torch.arange(lk[b])[None, :]
            s = s.masked_fill(j > i + lk[b] - lq[b], float("-inf"))
        row = torch.logsumexp(s, -1).float()
        lse[:, cq[b]:cq[b + 1]] = torch.where(torch.isneginf(row), torch.full_like(row, float("inf")), row)
    return (out.detach(), lse, *grads)


def _lowp_out_delta_terms(q, k, v, dout, lq, lk, causal, scale, p=0.0, seed=0, offset=0, dtype=torch.bfloat16):
    """What the backward's ``delta = rowsum(dO * O)`` taken from the output rounded to ``dtype`` adds
    to dQ and dK, in fp64 (FlashAttention's form, the kernels': the op returns O in q's dtype and
    the backward gets only that; PyTorch's autograd of the reference instead sums dP * P in fp32
    and never sees O rounded). With eps = rowsum(dO * (O_lowp - O)) per query row, dS = P * (Z dP -
    delta) moves by -P eps (P the softmax before dropout), so dQ by -scale eps (P K) and dK by
    -scale P^T (eps q): two dropout-free reference calls."""
    x = [t.detach().cpu().double() for t in (q, k, v, dout)]
    lengths = (_cu(lq).cpu(), _cu(lk).cpu(), max(lq, default=0), max(lk, default=0))
    out = reference.attention_varlen(*x[:3], *lengths, is_causal=causal, scale=scale, dropout_p=p,
                                     rng=(seed, offset))
    eps = (x[3] * (out.to(dtype).double() - out)).sum(-1, keepdim=True)  # (total_q, H, 1)
    pk = reference.attention_varlen(x[0], x[1], x[1], *lengths, is_causal=causal, scale=scale)  # P K
    values = x[2].clone().requires_grad_()
    plain = reference.attention_varlen(x[0], x[1], values, *lengths, is_causal=causal, scale=scale)
    return -scale * eps * pk, -scale * torch.autograd.grad(plain, values, eps * x[0])[0]


def _check_fp32(got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.cpu()
        assert torch.equal(torch.isfinite(g), torch.isfinite(w)), f"{name}: non-finite entries differ"
        atol, rtol = TOL["out"] if name in ("out", "lse") else TOL["grad"]
        assert_close(name, g, w, atol=atol, rtol=rtol)


# (H, D, query lengths, key lengths): several tiles of 16, empty sequences, Lq > Lk and Lq < Lk.
LENGTHS = (2, 24, [37, 0, 5, 16, 50], [20, 9, 0, 16, 61])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequences_spanning_many_tiles(causal, small_blocks):
    H, D, lq, lk = LENGTHS
    q, k, v, dout = _inputs(H, D, lq, lk, seed=int(causal))
    _check_fp32(_kernels(q, k, v, dout, lq, lk, causal, 0.3), _reference(q, k, v, dout, lq, lk, causal, 0.3))


@pytest.mark.parametrize("seed, offset", [(2**62 + 12345, 2**32 - 1000), (7, 3 * 2**31 + 5)])
def test_dropout_on_the_padded_ops_counters(seed, offset, small_blocks):
    """Sequence b's rows take the padded op's counters on (B, H, max_seqlen_q, max_seqlen_k), here
    with bounds above the longest lengths (a longer dropout row and more rows per head) and
    offsets that cross 2**32 inside the tensor."""
    H, D, lq, lk = LENGTHS
    q, k, v, dout = _inputs(H, D, lq, lk, seed=5)
    bounds = dict(max_q=max(lq) + 3, max_k=max(lk) + 9)
    got = _kernels(q, k, v, dout, lq, lk, True, 0.2, 0.3, seed, offset, **bounds)
    _check_fp32(got, _reference(q, k, v, dout, lq, lk, True, 0.2, 0.3, seed, offset, **bounds))
    plain = _kernels(q, k, v, dout, lq, lk, True, 0.2, 0.3, seed, offset)
    assert (got[0] - plain[0]).abs().max() > 1e-2, "max_seqlen_k did not move the dropout rows"


@pytest.mark.parametrize("heavy", [False, True], ids=["causal", "causal_dropout"])
@pytest.mark.parametrize("D", [20, 100, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_first_choice_tiles_against_reference(monkeypatch, dtype, D, heavy):
    """Each kernel's first-choice GPU config (attention._configs(...)[0], mostly BLOCK_M != BLOCK_N),
    the specialisation the AOT test compiles, on lengths that end mid-tile."""
    if not A.INTERPRET:
        pytest.skip("the interpreter alone runs a fixed config; a GPU autotunes")
    monkeypatch.setattr(A, "INTERPRET_FIRST_CHOICE", True)
    lq, lk = [37, 3, 0], [53, 70, 4]
    q, k, v, dout = _inputs(1, D, lq, lk, dtype=dtype, seed=D)
    p, seed, offset = (0.2, 2**35 + 7, 2**32 - 11) if heavy else (0.0, 0, 0)
    scale = 1.0 / math.sqrt(D)
    got = _kernels(q, k, v, dout, lq, lk, True, scale, p, seed, offset)
    want32 = _reference(q, k, v, dout, lq, lk, True, scale, p, seed, offset)
    if dtype == torch.float32:
        _check_fp32(got, want32)
        return
    wantlp = _reference(q, k, v, dout, lq, lk, True, scale, p, seed, offset, dtype=dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name == "lse":
            assert_close(name, got[i].cpu(), want32[i], atol=1e-2, rtol=1e-2)
        else:
            assert got[i].dtype == dtype, name
            assert_close_lowp(name, got[i].cpu().float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


@pytest.fixture
def fused_kinds(monkeypatch, small_blocks):
    """FUSED_DQ on, 16 x 16 tiles in the interpreter (several key tiles add to each query tile);
    the gradients start as NaN (dq is torch.empty on a GPU: a row no key block writes must not
    pass by luck); yields the kinds of the kernels each backward launches."""
    monkeypatch.setattr(A, "FUSED_DQ", True)
    grad_like = A._grad_like
    monkeypatch.setattr(A, "_grad_like", lambda x: grad_like(x).fill_(float("nan")))
    yield spy_launches(monkeypatch, A)


# (H, D, query lengths, key lengths, causal, dropout p), all with 16 x 16 tiles: sequences with
# Lk = 0 and Lq > 0 (no key block: key block 0 zeroes their dQ rows), causal Lq > Lk (query tiles
# no key block sees: zeroed too), 2-4 key tiles a query tile, dropout on the padded op's counters
FUSED_CASES = {
    "lk0_full": (2, 16, [20, 7, 33], [0, 12, 40], False, 0.0),
    "lk0_causal_dropout": (1, 24, [18, 0, 5, 40], [45, 9, 0, 0], True, 0.2),
    "causal_lq_gt_lk": (2, 16, [70, 3, 50], [20, 3, 33], True, 0.0),
    "causal_lq_lt_lk_dropout": (1, 32, [30, 17], [64, 50], True, 0.3),
    "full_dropout": (2, 16, [37, 16], [61, 49], False, 0.25),
}


@pytest.mark.parametrize("case", list(FUSED_CASES), ids=list(FUSED_CASES))
def test_fused_dq_matches_reference(case, fused_kinds):
    """dQ made in the dK/dV kernel (no dQ launch) against the reference; the dropout bits the
    reference draws (philox.py's v3) are the forward's, so a bit made otherwise shows in dq."""
    H, D, lq, lk, causal, p = FUSED_CASES[case]
    q, k, v, dout = _inputs(H, D, lq, lk, seed=len(case))
    got = _kernels(q, k, v, dout, lq, lk, causal, 0.3, p, 7, 2**32 - 5)
    assert fused_kinds == ["fwd", "dkdv_dq"], fused_kinds
    _check_fp32(got, _reference(q, k, v, dout, lq, lk, causal, 0.3, p, 7, 2**32 - 5))


def test_fused_dq_deterministic_and_equal_to_two_kernels(fused_kinds, monkeypatch):
    """Two runs give the same bits; the opt-out (FUSED_DQ off, as FASTFORMER_TRITON_FUSED_DQ=0
    sets it at import) launches dK/dV and dQ and agrees to rounding."""
    H, D, lq, lk = 2, 16, [40, 0, 9, 33], [35, 6, 0, 50]
    q, k, v, dout = _inputs(H, D, lq, lk, seed=8)
    first = _kernels(q, k, v, dout, lq, lk, True, 0.3, 0.2, 1, 2)
    second = _kernels(q, k, v, dout, lq, lk, True, 0.3, 0.2, 1, 2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name}: two runs differ"
    monkeypatch.setattr(A, "FUSED_DQ", False)
    fused_kinds.clear()
    two = _kernels(q, k, v, dout, lq, lk, True, 0.3, 0.2, 1, 2)
    assert fused_kinds == ["fwd", "dkdv", "dq"], fused_kinds
    for name, a, b in zip(("dq", "dk", "dv"), first[2:], two[2:]):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


def test_fused_dq_env_opt_out_at_import():
    """FASTFORMER_TRITON_FUSED_DQ=0, read at import, turns the fused backward off (the launches
    and the AOT specs: no "attention_varlen_dkdvdq" name; the in-process tests cover it on)."""
    import os
    import subprocess
    import sys

    script = ("from fastformer.triton_kernels import attention as A, attention_varlen as V\n"
              "print(A.FUSED_DQ, any('dkdvdq' in s['name'] for s in V.aot_specs()))")
    env = dict(os.environ, FASTFORMER_TRITON_FUSED_DQ="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "False False", proc.stdout


@pytest.mark.parametrize("fused", [True, False], ids=["fused_dq", "two_kernels"])
def test_launch_grids_cover_the_longest_sequence(monkeypatch, fused):
    """Forward and dQ: cdiv(max_seqlen_q, BLOCK_M) programs per head, dK/dV: cdiv(max_seqlen_k,
    BLOCK_N), of the B * H heads on one grid axis, all with VARLEN and neither mask; the
    preprocess runs on the packed rows. With FUSED_DQ (the default) dK/dV makes dQ: no dQ launch."""
    monkeypatch.setattr(A, "FUSED_DQ", fused)
    seen = []
    launch = A._launch

    def spy(kind, fn, grid_of, block_d, elt, args, meta, *rest):
        seen.append((kind, grid_of(dict(A.INTERPRET_BLOCKS)), meta["VARLEN"], meta["HAS_KPM"], meta["HAS_MASK"]))
        return launch(kind, fn, grid_of, block_d, elt, args, meta, *rest)

    monkeypatch.setattr(A, "_launch", spy)
    H, D, lq, lk = LENGTHS
    q, k, v, dout = _inputs(H, D, lq, lk)
    _kernels(q, k, v, dout, lq, lk, True, 0.3)
    bm, bn = A.INTERPRET_BLOCKS["BLOCK_M"], A.INTERPRET_BLOCKS["BLOCK_N"]
    B = len(lq)
    bwd = ([("dkdv_dq", (math.ceil(max(lk) / bn) * H * B, 1, 1), True, False, False)] if fused else
           [("dkdv", (math.ceil(max(lk) / bn) * H * B, 1, 1), True, False, False),
            ("dq", (math.ceil(max(lq) / bm) * H * B, 1, 1), True, False, False)])
    assert seen == [("fwd", (math.ceil(max(lq) / bm) * H * B, 1, 1), True, False, False), *bwd], seen


def test_packed_projection_views_and_gradient_layout(small_blocks):
    """q, k, v as views of (total, 3, H, D) projections (a row stride of 3*H*D): read through the
    strides; the gradients are laid out like empty_like of each input."""
    H, D, lq, lk = 3, 40, [9, 30, 1], [9, 30, 1]
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lq), 3, H, D, generator=g).to(DEVICE)
    q, k, v = qkv.unbind(1)
    dout = torch.randn(sum(lq), H, 2 * D, generator=g).to(DEVICE)[..., :D].contiguous()
    assert not q.is_contiguous() and q.stride(0) == 3 * H * D
    got = _kernels(q, k, v, dout, lq, lk, True, 0.2)
    _check_fp32(got, _reference(q, k, v, dout, lq, lk, True, 0.2))
    for grad, x in zip(got[2:], (q, k, v)):
        assert grad.shape == x.shape and grad.stride() == torch.empty_like(x).stride()


def test_cu_seqlens_past_the_rows_are_clamped(small_blocks):
    """The host never reads cu_seqlens (a GPU would synchronise): the kernels clamp each sequence
    into the tensors' rows, so a cu_seqlens past total reads and writes nothing outside them."""
    H, D = 2, 16
    lq = lk = [3, 4]
    q, k, v, dout = _inputs(H, D, lq, lk, seed=9)
    bad = torch.tensor([0, 3, 40], dtype=torch.int32, device=DEVICE)  # sequence 1 "ends" at row 40 of 7
    got = _kernels(q, k, v, dout, lq, lk, False, 0.3, cu_q=bad, cu_k=bad, max_q=4, max_k=4)
    _check_fp32(got, _reference(q, k, v, dout, lq, lk, False, 0.3))


def test_large_offset_kernels_against_reference(monkeypatch, small_blocks):
    """The int64-offset variant (LARGE_OFFSETS, forced here) computes what the int32 one does."""
    monkeypatch.setattr(A, "_large_offsets", lambda *args: True)
    H, D, lq, lk = 1, 24, [21, 5], [19, 30]
    q, k, v, dout = _inputs(H, D, lq, lk, seed=3)
    got = _kernels(q, k, v, dout, lq, lk, True, 0.3, 0.25, 9, 77)
    _check_fp32(got, _reference(q, k, v, dout, lq, lk, True, 0.3, 0.25, 9, 77))


# FlashAttention's rule, like for like. The kernels take delta = rowsum(dO * O) from the output as
# the op returns it (bf16), as FlashAttention does; the bf16 reference's autograd sums dP * P in
# fp32 and never sees O rounded. With dropout that rounding is the larger part of dQ's error: O =
# (P Z) V with Z's 1 / (1 - p) is off the bf16 grid even where one key dominates a row (without
# dropout O is then v_j itself), and eps = rowsum(dO * (O_bf16 - O)) enters dS as -P eps, summed
# coherently over the keys. Here, over dropout seeds 0-20, that term alone (fp64, the rest exact)
# moves dQ by 1.35e-2 of the kernel's 1.66e-2 error in 18 seeds (5.4e-3 - 5.9e-3 in the three that
# drop the row's key), against the bf16 reference's 6.6e-3 - 9.0e-3: ratios 1.27 - 2.51 (dK 1.24 -
# 2.09); without dropout 5.3e-3 (ratio 0.8). So the low-precision reference here is the bf16 one
# plus that term (_lowp_out_delta_terms): ratios 1.14 - 1.57 (dQ) and 0.71 - 1.64 (dK) over those
# seeds, factor 2 as everywhere; a 1% wrong dropout scale in the backward fails dQ (4.5e-2 > 2.7e-2).
def test_bf16_multi_tile(small_blocks):
    H, D, lq, lk = LENGTHS
    q, k, v, dout = _inputs(H, D, lq, lk, dtype=torch.bfloat16, seed=2)
    args = (q, k, v, dout, lq, lk, True, 0.2, 0.1, 11, 0)
    got = _kernels(*args)
    want32 = _reference(*args)
    wantlp = list(_reference(*args, dtype=torch.bfloat16))
    dq_term, dk_term = _lowp_out_delta_terms(*args)
    wantlp[2], wantlp[3] = wantlp[2].double() + dq_term, wantlp[3].double() + dk_term
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert got[i].dtype == (torch.float32 if name == "lse" else torch.bfloat16), name
        if name == "lse":
            assert_close(name, got[i].cpu(), want32[i], atol=1e-2, rtol=1e-2)
        else:
            assert_close_lowp(name, got[i].cpu().float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


def test_bad_inputs_raise_clear_errors():
    q, k, v = (torch.randn(n, 2, 8, device=DEVICE) for n in (5, 7, 7))
    cq, ck = _cu([2, 3]), _cu([4, 3])
    rng = philox.pack(0, 0)
    cases = [
        ((q[0], k, v, cq, ck, 3, 4), ValueError, r"q must be 3-D \(total, H, D\)"),
        ((q, torch.randn(7, 3, 8, device=DEVICE), v, cq, ck, 3, 4), ValueError, r"k and v must have shape"),
        ((q, k, v.double(), cq, ck, 3, 4), TypeError, "must share one dtype"),
        ((*(torch.randn(2, 1, 300, device=DEVICE) for _ in range(3)), _cu([2]), _cu([2]), 2, 2), ValueError,
         r"head dim D must be in \[1, 256\]"),
        ((torch.randn(5, 2, 16, device=DEVICE)[..., ::2], k, v, cq, ck, 3, 4), ValueError, "contiguous last"),
        ((q, k, v, cq.long(), ck, 3, 4), TypeError, "cu_seqlens_q must be int32"),
        ((q, k, v, cq, ck[:2], 3, 4), ValueError, "cu_seqlens_k must have cu_seqlens_q's shape"),
        ((q, k, v, cq, ck, -1, 4), ValueError, "max_seqlen_q and max_seqlen_k must be >= 0"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            V.attention_varlen_fwd(*args, False, 0.5, 0.0, rng)
    out, lse = V.attention_varlen_fwd(q, k, v, cq, ck, 3, 4, False, 0.5, 0.0, rng)
    with pytest.raises(ValueError, match=r"lse \(H, total_q\)"):
        V.attention_varlen_bwd(out, q, k, v, out, lse.t(), cq, ck, 3, 4, False, 0.5, 0.0, rng)


def test_registered_ops_opcheck():
    """Schema, fake (meta) implementation and dispatch of the registered ops."""
    lq, lk = [3, 0, 7], [5, 2, 7]
    q, k, v, dout = _inputs(2, 16, lq, lk)
    for causal, p in ((False, 0.0), (True, 0.2)):
        args = (q, k, v, _cu(lq), _cu(lk), 7, 7, causal, 0.25, p, philox.pack(5, 3))
        torch.library.opcheck(V.attention_varlen_fwd.op, args)
        out, lse = V.attention_varlen_fwd(*args)
        torch.library.opcheck(V.attention_varlen_bwd.op, (dout, q, k, v, out, lse, *args[3:]))


def test_torch_compile_traces_without_graph_break():
    """The autograd Function over the registered ops compiles as one graph (fullgraph), forward
    and backward, and gives the eager values."""
    import torch._dynamo.testing

    from fastformer.autograd import AttentionVarlenFunction

    lq, lk = [4, 9], [6, 9]
    q, k, v, dout = _inputs(2, 16, lq, lk)
    cu_q, cu_k = _cu(lq), _cu(lk)

    def f(q, k, v):
        return AttentionVarlenFunction.apply("q,k,v", cu_q, cu_k, 9, 9, True, 0.25, 0.0, V, None, q, k, v)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward(dout)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*eager).backward(dout)
    assert counter.frame_count == 1
    for name, a, b in zip(("dq", "dk", "dv"), leaves, eager):
        assert_close(name, a.grad, b.grad, atol=0, rtol=0)


def test_aot_specs_cover_every_launch():
    """Every (dtype, BLOCK_D bucket, feature class, kernel, autotune config) the varlen host can
    launch has a spec: the padded op's kernels with VARLEN and no masks, every argument typed."""
    specs = V.aot_specs()
    names = [s["name"] for s in specs]
    by_name = {s["name"]: s for s in specs}
    assert len(names) == len(set(names)) and not set(names) & {s["name"] for s in A.aot_specs()}
    for s in specs:
        fn = s["fn"]
        assert fn in (A._attention_fwd, A.kernels._attention_bwd_dkdv, A.kernels._attention_bwd_dq), s["name"]
        assert set(s["signature"]) == set(fn.arg_names), s["name"]
        for arg, typ in s["signature"].items():
            assert (typ == "constexpr") == (arg in s["constexprs"]), (s["name"], arg)
        assert s["signature"]["CuSeqlensQ"] == s["signature"]["CuSeqlensK"] == "*i32"
        c = s["constexprs"]
        assert c["VARLEN"] and not c["HAS_KPM"] and not c["HAS_MASK"] and c["IS_CAUSAL"], s["name"]
    for dtype, ptr in A._PTR.items():
        elt = torch.empty((), dtype=dtype).element_size()
        for block_d in A.BLOCK_D_BUCKETS:
            # the backward: dK/dV making dQ too (FUSED_DQ, the default), and the opt-out's two
            # kernels for TWO_KERNEL_SAMPLE only; or dK/dV then dQ in full
            bwd = ("dkdv_dq",) if A.FUSED_DQ else ("dkdv", "dq")
            if A.FUSED_DQ and (dtype, block_d) in A.TWO_KERNEL_SAMPLE:
                bwd += ("dkdv", "dq")
            for heavy in (False, True):
                for kind in ("fwd", *bwd):
                    for cfg in A._configs(kind, block_d, elt, heavy, True):
                        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
                        name = (f"attention_varlen_{kind.replace('_', '')}_{ptr[1:]}_d{block_d}"
                                f"_{'heavy' if heavy else 'light'}_m{bm}_n{bn}_w{cfg.num_warps}_s{cfg.num_stages}")
                        assert name in names
    fused = [n for n in names if n.startswith("attention_varlen_dkdvdq_")]
    two = [n for n in names if n.startswith(("attention_varlen_dkdv_", "attention_varlen_dq_"))]
    if A.FUSED_DQ:  # the fused kernel's specs make dQ; the sample's two-kernel ones do not
        assert fused and all(by_name[n]["constexprs"]["FUSED_DQ"] for n in fused)
        assert {tuple(n.split("_")[3:5]) for n in two} == {
            (A._PTR[dtype][1:], f"d{d}") for dtype, d in A.TWO_KERNEL_SAMPLE}, two
        assert not any(by_name[n]["constexprs"].get("FUSED_DQ") for n in two)
    else:
        assert not fused
