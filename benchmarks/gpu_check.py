"""``make gpu-check``: everything that needs a GPU, in one go, for whoever first has one.

Steps (each logged to ``benchmarks/results/<device-name>/<step>.log``; every step runs even if
an earlier one failed, and the exit status is 1 if any failed):

1. ``pytest -m gpu``: every gpu-marked test (kernels at GPU-only sizes, the per-op smoke tests
   of each GPU backend against the reference);
2. ``python -m fastformer check``: every op on every kernel backend here against the reference;
3. ``python -m fastformer bench --device cuda``: the GPU benchmarks, results in the same folder.

``summary.md`` there lists each step's status and time. Without a CUDA GPU it says why and
exits 1 at once: it never passes by running nothing.
"""
import os
import subprocess
import sys
import time
from typing import List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps(out: str, python: str = sys.executable) -> List[Tuple[str, List[str]]]:
    """(name, command) of each step, in order."""
    return [
        ("gpu-tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"]),
        ("check", [python, "-m", "fastformer", "check"]),
        ("bench", [python, "-m", "fastformer", "bench", "--device", "cuda", "--out", out]),
    ]


def why_not_gpu() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return (f"make gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    return None


def run_step(name: str, cmd: List[str], log_path: str) -> Tuple[int, float]:
    """Run one step with its output both on the terminal and in its log; (exit status, seconds)."""
    print(f"==> {name}: {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    return code, time.perf_counter() - started


def main(argv: Optional[List[str]] = None) -> int:
    reason = why_not_gpu()
    if reason:
        print(f"gpu-check: FAILED: {reason}", file=sys.stderr)
        return 1
    import torch

    sys.path.insert(0, ROOT)
    from fastformer.jobs.bench.report import device_name

    out = os.path.join(ROOT, "benchmarks", "results", device_name(torch.device("cuda")))
    os.makedirs(out, exist_ok=True)
    results = []
    for name, cmd in steps(out):
        code, seconds = run_step(name, cmd, os.path.join(out, f"{name}.log"))
        results.append((name, code, seconds))
        print(f"<== {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f}s", flush=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"# make gpu-check on {torch.cuda.get_device_name()}\n\n| step | status | seconds | log |\n|---|---|---|---|\n")
        for name, code, seconds in results:
            f.write(f"| {name} | {'ok' if code == 0 else f'FAILED (exit {code})'} | {seconds:.0f} | {name}.log |\n")
    failed = [name for name, code, _ in results if code != 0]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} (logs in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
