"""The Triton attention backward with dQ made in the dK/dV kernel (attention.FUSED_DQ, BACKWARD.md
in fastformer/triton_kernels): each key block adds dS K to one fp32 accumulator a query tile, in
key-block order. Against the reference's gradients (fp32 and bf16, causal with Sq < Sk and
Sq > Sk, key padding, dropout with the reference's bits, several key tiles a query tile), the same
bits run to run, and the dQ kernel not launched.

Without a GPU everything runs in Triton's interpreter on CPU tensors (tests/conftest.py), where
the programs run one at a time in id order: a key block whose turn has not come makes its tiles' dQ
NaN (a wrong order fails there instead of spinning). The ordering between concurrent key
blocks is exercised on a GPU only (test_fused_dq_ordering_on_gpu, in make gpu-check's gpu-tests:
skipped in the interpreter); the compiled kernel's PTX (pipelined, acquire / release, no spills)
ahead of time, no GPU needed."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from fastformer import philox
from test_attention_triton import LOWP_FACTOR, _check_fp32, _inputs, _kernels, _reference
from utils import assert_close, assert_close_lowp, kernel_backends, run_jit_script, spy_launches

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fused(monkeypatch, small_blocks):
    """FUSED_DQ on, 16 x 16 tiles in the interpreter (several key tiles add to each query tile);
    yields the kinds of the kernels each backward launches."""
    monkeypatch.setattr(A, "FUSED_DQ", True)
    yield spy_launches(monkeypatch, A)


# (B, H, Sq, Sk, D, causal, kpm_frac, p): Sk of 3-7 key tiles; causal Sq > Sk leaves query
# tiles no key block sees (key block 0 zeroes them), Sq < Sk key blocks that see no query
CASES = {
    "plain": (1, 2, 37, 50, 16, False, 0.0, 0.0),
    "causal_sq_lt_sk": (1, 1, 40, 70, 24, True, 0.0, 0.0),
    "causal_sq_gt_sk": (2, 1, 75, 33, 16, True, 0.3, 0.0),
    "kpm_dropout": (1, 2, 45, 60, 16, False, 0.3, 0.2),
    "causal_dropout": (1, 1, 50, 47, 32, True, 0.2, 0.3),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_dq_matches_reference(case, fused):
    B, H, Sq, Sk, D, causal, kpm_frac, p = CASES[case]
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=kpm_frac, seed=3)
    got = _kernels(q, k, v, kpm, am, dout, causal, 0.25, p, 7, 2**32 - 5)
    assert "dq" not in fused and "dkdv_dq" in fused, f"launched {fused}"
    # dropout: the reference draws the same bits (philox.py's v3 convention), so any bit the fused
    # kernel made differently from the forward shows up in dq, dk or dv
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, causal, 0.25, p, 7, 2**32 - 5))


def test_fused_dq_bf16(fused):
    """bf16 inputs: FlashAttention's rule against the fp32 reference; dQ is written in bf16 by
    each query tile's last key block."""
    B, H, Sq, Sk, D = 1, 2, 45, 61, 40
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, dtype=torch.bfloat16, kpm_frac=0.2)
    got = _kernels(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0)
    assert "dq" not in fused
    want32 = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=torch.bfloat16)
    for i, name in ((2, "dq"), (3, "dk"), (4, "dv")):
        assert got[i].dtype == torch.bfloat16, name
        assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


def test_fused_dq_deterministic_and_equal_to_two_kernels(fused, monkeypatch):
    """Two runs give the same bits; the two-kernel backward (dQ kernel) agrees to rounding."""
    B, H, Sq, Sk, D = 1, 1, 33, 50, 16
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=0.1, seed=5)
    first = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    second = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name}: two runs differ"
    monkeypatch.setattr(A, "FUSED_DQ", False)
    fused.clear()
    two = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    assert "dq" in fused and "dkdv_dq" not in fused, f"launched {fused}"
    for name, a, b in zip(("dq", "dk", "dv"), first[2:], two[2:]):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feature", ["gqa", "rel_bias"])
def test_fused_dq_gqa_and_rel_bias_equal_two_kernels(feature, fused, monkeypatch):
    """Grouped-query heads (dQ per query head, k / v shared by two) and a relative position bias
    (its gradient from the same dS^T): the fused backward gives the two-kernel one's gradients
    (those are checked against the reference in test_attention_gqa.py / test_attention_rel_bias.py)."""
    B, H, Sq, Sk, D = 1, 2, 24, 40, 16
    g = torch.Generator().manual_seed(9)
    hk = H // 2 if feature == "gqa" else H
    q, dout = (torch.randn(B, H, Sq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, hk, Sk, D, generator=g) for _ in range(2))
    kw = dict(rel_bias=torch.randn(H, 2 * 7 + 1, generator=g), rel_shift=3) if feature == "rel_bias" else {}
    results = []
    for on in (True, False):
        monkeypatch.setattr(A, "FUSED_DQ", on)
        out, lse = A.attention_fwd(q, k, v, None, None, True, 0.3, 0.2, philox.pack(1, 2), **kw)
        results.append(A.attention_bwd(dout, q, k, v, out, lse, None, None, True, 0.3, 0.2, philox.pack(1, 2), **kw))
    assert fused.count("dkdv_dq") == 1 and fused.count("dq") == 1, f"launched {fused}"
    names = ("dq", "dk", "dv", "drel") if feature == "rel_bias" else ("dq", "dk", "dv")
    for name, a, b in zip(names, *results):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


# Run in a process of its own: a spin-wait that never ends (a key block waiting on a counter
# nobody advances) hangs the GPU, and only killing the process ends it; the limit keeps such a
# hang from eating make gpu-check's window (its gpu-tests step, benchmarks/gpu_check.py). The
# first config of each kernel (utils.first_configs, as deterministic mode launches): no
# autotuning, so the compiles fit in the limit.
ORDERING_TIMEOUT_S = 90
_ORDERING_SCRIPT = r"""
import torch
from fastformer import philox
from fastformer.triton_kernels import attention as A, utils
kinds = []
launch = A._launch
A._launch = lambda kind, *a, **kw: kinds.append(kind) or launch(kind, *a, **kw)
B, H, S, D = 2, 4, 1024, 64
rng = lambda: philox.pack(3, 4)
with utils.first_configs():
    for dtype in (torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(1)
        q, k, v, dout = (torch.randn(B, H, S, D, generator=g).to("cuda", dtype) for _ in range(4))
        kpm = (torch.rand(B, S, generator=g) < 0.1).cuda()
        A.FUSED_DQ = True
        out, lse = A.attention_fwd(q, k, v, kpm, None, True, 0.125, 0.1, rng())
        first = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, rng())
        for run in range(20):
            again = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, rng())
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"{dtype} run {run + 1}: {name} differs from the first run's"
        A.FUSED_DQ = False
        two = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, rng())
        for name, a, b in zip(("dq", "dk", "dv"), first, two):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=f"{dtype} {name}")
assert "dkdv_dq" in kinds and "dq" in kinds, kinds
torch.cuda.synchronize()
print("ordered")
"""


@pytest.mark.gpu
@pytest.mark.skipif(A.INTERPRET, reason="the interpreter runs the programs one at a time in id order: the "
                                        "ordered hand-over between concurrent key blocks needs a GPU")
def test_fused_dq_ordering_on_gpu():
    """Many concurrent key blocks a query tile (causal, dropout, 1024 x 1024, fp16 and bf16): 20
    backward runs give the first run's bits (a block that read the partial sums before its turn,
    or saw a stale copy, would change them), and the two-kernel backward's dQ to rounding; in a
    process of its own, killed past ORDERING_TIMEOUT_S (a hung spin-wait fails the test)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen([sys.executable, "-c", _ORDERING_SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=ORDERING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the fused backward did not finish in {ORDERING_TIMEOUT_S} s (a spin-wait that never "
                    f"ends?):\n{output[-3000:]}")
    assert proc.returncode == 0 and "ordered" in output, output[-5000:]


def test_fused_dq_very_negative_scores_ragged_keys(fused):
    """Every score near -280 and Sk not a multiple of the key tile: past Sk, P = exp2(0 - lse)
    overflows to inf in the dK/dV tile (harmless there, those keys are never stored); dQ must
    not turn it into inf x 0 = NaN."""
    B, H, Sq, Sk, D = 1, 1, 20, 40, 16
    g = torch.Generator().manual_seed(4)
    q = torch.full((B, H, Sq, D), 4.0)
    k = -torch.rand(B, H, Sk, D, generator=g) - 4.0
    v, dout = torch.randn(B, H, Sk, D, generator=g), torch.randn(B, H, Sq, D, generator=g)
    got = _kernels(q, k, v, None, None, dout, False, 1.0)
    assert "dq" not in fused
    _check_fp32(got, _reference(q, k, v, None, None, dout, False, 1.0))


# The first-choice fused kernel of the heavy class (dropout, masks) compiled ahead of time for
# sm_80 (test_triton_compile.py compiles the same spec: Triton's cache), its PTX read back.
_PTX_SCRIPT = r"""
import json, re
from fastformer.triton_kernels import aot, attention as A
specs = A.aot_specs()
[spec] = [specs[i] for i in aot.first_choice_indices(specs)
          if re.fullmatch(r"attention_dkdvdq_fp16_d64_heavy_m\d+_n\d+_w\d+_s\d+", specs[i]["name"])]
kernel, log = aot._compile(spec, 80)
row = aot._resources(kernel, 80, log)
ptx = kernel.asm["ptx"]
print(json.dumps({"name": spec["name"], "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)),
                  "acquire": len(re.findall(r"\bld\.global\.(?:gpu\.acquire|acquire\.gpu)\b", ptx)),
                  "release": len(re.findall(r"\batom\.global\.(?:gpu\.release|release\.gpu)\.exch\b", ptx)),
                  "spills": aot.spills(row), "registers": row["registers"]}))
"""


def test_fused_kernel_ptx_pipelined_ordered_no_spills():
    """The fused dK/dV + dQ kernel as a GPU runs it (sm_80 PTX, no GPU needed): the query-tile
    loop is software-pipelined (cp.async: the hand-over's barrier is inline asm, which Triton's
    pipeliner does not see; tl.debug_barrier made it skip the loop), the wait is an acquire load
    and the hand-over a release exchange, and nothing spills."""
    got = run_jit_script(_PTX_SCRIPT, ROOT)
    assert got["cp_async"] > 0, f"{got}: the query-tile loop is not pipelined"
    assert got["acquire"] >= 1 and got["release"] >= 1, f"{got}: no acquire load / release exchange"
    assert got["spills"] == 0, f"{got}: spills"


def test_fused_kind_takes_dkdv_configs_led_by_its_own():
    """The fused kind ("dkdv_dq") autotunes over dK/dV's configs; where _CONFIGS_FUSED lists a
    lead (dK/dV's first choice spilled with dQ: tests/test_triton_compile.py compiles every first
    choice), that one is first and the launch's first config."""
    assert A._CONFIGS_FUSED
    for (block_d, tag, cls, arch, varlen), (bm, bn, warps, stages) in A._CONFIGS_FUSED.items():
        elt, tf32 = (4, True) if tag == "tf32" else (tag, False)
        args = (block_d, elt, cls != "light", varlen, cls == "rel", arch, False, tf32)
        fused, two = A._configs("dkdv_dq", *args), A._configs("dkdv", *args)
        assert (fused[0].kwargs, fused[0].num_warps, fused[0].num_stages) == (
            {"BLOCK_M": bm, "BLOCK_N": bn}, warps, stages)
        assert [str(c) for c in fused[1:]] == [str(c) for c in two if str(c) != str(fused[0])]
        assert A._first_config("dkdv_dq", block_d, elt, cls != "light", varlen, cls == "rel", arch, tf32) == dict(
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    # the packed layout's own lead: not the padded one's
    assert A._configs("dkdv_dq", 32, 2, True, True, True, 80)[0].kwargs == {"BLOCK_M": 16, "BLOCK_N": 64}
    assert A._configs("dkdv_dq", 32, 2, True, False, True, 80)[0].kwargs == (
        A._configs("dkdv", 32, 2, True, False, True, 80)[0].kwargs)
    # a class it does not list: dK/dV's configs as they are
    assert [str(c) for c in A._configs("dkdv_dq", 64, 2, True, False, False, 80)] == [
        str(c) for c in A._configs("dkdv", 64, 2, True, False, False, 80)]
