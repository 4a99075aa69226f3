"""Loads the C++/CUDA extension ``fastformer._C`` on first use, never at import time.

``FASTFORMER_EXT_LIBRARY=/path/lib.so`` loads a privately built copy instead
(``tools/dev_build.py``), so kernel work can be tested without a full build.

``FASTFORMER_CUDA_SIMT=/path/fastformer_simt.so`` names the SIMT test harness (the CUDA kernels
compiled as host C++, ``tests/simt/build.py``; ``tests/conftest.py`` builds it and sets the
variable): its ops ``torch.ops.fastformer_simt.<op>`` run the ``cuda`` backend on CPU tensors.
"""
import functools
import importlib
import os
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def load_error() -> Optional[str]:
    """None once the extension's ops are registered, else why they could not be."""
    path = os.environ.get("FASTFORMER_EXT_LIBRARY")
    try:
        if path:
            torch.ops.load_library(path)
        else:
            importlib.import_module("fastformer._C")
    except (ImportError, OSError) as exc:
        return (f"the C++ extension fastformer._C is not built ({exc}); build it with "
                "`make build` or `pip install --no-build-isolation -e .`")
    from . import fake_ops  # noqa: F401  (fake implementations so torch.compile traces the ops)
    return None


@functools.lru_cache(maxsize=None)
def simt_load_error() -> Optional[str]:
    """None once the SIMT harness library (``FASTFORMER_CUDA_SIMT``) is loaded, else why not."""
    path = os.environ.get("FASTFORMER_CUDA_SIMT", "")
    if path in ("", "0", "off"):
        return ("the SIMT harness is not loaded (FASTFORMER_CUDA_SIMT is not set; tests/conftest.py "
                "builds it with tests/simt/build.py)")
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        return f"cannot load the SIMT harness FASTFORMER_CUDA_SIMT={path} ({exc})"
    return None


def cpu_capability() -> Optional[str]:
    """The ISA level the CPU kernels run at ("DEFAULT", "AVX2" or "AVX512": ``at::get_cpu_capability()``,
    ``ATEN_CPU_CAPABILITY`` included, never above what the CPU runs), or None without the extension."""
    if load_error() is not None:
        return None
    try:
        return str(torch.ops.fastformer.cpu_capability())
    except (AttributeError, RuntimeError):  # a library built before the ISA levels existed
        return None


def has_kernel(op: str, dispatch_key: str, namespace: str = "fastformer") -> bool:
    """Whether ``<namespace>::<op>`` has a kernel registered for ``dispatch_key`` (CPU, CUDA);
    namespace ``fastformer_simt`` is the SIMT harness's."""
    if (simt_load_error() if namespace == "fastformer_simt" else load_error()) is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{op}", dispatch_key)
