"""The records every benchmark writes (one per op, provider, shape, mode and dtype), and the
interleaved timing that fills them in; shared by the op, training-step and Hugging Face benchmarks."""
import statistics
from typing import Callable, Collection, Dict, List, Optional, Tuple, Union

import torch

from .ops import OPS
from .timing import Timing, measure_interleaved, peak_memory_bytes

# (warmup calls, min samples, max samples, min seconds) per sweep size
# gpu-check: `make gpu-check` on a borrowed GPU, the whole sweep in a couple of minutes (a GPU's
# device-timed calls vary little, so 10 samples after 3 warm-up calls give a stable minimum)
TIMING = {"smoke": (0, 1, 1, 0.0), "quick": (0, 3, 50, 0.05), "gpu-check": (3, 10, 10, 0.0),
          "full": (3, 10, 200, 0.5), "small": (3, 10, 200, 0.5)}
STEP_TIMING = {"smoke": (0, 1, 1, 0.0), "quick": (1, 3, 5, 0.0), "gpu-check": (1, 3, 5, 0.0),
               "full": (2, 10, 30, 2.0), "small": (3, 20, 60, 2.0)}


def with_reps(timing: Tuple[int, int, int, float], reps: Optional[int]) -> Tuple[int, int, int, float]:
    """``timing`` taking at least ``reps`` samples (``--reps``; None keeps the sweep's counts)."""
    if reps is None:
        return timing
    warmup, min_reps, max_reps, min_time = timing
    return warmup, reps, max(reps, max_reps), min_time


def new_record(op: str, provider: str, shape: Dict, label: str, mode: str, dtype: str, status: str) -> Dict:
    return {"op": op, "provider": provider, "shape": shape, "label": label, "mode": mode, "dtype": dtype,
            "status": status, "median_ms": None, "min_ms": None, "q25_ms": None, "q75_ms": None, "iqr_ms": None, "reps": 0,
            "first_call_ms": None, "throughput": None, "unit": OPS[op].unit if op in OPS else None,
            "tokens_per_s": None, "peak_mem_mb": None, "setup_ms": None,
            # CUDA: the times above are device time per call (CUDA events around ``calls_per_sample``
            # back-to-back calls), these the host's wall time of one call alone; None on a CPU
            "host_median_ms": None, "host_min_ms": None, "calls_per_sample": None, "timer": None}


def error_status(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"error: {type(e).__name__}: {msg[:160]}"


def time_all(calls: Dict[str, Callable[[], object]], recs: Dict[str, Dict],
              timing: Tuple[int, int, int, float]) -> Dict[str, Timing]:
    """``calls`` timed interleaved within each repetition; when that fails, every record of
    ``recs`` says why and nothing is returned."""
    warmup, min_reps, max_reps, min_time = timing
    try:
        return measure_interleaved(calls, warmup=warmup, min_reps=min_reps, max_reps=max_reps, min_time=min_time)
    except Exception as e:
        for name in calls:
            recs[name]["status"] = error_status(e)
        return {}


def set_timed(rec: Dict, t: Timing, **more) -> None:
    rec.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, q25_ms=t.q25_ms, q75_ms=t.q75_ms,
               iqr_ms=t.iqr_ms, reps=t.reps, first_call_ms=t.first_call_ms, samples_ms=list(t.samples_ms),
               host_median_ms=t.host_median_ms, host_min_ms=t.host_min_ms, calls_per_sample=t.calls_per_sample,
               timer=t.timer, **more)


def relate(recs: Dict[str, Dict], yardstick: str, key: str, skip=()) -> None:
    """``rec[key]``: the yardstick's best time over each record's (the share of the machine's
    limit it reaches), None for a record that failed, the yardstick itself and ``skip``.
    ``rec[key + "_paired"]``: the median over the repetitions of the yardstick's time over the
    record's in that repetition (timed interleaved, so next to each other: a machine whose speed
    drifts moves both), None unless both have the same number of samples."""
    base = recs.get(yardstick)
    for name, rec in recs.items():
        ok = rec["status"] == "ok" and base is not None and base["status"] == "ok"
        ok = ok and name != yardstick and name not in skip
        rec[key] = base["min_ms"] / rec["min_ms"] if ok else None
        pairs = list(zip(base.get("samples_ms") or [], rec.get("samples_ms") or [])) if ok else []
        same = ok and len(pairs) == len(base["samples_ms"]) == len(rec["samples_ms"]) > 0
        rec[key + "_paired"] = statistics.median(b / r for b, r in pairs) if same else None


def emit(records: List[Dict], recs: Dict[str, Dict], log, what: str, digits: int) -> None:
    """Append ``recs`` to ``records``, logging one line each."""
    for rec in recs.values():
        records.append(rec)
        if log:
            log(f"  {what} {rec['provider']}: "
                + (_times(rec, digits) if rec["status"] == "ok" else rec["status"]))


def _times(rec: Dict, digits: int) -> str:
    """The log's times of one record: device and host per call on CUDA, wall time on a CPU."""
    times = f"median {rec['median_ms']:.{digits}f} ms, min {rec['min_ms']:.{digits}f} ms"
    if rec.get("host_median_ms") is None:
        return times
    return f"device {times}; host median {rec['host_median_ms']:.{digits}f} ms per call"


def time_steps(op: str, shape: Dict, label: str, dtype: str, size: str, device: torch.device,
               builders: Dict[str, Union[Callable[[], object], str]], flops: float,
               no_peak: Collection[str] = (), reps: Optional[int] = None) -> Dict[str, Dict]:
    """The records of one training-step shape and dtype: ``builders`` maps each provider to a
    callable that builds its step (a ``train_step.Step``), or to the reason it cannot run here
    (recorded as skipped); the steps are timed interleaved, each with its peak memory (except
    ``no_peak``), tokens per second and TFLOP/s of ``flops``; ``reps``: see :func:`with_reps`."""
    recs, steps = {}, {}
    for provider, build in builders.items():
        rec = recs[provider] = new_record(op, provider, shape, label, "step", dtype, "")
        rec["unit"] = "TFLOP/s"
        if isinstance(build, str):
            rec["status"] = f"skipped: {build}"
            continue
        try:
            steps[provider] = build()
        except Exception as e:  # noqa: BLE001 (a provider that fails says why; the others run)
            rec["status"] = error_status(e)
    timings = time_all({p: st.run for p, st in steps.items()}, recs, with_reps(STEP_TIMING[size], reps))
    for provider, t in timings.items():
        step, peak = steps[provider], None
        if provider not in no_peak:
            try:
                peak = peak_memory_bytes(step.run, device, reset=step.reset)
            except Exception:  # noqa: BLE001 (the time stands without the memory)
                peak = None
        set_timed(recs[provider], t, peak_mem_mb=peak / 2**20 if peak is not None else None,
                  tokens_per_s=step.tokens / (t.median_ms / 1e3), throughput=flops / (t.min_ms / 1e3) / 1e12)
    return recs
