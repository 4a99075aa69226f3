"""Timing and peak memory of one benchmarked callable.

Timing: the first call is timed alone (it includes any compilation), then warm-up calls,
then repeated calls until both ``min_reps`` and ``min_time`` are reached (or ``max_reps``);
each call is timed on its own so the median and the inter-quartile range can be reported.
On CUDA the callable itself synchronises and times itself with CUDA events (see
:func:`synchronized`): the samples are the GPU's time between the events, without the
synchronisation's host round trip (the first call stays wall time: it includes compilation).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over one call, above what was
allocated before it. On CPU, ``tracemalloc`` does not see torch's allocator, so one call runs
under ``torch.profiler`` with ``profile_memory=True`` and the allocation/free events of the
CPU allocator are replayed in time order; the peak is the highest running total.
"""
import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class Timing:
    median_ms: float
    q25_ms: float
    q75_ms: float
    reps: int
    first_call_ms: float
    min_ms: float = float("nan")
    samples_ms: Tuple[float, ...] = ()  # every timed call, in call order (rep i of interleaved callables: i-th)

    @property
    def iqr_ms(self) -> float:
        return self.q75_ms - self.q25_ms


def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronisation when ``device`` is a GPU; the returned callable
    then also keeps, as ``device_seconds``, the GPU time of its last call (CUDA events around it)."""
    if device.type != "cuda":
        return fn

    def run():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize(device)
        run.device_seconds = start.elapsed_time(end) / 1e3
        return out

    run.device_seconds = None
    return run


def _call(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` took: its own device time when it keeps one, else wall time."""
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    device = getattr(fn, "device_seconds", None)
    return wall if device is None else device


def _quantile(sorted_values: List[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def measure(fn: Callable[[], object], *, warmup: int = 2, min_reps: int = 5, max_reps: int = 200,
            min_time: float = 0.2, max_time: float = 10.0) -> Timing:
    """Time ``fn`` (already synchronising): the first call, ``warmup`` more, then the samples."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    samples: List[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps:
        samples.append(_call(fn))
        spent = time.perf_counter() - start
        if len(samples) >= min_reps and spent >= min_time:
            break
        if spent >= max_time and len(samples) >= 1:
            break
    return _timing(samples, first)


def _timing(samples: List[float], first: float) -> Timing:
    ms = sorted(s * 1e3 for s in samples)
    return Timing(median_ms=statistics.median(ms), q25_ms=_quantile(ms, 0.25), q75_ms=_quantile(ms, 0.75),
                  reps=len(ms), first_call_ms=first * 1e3, min_ms=ms[0], samples_ms=tuple(s * 1e3 for s in samples))


def measure_interleaved(fns: Dict[str, Callable[[], object]], *, warmup: int = 2, min_reps: int = 5,
                        max_reps: int = 50, min_time: float = 0.0) -> Dict[str, Timing]:
    """Time several callables that are compared with each other, interleaved: each repetition
    calls every one of them once (in an order rotated every repetition), so a change in the
    machine's load hits all of them alike instead of whichever happened to run then. Stops after
    ``max_reps`` repetitions, or once there are ``min_reps`` and ``min_time`` seconds have passed."""
    names = list(fns)
    first: Dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        fns[name]()
        first[name] = time.perf_counter() - t0
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: Dict[str, List[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for rep in range(max_reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            samples[name].append(_call(fns[name]))
        if rep + 1 >= min_reps and time.perf_counter() - start >= min_time:
            break
    return {name: _timing(samples[name], first[name]) for name in names}


@contextlib.contextmanager
def _quiet_profiler():
    """Keep the profiler's start/stop log lines (written by C++ to file descriptor 2) off the
    terminal while it runs."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_peak_bytes(fn: Callable[[], object]) -> Optional[int]:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            events.append((e.start_ns(), e.nbytes()))
    events.sort()
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return peak


def peak_memory_bytes(fn: Callable[[], object], device: torch.device,
                      reset: Optional[Callable[[], object]] = None) -> Optional[int]:
    """Bytes allocated at the peak of one ``fn()`` call, above what was live before it.

    ``reset`` runs first, outside the measured window: it frees what the previous call left
    behind (e.g. the ``.grad`` tensors), which ``fn`` would otherwise free inside the window
    and so hide the memory it needs itself.
    """
    if reset is not None:
        reset()
    gc.collect()  # an earlier call's reference cycles, freed inside the window, would hide memory
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # the base after the reset: memory freed between the two (late frees of an earlier call)
        # made the peak negative on a GPU when the base was read first
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        del out
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        return _cpu_peak_bytes(fn)
    except (RuntimeError, AttributeError):
        return None
