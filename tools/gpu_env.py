"""Prepare the Python that ``make gpu-check`` runs in: a venv (``.venv-gpu``) on a CUDA build of torch.

    python3 tools/gpu_env.py --venv .venv-gpu DEP...

Standard library only (it runs before anything is installed). In order:

1. No NVIDIA GPU here (no /proc/driver/nvidia/gpus/* and no ``nvidia-smi -L``): one line, exit 1,
   nothing created or installed (a CPU machine never downloads a CUDA torch).
2. The torch: the first Python of ``--torch-python`` (repeatable; default: this Python, then
   TORCH_PYTHONS) whose torch is a CUDA build. The venv is made from its base interpreter with a
   ``.pth`` naming its site-packages, so that torch (and triton, nvidia-*) are used as they are,
   never downloaded again: on a machine without network that is the only torch there is. Where
   no Python has a CUDA torch, the venv pip-installs torch==2.13.0 (PyPI's Linux build of it is
   a CUDA one); when that fails, one line says so and what to give instead, exit 1.
3. The DEPs that the venv lacks are pip-installed; when pip cannot (no network), one line names
   what is missing and gpu-check runs without it (benchmarks/gpu_check.py leaves out what needs
   it), exit 0.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

TORCH = "torch==2.13.0"
# machines whose CUDA torch lives in a venv of their own (the lent GPU machines: /opt/torch/.venv)
TORCH_PYTHONS = ["/opt/torch/.venv/bin/python"]
PTH = "_fastformer_gpu_torch.pth"

_PROBE = r"""
import json, sys
info = {"executable": sys.executable, "base": getattr(sys, "_base_executable", sys.executable),
        "site": [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda)
except Exception as e:
    info.update(torch=None, cuda=None, error=f"{type(e).__name__}: {e}")
print(json.dumps(info))
"""


def say(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def why_no_gpu(gpus_dir: str = "/proc/driver/nvidia/gpus",
               run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Optional[str]:
    """None when an NVIDIA GPU is visible, else why not (before any torch is looked at)."""
    if glob.glob(os.path.join(gpus_dir, "*")):
        return None
    try:
        if run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).returncode == 0:
            return None
    except (OSError, subprocess.SubprocessError):
        pass
    return f"no CUDA GPU here (nothing in {gpus_dir} and no working nvidia-smi); nothing was installed or run"


def probe_python(python: str) -> Optional[Dict]:
    """What ``python`` is and which torch it imports (None when it does not run)."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def pick_torch_python(candidates: Sequence[str], probe: Callable[[str], Optional[Dict]] = probe_python
                      ) -> Tuple[Optional[Dict], List[str]]:
    """(the first candidate whose torch has CUDA, what each earlier one had instead)."""
    seen = []
    for python in dict.fromkeys(candidates):
        if not os.path.exists(python):
            continue
        info = probe(python)
        if info and info.get("cuda"):
            return info, seen
        seen.append(f"{python}: " + ("does not run" if info is None else
                                    f"torch {info['torch']} (CPU build)" if info.get("torch") else "no torch"))
    return None, seen


def requirement_name(req: str) -> Tuple[str, Optional[str]]:
    """(normalised distribution name, pinned version or None) of ``name[==version]``."""
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:==\s*([^\s;,]+))?", req)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2)


def _release(version: str) -> Optional[Tuple[int, ...]]:
    """The release numbers of a plain ``N(.N)*`` version (a local ``+cu130`` ignored), else None."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:\+[A-Za-z0-9.]+)?", version.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


_COMPARE = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b,
            "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def satisfies(version: str, req: str) -> bool:
    """Whether ``version`` meets every ``op version`` clause of ``req`` (e.g. ``ninja>=1.12,<2``).
    Only plain release numbers are compared (packaging is not installed yet where this runs): a
    clause or version it cannot read counts as unmet, so that pip, which reads them all, decides."""
    clauses = re.sub(r"^\s*[A-Za-z0-9_.\-]+\s*", "", req.split(";")[0])
    have = _release(version)
    for clause in filter(None, (c.strip() for c in clauses.split(","))):
        m = re.fullmatch(r"(==|!=|>=|<=|>|<)\s*(\S+)", clause)
        want = _release(m.group(2)) if m else None
        if have is None or want is None:
            return False
        n = max(len(have), len(want))  # 1.12 == 1.12.0
        if not _COMPARE[m.group(1)](have + (0,) * (n - len(have)), want + (0,) * (n - len(want))):
            return False
    return True


def missing(requirements: Sequence[str], installed: Dict[str, str]) -> List[str]:
    """The requirements that ``installed`` (normalised name -> version) does not satisfy: absent,
    or a version outside the requirement's clauses (``==``, ``>=``, ...)."""
    out = []
    for req in requirements:
        name, _ = requirement_name(req)
        if name not in installed or not satisfies(installed[name], req):
            out.append(req)
    return out


def installed_distributions(python: str) -> Dict[str, str]:
    code = ("import importlib.metadata as m, json, re; print(json.dumps({re.sub(r'[-_.]+', '-', "
            "d.metadata['Name']).lower(): d.version for d in m.distributions() if d.metadata['Name']}))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def pip_install(python: str, requirements: Sequence[str]) -> Tuple[bool, str]:
    """(ok, pip's last line); few retries, so that no network is said in seconds."""
    cmd = [python, "-m", "pip", "install", "--quiet", "--retries", "1", "--timeout", "15", *requirements]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return proc.returncode == 0, (lines[-1] if lines else f"exit {proc.returncode}")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def make_venv(venv: str, base: str, site_dirs: Sequence[str], with_pip: bool = True) -> None:
    """A venv from ``base`` whose ``.pth`` puts ``site_dirs`` (another Python's site-packages)
    after its own; without pip where ``base`` cannot make one (the .pth's pip then serves)."""
    if not os.path.exists(venv_python(venv)):
        if not with_pip or subprocess.run([base, "-m", "venv", venv], capture_output=True).returncode != 0:
            subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
    purelib = subprocess.run([venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(purelib, exist_ok=True)
    with open(os.path.join(purelib, PTH), "w") as f:
        f.write("".join(f"{d}\n" for d in site_dirs))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="prepare make gpu-check's venv")
    p.add_argument("--venv", default=".venv-gpu")
    p.add_argument("--torch-python", action="append", default=None,
                   help="a Python whose torch to use (default: this one, then " + ", ".join(TORCH_PYTHONS) + ")")
    p.add_argument("deps", nargs="*")
    args = p.parse_args(argv)
    reason = why_no_gpu()
    if reason:
        say(reason)
        return 1
    venv = os.path.abspath(args.venv)
    candidates = args.torch_python or [sys.executable] + TORCH_PYTHONS
    chosen, others = pick_torch_python(candidates + [venv_python(venv)])
    if chosen is None:
        say(f"no CUDA build of torch here ({'; '.join(others) or 'no Python found'}): installing {TORCH}")
        make_venv(venv, sys.executable, [])
        ok, last = pip_install(venv_python(venv), [TORCH])
        info = probe_python(venv_python(venv)) if ok else None
        if not (info and info.get("cuda")):
            say(f"could not install a CUDA build of {TORCH} ({last if not ok else 'it is a CPU build'}); "
                f"give a Python that has one: make gpu-check PYTHON=/path/to/python")
            return 1
    elif chosen["executable"] != venv_python(venv):
        make_venv(venv, chosen["base"], chosen["site"])
        say(f"torch {chosen['torch']} (CUDA {chosen['cuda']}) of {chosen['executable']}, through {venv}")
    need = missing(args.deps, installed_distributions(venv_python(venv)))
    if need:
        ok, last = pip_install(venv_python(venv), need)
        if not ok:
            say(f"pip could not install {' '.join(need)} ({last}): running without them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
