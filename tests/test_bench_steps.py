"""The training-step benchmarks that ``make gpu-check`` runs at GPU sizes (``--sweep gpu-check``),
run here at their tiny size (``--sweep smoke``) on the CPU: every provider that can run gives
tokens/s and peak memory, and the CUDA-graph variants (``torch.compile(mode="reduce-overhead")``)
say why they cannot run on a CPU. The plain ``torch.compile`` providers run on a CPU too, but
compile for tens of seconds: they are left to the slow tier (tests/test_bench.py, test_hf_bench.py)."""
import json

import pytest
import torch

from fastformer.jobs.bench import hf_step, train_step
from fastformer.jobs.cli import main

pytestmark = pytest.mark.usefixtures("one_thread_module")

CPU = torch.device("cpu")


def _run(tmp_path, op, providers, dtype):
    code = main(["bench", "--sweep", "smoke", "--ops", op, "--dtypes", dtype, "--providers", *providers,
                 "--no-plots", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    return {r["provider"]: r for r in json.load(open(tmp_path / "results.json"))["results"] if r["op"] == op}


def _timed(rec):
    assert rec["status"] == "ok", (rec["provider"], rec["status"])
    assert rec["tokens_per_s"] > 0 and rec["peak_mem_mb"] is not None and rec["peak_mem_mb"] > 0
    assert 0 < rec["min_ms"] <= rec["median_ms"]
    assert rec["timer"] == "wall" and rec["host_median_ms"] is None  # a CPU: wall time, no host column


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_train_step_runs_tiny_for_each_provider(tmp_path, dtype):
    recs = _run(tmp_path, "train_step", [train_step.AUTO, train_step.EAGER, train_step.AUTO_GRAPHS], dtype)
    assert {train_step.AUTO, train_step.EAGER, train_step.AUTO_GRAPHS} <= set(recs)
    _timed(recs[train_step.AUTO])
    _timed(recs[train_step.EAGER])
    skipped = recs[train_step.AUTO_GRAPHS]["status"]
    assert skipped.startswith("skipped: ") and "reduce-overhead" in skipped and "CUDA" in skipped
    assert recs[train_step.AUTO]["speedup_vs_eager"] == pytest.approx(
        recs[train_step.EAGER]["min_ms"] / recs[train_step.AUTO]["min_ms"])


def test_hf_step_runs_tiny_for_each_provider(tmp_path):
    pytest.importorskip("transformers", reason="transformers is an optional dependency (pip install transformers)")
    providers = [hf_step.EAGER, hf_step.FASTFORMER, hf_step.FASTFORMER_GRAPHS]
    recs = _run(tmp_path, hf_step.OP, providers, "bf16")
    assert set(recs) == set(providers)
    _timed(recs[hf_step.EAGER])
    if hf_step.why_not(hf_step.FASTFORMER, CPU) is None:
        _timed(recs[hf_step.FASTFORMER])
    skipped = recs[hf_step.FASTFORMER_GRAPHS]["status"]
    assert skipped.startswith("skipped: ") and "reduce-overhead" in skipped and "CUDA" in skipped


def test_auto_is_fastformers_own_choice_and_graphs_need_cuda():
    assert train_step.why_not(train_step.AUTO, CPU) is None
    assert train_step._backend(train_step.AUTO) is None and train_step._backend(train_step.AUTO_GRAPHS) is None
    assert "needs a CUDA device" in train_step.why_not(train_step.AUTO_GRAPHS, CPU)
    assert train_step.why_not(train_step.AUTO_GRAPHS, torch.device("cuda")) is None
    # on a CPU auto is the cpu backend: its default rows stay what they were
    assert train_step.AUTO not in train_step.providers_for(CPU) and train_step.AUTO in train_step.providers_for(
        torch.device("cuda"))
    assert train_step.AUTO_GRAPHS in train_step.COMPILED and hf_step.FASTFORMER_GRAPHS in hf_step.COMPILED
    with pytest.raises(RuntimeError, match="CUDA"):
        train_step.build_step(train_step.AUTO_GRAPHS, train_step.sweep("cpu", "smoke")[0], CPU, "fp32")
