"""The bench's GPU timing, on a CPU with a fake device (fastformer/jobs/bench/timing.py): device
time per call (events around back-to-back calls, the stream kept busy so the host's time
hides) and host time per call (the Python call alone) are told apart, and the records and the
report show both on CUDA while a CPU's output keeps its meaning."""
import time

import pytest
import torch

from fastformer.jobs.bench import records as bench_records
from fastformer.jobs.bench import report, timing


class FakeDevice:
    """One GPU stream modelled on the host's clock: work launched at host time t starts once the
    stream is free and t has come; an event completes when the stream reaches it."""

    def __init__(self):
        self.free_at = 0.0
        self.busy_requests = []

    def launch(self, seconds: float) -> None:
        start = max(self.free_at, time.perf_counter())
        self.free_at = start + seconds

    def busy(self, seconds: float) -> None:
        self.busy_requests.append(seconds)
        self.launch(seconds)

    def synchronize(self) -> None:
        wait = self.free_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def event(self):
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice):
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = max(self.device.free_at, time.perf_counter())

    def elapsed_time(self, end: "FakeEvent") -> float:  # ms, as torch.cuda.Event's
        return (end.at - self.at) * 1e3


def _spin(seconds: float) -> None:  # host work more exact than a sleep
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _callable(device: FakeDevice, host_s: float, device_s: float, sleep: bool = True):
    """Python for ``host_s`` before its one launch of ``device_s`` of GPU work."""
    def call():
        (time.sleep if sleep else _spin)(host_s)
        device.launch(device_s)
    return call


def test_the_fake_device_shows_the_old_timers_fault():
    """Events around one call on an idle stream (the old ``synchronized``) count the Python
    before the first launch as GPU time: 4 ms of host + 20 ms of GPU read as >= 24 ms."""
    dev = FakeDevice()
    fn = _callable(dev, 0.004, 0.020)
    start, end = dev.event(), dev.event()
    start.record()
    fn()
    end.record()
    dev.synchronize()
    assert start.elapsed_time(end) >= 24.0


def test_a_known_host_sleep_and_device_duration_give_those_two_numbers():
    dev = FakeDevice()
    fn = timing.synchronized(_callable(dev, 0.004, 0.020), torch.device("cpu"), clock=dev)
    t = timing.measure(fn, warmup=1, min_reps=5, max_reps=5, min_time=0.0)
    assert t.timer == "cuda-events" and t.reps == 5 and t.calls_per_sample == 1
    assert t.median_ms == pytest.approx(20.0, abs=0.5)  # the device's time, the host's 4 ms hidden
    assert 4.0 <= t.host_median_ms < 15.0 and 4.0 <= t.host_min_ms <= t.host_median_ms
    assert len(t.host_samples_ms) == 5 and len(t.samples_ms) == 5
    # the stream was kept busy before every sample, for longer than the host took
    assert len(dev.busy_requests) == 5 and all(b >= 0.004 * timing.BUSY_FACTOR for b in dev.busy_requests)


def test_short_calls_are_timed_back_to_back_and_divided_by_their_count():
    """A 2 ms kernel behind 0.2 ms of Python: a sample spans several calls (about 10 ms), the
    device time is the total over the count, and interleaving keeps each callable's own numbers."""
    dev = FakeDevice()
    fns = {name: timing.synchronized(_callable(dev, 0.0002, ms / 1e3, sleep=False), torch.device("cpu"), clock=dev)
           for name, ms in (("two", 2.0), ("three", 3.0))}
    got = timing.measure_interleaved(fns, warmup=1, min_reps=4, max_reps=4)
    for name, ms in (("two", 2.0), ("three", 3.0)):
        t = got[name]
        assert t.calls_per_sample > 1 and t.reps == 4
        assert t.median_ms == pytest.approx(ms, abs=0.1)
        assert 0.2 <= t.host_median_ms < ms


def test_synchronized_waits_for_the_device_and_keeps_the_raw_call():
    dev = FakeDevice()
    raw = _callable(dev, 0.0, 0.010)
    fn = timing.synchronized(raw, torch.device("cpu"), clock=dev)
    assert fn.raw is raw and fn.clock is dev
    t0 = time.perf_counter()
    fn()
    assert time.perf_counter() - t0 >= 0.010  # returned only after the device's work


def test_on_a_cpu_a_sample_is_the_calls_wall_time_and_there_is_no_host_column():
    def call():
        time.sleep(0.003)
    fn = timing.synchronized(call, torch.device("cpu"))
    assert fn is call
    t = timing.measure(fn, warmup=0, min_reps=3, max_reps=3, min_time=0.0)
    assert t.timer == "wall" and t.host_median_ms is None and t.calls_per_sample == 1
    assert t.min_ms >= 3.0


def _record(provider, t):
    rec = bench_records.new_record("train_step", provider, {}, "d32", "step", "bf16", "")
    bench_records.set_timed(rec, t, tokens_per_s=1000.0, peak_mem_mb=1.0)
    return rec


def test_records_and_report_show_device_and_host_time_on_cuda_only():
    dev = FakeDevice()
    fn = timing.synchronized(_callable(dev, 0.001, 0.005), torch.device("cpu"), clock=dev)
    gpu = _record("fastformer-auto", timing.measure(fn, warmup=0, min_reps=3, max_reps=3, min_time=0.0))
    assert gpu["timer"] == "cuda-events" and gpu["host_median_ms"] >= 1.0 and gpu["calls_per_sample"] >= 1
    table = report.markdown([gpu])
    head = table.splitlines()[2]
    assert "| device median ms | device min ms | IQR ms | host median ms |" in head
    assert f"| {report._fmt(gpu['host_median_ms'])} |" in table.splitlines()[4]
    lines = []
    bench_records.emit([], {"x": gpu}, lines.append, "train_step", 1)
    assert "device median" in lines[0] and "host median" in lines[0]

    cpu = _record("fastformer-cpu", timing.measure(lambda: None, warmup=0, min_reps=3, max_reps=3, min_time=0.0))
    assert cpu["host_median_ms"] is None and cpu["timer"] == "wall"
    head = report.markdown([cpu]).splitlines()[2]
    assert "| median ms | min ms | IQR ms |" in head and "host" not in head and "device" not in head
