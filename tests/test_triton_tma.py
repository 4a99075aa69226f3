"""The opt-in TMA (tensor-descriptor) row streams of the Triton attention on sm_90
(FASTFORMER_TRITON_TMA=1; triton_kernels/HOPPER.md): the forward's K / V and the dK/dV kernel's
Q / dO (and K / V), padded and packed, checked without a GPU: which launches take it (tma_eligible,
on the CPU), that it computes what the cp.async kernels do (Triton's interpreter runs tensor
descriptors, with TMA's alignment rules and zero fill), and that it compiles ahead of time for
sm_90 to bulk tensor copies (cp.async.bulk.tensor / UTMALDG) without spills."""
import math

import pytest
import torch

from utils import assert_close, assert_close_lowp, device_for, kernel_backends, run_jit_script

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
VL = pytest.importorskip("fastformer.triton_kernels.attention_varlen", reason="triton is not installed")

from fastformer import philox  # noqa: E402
from test_attention_triton import LOWP_FACTOR, _inputs, _reference  # noqa: E402
from test_attention_varlen_triton import _cu  # noqa: E402
from test_attention_varlen_triton import _reference as _varlen_reference  # noqa: E402
from test_triton_hopper import ROOT  # noqa: E402


def _qkv(D, dtype=torch.float16, B=2, H=2, S=8):
    return tuple(torch.zeros(B, H, S, D, dtype=dtype) for _ in range(3))


def _eligible(q, k, v, arch=90):
    return A.tma_eligible(q, k, v, A.padded_layout(q, k), arch)


# ----------------------------------------------------------------------------------------------
# Which launches take TMA
# ----------------------------------------------------------------------------------------------
def test_tma_decision(monkeypatch):
    """TMA only when asked for, on sm_90, padded fp16 / bf16 at d64 / d128 and where k and v meet
    TMA's rules (16-byte aligned base and strides, contiguous in D, D * element size >= 16)."""
    q, k, v = _qkv(64)
    monkeypatch.delenv(A.TMA_ENV, raising=False)
    assert not _eligible(q, k, v)  # off by default
    monkeypatch.setenv(A.TMA_ENV, "0")
    assert not _eligible(q, k, v)
    monkeypatch.setenv(A.TMA_ENV, "1")  # read at each call, not at import
    assert _eligible(q, k, v)
    assert not _eligible(q, k, v, arch=80)  # sm_80 (and CPU tensors' family): no TMA
    for dtype in (torch.bfloat16, torch.float32):
        assert _eligible(*_qkv(64, dtype)) == (dtype == torch.bfloat16)  # fp32: the cp.async kernel
    for D, want in ((16, False), (32, False), (40, True), (48, True), (72, True), (120, True), (128, True),
                    (136, False), (256, False)):  # BLOCK_D 64 / 128 only (rows a multiple of 16 bytes)
        assert _eligible(*_qkv(D)) == want, D
    assert not _eligible(*_qkv(36))  # 72-byte rows: not a multiple of 16 bytes
    assert not _eligible(*_qkv(44))  # 88-byte rows

    # a base 2 bytes off 16-byte alignment; 16 bytes off is aligned
    buf = torch.zeros(2 * 2 * 8 * 64 + 8, dtype=torch.float16)
    odd, even = buf[1:1 + k.numel()].view(k.shape), buf[8:8 + k.numel()].view(k.shape)
    assert odd.data_ptr() % 16 and not even.data_ptr() % 16
    assert not _eligible(q, odd, v) and not _eligible(q, k, odd)
    assert _eligible(q, even, even)

    # a (B, S, H, D) view with a head stride of 65 elements (130 bytes) and rows of 260 bytes
    wide = torch.zeros(2, 8, 2, 65, dtype=torch.float16)[..., :64].transpose(1, 2)
    assert wide.stride() == (8 * 2 * 65, 65, 2 * 65, 1)
    assert not _eligible(q, wide, v)
    # the same view padded to 72 elements: 144-byte heads, 288-byte rows: TMA
    assert _eligible(q, torch.zeros(2, 8, 2, 72, dtype=torch.float16)[..., :64].transpose(1, 2), v)
    # a size-1 dimension's stride is never applied: an odd one does not matter
    one = torch.zeros(64 * 8 * 2 + 16, dtype=torch.float16).as_strided((1, 2, 8, 64), (7, 8 * 64, 64, 1))
    assert _eligible(one, one, one)
    # not contiguous in D
    assert not A.tma_layout_ok(torch.zeros(2, 2, 64, 8, dtype=torch.float16).transpose(-1, -2))
    assert not A.tma_layout_ok(torch.zeros(2, 2, 8, 4, dtype=torch.float16))  # 8 bytes a row
    assert A.tma_layout_ok(torch.zeros(2, 2, 8, 8, dtype=torch.float16))  # 16 bytes a row

    assert not _eligible(q, k[:, :, :0], v[:, :, :0])  # no key: no descriptor to build
    # launches torch.compile captures take the cp.async kernel
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _eligible(q, k, v)


def test_tma_decision_packed_and_backward(monkeypatch):
    """The packed layout ((total, H, D) tensors, each sequence's descriptors from its first row)
    takes TMA under the padded rules: its rows are H * D elements apart, its heads D; the
    backward's dK/dV kernel also needs q and dout (its streamed tiles) within them."""
    monkeypatch.setenv(A.TMA_ENV, "1")
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32)  # sequence 1 is empty

    def layout(t, max_k=11):
        return A.Layout(3, t.shape[1], 11, max_k, t.shape[2], t.shape[0], t.shape[0], cu, cu, True)

    packed = torch.zeros(16, 2, 64, dtype=torch.float16)
    assert A.tma_eligible(packed, packed, packed, layout(packed), 90)
    assert not A.tma_eligible(packed, packed, packed, layout(packed), 80)
    assert not A.tma_eligible(packed, packed, packed, layout(packed, max_k=0), 90)  # no key in any sequence
    assert not A.tma_eligible(*(packed.float(),) * 3, layout(packed), 90)
    # rows of a (total, 3, H, D) projection (the q / k / v views a fused in-projection makes): 384-byte rows
    qkv = torch.zeros(16, 3, 2, 64, dtype=torch.bfloat16)
    assert A.tma_eligible(qkv[:, 0], qkv[:, 1], qkv[:, 2], layout(packed), 90)
    # one k / v head for two query heads, sliced from a two-head buffer: rows 256 bytes apart
    assert A.tma_eligible(packed, packed[:, :1], packed[:, :1], layout(packed), 90)
    # heads 65 elements (130 bytes) apart; D = 36 (72-byte heads and rows)
    wide = torch.zeros(16, 2, 65, dtype=torch.float16)[..., :64]
    assert not A.tma_eligible(packed, wide, packed, layout(packed), 90)
    assert not A.tma_eligible(packed, packed, wide, layout(packed), 90)
    d36 = torch.zeros(16, 2, 36, dtype=torch.float16)
    assert not A.tma_eligible(d36, d36, d36, layout(d36), 90)
    # the backward's streamed q / dout: each must meet the rules too, padded or packed
    assert A.tma_eligible(packed, packed, packed, layout(packed), 90, packed, packed)
    assert not A.tma_eligible(packed, packed, packed, layout(packed), 90, wide, packed)
    assert not A.tma_eligible(packed, packed, packed, layout(packed), 90, packed, wide)
    q, k, v = _qkv(64)
    odd = torch.zeros(q.numel() + 1, dtype=torch.float16)[1:].view(q.shape)  # 2 bytes off 16-byte alignment
    assert _eligible(q, k, v) and not A.tma_eligible(q, k, v, A.padded_layout(q, k), 90, q, odd)


def test_tma_scratch_allocator_is_set_for_the_launch_only():
    """The descriptors' scratch hook: torch memory on the launch's device inside the scope, and the
    allocator that was set before (here a sentinel) back after it, also when the launch raises."""
    import triton
    from triton.runtime import _allocation

    def sentinel(size, alignment, stream):
        raise AssertionError("the caller's allocator was used inside the launch")

    token = _allocation._allocator.set(sentinel)
    try:
        with A._tma_scratch(torch.device("cpu")):
            buf = _allocation._allocator.get()(256, 128, None)
            assert buf.dtype == torch.int8 and buf.numel() == 256 and buf.device.type == "cpu"
        assert _allocation._allocator.get() is sentinel
        with pytest.raises(ValueError, match="launch failed"):
            with A._tma_scratch(torch.device("cpu")):
                raise ValueError("launch failed")
        assert _allocation._allocator.get() is sentinel
    finally:
        _allocation._allocator.reset(token)
    # the hook _tma_scratch sets is the one triton.set_allocator sets (a Triton upgrade that moves
    # it fails here, not silently on a GPU)
    token = _allocation._allocator.set(sentinel)
    try:
        triton.set_allocator(None)
        assert _allocation._allocator.get() is None
    finally:
        _allocation._allocator.reset(token)


class _Recorder:
    """Stands for a Triton kernel: runs nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def test_tma_launches_are_tuned_apart(monkeypatch):
    """On a GPU the TMA forward has its own autotuner (a tuner keys only on the keywords _tuned
    names, TMA not among them): the cp.async kernel's best tile is not reused untimed."""
    monkeypatch.setattr(A, "_TUNERS", {})
    assert A._tuned("fwd", A._attention_fwd, 64, 2, False, arch=90, tma=True) is not A._tuned(
        "fwd", A._attention_fwd, 64, 2, False, arch=90)
    tuners = []
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(A, "first_config_only", lambda: False)
    monkeypatch.setattr(A, "_tuned", lambda *a: tuners.append(a) or _Recorder())
    monkeypatch.setattr(torch.library, "wrap_triton", lambda fn: fn)
    monkeypatch.setattr(A, "_arch", lambda device: 90)
    q = torch.zeros(1, 1, 64, 64, dtype=torch.float16)
    for env in ("1", "0"):
        monkeypatch.setenv(A.TMA_ENV, env)
        A.attention_fwd(q, q, q, None, None, False, 1.0, 0.0, torch.zeros(2, dtype=torch.int64))
    assert [t[10] for t in tuners] == [True, False]  # _tuned's ``tma``


def _launched_tma(monkeypatch, kinds=("fwd",)):
    """The TMA constexpr of every launch of these kinds from now on (the forward's by default);
    checks that each TMA launch runs inside _tma_scratch (the descriptors' scratch allocator, which
    the interpreter does not ask for but a GPU launch does) and each other one outside it."""
    from triton.runtime import _allocation
    seen = []
    launch = A._launch
    outside = _allocation._allocator.get()

    def spy(kind, fn, grid_of, block_d, elt, args, meta, *rest):
        if kind in kinds:
            seen.append(meta["TMA"])
            assert (_allocation._allocator.get() is not outside) == meta["TMA"], (kind, meta["TMA"])
        return launch(kind, fn, grid_of, block_d, elt, args, meta, *rest)

    monkeypatch.setattr(A, "_launch", spy)
    return seen


def _sm90_or_interpreter(monkeypatch):
    """Where the TMA kernel can run: Triton's interpreter (a CPU device taken for sm_90), or an
    sm_90 GPU (the real bulk copies); skips elsewhere."""
    if A.INTERPRET:
        monkeypatch.setattr(A, "_arch", lambda device: 90)
    elif not (torch.cuda.is_available() and A._arch(torch.device("cuda")) == 90):
        pytest.skip("TMA runs in Triton's interpreter or on an sm_90 GPU; this GPU is neither")


# ----------------------------------------------------------------------------------------------
# The TMA kernel in the interpreter (and on an sm_90 GPU)
# ----------------------------------------------------------------------------------------------
def _equal_or_close(names, got, want):
    """The TMA kernels against the cp.async ones: the same bits in the interpreter (the same loads,
    the same arithmetic); on an sm_90 GPU within a rounding (the autotuner may pick other tiles)."""
    for name, g, w in zip(names, got, want):
        if A.INTERPRET:
            assert torch.equal(g, w), f"{name}: TMA and cp.async differ"
        else:
            tol = 1e-4 if g.dtype == torch.float32 else 2e-2
            assert_close(f"{name} vs cp.async", g.float(), w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, D, heavy", [(torch.float16, 40, False), (torch.float16, 64, True),
                                             (torch.bfloat16, 128, True)],
                         ids=["fp16_d40_light", "fp16_d64_heavy", "bf16_d128_heavy"])
def test_tma_forward_and_backward_match_cp_async_and_reference(monkeypatch, dtype, D, heavy):
    """The interpreter runs the kernels with TMA on (a device taken for sm_90, the variable set):
    the forward and the dK/dV(+dQ) kernel give the same bits as with TMA off (on an sm_90 GPU:
    within a rounding), and the reference's output and gradients within low-precision tolerance.
    Two sequences of two heads, lengths ending mid-tile (the descriptors' zero fill at Sq / Sk,
    and at D for d40), causal with a padding mask; heavy: with an additive mask and dropout too,
    and one k / v head for both query heads (grouped-query: the descriptors of head h // 2). The
    heavy backward at d128 keeps the cp.async kernel (TMA spilled it: TMA_BWD_HEAVY_BLOCK_D)."""
    _sm90_or_interpreter(monkeypatch)
    seen = _launched_tma(monkeypatch, ("fwd", "dkdv_dq", "dkdv"))
    q, k, v, kpm, am, dout = _inputs(2, 2, 37, 83, D, dtype=dtype, kpm_frac=0.2, mask="full" if heavy else None,
                                     seed=D)
    if heavy:
        k, v = k[:, :1], v[:, :1]
    scale = 1.0 / math.sqrt(D)
    p = 0.25 if heavy else 0.0
    args = (q, k, v, kpm, am, True, scale, p, philox.pack(3, 5))
    bwd_tma = not heavy or A._block_d(D) in A.TMA_BWD_HEAVY_BLOCK_D
    assert bwd_tma == (D != 128)
    got = {}
    for env in ("1", "0"):
        monkeypatch.setenv(A.TMA_ENV, env)
        out, lse = A.attention_fwd(*args)
        if env == "1" or bwd_tma:  # else the cp.async backward ran already: once is enough
            grads = A.attention_bwd(dout, q, k, v, out, lse, *args[3:])[:3]
        got[env] = (out, lse, *grads)
    assert seen == [True, bwd_tma, False] + [False] * bwd_tma
    _equal_or_close(("out", "lse", "dq", "dk", "dv"), got["1"], got["0"])
    want32 = _reference(q, k, v, kpm, am, dout, True, scale, p, 3, 5, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, scale, p, 3, 5, dtype=dtype)
    out, lse, *grads = got["1"]
    assert_close_lowp("out", out.float(), want32[0], wantlp[0].float(), factor=LOWP_FACTOR)
    assert_close("lse", lse, want32[1], atol=1e-2, rtol=1e-2)
    for name, g, w32, wlp in zip(("dq", "dk", "dv"), grads, want32[2:], wantlp[2:]):
        assert_close_lowp(name, g.float(), w32, wlp.float(), factor=LOWP_FACTOR)


def test_tma_packed_matches_cp_async_and_reference(monkeypatch):
    """The packed layout with TMA: each program's descriptors start at its sequence's first key /
    query row and are that sequence's length long, so the zero fill stops at its own last row.
    Ragged lengths ending mid-tile, a sequence without keys and one without queries, causal,
    dropout, one k / v head for two query heads (sliced from a two-head buffer: rows 2 * D apart),
    D = 40 (zero fill at D); the rows of k and v after the last sequence hold NaN, which a
    descriptor running past its sequence's end would let into the output (0 * NaN) and dQ. The
    forward and the dK/dV(+dQ) kernel: the same bits as the cp.async kernels, and the reference's."""
    _sm90_or_interpreter(monkeypatch)
    seen = _launched_tma(monkeypatch, ("fwd", "dkdv_dq", "dkdv"))
    H, D, dtype = 2, 40, torch.float16
    lq, lk = [37, 0, 5, 20], [20, 9, 0, 45]
    g = torch.Generator().manual_seed(40)
    q, dout = (torch.randn(sum(lq), H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.cat([torch.randn(sum(lk), H, D, generator=g), torch.full((7, H, D), float("nan"))]).to(dtype)[:, :1]
            for _ in range(2))
    q, dout, k, v = (t.to(device_for("triton")) for t in (q, dout, k, v))
    scale, p = 1.0 / math.sqrt(D), 0.2
    lengths = (_cu(lq), _cu(lk), max(lq), max(lk))
    got = {}
    for env in ("1", "0"):
        monkeypatch.setenv(A.TMA_ENV, env)
        out, lse = VL.attention_varlen_fwd(q, k, v, *lengths, True, scale, p, philox.pack(7, 9))
        dq, dk, dv, _ = VL.attention_varlen_bwd(dout, q, k, v, out, lse, *lengths, True, scale, p, philox.pack(7, 9))
        got[env] = (out, lse, dq, dk, dv)
    assert seen == [True, True, False, False]
    rows = sum(lk)  # the sequences' rows: no kernel writes dK / dV of the rows after them
    _equal_or_close(("out", "lse", "dq", "dk", "dv"), *([*r[:3], r[3][:rows], r[4][:rows]] for r in got.values()))
    out, lse, dq, dk, dv = (t.cpu() for t in got["1"])
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    want32 = _varlen_reference(q, k[:rows], v[:rows], dout, lq, lk, True, scale, p, 7, 9)
    wantlp = _varlen_reference(q, k[:rows], v[:rows], dout, lq, lk, True, scale, p, 7, 9, dtype=dtype)
    assert_close_lowp("out", out.float(), want32[0], wantlp[0].float(), factor=LOWP_FACTOR)
    assert_close("lse", lse, want32[1], atol=1e-2, rtol=1e-2)
    for name, gr, w32, wlp in zip(("dq", "dk", "dv"), (dq, dk[:rows], dv[:rows]), want32[2:], wantlp[2:]):
        assert_close_lowp(name, gr.float(), w32, wlp.float(), factor=LOWP_FACTOR)


@pytest.mark.gpu
@pytest.mark.skipif(A.INTERPRET, reason="the interpreter runs these cases in the tests above")
def test_tma_on_a_gpu():
    """`make gpu-check` runs only `pytest -m gpu`: this brings the two proofs above to its GPU,
    where TMA's bulk copies really run (skipped, with the reason, on a GPU that is not sm_90):
    padded at fp16 d64 heavy (the forward and the dK/dV(+dQ) kernel with TMA, masks, dropout,
    grouped-query) and packed; one padded case, as each case compiles four kernels on the GPU
    within gpu-tests' time limit (the interpreter runs all three above)."""
    with pytest.MonkeyPatch.context() as mp:
        test_tma_forward_and_backward_match_cp_async_and_reference(mp, torch.float16, 64, True)
    with pytest.MonkeyPatch.context() as mp:
        test_tma_packed_matches_cp_async_and_reference(mp)


def test_tma_falls_back_where_the_rules_fail(monkeypatch):
    """With the variable set on "sm_90", a k whose rows are 72 bytes apart (D = 36 in a 36-wide
    buffer, BLOCK_D 64) runs the cp.async kernel, and so does every launch on sm_80."""
    _sm90_or_interpreter(monkeypatch)
    monkeypatch.setenv(A.TMA_ENV, "1")
    seen = _launched_tma(monkeypatch)
    q, k, v, _, _, dout = _inputs(1, 2, 20, 24, 36, dtype=torch.float16, seed=1)
    scale = 1.0 / 6
    out, lse = A.attention_fwd(q, k, v, None, None, False, scale, 0.0, philox.pack(0, 0))
    monkeypatch.setattr(A, "_arch", lambda device: 80)
    q64, k64, v64 = (torch.nn.functional.pad(t, (0, 28)) for t in (q, k, v))  # 128-byte rows, d64
    A.attention_fwd(q64, k64, v64, None, None, False, scale, 0.0, philox.pack(0, 0))
    assert seen == [False, False]
    want = _reference(q, k, v, None, None, dout, False, scale, dtype=torch.float32)
    wantlp = _reference(q, k, v, None, None, dout, False, scale, dtype=torch.float16)
    assert_close_lowp("out", out.float(), want[0], wantlp[0].float(), factor=LOWP_FACTOR)


# ----------------------------------------------------------------------------------------------
# Ahead of time for sm_90: bulk tensor copies, no spills
# ----------------------------------------------------------------------------------------------
_AOT_SCRIPT = r"""
import json, re
import torch
from fastformer.triton_kernels import aot, attention as A
f16, bf16 = (torch.float16,), (torch.bfloat16,)
specs = (A.tma_specs(f16, (64,), ("light",), ("fwd",)) + A.tma_specs(bf16, (128,), ("heavy",), ("fwd",))
         + A.tma_specs(f16, (64,), ("heavy",), ("bwd",)) + A.tma_specs(bf16, (128,), ("heavy",), ("fwd",), True)
         + A.tma_specs(f16, (64,), ("light",), ("bwd",), True))
out = {}
for spec in specs:
    kernel, log = aot._compile(spec, spec["ccs"][0])
    row = aot._resources(kernel, 90, log)
    sass = aot.sass(kernel)
    out[spec["name"]] = dict(row, ccs=spec["ccs"], bulk=kernel.asm["ptx"].count("cp.async.bulk.tensor"),
                             UTMALDG=len(re.findall(r"\bUTMALDG\b", sass)), HGMMA=len(re.findall(r"\bHGMMA\.", sass)),
                             HMMA=len(re.findall(r"\bHMMA\.", sass)), scratch=kernel.metadata.global_scratch_size)
print(json.dumps(out))
"""


def test_tma_kernels_compile_to_bulk_tensor_copies():
    """sm_90's first choice with TMA, compiled ahead of time for sm_90 as aot.py does: the padded
    forward (fp16 d64 light, bf16 d128 heavy), the padded dK/dV + dQ kernel (fp16 d64 heavy), the
    packed forward (bf16 d128 heavy) and dK/dV + dQ (fp16 d64 light). Their streamed rows arrive by
    cp.async.bulk.tensor (UTMALDG in the SASS), the dots stay on wgmma (the fused dQ's dot, 32
    query rows, is mma.sync with or without TMA), no register spills, and a 128-byte descriptor of
    global scratch a streamed tensor and program (the forward's K, V; dK/dV's K, V, Q, dO)."""
    rows = run_jit_script(_AOT_SCRIPT, ROOT)
    assert len(rows) == 5, rows
    for name, row in rows.items():
        assert name.endswith("_sm90_tma") and row["ccs"] == [90], name
        assert row["bulk"] > 0 and row["UTMALDG"] > 0, (name, row)
        assert row["HGMMA"] > 0, (name, row)
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, (name, row)
        fwd = "_fwd_" in name
        assert row["HMMA"] == 0 or not fwd, (name, row)
        assert row["scratch"] >= (256 if fwd else 512), (name, row)
    assert sum(name.startswith("attention_varlen_") for name in rows) == 2


def test_tma_specs_stay_out_of_the_default_aot_run(monkeypatch):
    """The opt-in's compiles: in aot_specs() (padded and packed) only when TMA is asked for, sm_90
    only, the forward and the backward's dK/dV kernel (the one backward() launches: dK/dV + dQ with
    FUSED_DQ), each the sm_90 first choice's tile."""
    monkeypatch.delenv(A.TMA_ENV, raising=False)
    assert not [s for s in A.aot_specs() + VL.aot_specs() if s["name"].endswith("_tma")]
    monkeypatch.setenv(A.TMA_ENV, "1")
    bwd = "dkdv_dq" if A.FUSED_DQ else "dkdv"
    for varlen, specs in ((False, A.aot_specs()), (True, VL.aot_specs())):
        tma = [s for s in specs if s["name"].endswith("_tma")]
        # the forward: 2 dtypes x 2 BLOCK_D x 3 classes; the backward: light at each BLOCK_D, heavy
        # and rel at d64 only
        assert len(tma) == 2 * len(A.TMA_BLOCK_D) * 3 + 2 * (len(A.TMA_BLOCK_D) + 2 * len(A.TMA_BWD_HEAVY_BLOCK_D))
        kinds = []
        for s in tma:
            c = s["constexprs"]
            assert s["ccs"] == [90] and c["TMA"] is True and c["VARLEN"] is varlen, s["name"]
            kind = "fwd" if s["fn"] is A._attention_fwd else bwd
            assert s["name"].startswith(f"attention{'_varlen' if varlen else ''}_{kind.replace('_', '')}_")
            if kind != "fwd":
                assert s["fn"] is A.kernels._attention_bwd_dkdv and c["FUSED_DQ"] is A.FUSED_DQ, s["name"]
            kinds.append(kind)
            heavy = c["HAS_MASK"] or c["HAS_DROPOUT"]
            cfg = A._configs(kind, c["BLOCK_D"], 2, heavy, varlen, c["HAS_REL"], 90)[0]
            assert {k: c[k] for k in cfg.kwargs} == cfg.kwargs, s["name"]
            assert (s["num_warps"], s["num_stages"]) == (cfg.num_warps, cfg.num_stages), s["name"]
            assert kind == "fwd" or not heavy or c["BLOCK_D"] in A.TMA_BWD_HEAVY_BLOCK_D, s["name"]
        assert kinds.count("fwd") == 12 and kinds.count(bwd) == 8
