"""Every Triton kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100), no GPU needed.

Runs ``python -m fastformer.triton_kernels.aot --cc 80 --cc 90 --configs first`` in a subprocess with
TRITON_INTERPRET removed (the interpreter replaces @triton.jit functions by numpy emulations),
then checks its report: every module of ``fastformer.triton_kernels.MODULES`` contributes ``aot_specs()``,
every selected spec compiles for both targets, no kernel spills registers to local memory, and
no kernel needs more shared memory than the target gives one block. The table of registers,
spills and shared memory per kernel prints with ``pytest -s`` and is attached to every failure
message.

By default only each specialisation's *first-choice* config is compiled (dtype x feature class x
head-dim / hidden-size bucket, the config the host launches first): that keeps ``make test``
quick. ``FASTFORMER_AOT_ALL=1`` compiles every autotune candidate instead (``--configs all``:
hundreds of compiles, tens of minutes on two cores; the full validation a GPU check runs).
A private ``TRITON_CACHE_DIR`` makes the run cold; a rerun over Triton's cache is quick.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.slow,
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CCS = (80, 90)
CONFIGS = "all" if os.environ.get("FASTFORMER_AOT_ALL", "0") == "1" else "first"
# A guard against hangs, not a budget: a cold build is one triton.compile per spec and target
# (seconds each on two cores); a rerun reuses Triton's cache and takes well under a minute.
TIMEOUT_S = 3600


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "fastformer.triton_kernels.aot", "--json", str(path), "--jobs", "2",
           "--configs", CONFIGS]
    for cc in CCS:
        cmd += ["--cc", str(cc)]
    # Its own session, so that a timeout ends the compile workers too, not only their parent.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S} s; its progress:\n{stderr[-5000:]}")
    print(stdout)
    assert path.exists(), (f"{' '.join(cmd)} wrote no report (exit {proc.returncode}):\n"
                           f"{stdout}\n{stderr[-5000:]}")
    with open(path) as f:
        report = json.load(f)
    return report, f"\n{stdout}"


def test_every_module_contributes_specs(aot):
    report, table = aot
    from fastformer.triton_kernels import MODULES
    assert set(report["modules"]) == set(MODULES), table
    for name, info in report["modules"].items():
        assert info["error"] is None, f"module {name}: {info['error']}{table}"
        assert info["specs"] > 0, f"module {name} has no aot_specs(){table}"


def test_every_spec_compiles_for_both_targets(aot):
    report, table = aot
    assert report["configs"] == CONFIGS, table
    compiled = {(r["module"], r["index"], r["cc"]) for r in report["kernels"] if "error" not in r}
    # each selected spec on its targets (a spec of one config family names its own: its "ccs")
    missing = [(name, i, cc) for name, info in report["modules"].items() for i, cc in info["targets"]
               if (name, i, cc) not in compiled]
    for name, info in report["modules"].items():
        assert {i for i, _ in info["targets"]} == set(info["selected"]), f"{name}: a spec has no target{table}"
        assert {cc for _, cc in info["targets"]} == set(CCS), f"{name}: not built for every target{table}"
    errors = [f"{r['name']} sm_{r['cc']}:\n{r.get('traceback', r['error'])[-3000:]}"
              for r in report["kernels"] if "error" in r]
    assert not missing and not errors, (f"{len(missing)} of {len(report['kernels'])} compiles failed:\n"
                                        + "\n".join(errors[:5]) + table)
    for r in report["kernels"]:
        assert 0 < r["registers"] <= 255, f"{r['name']} sm_{r['cc']}: {r['registers']} registers{table}"


def test_shared_memory_fits_each_target(aot):
    report, table = aot
    over = [f"{r['name']} sm_{r['cc']}: {r['shared'] + r['static_shared']} B > {r['smem_limit']} B"
            for r in report["kernels"] if "error" not in r and not r["fits"]]
    assert not over, "\n".join(over) + table


def test_no_kernel_spills(aot):
    from fastformer.triton_kernels.aot import spill_message, spills
    report, table = aot
    spilling = [spill_message(r) for r in report["kernels"] if "error" not in r and spills(r)]
    assert not spilling, (f"{len(spilling)} kernel/config/arch combinations spill registers:\n"
                          + "\n".join(spilling) + table)


def test_the_default_attention_backward_is_compiled(aot):
    """The attention backward the host launches by default (padded and packed), dK/dV making dQ
    (attention.FUSED_DQ), is compiled at every first choice; the two-kernel backward of the opt-out
    (FASTFORMER_TRITON_FUSED_DQ=0) for attention.TWO_KERNEL_SAMPLE only, which keeps this run
    short (with the opt-out set, in full: then no fused kernel)."""
    report, table = aot
    from fastformer.triton_kernels import attention as A
    for module in ("attention", "attention_varlen"):  # the padded and the packed (varlen) layouts alike
        names = [r["name"] for r in report["kernels"] if r["module"] == module]
        fused = [n for n in names if n.startswith(f"{module}_dkdvdq_")]
        two = [n for n in names if n.startswith((f"{module}_dkdv_", f"{module}_dq_"))]
        fwd = [n for n in names if n.startswith(f"{module}_fwd_")]
        # fp16, bf16, fp32 with ieee and with tf32 dots; light, heavy, rel; one spec per family
        every = 4 * len(A.BLOCK_D_BUCKETS) * 3 * len(A.ARCHS)
        assert len(fwd) == every, module + table
        if A.FUSED_DQ:
            assert len(fused) == every and len(two) == 2 * len(A.TWO_KERNEL_SAMPLE) * 3 * len(A.ARCHS), module + table
        else:
            assert not fused and len(two) == 2 * every, module + table
