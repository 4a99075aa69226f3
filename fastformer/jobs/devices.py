"""Where a job runs: its device, its CPU threads, its dtype and its kernel backend.

Shared by ``train``, ``translate`` and ``bench``, so each flag means the same in every job.
"""
import contextlib
import os
import statistics
import time
from typing import Callable, Optional

import torch

LOADAVG = "/proc/loadavg"
OWN_TASKS = "/proc/self/task"
THREADS_HELP = ("torch CPU threads (default: one per core, or 1 when other work already keeps every core "
                "busy as the job starts)")
DTYPES = ("auto", "fp32", "bf16")


def pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` is CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be one of 'auto', 'cpu', 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch.cuda.is_available() is False")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> str:
    """``--dtype``: ``auto`` is bf16 autocast on a CUDA GPU that has bf16 (tensor-core speed,
    fp32 statistics and master weights) and fp32 elsewhere (a CPU without native bf16 GEMMs
    gains little from it); ``fp32`` and ``bf16`` are taken as given."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {name!r}")
    if name != "auto":
        return name
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def backend_context(name: str):
    """``fastformer.use_backend(name)``, or nothing for ``"auto"`` (so ``FASTFORMER_BACKEND`` and
    ``fastformer.set_backend`` still apply)."""
    import fastformer

    return contextlib.nullcontext() if name == "auto" else fastformer.use_backend(name)


def _own_running_threads(task_dir: str) -> int:
    """This process's threads in state R (at least 1: the one reading)."""
    running = 0
    try:
        for tid in os.listdir(task_dir):
            with open(os.path.join(task_dir, tid, "stat")) as f:
                # "pid (comm) S ...": the state follows the last ')' (comm may hold spaces)
                running += f.read().rpartition(")")[2].split()[0] == "R"
    except (OSError, IndexError):
        pass
    return max(1, running)


def runnable_elsewhere(loadavg: str = LOADAVG, own_tasks: str = OWN_TASKS, samples: int = 5,
                       interval: float = 0.02) -> Optional[float]:
    """How many tasks other than this process's are running or ready to run now: the median of
    ``samples`` reads, ``interval`` seconds apart, of the 4th field of ``/proc/loadavg``
    ("running/total", this process's running threads included, so they are taken off).
    None where that file cannot be read (no /proc).

    Unlike the load average, this does not remember the last minute, so the build that
    ``make demo`` ran just before training does not count as load."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(interval)
        try:
            with open(loadavg) as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        counts.append(max(0, running - _own_running_threads(own_tasks)))
    return float(statistics.median(counts))


def machine_load(loadavg: str = LOADAVG) -> float:
    """Work competing for the cores as the job starts: :func:`runnable_elsewhere`, or on a
    system without ``/proc`` the 1-minute load average (0 when that is unknown too)."""
    now = runnable_elsewhere(loadavg)
    if now is not None:
        return now
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def pick_threads(threads: Optional[int], processes_here: int = 1,
                 load: Callable[[], float] = machine_load) -> int:
    """The CPU threads to run with: ``threads`` if given; else torch's default shared among the
    ``processes_here`` processes of this job on the machine, except on a machine where other
    work (``load()``, the job's own other processes not counted) already occupies every core:
    there extra OpenMP threads would mostly wait on each other, and one thread runs fastest."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads!r}")
        return threads
    default = max(1, torch.get_num_threads() // max(1, processes_here))
    if default == 1:
        return 1
    others = load() - (processes_here - 1)  # the sibling processes are not competition
    return 1 if others >= (os.cpu_count() or 1) else default
