"""Which C++ compiler builds the extensions: one that links libstdc++ as the shared library.

A compiler that links libstdc++ statically (the first GPU machine's ``CC``/``CXX``, /opt/gcc, did)
gives the extension a private copy of libstdc++'s streams and locale beside the process's own.
TORCH_CHECK messages that format an integer then crash the process. ``choose()`` notices such a
``CXX`` and falls back to the system's ``g++``/``c++``; setup.py, the SIMT harness's build and
gpu-check use it. Standard library only.
"""
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Mapping, Optional, Tuple

# std::ostream::_M_insert<long> (integer output) and std::locale::classic(): a shared object that
# defines them carries its own libstdc++ streams and locale
MARKERS = ("_ZNSo9_M_insertIlEERSoT_", "_ZNSt6locale7classicEv")
_PROBE = ("#include <locale>\n#include <sstream>\n#include <string>\n"
          "std::string fmt(long v) { std::ostringstream s; s.imbue(std::locale::classic()); s << v; return s.str(); }\n")
FALLBACKS = ("g++", "c++")


def defined_markers(path: str) -> Optional[List[str]]:
    """The MARKERS that the shared object ``path`` defines (None: nm is not here)."""
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    defined = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}  # less @@GLIBCXX_x
    return [s for s in MARKERS if s in defined]


def links_libstdcxx_statically(cxx: str) -> Optional[bool]:
    """Whether a shared object that ``cxx`` links carries libstdc++'s streams (None: cannot tell)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            proc = subprocess.run([cxx, "-shared", "-fPIC", "-O1", src, "-o", lib], capture_output=True,
                                  timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        found = defined_markers(lib) if proc.returncode == 0 else None
    return None if found is None else bool(found)


def choose(env: Mapping[str, str] = os.environ) -> Tuple[Dict[str, str], str]:
    """(CC and CXX to set, a line saying why) when ``env``'s CXX links libstdc++ statically and
    the system's compiler does not; else ({}, "")."""
    cxx = env.get("CXX")
    if not cxx or not links_libstdcxx_statically(cxx):
        return {}, ""
    problem = f"CXX={cxx} links libstdc++ statically, which crashes torch extensions' error messages"
    mine = os.path.realpath(shutil.which(cxx, path=env.get("PATH")) or cxx)
    for name in FALLBACKS:
        other = shutil.which(name, path=env.get("PATH"))
        if other and os.path.realpath(other) != mine and links_libstdcxx_statically(other) is False:
            cc = os.path.join(os.path.dirname(other), "gcc" if name == "g++" else "cc")
            cc = cc if os.path.exists(cc) else other
            return {"CC": cc, "CXX": other}, f"{problem}: building with {other} instead"
    return {}, f"{problem}, and no other g++/c++ here links it as a shared library"


def use_shared(who: str) -> None:
    """Set CC/CXX in this process as ``choose()`` says, and print its line (``who``: the builder)."""
    compilers, why = choose()
    if why:
        print(f"{who}: {why}", file=sys.stderr, flush=True)
    os.environ.update(compilers)
