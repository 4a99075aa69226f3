"""Find an nvcc whose CUDA major version is torch's, installing one from the registry if needed.

torch's extension builder refuses an nvcc of another major version than the CUDA torch was
built with (torch 2.13's PyPI build is CUDA 12 or 13; a machine's /usr/local/cuda may be either).
This looks, in order, at $CUDA_HOME, the nvcc on PATH, /usr/local/cuda and the nvcc packages of
this Python's site-packages; the first whose major matches wins, one with torch's exact
major.minor first. When none matches and --install is given, it pip-installs NVIDIA's nvcc package
for torch's CUDA into this Python (PACKAGES below) and takes that one.

    python tools/find_nvcc.py [--install]

Prints the CUDA_HOME to build with on stdout (exit 0); otherwise one line on stderr saying why
and what to do, and exit 1. benchmarks/gpu_check.py calls :func:`find` directly.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

# NVIDIA's nvcc wheels per CUDA major: the suffixed names up to CUDA 12 (whose nvcc wheel has no
# cuda_runtime.h: the runtime wheel beside it does); from CUDA 13 on the unsuffixed names carry
# the major in their version (nvidia-cuda-nvcc-cu13 is an empty, deprecated placeholder), and
# the nvcc wheel needs the runtime, crt and nvvm wheels, which install into the same folder. Each
# entry: (the wheels to install, the toolkit folder they make under site-packages).
PACKAGES = {
    11: (["nvidia-cuda-nvcc-cu11", "nvidia-cuda-runtime-cu11"], "nvidia/cuda_nvcc"),
    12: (["nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12"], "nvidia/cuda_nvcc"),
}


def package(major: int, minor: Optional[int] = None) -> Tuple[List[List[str]], str]:
    """(pip installs to try in order, each a list of requirements; the toolkit folder under
    site-packages) for a CUDA version: the same major.minor as torch's first (headers newer than
    torch's CUDA runtime may call what that runtime lacks), then any of the major."""
    # from CUDA 13 on, the wheels nvcc needs are named too, to pin them to torch's minor as well
    names, folder = PACKAGES.get(major, (["nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-nvvm"],
                                         f"nvidia/cu{major}"))
    suffixed = major in PACKAGES  # the major is in the name; else only in the version
    attempts = [[f"{n}=={major}.{minor}.*" for n in names]] if minor is not None else []
    attempts.append(list(names) if suffixed else [f"{n}=={major}.*" for n in names])
    return attempts, folder


def parse_release(version_text: str) -> Optional[Tuple[int, int]]:
    """(major, minor) from ``nvcc --version`` output ("... release 13.0, V13.0.88"), else None."""
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_torch_cuda(version: Optional[str]) -> Optional[Tuple[int, int]]:
    """(major, minor) of ``torch.version.cuda`` ("12.8", "13.0"), None for a CPU build."""
    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class Candidate:
    where: str                      # what pointed at it: "$CUDA_HOME", "PATH", ...
    cuda_home: str                  # the folder holding bin/nvcc
    release: Optional[Tuple[int, int]]  # its version, None when it did not run


def pick(torch_cuda: Tuple[int, int], candidates: Sequence[Candidate]) -> Optional[Candidate]:
    """The candidate to build with: the first with torch's major.minor, else the first with its
    major, else None."""
    for c in candidates:
        if c.release == torch_cuda:
            return c
    for c in candidates:
        if c.release is not None and c.release[0] == torch_cuda[0]:
            return c
    return None


def describe(candidates: Sequence[Candidate]) -> str:
    if not candidates:
        return "no nvcc found ($CUDA_HOME, PATH, /usr/local/cuda, site-packages)"
    return ", ".join(f"{'.'.join(map(str, c.release)) if c.release else 'unknown'} at {c.cuda_home} ({c.where})"
                     for c in candidates)


def nvcc_version(nvcc: str) -> Optional[Tuple[int, int]]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_release(out)


def site_dirs() -> List[str]:
    """This Python's site-packages folders (purelib and platlib, and those sys.path adds)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(d for d in dirs if d and os.path.isdir(d)))


def has_runtime_headers(home: str) -> bool:
    """Whether a toolkit folder has cuda_runtime.h: in its include/, or, for CUDA 12's nvcc wheel
    (nvidia/cuda_nvcc), in the runtime wheel's nvidia/cuda_runtime/include beside it (setup.py
    adds that one). A folder without it is not a CUDA_HOME, e.g. /usr/local for an nvcc wrapper
    script in /usr/local/bin."""
    home = os.path.normpath(home)
    return any(os.path.isfile(os.path.join(d, "cuda_runtime.h"))
               for d in (os.path.join(home, "include"), os.path.join(os.path.dirname(home), "cuda_runtime", "include")))


def locate(folders: Iterable[str], env=None, which: Callable[[str], Optional[str]] = shutil.which,
           version: Callable[[str], Optional[Tuple[int, int]]] = nvcc_version) -> List[Candidate]:
    """Every distinct toolkit with an nvcc and the CUDA runtime's headers: $CUDA_HOME's, PATH's,
    /usr/local/cuda's, then those of the toolkit ``folders`` (absolute paths of
    site-packages/nvidia/...)."""
    env = os.environ if env is None else env
    homes: List[Tuple[str, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            homes.append((f"${var}", env[var]))
    on_path = which("nvcc")
    if on_path:
        homes.append(("PATH", os.path.dirname(os.path.dirname(os.path.realpath(on_path)))))
    homes.append(("/usr/local/cuda", "/usr/local/cuda"))
    homes += [("pip package", f) for f in folders]
    seen, out = set(), []
    for where, home in homes:
        nvcc = os.path.join(home, "bin", "nvcc")
        key = os.path.realpath(nvcc)
        if key in seen or not os.path.isfile(nvcc) or not has_runtime_headers(home):
            continue
        seen.add(key)
        out.append(Candidate(where, home, version(nvcc)))
    return out


def pip_install(requirements: List[str], python: str = sys.executable, timeout: float = 600) -> Tuple[bool, str]:
    """``pip install requirements`` into ``python``; (ok, last line of its output). Few retries:
    on a machine without network it should say so in seconds, not minutes. --ignore-installed:
    the wheels land together in this Python's own site-packages even where another site-packages
    that it sees (make gpu-check's venv sees torch's) holds some of them already, so that the
    toolkit folder has nvcc and the runtime's headers side by side."""
    cmd = [python, "-m", "pip", "install", "--quiet", "--ignore-installed", "--retries", "1", "--timeout", "15",
           *requirements]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    return proc.returncode == 0, (lines[-1].strip() if lines else f"exit {proc.returncode}")


@dataclass
class Result:
    cuda_home: Optional[str]
    message: str  # one line: what was chosen or done, or why nothing could be


def find(torch_cuda_version: Optional[str], install: bool = False, env=None,
         candidates: Optional[Callable[[], List[Candidate]]] = None,
         installer: Callable[[List[str]], Tuple[bool, str]] = pip_install) -> Result:
    """The CUDA_HOME to build with for torch's CUDA version (``torch.version.cuda``), installing
    NVIDIA's nvcc package when ``install`` and no nvcc here matches."""
    want = parse_torch_cuda(torch_cuda_version)
    if want is None:
        return Result(None, "torch is a CPU build (torch.version.cuda is None): there is no CUDA to build for")
    attempts, folder = package(*want)
    scan = candidates or (lambda: locate([os.path.join(d, folder) for d in site_dirs()], env=env))
    found = scan()
    chosen = pick(want, found)
    wanted = f"CUDA {want[0]}.{want[1]}"
    if chosen is not None:
        return Result(chosen.cuda_home, f"nvcc {'.'.join(map(str, chosen.release))} at {chosen.cuda_home} "
                                        f"({chosen.where}) for torch's {wanted}")
    none_here = f"no nvcc of CUDA {want[0]}, torch's {wanted} major, here ({describe(found)})"
    if not install:
        return Result(None, f"{none_here}; pip install {' '.join(attempts[0])} "
                            f"or set CUDA_HOME to a CUDA {want[0]} toolkit")
    failures = []
    for reqs in attempts:
        ok, last = installer(reqs)
        wheels = " ".join(reqs)
        if ok:
            chosen = pick(want, scan())
            if chosen is not None:
                return Result(chosen.cuda_home, f"installed {wheels}: nvcc {'.'.join(map(str, chosen.release))} at "
                                                f"{chosen.cuda_home} for torch's {wanted}")
            failures.append(f"{wheels} installed but no nvcc of CUDA {want[0]} with the runtime's headers "
                            f"appeared under {folder}")
        else:
            failures.append(f"{wheels}: {last}")
    return Result(None, f"{none_here} and pip could not install one ({'; '.join(failures)}); "
                        f"offline? put a CUDA {want[0]} nvcc on PATH or set CUDA_HOME")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="pip-install NVIDIA's nvcc package when none matches")
    args = p.parse_args(argv)
    import torch

    result = find(torch.version.cuda, install=args.install)
    if result.cuda_home is None:
        print(f"find_nvcc: {result.message}", file=sys.stderr)
        return 1
    print(f"find_nvcc: {result.message}", file=sys.stderr)
    print(result.cuda_home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
