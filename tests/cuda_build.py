"""nvcc for the tests, no GPU needed: one compile per .cu file and target a session, shared by
the ptxas check (tests/test_cuda_compile.py) and the SASS checks (tests/test_cuda_sass.py).

    nvcc -c -O3 -std=c++17 -gencode arch=compute_<a>,code=sm_<a> -Xptxas -v <file>.cu   (a: 80, 90)

One nvcc a target, not one for both: nvcc compiles a file's targets one after the other, so on two
cores the two halves run side by side (attention.cu: 54 kernels a target), each piece has the whole
timeout to itself, and the SASS checks (sm_90 only) compile half. ``compile_arch(cu, arch)``
returns {cmd, rc, output, rows (parse_ptxas), obj}; ``compile_cu(cu)`` both targets' (in parallel)
merged, obj by target. The objects stay in a session temporary folder, so ``sass(cu, arch)``
disassembles them (cuobjdump -sass, the one on PATH or the copy bundled with triton, found without
importing triton) into each kernel's instructions.
"""
import atexit
import collections
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

ARCHS = ("80", "90")
TIMEOUT_S = 600  # a guard against hangs; a piece (file, target) takes 10-250 s on two busy cores


def _timeout():
    """TIMEOUT_S, times the machine's load per core when that is above 1 (at most 4x): the guard
    is against a hang, not a slow machine. attention.cu for both targets in one nvcc took 480 s of
    its 600 on the shared 2-core machine at load 11-14, and timed out twice; a piece is about
    half of that."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return TIMEOUT_S * min(4.0, max(1.0, load))


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


NVCC = _nvcc()
NO_NVCC = "nvcc is not installed (not on PATH, not in $CUDA_HOME/bin or /usr/local/cuda/bin)"


def _demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             timeout=60)
        lines = out.stdout.splitlines()
        if out.returncode == 0 and len(lines) == len(names):
            return dict(zip(names, lines))
    except (OSError, subprocess.SubprocessError):
        pass
    return {n: n for n in names}


def parse_ptxas(text):
    """ptxas -v output -> [{name, arch, registers, stack, spill_stores, spill_loads, smem}]."""
    rows, current = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
        if m:
            current = {"name": m.group(1), "arch": m.group(2), "registers": 0, "stack": 0,
                       "spill_stores": 0, "spill_loads": 0, "smem": 0}
            rows.append(current)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m and (current is None or current["name"] != m.group(1)):
            # a non-inlined device function: its spills count as well
            current = {"name": m.group(1), "arch": rows[-1]["arch"] if rows else "?",
                       "registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
            rows.append(current)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    return rows


_OUT = tempfile.mkdtemp(prefix="fastformer-nvcc-")
atexit.register(shutil.rmtree, _OUT, True)


@functools.lru_cache(maxsize=None)
def compile_arch(cu, arch):
    """Compile one .cu file for sm_<arch> (once a session): {cmd, rc, output, rows, obj}."""
    obj = os.path.join(_OUT, f"{os.path.basename(cu)}.sm_{arch}.o")
    cmd = [NVCC, "-c", "-O3", "-std=c++17", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
           "-Xptxas", "-v", cu, "-o", obj]
    timeout = _timeout()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cmd": cmd, "rc": None, "output": f"timed out after {timeout:.0f} s", "rows": [], "obj": None}
    output = proc.stdout + proc.stderr
    return {"cmd": cmd, "rc": proc.returncode, "output": output, "rows": parse_ptxas(output), "obj": obj}


def compile_cu(cu):
    """Compile one .cu file for every target of ARCHS, the targets in parallel (once a session):
    {cmd (the first failing piece's, else the first's), rc (the first failing piece's, else 0),
    output and rows (all pieces'), obj ({arch: object})}."""
    with ThreadPoolExecutor(max_workers=len(ARCHS)) as pool:
        pieces = list(pool.map(lambda a: compile_arch(cu, a), ARCHS))
    bad = [r for r in pieces if r["rc"] != 0]
    first = bad[0] if bad else pieces[0]
    return {"cmd": first["cmd"], "rc": first["rc"], "output": "".join(r["output"] for r in pieces),
            "rows": [row for r in pieces for row in r["rows"]],
            "obj": {a: r["obj"] for a, r in zip(ARCHS, pieces)}}


def _short(name):
    """A demangled kernel name without its return type, anonymous namespace and parameters."""
    name = name.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")  # triton's wheel bundles the CUDA binary tools
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


CUOBJDUMP = _cuobjdump()


def parse_sass(text):
    """cuobjdump -sass text -> {mangled function name: [instruction text, ...]} (predicates kept,
    addresses and encodings dropped)."""
    functions, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m and current is not None:
            current.append(m.group(1))
    return functions


@functools.lru_cache(maxsize=None)
def sass(cu, arch):
    """{short demangled kernel name with template arguments: [instructions]} of one compiled .cu
    file for ``arch`` ("80" or "90")."""
    result = compile_arch(cu, arch)
    if result["rc"] != 0:
        raise RuntimeError(f"nvcc failed for {cu}:\n{result['output'][-4000:]}")
    proc = subprocess.run([CUOBJDUMP, "-sass", "-arch", f"sm_{arch}", result["obj"]], capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {proc.stderr[-2000:]}")
    functions = parse_sass(proc.stdout)
    names = _demangle(sorted(functions))
    return {_short(names[n]): code for n, code in functions.items()}


def opcode(instruction):
    """The opcode's base name of one SASS instruction: '@P0 HMMA.16816.F32.BF16 R0, ...' -> 'HMMA'."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def opcode_counts(code):
    """Counter of opcode base names over a list of instructions."""
    return collections.Counter(opcode(i) for i in code)
