"""Triton attention kernels beyond tests/test_attention.py: the head-dim padding path, lengths
against the block sizes, whole-tile causal skipping (Sq > Sk and Sq < Sk), strided inputs and
broadcast masks, 64-bit dropout counters, low precision, the registered ops (opcheck,
torch.compile without graph breaks) and the ahead-of-time compile specs.

Without a GPU everything runs in Triton's interpreter on CPU tensors (tests/conftest.py)."""
import math

import pytest
import torch

from fastformer import philox
from fastformer.ops import reference
from utils import assert_close, assert_close_lowp, device_for, kernel_backends

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
T = pytest.importorskip("fastformer.triton_kernels.attention_tiles", reason="triton is not installed")
DEVICE = device_for("triton")

# fp32 (atol, rtol): outputs and lse, then gradients (sums over up to 256 keys / queries).
TOL = {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)}
# Low precision, FlashAttention's rule against the fp32 reference. The kernels round fp32 -> bf16
# to nearest even in the interpreter too (attention_tiles.cast), so the GPU's factor applies.
LOWP_FACTOR = 2.0


def _inputs(B, H, Sq, Sk, D, dtype=torch.float32, kpm_frac=0.0, mask=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(DEVICE, dtype) for S in (Sq, Sk, Sk))
    kpm = (torch.rand(B, Sk, generator=g) < kpm_frac).to(DEVICE) if kpm_frac > 0 else None
    am = None
    if mask == "full":  # (B, H, Sq, Sk) with some -inf
        am = torch.randn(B, H, Sq, Sk, generator=g)
        am = am.masked_fill(torch.rand(B, H, Sq, Sk, generator=g) < 0.2, float("-inf")).to(DEVICE)
    elif mask == "broadcast":  # (Sq, Sk) expanded: stride 0 on B and H
        am = torch.randn(Sq, Sk, generator=g).to(DEVICE).expand(B, H, Sq, Sk)
    dout = torch.randn(B, H, Sq, D, generator=g).to(DEVICE, dtype)
    return q, k, v, kpm, am, dout


def _kernels(q, k, v, kpm, am, dout, causal, scale, p=0.0, seed=0, offset=0):
    out, lse = A.attention_fwd(q, k, v, kpm, am, causal, scale, p, philox.pack(seed, offset))
    dq, dk, dv, _ = A.attention_bwd(dout, q, k, v, out, lse, kpm, am, causal, scale, p, philox.pack(seed, offset))
    return out, lse, dq, dk, dv


def _reference(q, k, v, kpm, am, dout, causal, scale, p=0.0, seed=0, offset=0, dtype=torch.float32):
    """Reference output and gradients (computed from the inputs cast to ``dtype``), and the lse
    computed independently: logsumexp of the visible scaled scores, +inf for an empty row."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = reference.attention(*leaves, key_padding_mask=kpm, attn_mask=am, is_causal=causal, scale=scale,
                              dropout_p=p, rng=(seed, offset))
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    Sq, Sk = q.shape[2], k.shape[2]
    s = torch.matmul(q.double(), k.double().transpose(-2, -1)) * scale
    if am is not None:
        s = s + am.double()
    hidden = torch.zeros(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        hidden = torch.arange(Sk, device=q.device)[None, :] > torch.arange(Sq, device=q.device)[:, None] + Sk - Sq
    if kpm is not None:
        hidden = hidden | kpm[:, None, None, :]
    lse = torch.logsumexp(s.masked_fill(hidden, float("-inf")), dim=-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).float()
    return (out.detach(), lse, *grads)


def _check_fp32(got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).sum() == torch.isfinite(w).sum(), f"{name}: non-finite entries differ"
        atol, rtol = TOL["out"] if name in ("out", "lse") else TOL["grad"]
        assert_close(name, g, w, atol=atol, rtol=rtol)


# (B, H, Sq, Sk, D, causal, kpm_frac, mask): head dims off the power-of-two grid go through
# the BLOCK_D padding path; lengths 1, 7, 113 against 16 x 16 tiles.
CASES = {
    "d8_tiny": (1, 1, 1, 1, 8, False, 0.0, None),
    "d59_sq1": (1, 2, 1, 113, 59, False, 0.0, None),
    "d111_sk1": (2, 1, 113, 1, 111, False, 0.0, None),
    "d40_7x113_causal": (1, 2, 7, 113, 40, True, 0.0, None),
    "d59_113x7_causal": (1, 2, 113, 7, 59, True, 0.0, None),
    "d111_kpm_fullmask": (2, 1, 33, 47, 111, False, 0.3, "full"),
    "d256_causal_kpm": (2, 1, 23, 17, 256, True, 0.2, None),
    "d24_causal_broadcast_mask": (2, 2, 40, 40, 24, True, 0.1, "broadcast"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shapes_against_reference(case, small_blocks):
    B, H, Sq, Sk, D, causal, kpm_frac, mask = CASES[case]
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=kpm_frac, mask=mask)
    scale = 1.0 / math.sqrt(D)
    got = _kernels(q, k, v, kpm, am, dout, causal, scale)
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, causal, scale))
    assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max over NaN rows
@pytest.mark.parametrize("Sq, Sk", [(64, 64), (80, 32), (32, 80)])
def test_causal_skips_whole_tiles(Sq, Sk, small_blocks):
    """Tiles that bottom-right causal masking hides entirely must never be read: NaN written into
    them leaves the rest exact. Forward and dQ: keys past the block's last visible key;
    dK / dV: queries before the key block's first viewer."""
    if not A.INTERPRET:
        pytest.skip("the tile size is only fixed (16 x 16) in the interpreter")
    B, H, D = 1, 2, 32
    q, k, v, _, _, dout = _inputs(B, H, Sq, Sk, D)
    scale = 1.0 / math.sqrt(D)
    want = _reference(q, k, v, None, None, dout, True, scale)

    # keys from `cut` (tile aligned) on are invisible to query rows [0, rows): i + Sk - Sq < cut
    cut = Sk - 16
    rows = cut - (Sk - Sq)
    assert rows > 0
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, cut:] = float("nan")
    v_nan[:, :, cut:] = float("nan")
    out, lse = A.attention_fwd(q, k_nan, v_nan, None, None, True, scale, 0.0, philox.pack(0, 0))
    assert_close("out", out[:, :, :rows], want[0][:, :, :rows], *TOL["out"])
    assert_close("lse", lse[:, :, :rows], want[1][:, :, :rows], *TOL["out"])
    out_clean, lse_clean = A.attention_fwd(q, k, v, None, None, True, scale, 0.0, philox.pack(0, 0))
    dq, _, _, _ = A.attention_bwd(dout, q, k_nan, v_nan, out_clean, lse_clean, None, None, True, scale, 0.0, philox.pack(0, 0))
    assert_close("dq", dq[:, :, :rows], want[2][:, :, :rows], *TOL["grad"])

    # queries before `first` see no key from `kcut` on (tile aligned in both directions)
    kcut = cut
    first = kcut - (Sk - Sq)
    q_nan, do_nan = q.clone(), dout.clone()
    q_nan[:, :, :first] = float("nan")
    do_nan[:, :, :first] = float("nan")
    _, dk, dv, _ = A.attention_bwd(do_nan, q_nan, k, v, out_clean, lse_clean, None, None, True, scale, 0.0, philox.pack(0, 0))
    assert_close("dk", dk[:, :, kcut:], want[3][:, :, kcut:], *TOL["grad"])
    assert_close("dv", dv[:, :, kcut:], want[4][:, :, kcut:], *TOL["grad"])


def test_rows_with_no_visible_key(small_blocks):
    """Causal with Sq > Sk, a fully padded batch and -inf mask rows: output 0, lse +inf, zero
    gradients, never NaN."""
    B, H, Sq, Sk, D = 2, 1, 37, 20, 16
    q, k, v, _, _, dout = _inputs(B, H, Sq, Sk, D)
    kpm = torch.zeros(B, Sk, dtype=torch.bool, device=DEVICE)
    kpm[1] = True  # batch 1: every key padded
    am = torch.zeros(B, H, Sq, Sk, device=DEVICE)
    am[0, 0, 30] = float("-inf")  # one visible row of batch 0 masked entirely by -inf
    out, lse, dq, dk, dv = _kernels(q, k, v, kpm, am, dout, True, 0.25)
    empty = torch.zeros(B, H, Sq, dtype=torch.bool, device=DEVICE)
    empty[:, :, : Sq - Sk] = True  # causal: query i < Sq - Sk sees nothing
    empty[1] = True
    empty[0, 0, 30] = True
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not t.isnan().any(), f"{name} has NaN"
    assert torch.isposinf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    _check_fp32((out, lse, dq, dk, dv), _reference(q, k, v, kpm, am, dout, True, 0.25))


def test_strided_inputs_and_outputs_layout(small_blocks):
    """q/k/v as (B, S, H, D) buffers viewed (B, H, S, D), a sliced dout: read through strides."""
    B, H, Sq, Sk, D = 2, 3, 21, 35, 48
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Sq, H, D, generator=g).to(DEVICE).transpose(1, 2)
    kv = torch.randn(B, Sk, 2, H, D, generator=g).to(DEVICE)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    dout = torch.randn(B, H, Sq, 2 * D, generator=g).to(DEVICE)[..., :D]
    am = torch.randn(1, H, 1, Sk, generator=g).to(DEVICE).expand(B, H, Sq, Sk)
    kpm_buf = torch.rand(Sk, B, generator=g).to(DEVICE) < 0.2
    kpm = kpm_buf.t()  # (B, Sk) with a key stride of B
    assert not q.is_contiguous() and not k.is_contiguous() and not dout.is_contiguous()
    got = _kernels(q, k, v, kpm, am, dout, False, 0.3)
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, False, 0.3))
    assert got[2].shape == q.shape and got[3].shape == k.shape and got[4].shape == v.shape


@pytest.mark.parametrize("seed, offset", [(2**62 + 12345, 2**32 - 1000), (7, 3 * 2**31 + 5)])
def test_dropout_matches_reference_with_64bit_counters(seed, offset, small_blocks):
    """The keep mask of (b, h, i, j) comes from counter offset + ((bh*ceil(Sq/16) + i//16)*ceil(Sk/32)
    + j//32)*32 + lane (philox.attention_keep_mask); offsets here cross 2**32 inside the tensor, so
    a 32-bit counter would drop different elements."""
    B, H, Sq, Sk, D = 2, 2, 19, 33, 32
    q, k, v, kpm, _, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=0.1)
    p = 0.3
    got = _kernels(q, k, v, kpm, None, dout, True, 0.2, p, seed, offset)
    want = _reference(q, k, v, kpm, None, dout, True, 0.2, p, seed, offset)
    # the lse is the pre-dropout normaliser
    _check_fp32(got, want)
    no_drop = _kernels(q, k, v, kpm, None, dout, True, 0.2)
    assert (got[0] - no_drop[0]).abs().max() > 1e-2, "dropout changed nothing"


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (16, 64)])
@pytest.mark.parametrize("Sq, Sk, causal", [(37, 21, True), (13, 50, True), (24, 41, False)])
def test_dropout_non_square_tiles(block_m, block_n, Sq, Sk, causal, monkeypatch):
    """BLOCK_M != BLOCK_N: dK / dV regenerate the mask on the transposed (keys, queries) tile and
    dQ / the forward on (queries, keys) tiles; all must be the reference's mask, whatever the
    tiling, also for causal Sq != Sk and key counts that end mid-group."""
    if not A.INTERPRET:
        pytest.skip("the tile size is only fixed in the interpreter")
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", block_m)
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_N", block_n)
    B, H, D = 1, 2, 16
    q, k, v, _, _, dout = _inputs(B, H, Sq, Sk, D, seed=Sq + Sk)
    p, seed, offset = 0.4, 2**40 + 3, 2**32 - 37
    got = _kernels(q, k, v, None, None, dout, causal, 0.3, p, seed, offset)
    _check_fp32(got, _reference(q, k, v, None, None, dout, causal, 0.3, p, seed, offset))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision(dtype, small_blocks):
    """fp16 / bf16 inputs, fp32 accumulation: FlashAttention's rule against the fp32 reference
    (in the interpreter bf16 dot operands are widened, attention_tiles.dot, since its tl.dot would
    multiply the bf16 storage as integers)."""
    B, H, Sq, Sk, D = 1, 2, 45, 29, 40
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, dtype=dtype, kpm_frac=0.2, mask="broadcast")
    got = _kernels(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0)
    want32 = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert got[i].dtype == (torch.float32 if name == "lse" else dtype), name
        if name == "lse":
            assert_close(name, got[i], want32[i], atol=1e-2, rtol=1e-2)
        else:
            assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


def test_bf16_conversion_rounds_to_nearest_even():
    """The kernels' fp32 -> bf16 conversion (P, dS and the outputs) rounds as torch and the GPU
    do, ties to even, infinities kept; the interpreter alone would truncate."""
    import triton
    import triton.language as tl

    @triton.jit
    def _convert(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, T.cast(tl.load(x_ptr + offs), tl.bfloat16))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(1)) * 10
    x[:5] = torch.tensor([float("inf"), -float("inf"), 0.99999, 1.0 - 2**-9, 1.0 + 3 * 2**-9])
    x = x.to(DEVICE)
    y = torch.empty(1024, dtype=torch.bfloat16, device=DEVICE)
    _convert[(1,)](x, y, 1024)
    assert torch.equal(y, x.to(torch.bfloat16))


def test_bad_inputs_raise_clear_errors():
    q = torch.randn(1, 1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 300"):
        big = torch.randn(1, 1, 4, 300, device=DEVICE)
        A.attention_fwd(big, big, big, None, None, False, 1.0, 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="share one dtype"):
        A.attention_fwd(q, q.double(), q, None, None, False, 1.0, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        qt = torch.randn(1, 1, 8, 4, device=DEVICE).transpose(-1, -2)
        A.attention_fwd(qt, q, q, None, None, False, 1.0, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="key_padding_mask"):
        A.attention_fwd(q, q, q, torch.zeros(1, 3, dtype=torch.bool, device=DEVICE), None, False, 1.0, 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="attn_mask"):
        A.attention_fwd(q, q, q, None, torch.zeros(1, 1, 4, 4, dtype=torch.float64, device=DEVICE), False, 1.0,
                        0.0, philox.pack(0, 0))


def test_registered_ops_opcheck():
    """Schema, fake (meta) implementation and dispatch of the registered ops."""
    q, k, v, kpm, am, dout = _inputs(1, 2, 9, 11, 16, kpm_frac=0.2, mask="broadcast")
    fwd_args = (q, k, v, kpm, am, True, 0.25, 0.2, philox.pack(5, 3))
    torch.library.opcheck(A.attention_fwd.op, fwd_args)
    out, lse = A.attention_fwd(*fwd_args)
    torch.library.opcheck(A.attention_bwd.op, (dout, q, k, v, out, lse, kpm, am, True, 0.25, 0.2, philox.pack(5, 3)))
    torch.library.opcheck(A.attention_fwd.op, (q, k, v, None, None, False, 0.25, 0.0, philox.pack(0, 0)))


def test_torch_compile_traces_without_graph_break():
    """The autograd Function over the registered ops compiles as one graph (fullgraph), forward
    and backward, and gives the eager values."""
    import torch._dynamo.testing

    from fastformer.autograd import AttentionFunction

    q, k, v, kpm, _, dout = _inputs(1, 2, 9, 11, 16, kpm_frac=0.2)

    def f(q, k, v):
        return AttentionFunction.apply(q, k, v, kpm, None, True, 0.25, 0.0, A)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.backward(dout)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    out_eager = f(*eager)
    out_eager.backward(dout)
    assert counter.frame_count == 1
    assert_close("out", out, out_eager, atol=0, rtol=0)
    for name, a, b in zip(("dq", "dk", "dv"), leaves, eager):
        assert_close(name, a.grad, b.grad, atol=0, rtol=0)


def test_aot_specs_cover_every_launch():
    """Every (dtype, BLOCK_D bucket, feature class, kernel, autotune config) has a spec that
    types every argument, and every config's estimated shared memory fits sm_80."""
    specs = A.aot_specs()
    names = [s["name"] for s in specs]
    assert len(names) == len(set(names))
    for s in specs:
        fn = s["fn"]
        assert set(s["signature"]) == set(fn.arg_names), s["name"]
        for arg, typ in s["signature"].items():
            assert (typ == "constexpr") == (arg in s["constexprs"]), (s["name"], arg)
        assert set(s["divisible_by_16"]) <= set(fn.arg_names)
    # keep_tile's dropout tiles: whole 16-query rows, whole or half 32-key tiles
    assert A.INTERPRET_BLOCKS["BLOCK_M"] % 16 == 0 and A.INTERPRET_BLOCKS["BLOCK_N"] % 16 == 0
    for D in (1, 16, 33, 64, 65, 128, 200, 256):
        assert A._block_d(D) in A.BLOCK_D_BUCKETS and A._block_d(D) >= D
    for dtype, ptr in A._PTR.items():
        elt = torch.empty((), dtype=dtype).element_size()
        for block_d in A.BLOCK_D_BUCKETS:
            # the backward: dK/dV making dQ too (FUSED_DQ, the default; the two kernels of the
            # opt-out for the sample TWO_KERNEL_SAMPLE only), or dK/dV then dQ
            bwd = ("dkdv_dq",) if A.FUSED_DQ else ("dkdv", "dq")
            if A.FUSED_DQ and (dtype, block_d) in A.TWO_KERNEL_SAMPLE:
                bwd += ("dkdv", "dq")
            for heavy in (False, True):
                for kind in ("fwd", *bwd):
                    for cfg in A._configs(kind, block_d, elt, heavy):
                        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
                        assert min(bm, bn, block_d) >= 16  # tl.dot's minimum on sm_80 / sm_90
                        assert bm % 16 == 0 and bn % 16 == 0  # keep_tile: 16 x 32 dropout tiles, or halves
                        est = A._smem_estimate(kind, bm, bn, block_d, cfg.num_stages, elt, heavy)
                        assert est <= A.SMEM_LIMIT[80]
                        cls = "heavy" if heavy else "light"
                        name = (f"attention_{kind.replace('_', '')}_{ptr[1:]}_d{block_d}_{cls}_m{bm}_n{bn}"
                                f"_w{cfg.num_warps}_s{cfg.num_stages}")
                        assert name in names


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_autotuned_long_sequences(dtype):
    """On a GPU the autotuned configs run: long causal sequences with padding and dropout."""
    B, H, Sq, Sk, D = 2, 4, 1000, 1000, 64
    q, k, v, kpm, _, dout = _inputs(B, H, Sq, Sk, D, dtype=dtype, kpm_frac=0.1)
    got = _kernels(q, k, v, kpm, None, dout, True, 0.125, 0.1, 99, 0)
    want32 = _reference(q, k, v, kpm, None, dout, True, 0.125, 0.1, 99, 0, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, None, dout, True, 0.125, 0.1, 99, 0, dtype=dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name != "lse":
            assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)
