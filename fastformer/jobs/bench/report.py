"""Benchmark reports: the machine record, the Markdown tables, the JSON file and the plots."""
import datetime
import importlib.metadata
import json
import os
import platform
import re
from typing import Dict, List, Optional, Tuple

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_warning() -> Optional[str]:
    """A warning when other work is already using the CPU cores (timings then mostly measure
    the scheduler: multi-threaded kernels wait for descheduled threads)."""
    load, cores = _load_average(), os.cpu_count() or 1
    if load is None or load < cores:
        return None
    advice = ("" if torch.get_num_threads() == 1 else
              f"; with {torch.get_num_threads()} threads they include waits for descheduled threads")
    return (f"warning: the machine is busy (load average {load:.1f} on {cores} cores): other work shares "
            f"the cores, so CPU timings are noisy and slower than on an idle machine{advice}")


def quiet_verdict(load: Optional[float], cores: int, load_after: Optional[float] = None) -> Tuple[bool, str]:
    """Whether CPU timings may be published: only from a quiet machine, whose 1-minute load
    average before the run (and, when given, after it, less the run's own threads) is at most a
    quarter of its cores (on this project's shared VM eager PyTorch's step time swings 2x with
    load, so a ratio taken under load is not a result)."""
    limit = cores / 4
    if load is None:
        return False, "NOT README-grade: the load average cannot be read here"
    if load > limit:
        return False, (f"NOT README-grade: load average {load:.2f} before the run on {cores} cores "
                       f"(above {limit:.2f}, a quarter of the cores): other work shared the machine")
    if load_after is not None:
        others = load_after - torch.get_num_threads()  # the benchmark itself keeps its threads busy
        if others > limit:
            return False, (f"NOT README-grade: load average {load_after:.2f} after the run on {cores} cores, "
                           f"more than the benchmark's own {torch.get_num_threads()} threads plus {limit:.2f}: "
                           f"other work started during the run")
        return True, (f"README-grade: quiet machine, load average {load:.2f} before the run and "
                      f"{load_after:.2f} after it (the benchmark's own {torch.get_num_threads()} threads) "
                      f"on {cores} cores")
    return True, f"README-grade: quiet machine, load average {load:.2f} before the run on {cores} cores"


def machine_info(device: torch.device) -> Dict:
    """What the numbers were measured on (triton's version is read without importing it)."""
    import fastformer
    from fastformer import _ext

    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fastformer": fastformer.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": _load_average(),
        "backends": {name: (a.available, a.reason) for name, a in fastformer.available_backends().items()},
        # the ISA level of the cpu backend's kernels (ATEN_CPU_CAPABILITY forces one: time AVX2 against
        # AVX-512 with two runs of `python -m fastformer bench`, ATEN_CPU_CAPABILITY=avx2 and =avx512)
        "cpu_capability": _ext.cpu_capability(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return info


def device_name(device: torch.device) -> str:
    """A directory-safe name of the device: the GPU's name, or ``cpu-<model>-<threads>t``."""
    if device.type == "cuda":
        raw = torch.cuda.get_device_name(device)
    else:
        raw = f"cpu-{_cpu_model()}-{torch.get_num_threads()}t"
    slug = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    return slug or "device"


# -- tables ---------------------------------------------------------------------------------------
def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def markdown(records: List[Dict]) -> str:
    """One Markdown table per op: a row per (shape, dtype, mode, provider). Speed-ups are ratios of
    the best (minimum) times, measured in the same run; the training step also shows the share
    of its time its matrix products alone take (torch's GEMMs, same shapes, same run; and over the
    real tokens only, the products left when padding is skipped: best over best, and the median of
    the repetitions' own ratios), and a
    memory-bound op the fraction of the machine's copy bandwidth it reaches (``torch-copy-alone``:
    a copy of the same bytes, same run).

    On CUDA the times are device time per call, and a ``host median ms`` column gives the host's
    wall time of one call alone (see :mod:`fastformer.jobs.bench.timing`); tokens/s and
    throughput come from the device time. On a CPU the times are wall time, as before."""
    lines: List[str] = []
    for op in dict.fromkeys(r["op"] for r in records):
        rows = [r for r in records if r["op"] == op]
        unit = next((r["unit"] for r in rows if r.get("unit")), "")
        share = any(r.get("gemm_share") is not None for r in rows)
        share_real = any(r.get("gemm_share_real_tokens") is not None for r in rows)
        paired = any(r.get("gemm_share_real_tokens_paired") is not None for r in rows)
        of_copy = any(r.get("copy_fraction") is not None for r in rows)
        # CUDA: device time per call (CUDA events) and, beside it, the host's time per call
        host = any(r.get("host_median_ms") is not None for r in rows)
        lines.append(f"\n### {op}\n")
        head = ["shape", "dtype", "mode", "provider"]
        head += (["device median ms", "device min ms", "IQR ms", "host median ms"] if host
                 else ["median ms", "min ms", "IQR ms"])
        head += [unit] if unit else []
        head += ["tokens/s", "peak MB", "vs eager", "vs compile"] + (["GEMM share"] if share else []) \
            + (["GEMM share, real tokens"] if share_real else []) \
            + (["real tokens, paired median"] if paired else []) \
            + (["of copy GB/s"] if of_copy else []) + ["1st call ms"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in rows:
            if r["status"] != "ok":
                cells = [r["label"], r["dtype"], r["mode"], r["provider"], r["status"]] + [""] * (len(head) - 5)
            else:
                cells = [r["label"], r["dtype"], r["mode"], r["provider"], _fmt(r["median_ms"]),
                         _fmt(r.get("min_ms")), _fmt(r["iqr_ms"], 2)]
                cells += [_fmt(r.get("host_median_ms"))] if host else []
                cells += [_fmt(r["throughput"])] if unit else []
                cells += [_fmt(r["tokens_per_s"]), _fmt(r["peak_mem_mb"])]
                cells += [f"{x:.2f}x" if x is not None else "-"
                          for x in (r.get("speedup_vs_eager"), r.get("speedup_vs_compile"))]
                if share:
                    cells.append(f"{r['gemm_share']:.2f}" if r.get("gemm_share") is not None else "-")
                if share_real:
                    cells.append(f"{r['gemm_share_real_tokens']:.2f}" if r.get("gemm_share_real_tokens") is not None
                                 else "-")
                if paired:
                    value = r.get("gemm_share_real_tokens_paired")
                    cells.append(f"{value:.3f}" if value is not None else "-")
                if of_copy:
                    cells.append(f"{r['copy_fraction']:.0%}" if r.get("copy_fraction") is not None else "-")
                cells.append(_fmt(r["first_call_ms"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def add_speedups(records: List[Dict]) -> None:
    """``speedup_vs_eager`` / ``speedup_vs_compile``: torch-eager's (torch-compile's) best time over
    this record's best time, within (op, shape, dtype, mode) of the same run (the median where a
    record has no minimum)."""
    def best(r):
        return r.get("min_ms") if r.get("min_ms") is not None else r["median_ms"]

    # the transformers workloads' own eager and compiled runs (fastformer.jobs.bench.hf_step)
    for base_names, key in ((("torch-eager", "transformers"), "speedup_vs_eager"),
                            (("torch-compile", "transformers-compile"), "speedup_vs_compile")):
        base = {(r["op"], r["label"], r["dtype"], r["mode"]): best(r)
                for r in records if r["provider"] in base_names and r["status"] == "ok"}
        for r in records:
            b = base.get((r["op"], r["label"], r["dtype"], r["mode"]))
            ok = r["status"] == "ok" and b is not None and best(r) > 0 and not r["provider"].endswith("-alone")
            r[key] = b / best(r) if ok else None


# -- files ----------------------------------------------------------------------------------------
def write_json(path: str, machine: Dict, settings: Dict, records: List[Dict], per_shape: bool = False) -> Dict:
    """Write (atomically) the run's records, keeping earlier records of ops not run this time
    (``per_shape``: of the (op, shape, provider) triples not run this time, for a run of some
    shapes only: gpu-check times a step's eager and its compiled providers in two runs)."""
    def key(r: Dict):
        return (r.get("op"), r.get("label"), r.get("provider")) if per_shape else r.get("op")

    now = {key(r) for r in records}
    kept: List[Dict] = []
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
            kept = [r for r in old.get("results", []) if key(r) not in now]
        except (OSError, ValueError):
            kept = []
    doc = {"machine": machine, "settings": settings, "results": kept + records}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)
    return doc


STEP_OPS = ("train_step", "hf_bart_step", "hf_t5_step")  # one shape each: a bar per provider, not a sweep


def plot_op(path: str, op: str, records: List[Dict], title_suffix: str = "") -> None:
    """One PNG for an op: throughput (higher is better) over the shape sweep, a line per provider
    (and dtype), a panel per mode; error bars span the inter-quartile range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["op"] == op and r["status"] == "ok"]
    if op in STEP_OPS:
        return _plot_train_step(path, rows, title_suffix, plt)
    modes = list(dict.fromkeys(r["mode"] for r in rows)) or ["fwd"]
    labels = list(dict.fromkeys(r["label"] for r in records if r["op"] == op))
    unit = next((r["unit"] for r in rows if r.get("unit")), "")
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = dict.fromkeys((r["provider"], r["dtype"]) for r in rows if r["mode"] == mode)
        for provider, dtype in series:
            pts = [r for r in rows if r["mode"] == mode and r["provider"] == provider and r["dtype"] == dtype]
            xs = [labels.index(r["label"]) for r in pts]
            ys = [r["throughput"] for r in pts]
            # the IQR of the time, mapped to throughput (time up -> throughput down)
            lo = [max(0.0, y - y * r["median_ms"] / r["q75_ms"]) if r["q75_ms"] else 0.0 for y, r in zip(ys, pts)]
            hi = [max(0.0, y * r["median_ms"] / r["q25_ms"] - y) if r["q25_ms"] else 0.0 for y, r in zip(ys, pts)]
            name = provider if len({d for _, d in series}) == 1 else f"{provider} {dtype}"
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{op} {mode}")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{op}{title_suffix}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_train_step(path: str, rows: List[Dict], title_suffix: str, plt) -> None:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(providers) + 2), 4.2))
    width = 0.8 / max(1, len(dtypes))
    for j, dtype in enumerate(dtypes):
        xs, ys = [], []
        for i, provider in enumerate(providers):
            r = next((r for r in rows if r["provider"] == provider and r["dtype"] == dtype), None)
            if r is not None:
                xs.append(i + j * width)
                ys.append(r["tokens_per_s"])
        bars = ax.bar(xs, ys, width=width, label=dtype)
        for bar, y in zip(bars, ys):
            ax.annotate(f"{y:,.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(providers))])
    ax.set_xticklabels(providers, rotation=15, fontsize=8)
    ax.set_ylabel("tokens/s (training step)")
    label = rows[0]["label"] if rows else ""
    ax.set_title(f"train step {label}{title_suffix}", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
