"""Loads the C++/CUDA extension ``fastformer._C`` on first use, never at import time.

``FASTFORMER_EXT_LIBRARY=/path/lib.so`` loads a privately built copy instead
(``tools/dev_build.py``), so kernel work can be tested without a full build.
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


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``fastformer::<op>`` has a kernel registered for ``dispatch_key`` (CPU, CUDA)."""
    if load_error() is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fastformer::{op}", dispatch_key)
