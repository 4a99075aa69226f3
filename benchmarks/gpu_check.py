"""``make gpu-check``: everything that needs a GPU, in one go and in about nine minutes, for whoever
first has one (``make gpu-check`` prepares the Python it runs in: tools/gpu_env.py).

Steps, each logged to ``benchmarks/results/<gpu-name>/<step>.log``, in this order, with the time
each is expected to take on one H100/H200 (measured on the H200 where a time is given as
"measured", else estimated) and the most it may take (its limit):

==================================== ========== ===== ================================================
step                                 expected   limit what
==================================== ========== ===== ================================================
``build``                            83 s meas.  180  tools/find_nvcc.py, then ``pip install -e .``
``error-path``                        4 s meas.   30  a CUDA glue check raises, not crashes
``check``                            80 s meas.   80  ``python -m fastformer check``
``graph-dropout``                    ~40 s        90  tests/test_gpu_graph_dropout.py: capture & replay
``bench-train_step-d512``            ~40 s        90  step table, fastformer auto vs eager PyTorch
``bench-hf_bart_step-d512``          ~40 s        90  step table, converted BART vs transformers (sdpa)
``bench-attention-d64`` / ``-d128``  50 / 58 s   100  the attention grid, one run per head dim
``bench-<op>`` (5 ops)               ~25 s each   40  add_layer_norm (23 s meas.), feed_forward, ...
``bench-train_step-d1024``           ~45 s        90  as d512, the big model
``bench-hf_bart_step-d1024``         ~45 s        90  as d512, the big model
``bench-train_step-d512-compiled``   ~150 s      240  reduce-overhead fastformer vs torch.compile
``bench-hf_bart_step-d512-compiled`` ~150 s      240  the same for BART (transformers + compile)
``bench-*-d1024-compiled`` (2)       ~160 s      240  the same, the big model
``gpu-tests``                        ~120 s      150  ``pytest -m gpu`` (all but graph-dropout)
==================================== ========== ===== ================================================

**What gives way when time is short.** The run has one time budget (``--budget``, default 540 s:
nine minutes, which leaves a 15-minute loan the machine's start and ``tools/gpu_env.py``). The
correctness steps (build, error-path, check, graph-dropout, gpu-tests) are *kept*: the limit of
every kept step still to come is held back from the benchmarks, so the GPU tests run even after a
slow build. The benchmarks share what is left, in the order above: a benchmark that cannot get
its expected time is skipped (recorded so in ``summary.md``), and the next, shorter ones still may
run. So the last benchmarks give way first: the compiled step tables (d1024 first, then d512),
then the d1024 step tables, then the other ops' tables (attention_varlen first), then attention
(D128 before D64); the d512 step tables give way last. On a cold H200 (83 s build, 80 s check)
the nine minutes hold the correctness steps, the d512 step tables, attention at D64 and perhaps
D128 or a couple of the other ops; run the rest in a later loan
with ``--steps`` (e.g. ``python benchmarks/gpu_check.py --steps 'bench-*-compiled'``: build and
error-path always run).

Every step runs even if an earlier one failed (a step that would start after the budget is
recorded as skipped; a benchmark the budget's end stops before its own limit is recorded as cut
short, not failed), and the exit status is 1 if any step failed. What each step does:

1. ``build``: tools/find_nvcc.py picks an nvcc of torch's CUDA major (pip-installing NVIDIA's
   when the machine's is of another major; where it cannot, one line says so and the extension
   is built without its CUDA kernels), then ``pip install --use-pep517 --no-build-isolation -e .``
   into the venv, as ``make build`` does (an in-place ``build_ext`` alone left the Triton
   kernels, installed as fastformer.triton_kernels, unimportable on the first machine);
2. ``error-path``: one CUDA glue check that fails with an integer in its message must raise a
   RuntimeError, not crash the process (it crashed in the first GPU build, built by a g++ that
   links libstdc++ statically: tools/libstdcxx.py now swaps such a CXX for the system's); when
   it crashes, the log gets what the process loaded (which objects define libstdc++'s stream
   and locale code, which compilers built the extension);
3. ``check``: ``python -m fastformer check`` (before the benchmarks, so that a run cut short has it);
4. ``graph-dropout``: a small model with dropout captured with ``torch.cuda.graph``: each replay
   must draw a fresh dropout mask, the one eager code draws at that generator state;
5. ``bench-<op>``: ``python -m fastformer bench --sweep gpu-check`` per op (attention in two
   runs, one per head dim): attention over the grid B 8, H 16, S 512/2048, D 64/128, causal or
   not, dropout 0 or 0.1, forward and backward, fastformer's cuda and triton backends against
   SDPA's flash kernel and eager PyTorch (TFLOP/s); the other ops at their quick shapes against
   their torch composition (GB/s or TFLOP/s; linear_cross_entropy forward + backward in one,
   as its forward computes the gradients); ``results.json`` and ``results.md`` (every op's
   table) and ``attention.md`` (the grid, one row per shape and mode, one column per provider)
   in the same folder;
6. ``bench-train_step-<d>`` / ``bench-hf_bart_step-<d>`` (``-compiled``): the whole training step
   (zero_grad, forward, label-smoothed loss, backward, Adam) at the GPU sizes
   (``train_step.GPU_SHAPES``: d_model 512 and 1024, 6+6 layers, 64 sentences of up to 128
   tokens, a quarter of them padding, bf16 autocast, dropout 0.1): tokens/s, device and host time
   per step and peak memory of ``fastformer.models.Seq2SeqTransformer`` (``fastformer-auto``) and
   of eager PyTorch's ``nn.Transformer`` model (``torch-eager``), then in their own run (the
   compilations take most of it) the fastformer model under ``torch.compile(mode="reduce-overhead")``
   and the torch model under ``torch.compile``; for BART, transformers (sdpa) and the converted
   model, then transformers under ``torch.compile`` and the converted model under reduce-overhead;
7. ``gpu-tests``: ``pytest -m gpu`` (test files importing a package that is not installed are
   left out, and the log's first line says which), without the SIMT harness.

``summary.md`` there lists each step's status and time, and ``results.md`` every table (the
speed-ups over eager and compiled PyTorch taken across the step tables' two runs). Without a CUDA
GPU it says why in one line and exits 1 at once: it never passes by running nothing.
"""
import argparse
import ast
import fnmatch
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import libstdcxx  # noqa: E402  (tools/: what a crash in the error path is looked at with)

# the ops benchmarked after attention (each its own `fastformer bench` run, so a slow one costs
# only its own records)
BENCH_OPS = ["attention", "add_layer_norm", "feed_forward", "cross_entropy", "linear_cross_entropy",
             "attention_varlen"]  # not embedding: one more step's limit would overrun a 15-minute GPU loan
# named, so that the log says why one cannot run; torch.compile is left out (a compilation per
# shape would take the whole budget)
BENCH_PROVIDERS = ["torch-eager", "fastformer-cuda", "fastformer-triton", "sdpa-flash", "fastformer-padded",
                   "torch-copy-alone", "torch-linear-cross-entropy-chunked"]
# linear_cross_entropy's forward computes the gradients too (chunk by chunk, never the (N, V)
# logits), so its backward alone only scales them: it is timed as one forward + backward
BENCH_MODES = {"linear_cross_entropy": ["fwd_bwd"]}
# the training-step tables: per model, the providers of its first run and of its compiled run
STEP_BENCHES = {"train_step": (["fastformer-auto", "torch-eager"],
                               ["fastformer-auto-reduce-overhead", "torch-compile"]),
                "hf_bart_step": (["transformers-fastformer", "transformers"],
                                 ["transformers-fastformer-reduce-overhead", "transformers-compile"])}
STEP_SHAPES = ["d512", "d1024"]  # a word of each train_step.GPU_SHAPES label (--shapes)
STEP_DTYPES = ["bf16"]  # bf16 autocast
GRAPH_TEST = os.path.join("tests", "test_gpu_graph_dropout.py")
# (step, seconds it may take at most): the budget caps each further
STEP_LIMITS = {"build": 180, "error-path": 30, "bench-attention-d64": 100, "bench-attention-d128": 100,
               "gpu-tests": 150, "check": 80, "graph-dropout": 90}
BENCH_LIMIT = 40  # each other op's bench
STEP_BENCH_LIMIT, COMPILED_STEP_LIMIT = 90, 240  # a step table's run; its compiled run
# (step name pattern, seconds it is expected to take): a benchmark is skipped when the budget
# cannot give it this much (measured on the H200 where known, see the docstring)
EXPECTED = [("bench-attention-d64", 50), ("bench-attention-d128", 58), ("bench-*-compiled", 150),
            ("bench-train_step-*", 40), ("bench-hf_bart_step-*", 40), ("bench-*", 25)]
KEPT = ("build", "error-path", "check", "graph-dropout", "gpu-tests")  # their time is held back from the benchmarks


def expected_seconds(name: str) -> float:
    """How long a step is expected to take (0: not a benchmark; kept steps run with what is left)."""
    return next((t for pattern, t in EXPECTED if fnmatch.fnmatch(name, pattern)), 0.0)


@dataclass
class Step:
    name: str
    cmd: List[str]
    limit: float
    env: Dict[str, str] = field(default_factory=dict)
    skip: Optional[str] = None  # why it does not run (it is then recorded as skipped)
    note: str = ""  # one line written first in its log


def why_not_gpu() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return (f"make gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    return None


def missing_modules(names: Sequence[str]) -> List[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def top_level_imports(path: str) -> List[str]:
    """The top-level packages a file imports at module level (what its collection needs)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module.split(".")[0])
    return names


def unimportable_tests(tests_dir: str, missing: Sequence[str]) -> Dict[str, List[str]]:
    """test file -> the missing packages it imports at module level (pytest would fail to collect
    it, and a collection error fails the whole run)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(tests_dir, "*.py"))):
        gone = sorted(set(top_level_imports(path)) & set(missing))
        if gone:
            out[path] = gone
    return out


def bench_step(op: str, out: str, python: str, plots: bool, shapes: Sequence[str] = ()) -> Step:
    """One `fastformer bench` run (``shapes``: only the op's shapes whose label has these words)."""
    cmd = [python, "-m", "fastformer", "bench", "--device", "cuda", "--sweep", "gpu-check", "--ops", op,
           "--modes", *BENCH_MODES.get(op, ["fwd", "bwd"]), "--providers", *BENCH_PROVIDERS, "--out", out]
    name = "-".join([f"bench-{op}"] + [w.lower() for w in shapes])
    return Step(name, cmd + (["--shapes", *shapes] if shapes else []) + ([] if plots else ["--no-plots"]),
                STEP_LIMITS.get(name, BENCH_LIMIT))


def step_bench(op: str, shape: str, out: str, python: str, plots: bool, compiled: bool) -> Step:
    """One `fastformer bench` run of a training step (``op``: train_step or hf_bart_step) at one of
    the GPU sizes (``shape``: d512 or d1024), its eager providers or (``compiled``) its compiled ones."""
    providers = STEP_BENCHES[op][1 if compiled else 0]
    cmd = [python, "-m", "fastformer", "bench", "--device", "cuda", "--sweep", "gpu-check", "--ops", op,
           "--dtypes", *STEP_DTYPES, "--providers", *providers, "--shapes", shape, "--out", out]
    name = f"bench-{op}-{shape}" + ("-compiled" if compiled else "")
    return Step(name, cmd + ([] if plots else ["--no-plots"]), COMPILED_STEP_LIMIT if compiled else STEP_BENCH_LIMIT)


def time_for(steps: Sequence[Step], index: int, left: float) -> Tuple[float, Optional[str]]:
    """Seconds step ``index`` may run when ``left`` seconds of the budget remain, or why it is
    skipped: a kept step gets what is left; a benchmark gets what is left after the limits of the
    kept steps still to come, and is skipped when that is under its expected time."""
    step = steps[index]
    if step.name in KEPT:
        return (min(step.limit, left), None) if left >= 5 else (0.0, "out of the budget")
    kept = [s for s in steps[index + 1:] if s.name in KEPT and s.skip is None]
    held = sum(s.limit for s in kept)
    share = left - held
    if share < max(5.0, expected_seconds(step.name)):
        return 0.0, "out of the budget" + (f" ({max(share, 0):.0f}s left, {held:.0f}s kept for "
                                           f"{', '.join(s.name for s in kept)})" if kept else "")
    return min(step.limit, share), None


def select(steps: Sequence[Step], patterns: Optional[Sequence[str]]) -> None:
    """``--steps``: leave out (as skipped) the steps no pattern names; build and error-path always run."""
    if not patterns:
        return
    for step in steps:
        if step.skip is None and step.name not in ("build", "error-path") and \
                not any(fnmatch.fnmatch(step.name, p) for p in patterns):
            step.skip = "not selected (--steps)"


def steps(out: str, python: str = sys.executable, cuda_home: Optional[str] = None,
          nvcc_note: str = "", missing: Sequence[str] = ()) -> List[Step]:
    """The steps, in order. ``cuda_home``: the toolkit to build the CUDA kernels with (None: build
    without them, ``nvcc_note`` says why); ``missing``: packages that are not installed."""
    build_env = {"MAX_JOBS": str(os.cpu_count() or 4)}
    build_env.update({"CUDA_HOME": cuda_home} if cuda_home else {"FASTFORMER_BUILD_CUDA": "0"})
    # --use-pep517: where wheel is installed and there is no pyproject.toml, pip otherwise runs
    # `setup.py develop`, which in setuptools >= 80 calls pip again with build isolation (network)
    install = [python, "-m", "pip", "install", "--quiet", "--use-pep517", "--no-build-isolation", "--no-deps",
               "--no-index", "-e", "."]
    result = [Step("build", install, STEP_LIMITS["build"], build_env,
                   note=nvcc_note),
              Step("error-path", [python, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--probe"],
                   STEP_LIMITS["error-path"],
                   skip=None if cuda_home else "the CUDA kernels are not built (no nvcc of torch's CUDA)")]
    # the quick correctness check first, so that a run cut short by its budget still has it
    result.append(Step("check", [python, "-m", "fastformer", "check"], STEP_LIMITS["check"]))
    tests = [python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    no_pytest = "pytest is not installed" if "pytest" in missing else None
    # capture and replay with dropout: a correctness check, before the benchmarks
    result.append(Step("graph-dropout", tests + [GRAPH_TEST], STEP_LIMITS["graph-dropout"],
                       {"FASTFORMER_CUDA_SIMT": "off"}, skip=no_pytest))
    from fastformer.jobs.bench.ops import GPU_CHECK_ATTENTION

    plots = "matplotlib" not in missing
    # the training steps at the base size first (the figure a user reads), then attention in two
    # runs, one per head dim (each compiles its own Triton kernels, so that a run cut short by its
    # limit loses half the grid, not all of it), the other ops, the big size, then the compiled
    # steps (minutes of compilation): what comes last gives way first
    first = len(result)
    result += [step_bench(op, STEP_SHAPES[0], out, python, plots, False) for op in STEP_BENCHES]
    result += [bench_step("attention", out, python, plots, shapes=[f"D{d}"]) for d in GPU_CHECK_ATTENTION["D"]]
    result += [bench_step(op, out, python, plots) for op in BENCH_OPS if op != "attention"]
    result += [step_bench(op, shape, out, python, plots, False) for shape in STEP_SHAPES[1:] for op in STEP_BENCHES]
    result += [step_bench(op, shape, out, python, plots, True) for shape in STEP_SHAPES for op in STEP_BENCHES]
    if "transformers" in missing:
        for step in result[first:]:
            if step.name.startswith("bench-hf_bart_step"):
                step.skip = "transformers is not installed"
    left_out = unimportable_tests(os.path.join(ROOT, "tests"), missing)
    tests += [f"--ignore={path}" for path in left_out]
    if os.path.join(ROOT, GRAPH_TEST) not in left_out:
        tests.append(f"--ignore={os.path.join(ROOT, GRAPH_TEST)}")  # run on its own above
    note = ""
    if left_out:
        note = (f"left out {len(left_out)} test files that import what is not installed "
                f"({', '.join(sorted({m for ms in left_out.values() for m in ms}))}): "
                + ", ".join(os.path.basename(p) for p in left_out))
    # FASTFORMER_CUDA_SIMT=off: the CPU harness of the CUDA kernels (tests/simt) is not what a GPU
    # checks, and building it took the step's time
    result.append(Step("gpu-tests", tests + ["tests"], STEP_LIMITS["gpu-tests"], {"FASTFORMER_CUDA_SIMT": "off"},
                       note=note, skip=no_pytest))
    return result


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def status_of(code: Optional[int], timed_out: bool = False, skip: Optional[str] = None) -> str:
    if skip:
        return f"skipped: {skip}"
    if timed_out:
        return "FAILED (out of time)"
    if code == 0:
        return "ok"
    return f"FAILED ({_signal_name(code)})" if code is not None and code < 0 else f"FAILED (exit {code})"


def run_step(step: Step, log_path: str, limit: float) -> Tuple[Optional[int], float, bool]:
    """Run one step with its output both on the terminal and in its log, for at most ``limit``
    seconds (then its process group is killed); (exit status, seconds, timed out)."""
    print(f"==> {step.name}: {' '.join(step.cmd)}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        if step.note:
            print(f"    {step.note}", flush=True)
            log.write(f"# {step.note}\n")
        log.write(f"$ {' '.join(step.cmd)}\n")
        log.flush()
        proc = subprocess.Popen(step.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **step.env}, start_new_session=True)
        deadline = started + limit
        timed_out = False

        def watchdog():  # the output is read line by line below; this kills the group past the limit
            nonlocal timed_out
            while proc.poll() is None:
                if time.perf_counter() > deadline:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    return
                time.sleep(0.5)

        threading.Thread(target=watchdog, daemon=True).start()
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
        if timed_out:
            log.write(f"\n# killed after {limit:.0f}s (the step's share of the time budget)\n")
    return code, time.perf_counter() - started, timed_out


# -- the error-path probe and the report of a crash ---------------------------------------------
def probe() -> int:
    """One failing check of the CUDA glue whose message formats integers must raise."""
    import torch

    import fastformer
    from fastformer import _ext, philox

    print("backends:", {k: (a.available, a.reason) for k, a in fastformer.available_backends().items()})
    if _ext.load_error():
        print(f"error-path: the extension is not loaded: {_ext.load_error()}")
        return 1
    import fastformer._C as ext

    private = libstdcxx.defined_markers(ext.__file__)
    if private:
        print(f"error-path: FAILED: {ext.__file__} carries its own libstdc++ (defines {', '.join(private)}): "
              f"build it with a compiler whose libstdc++ this process loads, without -static-libstdc++")
        return 1
    dev = torch.device("cuda")
    q, k, v = (torch.randn(n, 2, 8, device=dev) for n in (5, 7, 7))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 4, 7], dtype=torch.int32, device=dev)
    try:
        torch.ops.fastformer.attention_varlen_fwd(q, k, v, cu_q, cu_k, -1, 4, False, 0.5, 0.0, philox.pack(0, 0))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        ok = "got -1" in first
        print(f"error-path: {'ok' if ok else 'FAILED'}: RuntimeError: {first}")
        return 0 if ok else 1
    print("error-path: FAILED: max_seqlen_q = -1 was accepted")
    return 1


def abi_report() -> int:
    """What a crash in the error path is looked at with: the C++ runtime objects in the process,
    each one that defines libstdc++'s integer output (std::ostream::_M_insert<long>) or its locale
    (two definitions: two copies of the locale's facet ids, the classic cause of a crash in integer
    formatting only), and the compilers named in the extension's .comment section."""
    import torch  # noqa: F401  (load what a real run has loaded)

    import fastformer._C as ext

    with open("/proc/self/maps") as f:
        objects = sorted({line.split()[-1] for line in f if ".so" in line.split()[-1]})
    print(f"extension: {ext.__file__}")
    for obj in objects:
        found = libstdcxx.defined_markers(obj)
        if found is None:
            print(f"nm unavailable; loaded objects: {' '.join(objects)}")
            break
        if found:
            print(f"defines {', '.join(found)}: {obj}")
    for cmd in (["readelf", "-p", ".comment", ext.__file__], ["ldd", ext.__file__]):
        try:
            print(f"$ {' '.join(cmd)}\n" + subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"$ {' '.join(cmd)}: {e}")
    for var in ("CC", "CXX", "LD_LIBRARY_PATH", "LD_PRELOAD"):
        print(f"{var}={os.environ.get(var, '')}")
    return 0


# -- the results ----------------------------------------------------------------------------------
def attention_table(records: List[Dict]) -> str:
    """The attention grid as one Markdown table: a row per (shape, dtype, mode), a column per
    provider, each cell its TFLOP/s (from the best time) or its error, and fastformer's
    backends over SDPA's flash kernel."""
    rows = [r for r in records if r["op"] == "attention"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    keys = list(dict.fromkeys((r["label"], r["dtype"], r["mode"]) for r in rows))
    cell = {(r["label"], r["dtype"], r["mode"], r["provider"]): r for r in rows}
    ratios = [p for p in ("fastformer-cuda", "fastformer-triton") if p in providers]
    head = ["shape", "dtype", "mode"] + [f"{p} TFLOP/s" for p in providers] + [f"{p} / flash" for p in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(r: Optional[Dict]) -> str:
        if r is None:
            return "-"
        if r["status"] != "ok":
            return r["status"].replace("|", "/")[:60]
        return f"{r['throughput']:.1f}"

    for label, dtype, mode in keys:
        cells = [label, dtype, mode] + [fmt(cell.get((label, dtype, mode, p))) for p in providers]
        flash = cell.get((label, dtype, mode, "sdpa-flash"))
        for p in ratios:
            r = cell.get((label, dtype, mode, p))
            ok = r and flash and r["status"] == "ok" and flash["status"] == "ok"
            cells.append(f"{flash['min_ms'] / r['min_ms']:.2f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def attention_dropout_table(records: List[Dict]) -> str:
    """What dropout costs each provider in the attention grid: a row per (shape without the
    dropout, dtype, mode), each provider's best time with dropout minus its best time without (ms),
    and fastformer's costs over SDPA flash's (issue 45's target: at most 1.00x); "-" where a
    provider lacks either time."""
    rows = [r for r in records if r["op"] == "attention" and r["status"] == "ok"]
    best = {}
    for r in rows:
        shape, _, p = r["label"].rpartition(" p")
        best[shape, r["dtype"], r["mode"], r["provider"], float(p)] = r["min_ms"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    keys = list(dict.fromkeys(k[:3] for k in best if k[4] > 0.0))
    cost = {}
    for shape, dtype, mode, provider, p in best:
        if p > 0.0 and (shape, dtype, mode, provider, 0.0) in best:
            cost[shape, dtype, mode, provider] = (best[shape, dtype, mode, provider, p]
                                                  - best[shape, dtype, mode, provider, 0.0])
    ratios = [p for p in ("fastformer-cuda", "fastformer-triton") if p in providers]
    head = ["shape", "dtype", "mode"] + [f"{p} +ms" for p in providers] + [f"{p} / flash" for p in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        cells = list(key) + [f"{cost[key + (p,)]:+.3f}" if key + (p,) in cost else "-" for p in providers]
        flash = cost.get(key + ("sdpa-flash",))
        for p in ratios:
            ours = cost.get(key + (p,))
            ok = ours is not None and flash is not None and flash > 0.0
            cells.append(f"{ours / flash:.2f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: str, gpu: str, results: List[Tuple[str, str, float]]) -> None:
    """``summary.md`` (each step's status and seconds, then the attention grid), and
    ``results.md`` rewritten from ``results.json`` with every op's table (each bench run wrote only
    its own op's)."""
    records: List[Dict] = []
    path = os.path.join(out, "results.json")
    if os.path.exists(path):
        with open(path) as f:
            records = json.load(f).get("results", [])
    lines = [f"# make gpu-check on {gpu}\n", "| step | status | seconds | log |", "|---|---|---|---|"]
    lines += [f"| {name} | {status} | {seconds:.0f} | {name}.log |" for name, status, seconds in results]
    text = "\n".join(lines) + "\n"
    if any(r["op"] == "attention" for r in records):
        table = attention_table(records)
        drop = attention_dropout_table(records)
        with open(os.path.join(out, "attention.md"), "w") as f:
            f.write(f"# attention on {gpu}: TFLOP/s from the best of 10 timed calls (CUDA events)\n\n{table}"
                    f"\n## what dropout 0.1 costs (ms added to the best time)\n\n{drop}")
        text += f"\n## attention\n\n{table}\n## attention: what dropout costs\n\n{drop}"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    if records:
        from fastformer.jobs.bench import report

        # the speed-ups again over all records: a step's eager and compiled providers ran apart
        report.add_speedups(records)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(f"fastformer bench (gpu-check) on {gpu}\n\n" + report.markdown(records))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="make gpu-check: build, GPU tests, check and benchmarks")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together (default 540)")
    p.add_argument("--steps", nargs="+", default=None, metavar="PATTERN",
                   help="run only the steps these glob patterns name (build and error-path always run), "
                        "e.g. 'bench-*-compiled' gpu-tests")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--abi-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # the checkout's fastformer (built in place) and tools/: run as a script, only benchmarks/ is on the path
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
    if args.probe:
        return probe()
    if args.abi_report:
        return abi_report()
    reason = why_not_gpu()
    if reason:
        print(f"gpu-check: FAILED: {reason}", file=sys.stderr)
        return 1
    import torch

    from fastformer.jobs.bench.report import device_name
    import find_nvcc

    out = os.path.join(ROOT, "benchmarks", "results", device_name(torch.device("cuda")))
    os.makedirs(out, exist_ok=True)
    nvcc = find_nvcc.find(torch.version.cuda, install=True)
    note = nvcc.message if nvcc.cuda_home else f"building WITHOUT the CUDA kernels: {nvcc.message}"
    print(f"gpu-check: {note}", flush=True)
    libstdcxx.use_shared("gpu-check")  # the CC/CXX that the build, the harness and the crash report inherit
    missing = missing_modules(["pytest", "hypothesis", "matplotlib", "transformers", "triton"])
    if missing:
        print(f"gpu-check: not installed here, so left out where needed: {', '.join(missing)}", flush=True)
    started = time.perf_counter()
    # no nvcc of torch's CUDA: everything else still runs, but the run fails, saying why
    results = [] if nvcc.cuda_home else [("nvcc", f"FAILED: {nvcc.message}", 0.0)]
    planned = steps(out, cuda_home=nvcc.cuda_home, nvcc_note=note, missing=missing)
    select(planned, args.steps)
    for index, step in enumerate(planned):
        left = args.budget - (time.perf_counter() - started)
        allowed, why = time_for(planned, index, left)
        if step.skip is None and why:
            step.skip = why.replace("the budget", f"the {args.budget:.0f}s budget", 1)
        if step.skip:
            status, seconds = status_of(None, skip=step.skip), 0.0
        else:
            log_path = os.path.join(out, f"{step.name}.log")
            code, seconds, timed_out = run_step(step, log_path, allowed)
            status = status_of(code, timed_out)
            if timed_out and step.name not in KEPT and allowed < step.limit:
                # a benchmark stopped by the budget's end, not by its own limit: no failure, no result
                status = f"cut short: the budget left it {allowed:.0f}s of its {step.limit:.0f}s"
            if step.name == "error-path" and code is not None and code < 0:
                # the crash itself printed nothing useful: what the process had loaded, in its log
                report = subprocess.run([sys.executable, __file__, "--abi-report"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=120)
                with open(log_path, "a") as log:
                    log.write(f"\n# the process died of {_signal_name(code)}; what it had loaded:\n"
                              + report.stdout + report.stderr)
        results.append((step.name, status, seconds))
        print(f"<== {step.name}: {status} in {seconds:.0f}s", flush=True)
    write_results(out, torch.cuda.get_device_name(), results)
    failed = [name for name, status, _ in results if status.startswith("FAILED")]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} "
          f"in {time.perf_counter() - started:.0f}s (logs in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
