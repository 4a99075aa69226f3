"""pytest plugin (``pytest_plugins`` in tests/conftest.py): the SIMT harness runs the ``cuda``
backend's kernels on CPU tensors.

At start-up it builds the harness (tests/simt/build.py: the CUDA kernels compiled as host C++,
incrementally, into build/simt) and loads it, then declares, through the backends' test hook
``Backend.add_device``, that the cuda backend also runs CPU tensors, emulated, with the kernels
``torch.ops.fastformer_simt.<op>``. Forcing ``use_backend("cuda")`` on CPU tensors then runs the
CUDA kernels here; ``auto`` never takes an emulated device and ``available_backends()`` does not
count it, so the library behaves as it does for users.

``FASTFORMER_CUDA_SIMT=/path/fastformer_simt.so`` loads a given build; ``FASTFORMER_CUDA_SIMT=off``
skips the harness (the cuda backend's CPU tests are then skipped, with the reason).
"""
import os
import time
from typing import Optional

import torch

NAMESPACE = "fastformer_simt"
_state = {"error": "the SIMT harness is not loaded (tests/simt/plugin.py did not run)", "path": "", "took": None}


def load_error() -> Optional[str]:
    """None once the harness is loaded and registered with the cuda backend, else why not."""
    return _state["error"]


def _load() -> None:
    path = os.environ.get("FASTFORMER_CUDA_SIMT", "")
    if path in ("0", "off"):
        _state["error"] = f"the SIMT harness is off (FASTFORMER_CUDA_SIMT={path})"
        return
    start = time.perf_counter()
    if path:
        try:
            torch.ops.load_library(path)
        except (OSError, RuntimeError) as exc:
            _state["error"] = f"cannot load the SIMT harness FASTFORMER_CUDA_SIMT={path} ({exc})"
            return
    else:
        from . import build  # builds and loads; a build error fails the session, as a broken build should

        path = build.build()
        _state["took"] = time.perf_counter() - start
    _state["path"] = path
    _register()
    _state["error"] = None


def _register() -> None:
    from fastformer import backends

    cuda = backends.BACKENDS["cuda"]
    cuda.add_device(backends.Device("cpu", cuda.device("cuda").dtypes,
                                    backends.OpLibrary(NAMESPACE, "CPU", "the SIMT harness"), emulated=True))


def pytest_configure(config):
    _load()


def pytest_report_header(config):
    if _state["error"]:
        return f"fastformer SIMT harness: {_state['error']}"
    took = _state["took"]
    return f"fastformer SIMT harness: {_state['path']}" + (f" (built or checked in {took:.1f} s)" if took else "")


def rerun_under(test_file: str, schedule: str, subset: str) -> None:
    """The tests of test_file matching `subset` (pytest -k) in a fresh process on this build of the
    harness, under FF_SIMT_SCHEDULE=schedule (tests/simt/simt.h); asserts they ran and passed."""
    import subprocess
    import sys

    env = dict(os.environ, FF_SIMT_SCHEDULE=schedule, FASTFORMER_CUDA_SIMT=_state["path"])
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test_file, "-k", subset]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(tests))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
