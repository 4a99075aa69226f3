"""The opt-in TMA (tensor-descriptor) K / V stream of the Triton attention forward on sm_90
(FASTFORMER_TRITON_TMA=1; triton_kernels/HOPPER.md), checked without a GPU: which launches take it
(tma_eligible, on the CPU), that it computes what the cp.async kernel does (Triton's interpreter
runs tensor descriptors, with TMA's alignment rules), and that it compiles ahead of time for sm_90
to bulk tensor copies (cp.async.bulk.tensor / UTMALDG) without spills."""
import math

import pytest
import torch

from utils import assert_close, assert_close_lowp, kernel_backends, run_jit_script

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")

from fastformer import philox  # noqa: E402
from test_attention_triton import LOWP_FACTOR, _inputs, _reference  # noqa: E402
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
    # the packed layout, and launches torch.compile captures, take the cp.async kernel
    packed = torch.zeros(16, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    layout = A.Layout(2, 2, 11, 11, 64, 16, 16, cu, cu, True)
    assert not A.tma_eligible(packed, packed, packed, layout, 90)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _eligible(q, k, v)


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
    """On a GPU the TMA forward has its own autotuner (Triton's keys on the lengths and D, not on
    constexprs such as TMA): the cp.async kernel's best tile is not reused untimed."""
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


def _launched_tma(monkeypatch):
    """The TMA constexpr of every forward launch from now on."""
    seen = []
    launch = A._launch

    def spy(kind, fn, grid_of, block_d, elt, args, meta, *rest):
        if kind == "fwd":
            seen.append(meta["TMA"])
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
@pytest.mark.parametrize("dtype, D, heavy", [(torch.float16, 40, False), (torch.bfloat16, 128, True)],
                         ids=["fp16_d40_light", "bf16_d128_heavy"])
def test_tma_forward_matches_cp_async_and_reference(monkeypatch, dtype, D, heavy):
    """The interpreter runs the kernel with TMA on (a device taken for sm_90, the variable set):
    the same bits as with TMA off (on an sm_90 GPU: within a rounding), and the reference's output
    within low-precision tolerance.
    Two sequences of two heads, lengths ending mid-tile (the descriptors' zero fill at Sk, and at
    D for d40), causal with a padding mask; heavy: with an additive mask and dropout too, and one
    k / v head for both query heads (grouped-query: the descriptors of head h // 2)."""
    _sm90_or_interpreter(monkeypatch)
    monkeypatch.setenv(A.TMA_ENV, "1")
    seen = _launched_tma(monkeypatch)
    q, k, v, kpm, am, dout = _inputs(2, 2, 37, 83, D, dtype=dtype, kpm_frac=0.2, mask="full" if heavy else None,
                                     seed=D)
    if heavy:
        k, v = k[:, :1], v[:, :1]
    scale = 1.0 / math.sqrt(D)
    p = 0.25 if heavy else 0.0
    args = (q, k, v, kpm, am, True, scale, p, philox.pack(3, 5))
    out, lse = A.attention_fwd(*args)
    monkeypatch.setenv(A.TMA_ENV, "0")
    out0, lse0 = A.attention_fwd(*args)
    assert seen == [True, False]
    if A.INTERPRET:  # the same loads, the same arithmetic
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    else:  # the autotuner may pick other tiles for the two
        assert_close("out vs cp.async", out.float(), out0.float(), atol=4e-3, rtol=4e-3)
        assert_close("lse vs cp.async", lse, lse0, atol=1e-4, rtol=1e-4)
    want32 = _reference(q, k, v, kpm, am, dout, True, scale, p, 3, 5, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, scale, p, 3, 5, dtype=dtype)
    assert_close_lowp("out", out.float(), want32[0], wantlp[0].float(), factor=LOWP_FACTOR)
    assert_close("lse", lse, want32[1], atol=1e-2, rtol=1e-2)


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
specs = (A.tma_specs((torch.float16,), (64,), ("light",)) + A.tma_specs((torch.bfloat16,), (128,), ("heavy",)))
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


def test_tma_forward_compiles_to_bulk_tensor_copies():
    """sm_90's first choice with TMA (fp16 d64 light, bf16 d128 heavy), compiled ahead of time for
    sm_90 as aot.py does: K and V arrive by cp.async.bulk.tensor (UTMALDG in the SASS), the dots
    stay on wgmma, no register spills, and two 128-byte descriptors of global scratch a program."""
    rows = run_jit_script(_AOT_SCRIPT, ROOT)
    assert len(rows) == 2, rows
    for name, row in rows.items():
        assert name.endswith("_sm90_tma") and row["ccs"] == [90], name
        assert row["bulk"] > 0 and row["UTMALDG"] > 0, (name, row)
        assert row["HGMMA"] > 0 and row["HMMA"] == 0, (name, row)
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, (name, row)
        assert row["scratch"] >= 256, (name, row)


def test_tma_specs_stay_out_of_the_default_aot_run(monkeypatch):
    """The opt-in's compiles: in aot_specs() only when TMA is asked for, sm_90 only, and each the
    sm_90 first choice's tile."""
    monkeypatch.delenv(A.TMA_ENV, raising=False)
    assert not [s for s in A.aot_specs() if s["name"].endswith("_tma")]
    monkeypatch.setenv(A.TMA_ENV, "1")
    tma = [s for s in A.aot_specs() if s["name"].endswith("_tma")]
    assert len(tma) == 2 * len(A.TMA_BLOCK_D) * 3
    for s in tma:
        assert s["ccs"] == [90] and s["constexprs"]["TMA"] is True and s["constexprs"]["VARLEN"] is False
        heavy = s["constexprs"]["HAS_MASK"] or s["constexprs"]["HAS_DROPOUT"]
        elt = 2
        cfg = A._configs("fwd", s["constexprs"]["BLOCK_D"], elt, heavy, False, s["constexprs"]["HAS_REL"], 90)[0]
        assert {k: s["constexprs"][k] for k in cfg.kwargs} == cfg.kwargs, s["name"]
        assert (s["num_warps"], s["num_stages"]) == (cfg.num_warps, cfg.num_stages), s["name"]
