"""The Triton attention on Hopper (sm_90), checked without a GPU: the sm_90 config family's
first choices compile to wgmma (HGMMA in the SASS; sm_80's to mma.sync, HMMA), run correctly in
the interpreter, and the launch picks them by the device's compute capability; the one-axis grid
(attention_grid / attention_tiles.program_ids) has no 65,535 limit on the batch and decodes every
(batch, head, tile); short lengths get their own autotune candidates."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from utils import assert_close, assert_close_lowp, kernel_backends

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastformer.triton_kernels import aot  # noqa: E402
from fastformer.triton_kernels.attention_tiles import program_ids  # noqa: E402
from test_attention_triton import LOWP_FACTOR, _inputs, _kernels, _reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("fwd", "dkdv", "dq")
LOWP_D = (32, 64, 128, 256)


def _m_side(kind, cfg):
    """The accumulator rows of a kernel's dots: its query tile (forward, dQ) or key tile (dK/dV)."""
    return cfg.kwargs["BLOCK_N" if kind == "dkdv" else "BLOCK_M"]


# ----------------------------------------------------------------------------------------------
# The grid: one axis, no 65,535 limit on B
# ----------------------------------------------------------------------------------------------
def test_grid_keeps_axes_1_and_2_within_cuda_limits():
    for n_rows, block, H, B in [(512, 64, 16, 100_000), (1, 16, 1, 100_000), (4096, 128, 65_536, 2)]:
        grid = A.attention_grid(n_rows, block, H, B)
        assert grid[1] <= 65_535 and grid[2] <= 65_535, grid
        assert grid[0] == -(-n_rows // block) * H * B <= 2**31 - 1, grid
    with pytest.raises(ValueError, match="programs"):
        A.attention_grid(2**20, 16, 64, 100_000)  # 2**16 tiles x 6.4M heads


class _Recorder:
    """Stands for a Triton kernel: records the grid of each launch, runs nothing."""

    def __init__(self, grids):
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kw: None


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_launch_grids_for_100000_sequences(monkeypatch, varlen):
    """Every attention launch (forward, delta preprocess, dK/dV, dQ) of a batch of 100,000
    sequences, padded or packed, keeps grid axes 1 and 2 within 65,535 (host code only: the
    kernels are recorders)."""
    grids = []
    monkeypatch.setattr(A, "kernel", lambda fn: _Recorder(grids))
    monkeypatch.setattr(A, "_launch", lambda kind, fn, grid_of, *a, **kw: grids.append(grid_of(
        {"BLOCK_M": 16, "BLOCK_N": 32})))
    B, H, S, D = 100_000, 2, 3, 8
    p = torch.zeros(2, dtype=torch.int64)
    if varlen:
        from fastformer.triton_kernels import attention_varlen as V
        q, k, v = (torch.zeros(B * S, H, D) for _ in range(3))
        cu = torch.arange(0, B * S + 1, S, dtype=torch.int32)
        out, lse = V.attention_varlen_fwd(q, k, v, cu, cu, S, S, True, 1.0, 0.0, p)
        V.attention_varlen_bwd(q, q, k, v, out, lse, cu, cu, S, S, True, 1.0, 0.0, p)
    else:
        q, k, v = (torch.zeros(B, H, S, D) for _ in range(3))
        out, lse = A.attention_fwd(q, k, v, None, None, True, 1.0, 0.0, p)
        A.attention_bwd(q, q, k, v, out, lse, None, None, True, 1.0, 0.0, p)
    fused = A.FUSED_DQ  # dK/dV makes dQ too (the default, padded and packed): no dQ launch
    assert len(grids) == (3 if fused else 4), grids  # fwd, preprocess, dkdv(_dq)[, dq]
    for grid in grids:
        assert len(grid) == 3 and grid[1] <= 65_535 and grid[2] <= 65_535, grids
    # forward / dQ: one query tile of 16 per head; dK/dV one key tile of 32; the preprocess runs
    # the packed rows as one sequence of B * S rows
    assert grids[0] == (B * H, 1, 1) and (fused or grids[3] == (B * H, 1, 1)), grids
    assert grids[2] == (B * H, 1, 1), grids
    pre_rows, pre_b = (B * S, 1) if varlen else (S, B)
    pre_block = A.INTERPRET_BLOCKS["BLOCK_M"] if A.INTERPRET else A.PREPROCESS_BLOCK_M  # the host's choice
    assert grids[1] == (-(-pre_rows // pre_block) * H * pre_b, 1, 1), grids


@triton.jit
def _decode(Out, n_rows, H, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    start, h, b64, h64 = program_ids(n_rows, H, BLOCK, REVERSE)
    pid = tl.program_id(0)
    tl.store(Out + 4 * pid, start)
    tl.store(Out + 4 * pid + 1, h)
    tl.store(Out + 4 * pid + 2, b64.to(tl.int32))
    tl.store(Out + 4 * pid + 3, h64.to(tl.int32))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward_order", "reversed_tiles"])
@pytest.mark.parametrize("n_rows, block, H, B", [(37, 16, 3, 5), (16, 16, 1, 7), (100, 32, 2, 1)])
def test_program_ids_decode_every_tile_once(n_rows, block, H, B, reverse):
    """program_ids on the one-axis grid: program (b*H + h) * tiles + t is tile t of head (b, h)
    (t counted from the last with REVERSE), every (b, h, tile) exactly once."""
    if not A.INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or a GPU to run a Triton kernel")
    device = "cpu" if A.INTERPRET else "cuda"
    grid = A.attention_grid(n_rows, block, H, B)
    out = torch.full((grid[0], 4), -1, dtype=torch.int32, device=device)
    _decode[grid](out, n_rows, H, BLOCK=block, REVERSE=reverse)
    tiles = -(-n_rows // block)
    want = [((tiles - 1 - t if reverse else t) * block, h, b, h) for b in range(B) for h in range(H)
            for t in range(tiles)]
    assert [tuple(r) for r in out.cpu().tolist()] == want


# ----------------------------------------------------------------------------------------------
# The sm_90 config family
# ----------------------------------------------------------------------------------------------
def _classes():
    """(heavy, varlen, rel) of every feature class the host launches."""
    return [(heavy, varlen, rel) for varlen in (False, True) for heavy, rel in ((False, False), (True, False),
                                                                                (True, True))]


# Where every 64-row tile tried spilled on sm_90 (HOPPER.md), so sm_80's mma.sync first choice
# stays: (kind, BLOCK_D, heavy).
SPILLING_AT_64_ROWS = {("dkdv", 256, False), ("dkdv", 256, True), ("dkdv", 128, True), ("dq", 256, True)}


def test_sm90_first_choices_put_64_rows_on_each_dot():
    """fp16 / bf16: every sm_90 first choice gives each dot an M side of >= 64 rows (a warpgroup's
    wgmma) but where 64-row tiles spill; sm_80's family is what it was, sm_90's only adds a lead,
    and the two differ where sm_80's first choice has a dot below 64 rows."""
    differ = 0
    for block_d in LOWP_D:
        for kind in KINDS:
            for heavy, varlen, rel in _classes():
                sm80 = A._configs(kind, block_d, 2, heavy, varlen, rel, 80)
                sm90 = A._configs(kind, block_d, 2, heavy, varlen, rel, 90)
                assert A._configs(kind, block_d, 2, heavy, varlen, rel) == sm80  # the default family
                where = (kind, block_d, heavy, varlen, rel, str(sm80[0]), str(sm90[0]))
                if (kind, block_d, heavy) in SPILLING_AT_64_ROWS:
                    assert str(sm90[0]) == str(sm80[0]), where
                else:
                    assert _m_side(kind, sm90[0]) >= 64, where
                assert sm90[0].num_warps in (4, 8)
                rest = [str(c) for c in sm90[1:]]
                assert rest == [str(c) for c in sm80 if str(c) != str(sm90[0])], where
                differ += str(sm80[0]) != str(sm90[0])
                if _m_side(kind, sm80[0]) < 64 and (kind, block_d, heavy) not in SPILLING_AT_64_ROWS:
                    assert str(sm80[0]) != str(sm90[0]), where
    assert differ > 0
    for kind in KINDS:  # fp32 keeps its one config (FMA or tf32 dots)
        assert A._configs(kind, 64, 4, True, False, False, 90) == A._configs(kind, 64, 4, True, False, False, 80)


def test_sm90_specs_compile_for_sm90_only():
    """The AOT specs: each family compiles for its own target (its ``ccs``), every sm_90 config
    has a spec named ``..._sm90``, and each specialisation's first choice is its family's first."""
    specs = A.aot_specs()
    by_name = {s["name"]: s for s in specs}
    for s in specs:
        if "preprocess" not in s["name"]:
            assert s["ccs"] == ([90] if s["name"].endswith("_sm90") else [80]), s["name"]
    first = {specs[i]["name"] for i in aot.first_choice_indices(specs)}
    for block_d in LOWP_D:
        # the padded backward: dK/dV making dQ (FUSED_DQ, the default; the two kernels of the
        # opt-out for TWO_KERNEL_SAMPLE), or dK/dV then dQ
        kinds = KINDS
        if A.FUSED_DQ:
            kinds = ("fwd", "dkdv_dq") + (KINDS[1:] if (torch.float16, block_d) in A.TWO_KERNEL_SAMPLE else ())
        for kind in kinds:
            for heavy, rel, cls in ((False, False, "light"), (True, False, "heavy"), (True, True, "rel")):
                for arch in (80, 90):
                    cfgs = A._configs(kind, block_d, 2, heavy, False, rel, arch, True)
                    names = [f"attention_{kind.replace('_', '')}_fp16_d{block_d}_{cls}_m{c.kwargs['BLOCK_M']}"
                             f"_n{c.kwargs['BLOCK_N']}_w{c.num_warps}_s{c.num_stages}{'_sm90' if arch == 90 else ''}"
                             for c in cfgs]
                    assert all(n in by_name for n in names), names
                    assert names[0] in first and not set(names[1:]) & first, names
                    for c in cfgs:
                        est = A._smem_estimate(kind, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], block_d, c.num_stages,
                                               2, heavy)
                        assert est <= A.SMEM_LIMIT[arch], (names[0], c)


def test_launch_picks_the_family_of_the_device(monkeypatch):
    """_arch: 90 on a compute capability 9.x GPU, 80 on others and on CPU tensors; _launch asks
    the family's first choice (the recorder stands for the kernel)."""
    assert A._arch(torch.device("cpu")) == 80
    A._cuda_arch.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: {0: (9, 0), 1: (8, 0), 2: (12, 0)}[index])
    try:
        assert [A._arch(torch.device("cuda", i)) for i in range(3)] == [90, 80, 80]
        A._cuda_arch.cache_clear()
        monkeypatch.setattr(torch.version, "hip", "6.2")  # a gfx9 GPU under ROCm: capability 9.x, no wgmma
        assert A._arch(torch.device("cuda", 0)) == 80
    finally:
        A._cuda_arch.cache_clear()
    calls = []
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(A, "first_config_only", lambda: True)  # the first config, no autotuning
    monkeypatch.setattr(torch.library, "wrap_triton", lambda fn: fn)
    for arch in (80, 90):
        A._launch("dq", _Recorder(calls), lambda kw: calls.append(kw) or (1, 1, 1), 64, 2,
                  (), {"HAS_MASK": True, "HAS_DROPOUT": False}, arch)
        want = A._configs("dq", 64, 2, True, False, False, arch)[0]
        assert {k: calls[-2][k] for k in want.kwargs} == want.kwargs
        assert (calls[-2]["num_warps"], calls[-2]["num_stages"]) == (want.num_warps, want.num_stages)
    assert calls[0] != calls[2]  # the heavy dQ at d64: its sm_80 first choice has 32 query rows


@pytest.mark.parametrize("heavy", [False, True], ids=["light", "heavy"])
@pytest.mark.parametrize("D", [40, 200])
def test_sm90_first_choice_tiles_against_reference(monkeypatch, D, heavy):
    """The interpreter runs each kernel's sm_90 first choice (a device of compute capability 9.x)
    on two sequences of two heads (several programs to decode), lengths ending mid-tile: causal
    with a padding mask ("light"), plus an additive mask ("heavy": the heavy tiles; no dropout
    here, its convention is another task's)."""
    if not A.INTERPRET:
        pytest.skip("the interpreter alone runs a fixed config; a GPU autotunes")
    monkeypatch.setattr(A, "INTERPRET_FIRST_CHOICE", True)
    monkeypatch.setattr(A, "_arch", lambda device: 90)
    used = []
    first = A._first_config
    monkeypatch.setattr(A, "_first_config", lambda *a: used.append(first(*a)) or used[-1])
    dtype = torch.float16
    q, k, v, kpm, am, dout = _inputs(2, 2, 37, 83, D, dtype=dtype, kpm_frac=0.2, mask="full" if heavy else None,
                                     seed=D)
    scale = 1.0 / math.sqrt(D)
    got = _kernels(q, k, v, kpm, am, dout, True, scale)
    block_d = A._block_d(D)
    launched = ("fwd", "dkdv_dq") if A.FUSED_DQ else KINDS  # dK/dV makes dQ too by default
    assert used == [first(kind, block_d, 2, heavy, False, False, 90) for kind in launched]
    want32 = _reference(q, k, v, kpm, am, dout, True, scale, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, scale, dtype=dtype)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name == "lse":
            assert_close(name, got[i], want32[i], atol=1e-2, rtol=1e-2)
        else:
            assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


# ----------------------------------------------------------------------------------------------
# Short lengths
# ----------------------------------------------------------------------------------------------
def test_short_lengths_get_more_candidates(monkeypatch):
    """Lengths up to SHORT_LENGTH (both) try the short candidates after the usual ones, under
    their own autotuner; longer (or symbolic) lengths do not; the first choice is the same."""
    assert A._short(128, 512) and A._short(1, 1)
    assert not A._short(513, 16) and not A._short(16, 4096) and not A._short(object(), 16)
    grew = 0
    for arch in (80, 90):
        for block_d in LOWP_D:
            for kind in KINDS:
                for heavy in (False, True):
                    long = [str(c) for c in A._configs(kind, block_d, 2, heavy, False, False, arch)]
                    short = [str(c) for c in A._configs(kind, block_d, 2, heavy, False, False, arch, True)]
                    assert short[:len(long)] == long and len(set(short)) == len(short)
                    grew += len(short) > len(long)
    assert grew >= 12
    tuners = []
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(A, "first_config_only", lambda: False)
    monkeypatch.setattr(A, "_tuned", lambda *a: tuners.append(a) or _Recorder([]))
    monkeypatch.setattr(torch.library, "wrap_triton", lambda fn: fn)
    for S in (512, 513):
        q = torch.zeros(1, 1, S, 64, dtype=torch.float16)
        A.attention_fwd(q, q, q, None, None, False, 1.0, 0.0, torch.zeros(2, dtype=torch.int64))
    assert [t[8] for t in tuners] == [True, False]  # _tuned's ``short`` (then ``tf32``)


# ----------------------------------------------------------------------------------------------
# wgmma in the SASS (ahead-of-time compiles, no GPU)
# ----------------------------------------------------------------------------------------------
_SASS_SCRIPT = r"""
import json, re, sys
from fastformer.triton_kernels import aot, attention as A
names = json.loads(sys.argv[1])
specs = {s["name"]: s for s in A.aot_specs()}
out = {}
for name in names:
    spec = specs[name]
    kernel, _ = aot._compile(spec, spec["ccs"][0])
    sass = aot.sass(kernel)
    out[name] = {"HGMMA": len(re.findall(r"\bHGMMA\.", sass)), "HMMA": len(re.findall(r"\bHMMA\.", sass)),
                 "shared": kernel.metadata.shared}
print(json.dumps(out))
"""


def _sass_names():
    """The first-choice fp16 forward, dK/dV and dQ for sm_90 at d64 and d128 (light; heavy at d64,
    where sm_90 leads with its own dK/dV and dQ tiles), and sm_80's light d64 ones: specs that
    test_triton_compile.py compiles too (Triton's cache)."""
    specs = A.aot_specs()
    first = [specs[i]["name"] for i in aot.first_choice_indices(specs)]

    def pick(kind, d, cls, sm90):
        return [n for n in first if n.startswith(f"attention_{kind}_fp16_d{d}_{cls}_m") and n.endswith("_sm90") == sm90]

    sm90 = [n for d, cls in ((64, "light"), (128, "light"), (64, "heavy")) for kind in KINDS
            for n in pick(kind, d, cls, True)]
    sm80 = [n for kind in KINDS for n in pick(kind, 64, "light", False)]
    assert len(sm90) == 9 and len(sm80) == 3, (sm90, sm80)
    return sm90, sm80


@pytest.fixture(scope="module")
def sass():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    sm90, sm80 = _sass_names()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real JIT functions
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SASS_SCRIPT, json.dumps(sm90 + sm80)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return sm90, sm80, json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm90_first_choices_run_on_wgmma(sass):
    """Every dot of the sm_90 first choices is a wgmma: HGMMA in the SASS and no HMMA (mma.sync)."""
    sm90, _, counts = sass
    bad = {n: counts[n] for n in sm90 if counts[n]["HGMMA"] == 0 or counts[n]["HMMA"] > 0}
    assert not bad, json.dumps(counts, indent=1)


def test_sm80_first_choices_run_on_mma_sync(sass):
    """sm_80 has no wgmma: its first choices' dots are HMMA (and the SASS check sees them)."""
    _, sm80, counts = sass
    bad = {n: counts[n] for n in sm80 if counts[n]["HMMA"] == 0 or counts[n]["HGMMA"] > 0}
    assert not bad, json.dumps(counts, indent=1)
