"""``make gpu-check`` (benchmarks/gpu_check.py): its steps and their time limits, what it leaves
out when a package or nvcc is missing, the tables it writes, and that it fails, saying why,
where there is no GPU rather than passing by running nothing."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def _steps(**kw):
    return {s.name: s for s in gpu_check.steps("OUT", python="py", **kw)}


def _modes(cmd):
    return cmd[cmd.index("--modes") + 1:cmd.index("--providers")]


STEP_TABLES = ["bench-train_step-d512", "bench-hf_bart_step-d512"]
STEP_TABLES_BIG = ["bench-train_step-d1024", "bench-hf_bart_step-d1024"]
STEP_TABLES_COMPILED = ["bench-train_step-d512-compiled", "bench-hf_bart_step-d512-compiled",
                        "bench-train_step-d1024-compiled", "bench-hf_bart_step-d1024-compiled"]


def test_steps_build_probe_check_then_bench_every_op_then_tests():
    steps = _steps(cuda_home="/cuda")
    assert list(steps) == (["build", "error-path", "check", "graph-dropout"] + STEP_TABLES
                           + ["bench-attention-d64", "bench-attention-d128", "bench-add_layer_norm", "bench-feed_forward", "bench-cross_entropy",
                              "bench-linear_cross_entropy", "bench-attention_varlen"]
                           + STEP_TABLES_BIG + STEP_TABLES_COMPILED + ["gpu-tests"])
    build = steps["build"]
    # installed as make build does: an in-place build_ext leaves fastformer.triton_kernels unimportable
    assert build.cmd[:3] == ["py", "-m", "pip"] and build.cmd[-2:] == ["-e", "."] and "--no-build-isolation" in build.cmd
    assert build.env["CUDA_HOME"] == "/cuda"
    assert "FASTFORMER_BUILD_CUDA" not in build.env
    bench = steps["bench-attention-d128"].cmd
    assert bench[:4] == ["py", "-m", "fastformer", "bench"]
    assert bench[bench.index("--sweep") + 1] == "gpu-check" and bench[bench.index("--out") + 1] == "OUT"
    assert bench[bench.index("--ops") + 1] == "attention" and "--no-plots" not in bench
    assert bench[bench.index("--shapes"):] == ["--shapes", "D128"]
    assert "--shapes" not in steps["bench-feed_forward"].cmd
    assert _modes(bench) == ["fwd", "bwd"]
    # its forward computes the gradients: a backward alone would be timed nearly free
    assert _modes(steps["bench-linear_cross_entropy"].cmd) == ["fwd_bwd"]
    providers = bench[bench.index("--providers") + 1:bench.index("--out")]
    assert {"fastformer-cuda", "fastformer-triton", "sdpa-flash", "torch-eager"} <= set(providers)
    assert "torch-compile" not in providers  # a compilation per shape would take the whole budget
    assert steps["gpu-tests"].cmd[:5] == ["py", "-m", "pytest", "-m", "gpu"]
    assert steps["gpu-tests"].env == {"FASTFORMER_CUDA_SIMT": "off"}  # the CPU harness is no GPU check
    assert steps["check"].cmd == ["py", "-m", "fastformer", "check"]
    assert all(s.skip is None for s in steps.values())
    # the kept (correctness) steps at their limits fit the default budget (nine minutes); the
    # benchmarks share what is left (test_the_budget_keeps_the_tests_and_the_last_benchmarks_give_way)
    assert sum(s.limit for s in steps.values() if s.name in gpu_check.KEPT) <= 540
    assert "default=540.0" in open(gpu_check.__file__).read()


def test_without_nvcc_the_build_leaves_out_the_cuda_kernels_and_says_why():
    steps = _steps(cuda_home=None, nvcc_note="building WITHOUT the CUDA kernels: no nvcc of CUDA 12")
    assert steps["build"].env["FASTFORMER_BUILD_CUDA"] == "0" and "CUDA_HOME" not in steps["build"].env
    assert steps["build"].note.startswith("building WITHOUT")
    assert "not built" in steps["error-path"].skip


def test_missing_packages_leave_out_what_needs_them(tmp_path, monkeypatch):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import os\nfrom hypothesis import given\n")
    (tests / "test_b.py").write_text("import torch\n\ndef f():\n    import hypothesis\n")  # imported late: fine
    (tests / "test_c.py").write_text("import transformers.models\n")
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    steps = _steps(cuda_home="/cuda", missing=["hypothesis", "transformers", "matplotlib"])
    cmd = steps["gpu-tests"].cmd
    assert [c for c in cmd if c.startswith("--ignore=")] == [f"--ignore={tests / 'test_a.py'}",
                                                             f"--ignore={tests / 'test_c.py'}",
                                                             f"--ignore={tests / 'test_gpu_graph_dropout.py'}"]
    assert steps["gpu-tests"].note == ("left out 2 test files that import what is not installed "
                                       "(hypothesis, transformers): test_a.py, test_c.py")
    assert "--no-plots" in steps["bench-attention-d64"].cmd
    assert _steps(cuda_home="/cuda", missing=["pytest"])["gpu-tests"].skip == "pytest is not installed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err and len(err.strip().splitlines()) == 1


def _fake_gpu(monkeypatch, tmp_path, steps, cuda_home="/cuda"):
    import fastformer.jobs.bench.report as report

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import find_nvcc

    monkeypatch.setattr(gpu_check, "why_not_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "steps", lambda out, **kw: steps)
    monkeypatch.setattr(report, "device_name", lambda device: "fake-gpu")
    monkeypatch.setattr(find_nvcc, "find", lambda version, install: find_nvcc.Result(cuda_home, "nvcc: test"))
    return tmp_path / "benchmarks" / "results" / "fake-gpu"


def test_a_failing_step_fails_the_run(tmp_path, monkeypatch):
    """Every step runs and is logged; one non-zero step makes the exit status 1."""
    py = sys.executable
    out = _fake_gpu(monkeypatch, tmp_path, [
        gpu_check.Step("one", [py, "-c", "print('first')"], 60),
        gpu_check.Step("two", [py, "-c", "import sys; print('second'); sys.exit(3)"], 60),
        gpu_check.Step("three", [py, "-c", "print('third')"], 60, note="a note"),
        gpu_check.Step("four", [py, "-c", "print('never')"], 60, skip="not wanted here")])
    assert gpu_check.main([]) == 1
    assert "second" in (out / "two.log").read_text()
    assert (out / "three.log").read_text().startswith("# a note\n") and "third" in (out / "three.log").read_text()
    assert not (out / "four.log").exists()
    summary = (out / "summary.md").read_text()
    assert "| two | FAILED (exit 3)" in summary and "| one | ok" in summary
    assert "| four | skipped: not wanted here" in summary


def test_no_nvcc_fails_the_run_though_every_step_passes(tmp_path, monkeypatch):
    out = _fake_gpu(monkeypatch, tmp_path, [gpu_check.Step("one", [sys.executable, "-c", "pass"], 60)], cuda_home=None)
    assert gpu_check.main([]) == 1
    assert "| nvcc | FAILED: nvcc: test |" in (out / "summary.md").read_text()


def test_a_step_past_its_limit_is_killed_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    py = sys.executable
    out = _fake_gpu(monkeypatch, tmp_path, [
        gpu_check.Step("slow", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 1),
        gpu_check.Step("late", [py, "-c", "pass"], 60)])
    assert gpu_check.main(["--budget", "6"]) == 1
    summary = (out / "summary.md").read_text()
    assert "| slow | FAILED (out of time) |" in summary
    assert "| late | skipped: out of the 6s budget |" in summary
    assert "killed after 1s" in (out / "slow.log").read_text()


def _rec(label, mode, provider, ms, status="ok"):
    return {"op": "attention", "label": label, "dtype": "bf16", "mode": mode, "provider": provider,
            "status": status, "min_ms": ms if status == "ok" else None, "median_ms": ms,
            "throughput": 100.0 / ms if status == "ok" else None, "unit": "TFLOP/s",
            "q25_ms": ms, "q75_ms": ms, "iqr_ms": 0.0, "tokens_per_s": 1.0, "peak_mem_mb": 1.0,
            "first_call_ms": ms}


def test_attention_table_has_a_row_per_shape_and_mode_and_ratios_to_flash():
    records = [_rec("S512 full p0", "fwd", "sdpa-flash", 1.0), _rec("S512 full p0", "fwd", "fastformer-cuda", 2.0),
               _rec("S512 full p0", "fwd", "fastformer-triton", 0.5),
               _rec("S512 full p0", "bwd", "sdpa-flash", 2.0),
               _rec("S512 full p0", "bwd", "fastformer-cuda", 0, status="error: RuntimeError: out of memory"),
               _rec("S512 full p0", "bwd", "fastformer-triton", 4.0)]
    lines = gpu_check.attention_table(records).splitlines()
    assert lines[0] == ("| shape | dtype | mode | sdpa-flash TFLOP/s | fastformer-cuda TFLOP/s | fastformer-triton TFLOP/s"
                        " | fastformer-cuda / flash | fastformer-triton / flash |")
    assert lines[2] == "| S512 full p0 | bf16 | fwd | 100.0 | 50.0 | 200.0 | 0.50x | 2.00x |"
    assert lines[3] == "| S512 full p0 | bf16 | bwd | 50.0 | error: RuntimeError: out of memory | 25.0 | - | 0.50x |"


def test_dropout_table_subtracts_each_providers_time_without_dropout():
    records = [_rec("S512 full p0", "fwd", "sdpa-flash", 1.0), _rec("S512 full p0.1", "fwd", "sdpa-flash", 1.25),
               _rec("S512 full p0", "fwd", "fastformer-cuda", 2.0), _rec("S512 full p0.1", "fwd", "fastformer-cuda", 2.5),
               _rec("S512 full p0", "bwd", "sdpa-flash", 2.0), _rec("S512 full p0.1", "bwd", "sdpa-flash", 2.5),
               _rec("S512 full p0", "bwd", "fastformer-cuda", 3.0),
               _rec("S512 full p0.1", "bwd", "fastformer-cuda", 0, status="error: RuntimeError: out of memory"),
               _rec("S2048 causal p0.1", "fwd", "sdpa-flash", 9.0)]  # no run without dropout: no row
    lines = gpu_check.attention_dropout_table(records).splitlines()
    assert lines[0] == "| shape | dtype | mode | sdpa-flash +ms | fastformer-cuda +ms | fastformer-cuda / flash |"
    assert lines[2] == "| S512 full | bf16 | fwd | +0.250 | +0.500 | 2.00x |"
    assert lines[3] == "| S512 full | bf16 | bwd | +0.500 | - | - |"
    assert lines[4].startswith("| S2048 causal | bf16 | fwd | - |") and len(lines) == 5


def test_results_are_written_as_tables_beside_the_json(tmp_path):
    records = [_rec("S512 full p0", "fwd", "sdpa-flash", 1.0), _rec("S512 full p0", "fwd", "fastformer-cuda", 2.0)]
    (tmp_path / "results.json").write_text(json.dumps({"machine": {}, "settings": {}, "results": records}))
    gpu_check.write_results(str(tmp_path), "Fake GPU", [("build", "ok", 61.0), ("bench-attention", "ok", 30.0)])
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# make gpu-check on Fake GPU") and "| build | ok | 61 | build.log |" in summary
    assert "| S512 full p0 | bf16 | fwd | 100.0 | 50.0 | 0.50x |" in summary
    assert "| S512 full p0 | bf16 | fwd | 100.0 | 50.0 | 0.50x |" in (tmp_path / "attention.md").read_text()
    assert "### attention" in (tmp_path / "results.md").read_text()
    assert "what dropout costs" in summary


def test_abi_report_names_the_one_libstdcxx_of_a_healthy_process():
    """What the error-path step logs after a crash, run as the step runs it (a script, from the
    checkout): here, with an extension linked as usual, only libstdc++ itself defines its stream
    and locale code."""
    from fastformer import _ext

    if _ext.load_error():
        pytest.skip(f"the extension is not built here: {_ext.load_error()}")
    if not shutil.which("nm"):
        pytest.skip("needs nm (binutils)")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--abi-report"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    defining = [line for line in proc.stdout.splitlines() if line.startswith("defines ")]
    assert len(defining) == 1 and "libstdc++.so" in defining[0], proc.stdout
    assert "$ ldd " in proc.stdout and "CXX=" in proc.stdout


def _opt(cmd, flag):
    """The values after ``flag`` up to the next option."""
    i = cmd.index(flag) + 1
    j = next((k for k in range(i, len(cmd)) if cmd[k].startswith("--")), len(cmd))
    return cmd[i:j]


def test_the_training_steps_run_at_the_gpu_sizes_for_every_provider():
    """The step tables: fastformer (auto) and eager PyTorch, then fastformer under reduce-overhead
    and torch.compile; BART plain (sdpa), converted, compiled; bf16 autocast; d_model 512 and 1024,
    6+6 layers, 64 sentences of up to 128 tokens, a quarter padding, dropout 0.1."""
    from fastformer.jobs.bench import hf_step, train_step

    steps = _steps(cuda_home="/cuda")
    providers = {}
    for name in STEP_TABLES + STEP_TABLES_BIG + STEP_TABLES_COMPILED:
        cmd = steps[name].cmd
        op = _opt(cmd, "--ops")[0]
        assert cmd[:4] == ["py", "-m", "fastformer", "bench"] and _opt(cmd, "--device") == ["cuda"]
        assert _opt(cmd, "--sweep") == ["gpu-check"] and _opt(cmd, "--dtypes") == ["bf16"]
        shape = _opt(cmd, "--shapes")
        assert shape == [name.split("-")[2]] and shape[0] in ("d512", "d1024")
        # the shape word picks exactly one of the sweep's shapes, the one of that d_model
        sweep = train_step.sweep("cuda", "gpu-check")
        picked = [s for s in sweep if shape[0] in (hf_step.label(s) if op == hf_step.OP else train_step.label(s)).split()]
        assert len(picked) == 1 and picked[0]["d_model"] == int(shape[0][1:])
        providers.setdefault(op, set()).update(_opt(cmd, "--providers"))
        assert steps[name].limit == (240 if name.endswith("-compiled") else 90)
    assert providers["train_step"] == {"fastformer-auto", "torch-eager", "fastformer-auto-reduce-overhead",
                                       "torch-compile"}
    assert providers["hf_bart_step"] == {"transformers", "transformers-compile", "transformers-fastformer",
                                         "transformers-fastformer-reduce-overhead"}
    assert all(p in train_step.PROVIDERS for p in providers["train_step"])
    assert all(p in hf_step.PROVIDERS for p in providers["hf_bart_step"])
    for shape, d in zip(train_step.sweep("cuda", "gpu-check"), (512, 1024)):
        assert (shape["d_model"], shape["heads"], shape["ffn"], shape["layers"], shape["B"], shape["S"],
                shape["dropout"]) == (d, d // 64, 4 * d, 6, 64, 128, 0.1)
        assert hf_step.sweep("cuda", "gpu-check") == train_step.sweep("cuda", "gpu-check")
        src, tgt = train_step.make_batch(shape, torch.device("cpu"))
        assert src.shape == (64, 128) and 0.15 < (src == train_step.PAD).float().mean().item() < 0.35


def test_the_capture_and_replay_test_runs_early_and_once():
    steps = _steps(cuda_home="/cuda")
    graph = steps["graph-dropout"].cmd
    assert graph[:5] == ["py", "-m", "pytest", "-m", "gpu"] and graph[-1] == gpu_check.GRAPH_TEST
    assert steps["graph-dropout"].env == {"FASTFORMER_CUDA_SIMT": "off"}
    assert f"--ignore={os.path.join(gpu_check.ROOT, gpu_check.GRAPH_TEST)}" in steps["gpu-tests"].cmd
    text = open(os.path.join(ROOT, gpu_check.GRAPH_TEST)).read()
    assert "pytest.mark.gpu" in text and "torch.cuda.graph(" in text and "replay()" in text
    assert "graph-dropout" in gpu_check.KEPT


def _simulate(budget, took, steps=None):
    """The run's plan when each step takes ``took(name)`` seconds: name -> seconds it ran, or why
    it was skipped."""
    steps = steps or list(_steps(cuda_home="/cuda").values())
    spent, plan = 0.0, {}
    for i, step in enumerate(steps):
        allowed, why = gpu_check.time_for(steps, i, budget - spent)
        if why:
            plan[step.name] = why
            continue
        ran = min(took(step.name), allowed)
        plan[step.name] = ran
        spent += ran
    return plan, spent


def test_the_budget_keeps_the_tests_and_the_last_benchmarks_give_way():
    """On a cold H200 (build 83 s, check 80 s, as measured) the nine minutes run every kept step,
    the d512 step tables and attention at D64; the compiled and big step tables give way; with
    time to spare everything runs."""
    took = {"build": 83, "error-path": 4, "check": 80, "graph-dropout": 40, "gpu-tests": 120}
    plan, spent = _simulate(540, lambda n: took.get(n, gpu_check.expected_seconds(n)))
    assert spent <= 540
    assert all(isinstance(plan[n], (int, float)) for n in gpu_check.KEPT)  # the tests are never squeezed out
    assert plan["gpu-tests"] == 120
    for name in STEP_TABLES + ["bench-attention-d64"]:
        assert isinstance(plan[name], (int, float)), (name, plan[name])
    for name in STEP_TABLES_BIG + STEP_TABLES_COMPILED:
        assert isinstance(plan[name], str) and plan[name].startswith("out of the budget"), name
        assert "kept for gpu-tests" in plan[name]
    plan, _ = _simulate(60 * 60, lambda n: took.get(n, gpu_check.expected_seconds(n)))
    assert all(isinstance(v, (int, float)) for v in plan.values())
    # a benchmark that cannot get its expected time is skipped, a shorter one after it may still run
    steps = [gpu_check.Step("bench-train_step-d512-compiled", [], 240), gpu_check.Step("bench-feed_forward", [], 40),
             gpu_check.Step("gpu-tests", [], 150)]
    plan, _ = _simulate(150 + 100, lambda n: 20, steps)
    assert isinstance(plan["bench-train_step-d512-compiled"], str) and plan["bench-feed_forward"] == 20
    assert plan["gpu-tests"] == 20


def test_steps_selects_by_pattern_and_always_builds():
    steps = list(_steps(cuda_home="/cuda").values())
    gpu_check.select(steps, ["bench-*-compiled", "gpu-tests"])
    run = [s.name for s in steps if s.skip is None]
    assert run == ["build", "error-path"] + STEP_TABLES_COMPILED + ["gpu-tests"]
    assert all(s.skip == "not selected (--steps)" for s in steps if s.name not in run)


def test_without_transformers_the_bart_step_tables_are_skipped():
    steps = _steps(cuda_home="/cuda", missing=["transformers"])
    assert all(s.skip == "transformers is not installed" for n, s in steps.items() if "hf_bart_step" in n)
    assert steps["bench-train_step-d512"].skip is None


def test_a_benchmark_the_budget_stops_is_cut_short_not_failed(tmp_path, monkeypatch):
    """A benchmark given less than its limit by the budget and stopped there fails nothing; one
    past its own limit, and a kept step past the budget, do fail the run."""
    py = sys.executable
    sleep = [py, "-c", "import time; time.sleep(60)"]
    out = _fake_gpu(monkeypatch, tmp_path, [gpu_check.Step("slow", sleep, 60)])  # no expected time: it starts
    assert gpu_check.main(["--budget", "6"]) == 0
    assert "| slow | cut short: the budget left it 6s of its 60s |" in (out / "summary.md").read_text()
    _fake_gpu(monkeypatch, tmp_path, [gpu_check.Step("slow", sleep, 1)])
    assert gpu_check.main(["--budget", "30"]) == 1
    assert "| slow | FAILED (out of time) |" in (out / "summary.md").read_text()
    _fake_gpu(monkeypatch, tmp_path, [gpu_check.Step("check", sleep, 60)])
    assert gpu_check.main(["--budget", "6"]) == 1
    assert "| check | FAILED (out of time) |" in (out / "summary.md").read_text()


def test_gpu_tests_run_the_fused_dq_ordering_stress_under_a_time_limit():
    """The gpu-tests step (pytest -m gpu) runs the Triton fused-dQ ordering stress test (its file
    is not left out, the test carries the gpu mark), and the test's own limit on its process (a
    spin-wait that never ends hangs the GPU) is shorter than the step's: a hang fails that test,
    the rest of the step still runs."""
    import ast
    path = os.path.join(ROOT, "tests", "test_attention_triton_fused_dq.py")
    tree = ast.parse(open(path).read())
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "test_fused_dq_ordering_on_gpu"]
    assert "pytest.mark.gpu" in [ast.unparse(d) for d in fn.decorator_list]
    cmd = _steps(cuda_home="/cuda")["gpu-tests"].cmd
    assert not [c for c in cmd if c.startswith("--ignore") and c.endswith("test_attention_triton_fused_dq.py")]
    [limit] = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", None) == "ORDERING_TIMEOUT_S"]
    assert 0 < limit < gpu_check.STEP_LIMITS["gpu-tests"]
