"""Loads the C++/CUDA extension ``fastformer._C`` on first use, never at import time.

``FASTFORMER_EXT_LIBRARY=/path/lib.so`` loads a privately built copy instead
(``tools/dev_build.py``), so kernel work can be tested without a full build.
"""
import functools
import importlib
import importlib.util
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
    from . import fake_ops

    fake_ops.register("fastformer")  # so torch.compile traces the ops
    _find_direct_entries()
    return None


def module():
    """The extension's Python module: fastformer._C, or the private build of
    ``FASTFORMER_EXT_LIBRARY`` loaded as that module (its init function is PyInit__C whatever the
    file's name), or None where it cannot be loaded."""
    return _module() if load_error() is None else None


@functools.lru_cache(maxsize=None)
def _module():
    path = os.environ.get("FASTFORMER_EXT_LIBRARY")
    try:
        if not path:
            return importlib.import_module("fastformer._C")
        spec = importlib.util.spec_from_file_location("fastformer._C", path)
        if spec is None:
            return None
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        return ext
    except (ImportError, OSError):
        return None


def _find_direct_entries() -> None:
    """Fill internal.fast.DIRECT with the module's ``<op>_eager`` functions (csrc/eager.h), keyed by
    the op as the backends hold it (declaration.OpLibrary.autograd_op). A library built before the
    entries has none: the fast paths call the registered ops."""
    from .internal import fast

    ext = _module()  # (the library is loaded: called from load_error)
    for name in dir(ext) if ext is not None else ():
        if name.endswith("_eager"):
            overload = getattr(torch.ops.fastformer, name[:-len("_eager")]).default
            fast.DIRECT[getattr(overload, "_op", overload)] = getattr(ext, name)


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
    """Whether ``<namespace>::<op>`` has a kernel registered for ``dispatch_key`` (CPU, CUDA). The
    ``fastformer`` namespace is loaded first; another (a test harness's) must be loaded already."""
    if namespace == "fastformer" and load_error() is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{op}", dispatch_key)
    except RuntimeError:  # no such op in the namespace
        return False
