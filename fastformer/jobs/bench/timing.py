"""Timing and peak memory of one benchmarked callable.

Timing: the first call is timed alone (it includes any compilation), then warm-up calls,
then repeated samples until both ``min_reps`` and ``min_time`` are reached (or ``max_reps``);
each sample is kept so the median and the inter-quartile range can be reported.

On a CPU a sample is the wall time of one call.

On CUDA (a callable made by :func:`synchronized`) each sample gives two numbers, kept apart:

* **device time per call**: the GPU's time for ``calls`` back-to-back calls, between two CUDA
  events, divided by ``calls``. The stream is kept busy first (a spin kernel,
  ``torch.cuda._sleep``, at least as long as the host takes to enqueue the calls), so the start
  event fires only once the host has queued the work: the Python before the first launch, and
  between launches, runs while the GPU is still busy and is not counted. (A callable that
  synchronises inside, e.g. a ``.item()``, makes the host wait for the GPU: its device time then
  includes the host time after each such sync, as the GPU sits idle during it. So does a call
  whose host time exceeds its device time once the launch queue, about a thousand launches, is
  full: the GPU then waits for the host, as it would in a training loop.)
* **host time per call**: the wall time of the Python call alone, after a
  ``torch.cuda.synchronize`` and with none inside it (the CPU's cost of enqueuing the work).

``calls`` is chosen after the warm-up so that a sample spans about 10 ms of GPU time (at most
50 calls). The first call stays wall time (synchronised: it includes compilation).

The device is reached through a small clock object (:class:`CudaClock`: ``synchronize()``,
``event()``, ``busy(seconds)``), so the logic runs on a CPU with a fake one (tests/test_bench_timing.py).

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

# a device sample spans about this much GPU time (``calls`` back-to-back calls), at most MAX_CALLS calls
TARGET_SAMPLE_S, MAX_CALLS = 0.010, 50
# the spin kernel before a device sample: BUSY_FACTOR times the host's time to enqueue the sample's
# calls, plus BUSY_MARGIN_S, at most MAX_BUSY_S
BUSY_FACTOR, BUSY_MARGIN_S, MAX_BUSY_S = 1.5, 0.001, 1.0


@dataclass
class Timing:
    median_ms: float  # per call: wall time on a CPU, device time on CUDA
    q25_ms: float
    q75_ms: float
    reps: int
    first_call_ms: float
    min_ms: float = float("nan")
    samples_ms: Tuple[float, ...] = ()  # every sample, in call order (rep i of interleaved callables: i-th)
    # CUDA only (None on a CPU): the host's wall time of one call alone, no sync inside
    host_median_ms: Optional[float] = None
    host_min_ms: Optional[float] = None
    host_samples_ms: Tuple[float, ...] = ()
    calls_per_sample: int = 1  # back-to-back calls a device sample spans
    timer: str = "wall"  # "wall" (CPU) or "cuda-events" (device time) + host time

    @property
    def iqr_ms(self) -> float:
        return self.q75_ms - self.q25_ms


class CudaClock:
    """What the timer needs of a CUDA device: synchronise, timing events, and a spin kernel that
    keeps the stream busy for about ``seconds`` (``torch.cuda._sleep``, calibrated once)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cycles_per_s: Optional[float] = None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def busy(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._cycles_per_s is None:
            self._cycles_per_s = self._calibrate()
        torch.cuda._sleep(max(1, int(min(seconds, MAX_BUSY_S) * self._cycles_per_s)))

    def _calibrate(self, cycles: int = 2_000_000) -> float:
        torch.cuda._sleep(cycles)  # its first launch loads the kernel
        self.synchronize()
        start, end = self.event(), self.event()
        start.record()
        torch.cuda._sleep(10 * cycles)
        end.record()
        self.synchronize()
        return 10 * cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


_CLOCKS: Dict[str, CudaClock] = {}


def synchronized(fn: Callable[[], object], device: torch.device, clock=None) -> Callable[[], object]:
    """``fn`` followed by a device synchronisation when ``device`` is a GPU (or ``clock`` is
    given); the returned callable keeps ``fn`` as ``raw`` and the device's clock as ``clock``, so
    the timers take its device time and its host time apart (see the module's docstring)."""
    if clock is None:
        if device.type != "cuda":
            return fn
        clock = _CLOCKS.setdefault(str(device), CudaClock(device))

    def run():
        out = fn()
        clock.synchronize()
        return out

    run.raw, run.clock = fn, clock
    return run


def _device_timed(fn: Callable[[], object]) -> bool:
    return getattr(fn, "clock", None) is not None and getattr(fn, "raw", None) is not None


def calls_per_sample(fn: Callable[[], object]) -> int:
    """How many back-to-back calls a device sample of ``fn`` spans: about TARGET_SAMPLE_S of GPU
    time, from one synchronised call's wall time (at least its device time), at most MAX_CALLS."""
    if not _device_timed(fn):
        return 1
    fn.clock.synchronize()
    t = time.perf_counter()
    fn.raw()
    fn.clock.synchronize()
    wall = time.perf_counter() - t
    return max(1, min(MAX_CALLS, int(TARGET_SAMPLE_S / max(wall, 1e-9))))


def _sample(fn: Callable[[], object], calls: int = 1) -> Tuple[float, Optional[float]]:
    """One sample of ``fn``: (seconds per call, host seconds per call or None).

    CPU: the wall time of one call, no host time. CUDA (``synchronized``): the host time of one
    call alone (synchronised before, nothing synchronised inside), then the device time of
    ``calls`` back-to-back calls between two events, the stream kept busy while the host
    enqueues them."""
    if not _device_timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, None
    clock, raw = fn.clock, fn.raw
    clock.synchronize()
    t = time.perf_counter()
    raw()
    host = time.perf_counter() - t
    clock.synchronize()
    clock.busy(BUSY_FACTOR * host * calls + BUSY_MARGIN_S)  # the start event waits behind it
    start, end = clock.event(), clock.event()
    start.record()
    for _ in range(calls):
        raw()
    end.record()
    clock.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, host


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
    calls = calls_per_sample(fn)
    samples: List[Tuple[float, Optional[float]]] = []
    start = time.perf_counter()
    while len(samples) < max_reps:
        samples.append(_sample(fn, calls))
        spent = time.perf_counter() - start
        if len(samples) >= min_reps and spent >= min_time:
            break
        if spent >= max_time and len(samples) >= 1:
            break
    return _timing(samples, first, calls)


def _timing(samples: List[Tuple[float, Optional[float]]], first: float, calls: int = 1) -> Timing:
    """The :class:`Timing` of ``samples`` ((seconds per call, host seconds or None) each)."""
    times = [s for s, _ in samples]
    hosts = [h * 1e3 for _, h in samples if h is not None]
    ms = sorted(s * 1e3 for s in times)
    return Timing(median_ms=statistics.median(ms), q25_ms=_quantile(ms, 0.25), q75_ms=_quantile(ms, 0.75),
                  reps=len(ms), first_call_ms=first * 1e3, min_ms=ms[0], samples_ms=tuple(s * 1e3 for s in times),
                  host_median_ms=statistics.median(hosts) if hosts else None,
                  host_min_ms=min(hosts) if hosts else None, host_samples_ms=tuple(hosts),
                  calls_per_sample=calls, timer="cuda-events" if hosts else "wall")


def measure_interleaved(fns: Dict[str, Callable[[], object]], *, warmup: int = 2, min_reps: int = 5,
                        max_reps: int = 50, min_time: float = 0.0) -> Dict[str, Timing]:
    """Time several callables that are compared with each other, interleaved: each repetition
    takes one sample of every one of them (in an order rotated every repetition), so a change in
    the machine's load hits all of them alike instead of whichever happened to run then. Stops after
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
    calls = {name: calls_per_sample(fns[name]) for name in names}
    samples: Dict[str, List[Tuple[float, Optional[float]]]] = {name: [] for name in names}
    start = time.perf_counter()
    for rep in range(max_reps):
        for i in range(len(names)):
            name = names[(i + rep) % len(names)]
            samples[name].append(_sample(fns[name], calls[name]))
        if rep + 1 >= min_reps and time.perf_counter() - start >= min_time:
            break
    return {name: _timing(samples[name], first[name], calls[name]) for name in names}


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
