"""Ahead-of-time compile every Triton kernel specialisation for real GPU targets, no GPU needed.

    python -m fastformer.triton_kernels.aot --cc 80 --cc 90 [--configs first|all] [--json PATH] [--jobs 2]
                                            [--module NAME ...] [--match REGEX]

Each module in ``fastformer.triton_kernels.MODULES`` defines ``aot_specs()``: a list of dicts, one per kernel
specialisation its host functions can launch, with keys

    name         a readable label (op, variant, dtype, tile)
    fn           the @triton.jit function (an autotune/heuristics wrapper is unwrapped)
    signature    {arg: "*fp32" | "*bf16" | "*fp16" | "i32" | "i64" | "fp32" | "constexpr"}
    constexprs   {arg: value} for every constexpr argument
    num_warps, num_stages
    divisible_by_16   (optional) args Triton's launcher would specialise as 16-aligned pointers /
                      multiples of 16; without them loads compile unvectorised and unpipelined
    first_choice      (optional) True for the configuration the host launches first for this
                      specialisation (the first entry of the kernel's config list: what runs
                      without autotuning, and what the interpreter tests force)
    ccs               (optional) the compute capabilities the host launches this spec on (a config
                      family of one target, as attention's sm_90 configs); compiled for those of
                      the requested ``--cc`` only. Default: every requested target

A *specialisation* is one kernel with one signature and its non-tile constexprs (dtype, feature
flags, head-dim or hidden-size bucket) and its ``ccs``; its *configs* are the tile constexprs in ``TILE_CONSTEXPRS``
with num_warps / num_stages. ``--configs first`` (the default, and what ``make test`` runs)
compiles each specialisation's first-choice config only; ``--configs all`` compiles every
autotune candidate (full validation). Without a ``first_choice`` key, the first spec of each
specialisation in list order is its first choice.

Every spec is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``
(with TRITON_INTERPRET unset) for each ``--cc``; the report gives, per kernel and target, the
registers per thread and the shared memory (from the cubin, ``cuobjdump --dump-resource-usage``),
the spill stores/loads (``ptxas -v`` on the same PTX with Triton's flags) and whether the shared
memory fits the target's opt-in maximum per block. Exit status 1 if any module fails to import or
defines no specs, any spec fails to compile, any kernel spills registers to local memory, or any
kernel does not fit.
"""
import argparse
import concurrent.futures as futures
import contextlib
import importlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

# Largest shared memory one block can opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

_PACKAGE = "fastformer.triton_kernels"  # the installed name (setup.py maps triton_kernels/ there)
# Constexprs that are autotune choices (tile shape), not part of what a specialisation computes.
TILE_CONSTEXPRS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "ROWS_PER_STEP"})


def _no_interpreter():
    """The interpreter turns @triton.jit functions into numpy emulations: AOT needs the real ones."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _modules(names=None):
    from . import MODULES
    return list(names) if names else list(MODULES)


def load_specs(module_name):
    """``aot_specs()`` of ``fastformer.triton_kernels.<module_name>`` (raises what importing raises)."""
    module = importlib.import_module(f"{_PACKAGE}.{module_name}")
    if not hasattr(module, "aot_specs"):
        raise AttributeError(f"{_PACKAGE}.{module_name} defines no aot_specs()")
    return list(module.aot_specs())


def _specialisation(spec):
    """What a spec computes, without its tile config: kernel, signature, non-tile constexprs, and
    the targets it is for."""
    fn = spec["fn"]
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", repr(fn))
    constexprs = tuple(sorted((k, repr(v)) for k, v in (spec.get("constexprs") or {}).items()
                              if k not in TILE_CONSTEXPRS))
    return name, tuple(sorted(spec["signature"].items())), constexprs, tuple(spec.get("ccs") or ())


def targets(spec, ccs):
    """The requested compute capabilities ``ccs`` that ``spec`` is compiled for (its ``ccs``)."""
    return [cc for cc in ccs if not spec.get("ccs") or cc in spec["ccs"]]


def first_choice_indices(specs):
    """Indices of the first-choice specs: those marked ``first_choice=True`` when any spec of the
    list carries the key, else the first spec of each specialisation in list order."""
    if any("first_choice" in spec for spec in specs):
        return [i for i, spec in enumerate(specs) if spec.get("first_choice")]
    seen, out = set(), []
    for i, spec in enumerate(specs):
        key = _specialisation(spec)
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _unwrap(fn):
    from triton.runtime.jit import JITFunction
    while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
        fn = fn.fn
    if not isinstance(fn, JITFunction):
        raise TypeError(f"spec fn {fn!r} is not a triton.jit function (was TRITON_INTERPRET set?)")
    return fn


def _source(spec):
    import triton
    fn = _unwrap(spec["fn"])
    constexprs = dict(spec.get("constexprs") or {})
    signature = {}
    for arg in fn.arg_names:  # kernel order; every argument must be typed
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in spec["signature"]:
            signature[arg] = spec["signature"][arg]
        else:
            raise KeyError(f"argument {arg!r} of {fn.__name__} has neither a signature type nor a constexpr")
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]]
             for arg in spec.get("divisible_by_16", ()) if signature.get(arg, "constexpr") != "constexpr"}
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def _compile(spec, cc):
    """triton.compile for ``cc``; also returns the ``ptxas -v`` log Triton's own ptxas run printed
    (empty when the kernel came from Triton's cache)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    options = {"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}
    buf = io.StringIO()
    with knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(buf):
            kernel = triton.compile(_source(spec), target=GPUTarget("cuda", cc, 32), options=options)
    return kernel, buf.getvalue()


def _resources(kernel, cc, log):
    """Registers / stack / static shared / local bytes from the cubin; spills from ``ptxas -v``
    (Triton's log of this compile, or a rerun with Triton's flags on the same PTX). Kept next to
    Triton's cache, keyed by the kernel's hash, so a rerun over cached kernels is quick."""
    from triton import knobs
    saved = os.path.join(knobs.cache.dir, "fastformer_aot", f"{kernel.metadata.hash}.json")
    if os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)
    row = _measure(kernel, cc, log)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    tmp = f"{saved}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(row, f)
    os.replace(tmp, saved)
    return row


def _measure(kernel, cc, log):
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory(prefix="ff_aot_") as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = _run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin])
        if "spill stores" not in log:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(kernel.asm["ptx"])
            log = _run([get_ptxas(cc).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                        f"--gpu-name={sm_arch_from_capability(cc)}", ptx, "-o", os.path.join(tmp, "v.o")])
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump --dump-resource-usage output:\n{usage}")
    regs, stack, static_smem, local = (int(g) for g in m.groups())
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not spills:
        raise RuntimeError(f"cannot read ptxas -v output:\n{log}")
    return {"registers": regs, "stack": stack, "static_shared": static_smem, "local": local,
            "spill_stores": sum(int(s) for s, _ in spills), "spill_loads": sum(int(l) for _, l in spills)}


def sass(kernel) -> str:
    """A compiled kernel's SASS (``cuobjdump -sass`` of its cubin, the copy bundled with Triton):
    what the tests that count instructions (HGMMA, UTMALDG) read."""
    from triton import knobs
    with tempfile.TemporaryDirectory(prefix="ff_aot_") as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return _run([knobs.nvidia.cuobjdump.path, "-sass", cubin])


def compile_one(module_name, index, cc):
    """Compile spec ``index`` of ``module_name`` for compute capability ``cc`` (a worker's job)."""
    _no_interpreter()
    row = {"module": module_name, "index": index, "cc": cc, "name": f"{module_name}[{index}]"}
    start = time.time()
    try:
        spec = load_specs(module_name)[index]
        row["name"] = spec["name"]
        row["num_warps"], row["num_stages"] = spec["num_warps"], spec["num_stages"]
        kernel, log = _compile(spec, cc)
        row.update(_resources(kernel, cc, log))
        row["shared"] = int(kernel.metadata.shared)
        limit = SMEM_LIMIT.get(cc)
        row["smem_limit"] = limit
        row["fits"] = limit is None or row["shared"] + row["static_shared"] <= limit
    except Exception as exc:  # reported per kernel; the run goes on
        root = exc
        while (root.__cause__ or root.__context__) is not None:  # Triton chains the real reason
            root = root.__cause__ or root.__context__
        row["error"] = f"{type(root).__name__}: {root}" + ("" if root is exc else f" (in {exc})")
        row["traceback"] = traceback.format_exc()
    row["seconds"] = round(time.time() - start, 2)
    return row


def run(ccs, modules=None, jobs=2, progress=None, configs="first", match=None):
    """Compile the specs of every module for every cc: each specialisation's first-choice config
    (``configs="first"``) or every spec (``"all"``), each for the targets of its ``ccs``; with
    ``match`` (a regular expression) only the selected specs whose name it matches. Returns
    ``{"modules": {name: {"specs": n, "selected": [index, ...], "targets": [[index, cc], ...],
    "error": str|None}}, "kernels": [row, ...]}``."""
    if configs not in ("first", "all"):
        raise ValueError(f"configs must be 'first' or 'all', got {configs!r}")
    _no_interpreter()
    report = {"ccs": list(ccs), "configs": configs, "modules": {}, "kernels": []}
    work = []
    for name in _modules(modules):
        try:
            specs = load_specs(name)
            error = None if specs else "aot_specs() returned no specs"
            selected = first_choice_indices(specs) if configs == "first" else list(range(len(specs)))
            if specs and not selected:
                error = "no spec is marked first_choice"
            if match is not None:  # a subset to look at; chosen after first_choice, so it is the same kernel
                selected = [i for i in selected if re.search(match, specs[i]["name"])]
        except Exception as exc:
            specs, selected, error = [], [], f"{type(exc).__name__}: {exc}"
        pairs = [(i, cc) for i in selected for cc in targets(specs[i], ccs)]
        report["modules"][name] = {"specs": len(specs), "selected": selected, "targets": [list(p) for p in pairs],
                                   "error": error}
        work += [(name, i, cc) for i, cc in pairs]
    if jobs <= 1:
        rows = (compile_one(*w) for w in work)
        for done, row in enumerate(rows, 1):
            report["kernels"].append(row)
            if progress:
                progress(done, len(work), row)
    else:
        ctx = multiprocessing.get_context("spawn")
        pool = futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_no_interpreter)
        with pool:
            pending = [pool.submit(compile_one, *w) for w in work]
            for done, fut in enumerate(futures.as_completed(pending), 1):
                row = fut.result()
                report["kernels"].append(row)
                if progress:
                    progress(done, len(work), row)
    report["kernels"].sort(key=lambda r: (r["module"], r["index"], r["cc"]))
    return report


def problems(report):
    """Every reason the report is not clean, one line each."""
    out = []
    for name, info in report["modules"].items():
        if info["error"]:
            out.append(f"module {name}: {info['error']}")
    for row in report["kernels"]:
        if "error" in row:
            out.append(f"{row['name']} sm_{row['cc']}: {row['error'].splitlines()[0]}")
        else:
            if not row["fits"]:
                out.append(f"{row['name']} sm_{row['cc']}: shared memory {row['shared']} + "
                           f"{row['static_shared']} B > {row['smem_limit']} B")
            if spills(row):
                out.append(spill_message(row))
    return out


def spills(row):
    """Bytes a compiled kernel spills (stores + loads to local memory); 0 for a clean kernel."""
    return row.get("spill_stores", 0) + row.get("spill_loads", 0)


def spill_message(row):
    return (f"{row['name']} sm_{row['cc']} (num_warps={row.get('num_warps')}, "
            f"num_stages={row.get('num_stages')}): spills {row['spill_stores']} B stores / "
            f"{row['spill_loads']} B loads at {row['registers']} registers")


def format_table(report):
    head = ("kernel", "sm", "regs", "spill st/ld B", "local B", "smem B", "fits", "s")
    rows = []
    for r in report["kernels"]:
        if "error" in r:
            rows.append((r["name"], str(r["cc"]), "-", "-", "-", "-", "ERROR", str(r["seconds"])))
        else:
            rows.append((r["name"], str(r["cc"]), str(r["registers"]),
                         f"{r['spill_stores']}/{r['spill_loads']}", str(r["local"]),
                         f"{r['shared'] + r['static_shared']}", "yes" if r["fits"] else "NO",
                         str(r["seconds"])))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    mods = ", ".join(f"{n}: {len(i.get('selected', ()))} of {i['specs']} specs"
                     + (f" (ERROR {i['error']})" if i["error"] else "")
                     for n, i in report["modules"].items())
    lines += ["", f"modules: {mods}"]
    issues = problems(report)
    lines += [f"problems ({len(issues)}):"] + [f"  {p}" for p in issues] if issues else ["problems: none"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastformer.triton_kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--cc", type=int, action="append", required=True,
                        help="compute capability to build for (80 = A100, 90 = H100); repeatable")
    parser.add_argument("--json", help="also write the full report (with tracebacks) to this file")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile processes (default: 2)")
    parser.add_argument("--module", action="append", help="only these modules of MODULES")
    parser.add_argument("--configs", choices=("first", "all"), default="first",
                        help="first: each specialisation's first-choice config (default); "
                             "all: every autotune candidate")
    parser.add_argument("--match", metavar="REGEX",
                        help="only the selected specs whose name this regular expression matches "
                             "(re.search), e.g. 'fp32.*_d256_'")
    parser.add_argument("--list", action="store_true", help="list the specs, compile nothing")
    args = parser.parse_args(argv)
    _no_interpreter()
    if args.list:
        for name in _modules(args.module):
            specs = load_specs(name)
            selected = set(first_choice_indices(specs))
            print(f"{name}: {len(specs)} specs, {len(selected)} first-choice (*)")
            for i, spec in enumerate(specs):
                if args.match is None or re.search(args.match, spec["name"]):
                    print(f"  {'*' if i in selected else ' '} {spec['name']}")
        return 0
    start = time.time()

    def progress(done, total, row):
        status = "ERROR" if "error" in row else f"{row.get('registers')} regs"
        print(f"[{done}/{total}] sm_{row['cc']} {row['name']}: {status} ({row['seconds']} s)",
              file=sys.stderr, flush=True)

    report = run(args.cc, args.module, jobs=args.jobs, progress=progress, configs=args.configs, match=args.match)
    report["seconds"] = round(time.time() - start, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(format_table(report))
    print(f"\n{len(report['kernels'])} compiles in {report['seconds']} s")
    return 1 if problems(report) else 0


if __name__ == "__main__":
    sys.exit(main())
