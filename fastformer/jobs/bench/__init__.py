"""``python -m fastformer bench``: every op (forward, backward, forward+backward) and the
end-to-end training step, for every provider that can run here, over a sweep of shapes; and
Hugging Face transformers' BART and T5 v1.1 training steps (``hf_bart_step``, ``hf_t5_step``: plain,
``torch.compile``d, and after ``fastformer.convert``, eager and compiled; see
:mod:`fastformer.jobs.bench.hf_step`) where transformers is installed (where it is not, their
records say so).

Providers (see :mod:`fastformer.jobs.bench.providers`): the fastformer backends that
``fastformer.available_backends()`` allows on the device (triton only on a GPU), eager PyTorch
(the composition ``torch.nn`` runs) and ``torch.compile`` of that composition, plus
``F.scaled_dot_product_attention`` kernels on CUDA. Each case is timed to a median and an
inter-quartile range after warm-up; throughput is TFLOP/s (matmul-bound ops) or GB/s of
minimum memory traffic (memory-bound ops), with tokens/s, peak memory, and the speed-up over
eager PyTorch measured in the same run.

``--quick`` runs two shapes per op and a smaller training batch, with few samples, and leaves
out ``torch.compile`` (tens of seconds of compilation per graph on a CPU) and the slow
``reference`` backend unless ``--providers`` names them; the full sweep runs every provider.

Output: a Markdown table on stdout (also ``results.md``), ``results.json`` (with the machine
record) and one PNG per op in ``benchmarks/results/<device-name>/`` (or ``--out DIR``); a rerun
with a subset of ``--ops`` replaces only those ops' records in ``results.json``.
"""
import argparse
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from ...internal.validation import positive_int
from ..devices import THREADS_HELP, machine_load, pick_device, pick_threads
from . import dropout_cost, hf_step, overhead, report, train_step
from .ops import MODES, OPS
from .providers import COPY, REGISTRY, build_case, default_dtypes, providers_for
from .records import TIMING, emit, error_status, new_record, relate, set_timed, time_all, time_steps, with_reps
from .timing import peak_memory_bytes

ALL_OPS = list(OPS) + ["train_step", *hf_step.OPS, overhead.OP, dropout_cost.OP]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _reps(text: str) -> int:
    try:  # the library's own count check, its message kept by argparse
        return positive_int("--reps", int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a short sweep and few samples (under 2 minutes on CPU; torch.compile is left out "
                        "unless named in --providers)")
    p.add_argument("--ops", nargs="+", choices=ALL_OPS, default=None, metavar="OP",
                   help=f"ops to run (default all): {' '.join(ALL_OPS)}")
    p.add_argument("--providers", nargs="+", default=None, metavar="NAME",
                   help=f"providers to run (default: all that can run here): {' '.join(REGISTRY)}; "
                        f"{' and '.join(hf_step.OPS)}: {' '.join(hf_step.PROVIDERS)}")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="op modes (default all)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(_DTYPES), default=None,
                   help="op dtypes (default fp32 on CPU, bf16 on CUDA); the training step always runs "
                        "fp32 and bf16 autocast; hf_bart_step and hf_t5_step run fp32, and bf16 autocast when "
                        "named")
    p.add_argument("--sweep", choices=sorted(TIMING), default=None,
                   help="shape sweep and sample counts (default: quick with --quick, else full)")
    p.add_argument("--reps", type=_reps, default=None, metavar="N",
                   help="at least N interleaved repetitions of every timing (default: the sweep's own "
                        "count, 10 for the full sweep's training step): steadier medians and paired ratios")
    p.add_argument("--shapes", nargs="+", default=None, metavar="WORD",
                   help="only the op shapes whose label has every WORD (e.g. D128 causal); results.json "
                        "then keeps the records of the op's other shapes")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + "; recorded with the results")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default benchmarks/results/<device-name>)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")


def _default_providers(size: str, device: torch.device, explicit: Optional[List[str]]) -> Optional[List[str]]:
    if explicit:
        return explicit
    names = list(REGISTRY)
    if size in ("quick", "smoke", "gpu-check"):
        # no compile (tens of seconds per graph, per shape) and no slow reference in short runs
        names = [n for n in names if "compile" not in REGISTRY[n].tags and "slow" not in REGISTRY[n].tags]
    return names


def shape_wanted(label: str, words: Optional[List[str]]) -> bool:
    """Whether a shape's label has every one of ``words`` (None: every shape)."""
    return words is None or set(words) <= set(label.split())


def bench_op(op: str, device: torch.device, dtypes: List[torch.dtype], size: str,
             providers: Optional[List[str]], modes: List[str], log=None,
             shapes: Optional[List[str]] = None, reps: Optional[int] = None) -> List[Dict]:
    """Records for every (shape, dtype, provider, mode) of ``op`` (``shapes``: only the shapes whose
    label has these words); the providers of one (shape, dtype, mode) are timed interleaved within
    each repetition."""
    spec = OPS[op]
    records = []
    for dtype in dtypes:
        dname = _DTYPE_NAMES[dtype]
        runnable = []
        for provider, reason in providers_for(op, device, dtype, providers):
            if reason is None:
                runnable.append(provider)
            elif log and providers is not None and provider.name in providers:
                log(f"  {op}: {provider.name} skipped: {reason}")
        for shape in spec.sweep(device.type, size):
            label = spec.label(shape)
            if not shape_wanted(label, shapes):
                continue
            cases, setup = {}, {}
            for provider in runnable:
                if not provider.supports(spec, shape):
                    continue
                t0 = time.perf_counter()
                try:  # inputs, and one forward pass (for bwd): a compiling provider compiles here
                    cases[provider.name] = build_case(op, provider.name, shape, device, dtype, modes)
                    setup[provider.name] = (time.perf_counter() - t0) * 1e3
                except Exception as e:  # a provider that cannot take this shape: say so, go on
                    records += [new_record(op, provider.name, shape, label, m, dname, error_status(e)) for m in modes]
            for mode in modes:
                recs = {name: new_record(op, name, shape, label, mode, dname, "") for name in cases}
                timings = time_all({n: c.calls[mode] for n, c in cases.items()}, recs, with_reps(TIMING[size], reps))
                for name, t in timings.items():
                    try:
                        peak = peak_memory_bytes(cases[name].calls[mode], device, reset=cases[name].reset)
                        seconds = t.min_ms / 1e3
                        set_timed(recs[name], t, setup_ms=setup[name],
                               peak_mem_mb=peak / 2**20 if peak is not None else None,
                               throughput=spec.throughput(shape, mode, seconds, torch.finfo(dtype).bits // 8),
                               tokens_per_s=spec.tokens(shape) / seconds)
                    except Exception as e:
                        recs[name]["status"] = error_status(e)
                relate(recs, COPY, "copy_fraction")  # the share of the machine's copy bandwidth reached
                emit(records, recs, log, f"{op} {label} {dname} {mode}", 3)
            del cases
    return records


GEMMS = "torch-gemms-alone"  # the yardstick: the step's matrix products alone, torch's GEMMs
# the same over the real tokens only: what is left of the yardstick when padding is skipped
GEMMS_REAL = "torch-gemms-real-tokens-alone"
YARDSTICKS = {GEMMS: ("gemm_share", False), GEMMS_REAL: ("gemm_share_real_tokens", True)}


def bench_train_step(device: torch.device, size: str, providers: Optional[List[str]], log=None,
                     dtypes: Optional[List[str]] = None, reps: Optional[int] = None,
                     shapes: Optional[List[str]] = None) -> List[Dict]:
    """Records of the training step for each provider and dtype (fp32, bf16 autocast; ``dtypes``
    keeps a subset), the providers timed interleaved within each repetition, beside the time of
    the step's matrix products alone (``torch-gemms-alone``) measured in the same interleaved run,
    and those over the real tokens only (``torch-gemms-real-tokens-alone``: fastformer's model
    skips padding in the position-wise layers, so its step can take less than the first).
    A provider named in ``providers`` that cannot run here gets a record saying why; ``shapes``:
    only the shapes whose label has every one of these words (e.g. ``d512``)."""
    names = providers or train_step.providers_for(device)
    if providers is None and size in ("quick", "smoke"):
        names = [n for n in names if n not in train_step.COMPILED + ("fastformer-reference",)]
    names = [n for n in names if n in train_step.PROVIDERS]
    records = []
    for shape in train_step.sweep(device.type, size):
        label = train_step.label(shape)
        if not shape_wanted(label, shapes):
            continue
        src, tgt = train_step.make_batch(shape, device)
        flops = train_step.step_gemm_flops(train_step.step_gemms(shape, src, tgt))
        for dtype in [d for d in train_step.DTYPES if dtypes is None or d in dtypes]:
            builders = {p: train_step.why_not(p, device) or (lambda p=p: train_step.build_step(p, shape, device, dtype))
                        for p in names}
            for yardstick, (_, real) in YARDSTICKS.items():
                builders[yardstick] = lambda real=real: train_step.build_gemms(shape, device, dtype, real_tokens=real)
            recs = time_steps("train_step", shape, label, dtype, size, device, builders, flops,
                              no_peak=YARDSTICKS, reps=reps)
            for yardstick, (key, _) in YARDSTICKS.items():
                relate(recs, yardstick, key, skip=YARDSTICKS)
            emit(records, recs, log, f"train_step {dtype}", 1)
    return records


def run(ops: Optional[List[str]] = None, providers: Optional[List[str]] = None, quick: bool = False,
        size: Optional[str] = None, modes: Optional[List[str]] = None, dtypes: Optional[List[str]] = None,
        device: str = "auto", out: Optional[str] = None, plots: bool = True, verbose: bool = True,
        threads: Optional[int] = None, shapes: Optional[List[str]] = None, reps: Optional[int] = None) -> Dict:
    """Run the benchmarks; returns the JSON document written to ``<out>/results.json``."""
    known = set(REGISTRY) | set(train_step.PROVIDERS) | set(hf_step.PROVIDERS)
    unknown = [p for p in providers or [] if p not in known]
    if unknown:
        raise ValueError(f"--providers: unknown provider(s) {unknown}; known: {sorted(known)}")
    dev = pick_device(device)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else None
    if threads is None:
        load = machine_load()
        threads = pick_threads(None, load=lambda: load)
        if threads != torch.get_num_threads() and log:
            log(f"the machine is busy ({load:g} tasks running besides this one on {os.cpu_count()} cores): "
                f"timing with {threads} thread instead of {torch.get_num_threads()} (--threads overrides)")
    torch.set_num_threads(pick_threads(threads))
    size = size or ("quick" if quick else "full")
    ops = ops or ALL_OPS
    modes = modes or list(MODES)
    torch_dtypes = [_DTYPES[d] for d in dtypes] if dtypes else default_dtypes(dev)
    chosen = _default_providers(size, dev, providers)
    out = out or os.path.join("benchmarks", "results", report.device_name(dev))
    machine = report.machine_info(dev)
    warning = report.busy_warning() if dev.type == "cpu" else None
    if warning and log:
        log(warning)
    load_before = machine["load_average"]
    quiet, verdict = (report.quiet_verdict(load_before, os.cpu_count() or 1) if dev.type == "cpu"
                      else (True, "README-grade: GPU timings (device time per call from CUDA events around back-to-back "
                            "calls; the host's time per call beside it)"))
    if log:
        log(verdict)
    started = time.perf_counter()
    records: List[Dict] = []
    for op in ops:
        if log:
            log(f"bench {op} ({size} sweep on {dev})")
        if op == "train_step":
            records += bench_train_step(dev, size, providers, log, dtypes=dtypes, reps=reps, shapes=shapes)
        elif op in hf_step.FAMILIES:
            records += hf_step.bench_hf_step(dev, size, providers, log, dtypes=dtypes, reps=reps, shapes=shapes,
                                             family=hf_step.FAMILIES[op])
        elif op == overhead.OP:
            records += overhead.bench(dev, reps=reps, log=log)
        elif op == dropout_cost.OP:
            records += dropout_cost.bench(dev, reps=reps, log=log, dtypes=dtypes)
        else:
            records += bench_op(op, dev, torch_dtypes, size, chosen, modes, log, shapes=shapes, reps=reps)
    report.add_speedups(records)
    load_after = report._load_average()
    if dev.type == "cpu" and quiet:
        # a run that made the machine busy part-way (other work started) is not a result either
        quiet, verdict = report.quiet_verdict(load_before, os.cpu_count() or 1, load_after)
    os.makedirs(out, exist_ok=True)
    settings = {"sweep": size, "reps": reps, "ops": ops, "shapes": shapes, "providers": chosen, "modes": modes,
                "dtypes": [_DTYPE_NAMES[d] for d in torch_dtypes], "seconds": time.perf_counter() - started,
                "load_average_before": load_before, "load_average_after": load_after,
                "readme_grade": quiet, "verdict": verdict,
                "method": "providers compared are timed interleaved within each repetition (training step); "
                          "speed-ups are ratios of best times from the same run"}
    doc = report.write_json(os.path.join(out, "results.json"), machine, settings, records,
                            per_shape=shapes is not None)
    table = report.markdown(records)
    sweep = size + (f", {reps} reps" if reps else "")
    header = (f"fastformer bench ({sweep}) on {machine['gpu'] or machine['cpu']}, {machine['torch_threads']} threads, "
              f"torch {machine['torch']}, triton {machine['triton']}, cpu kernels {machine['cpu_capability']}, "
              f"load average {load_before} before the run, "
              f"{settings['load_average_after']} after\n\n**{verdict}**\n\n"
              + (f"{warning}\n\n" if warning else ""))
    if any(r["op"] == overhead.OP and r["status"] == "ok" for r in records):
        # the host cost a call: its own table, and where the microseconds go (cProfile)
        table += "\n### host cost a call (forward + backward, tiny shapes, 1 thread)\n\n" + overhead.markdown(records)
        with open(os.path.join(out, "overhead_profile.md"), "w") as f:
            f.write(f"# Where an op call's host time goes ({machine['cpu']})\n\n")
            f.write("".join(overhead.profile(c) for c in overhead.cases() if c.p > 0 or c.op.endswith("entropy")))
    if any(r["op"] == dropout_cost.OP and r["status"] == "ok" for r in records):
        table += "\n### dropout's cost (attention + add_layer_norm, forward + backward, cpu backend)\n\n" + \
            dropout_cost.markdown(records)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(header + table)
    plotted = [op for op in ops if op not in (overhead.OP, dropout_cost.OP)]  # (tables of their own: no sweep to plot)
    if plots:
        for op in plotted:
            report.plot_op(os.path.join(out, f"{op}.png"), op, records,
                           title_suffix=f" - {machine['gpu'] or machine['cpu']}")
    print(header + table)
    print(f"wrote {os.path.join(out, 'results.json')}" + (f" and {len(plotted)} PNG plots" if plots and plotted else "")
          + f" in {settings['seconds']:.0f}s")
    return doc


def run_from_args(args: argparse.Namespace) -> Dict:
    return run(ops=args.ops, providers=args.providers, quick=args.quick, size=args.sweep, modes=args.modes,
               dtypes=args.dtypes, device=args.device, out=args.out, plots=args.plots, threads=args.threads,
               shapes=args.shapes, reps=args.reps)
