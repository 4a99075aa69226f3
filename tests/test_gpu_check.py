"""``make gpu-check`` (benchmarks/gpu_check.py): its steps, and that it fails, saying why, where
there is no GPU rather than passing by running nothing."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_steps_are_gpu_tests_check_and_cuda_bench():
    steps = dict(gpu_check.steps("OUT", python="py"))
    assert list(steps) == ["gpu-tests", "check", "bench"]
    assert steps["gpu-tests"][:5] == ["py", "-m", "pytest", "-m", "gpu"]
    assert steps["check"] == ["py", "-m", "fastformer", "check"]
    bench = steps["bench"]
    assert bench[:4] == ["py", "-m", "fastformer", "bench"]
    assert bench[bench.index("--device") + 1] == "cuda" and bench[bench.index("--out") + 1] == "OUT"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert gpu_check.main([]) == 1
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_a_failing_step_fails_the_run(tmp_path, monkeypatch):
    """Every step runs and is logged; one non-zero step makes the exit status 1."""
    import sys

    monkeypatch.setattr(gpu_check, "why_not_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    cmds = [("one", [sys.executable, "-c", "print('first')"]),
            ("two", [sys.executable, "-c", "import sys; print('second'); sys.exit(3)"]),
            ("three", [sys.executable, "-c", "print('third')"])]
    monkeypatch.setattr(gpu_check, "steps", lambda out, python=None: cmds)
    import fastformer.jobs.bench.report as report
    monkeypatch.setattr(report, "device_name", lambda device: "fake-gpu")
    assert gpu_check.main([]) == 1
    out = tmp_path / "benchmarks" / "results" / "fake-gpu"
    assert "second" in (out / "two.log").read_text() and "third" in (out / "three.log").read_text()
    summary = (out / "summary.md").read_text()
    assert "| two | FAILED (exit 3)" in summary and "| one | ok" in summary
