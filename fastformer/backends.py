"""The backend registry: which kernels run an op, and why a backend cannot.

Backends: ``reference`` (pure PyTorch, anywhere), ``cpu`` (C++ kernels in
``fastformer._C``), ``triton`` (``triton_kernels``; CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) and ``cuda`` (CUDA kernels in ``fastformer._C``).

``set_backend(name)``, ``with use_backend(name):`` and the environment variable
``FASTFORMER_BACKEND`` choose. ``"auto"`` (the default) takes, per tensor device, the
first backend that can run the call: ``cuda: triton, cuda, reference`` and
``cpu: cpu, reference``. A forced backend that cannot run a call raises an error
that says why; an automatic pick falls through to the next one instead.

In the tests, ``cuda`` also runs CPU tensors when the SIMT harness is loaded
(``FASTFORMER_CUDA_SIMT``, see ``_ext``): its kernels are then ``torch.ops.fastformer_simt.<op>``,
the CUDA kernels compiled as host C++. ``auto`` never picks it.
"""
import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch

from . import _ext

NAMES = ("reference", "cpu", "triton", "cuda")
AUTO_ORDER = {"cuda": ("triton", "cuda", "reference"), "cpu": ("cpu", "reference")}
_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16),
    "triton": (torch.float32, torch.float16, torch.bfloat16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16),
}


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why."""
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


_state = threading.local()


def _validate_name(name: str) -> str:
    if name != "auto" and name not in NAMES:
        raise ValueError(f"backend must be 'auto' or one of {NAMES}, got {name!r}")
    return name


def get_backend() -> str:
    """The backend name in force: the innermost ``use_backend``, else ``set_backend``, else env."""
    name = getattr(_state, "name", None)
    if name is None:
        name = _validate_name(os.environ.get("FASTFORMER_BACKEND", "auto"))
    return name


def set_backend(name: str) -> None:
    """Choose the backend for every following op call in this thread (``"auto"`` restores)."""
    _state.name = _validate_name(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: run the enclosed op calls on backend ``name``."""
    previous = getattr(_state, "name", None)
    _state.name = _validate_name(name)
    try:
        yield
    finally:
        _state.name = previous


def _triton_missing() -> Optional[str]:
    """Why triton cannot be imported, found without importing it (import fastformer stays light)."""
    if "triton" in sys.modules and sys.modules["triton"] is None:  # import blocked on purpose
        return "the triton package is not installed (pip install triton)"
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "the triton package is not installed (pip install triton)"
    return None


def availability(name: str, device_type: Optional[str] = None) -> Availability:
    """Whether backend ``name`` can run here (on ``device_type`` if given)."""
    _validate_name(name)
    if name == "reference":
        return Availability(True)
    if name == "cpu":
        if device_type not in (None, "cpu"):
            return Availability(False, f"the cpu backend runs CPU tensors, not {device_type} tensors")
        err = _ext.load_error()
        if err is not None:
            return Availability(False, err)
        level = _ext.cpu_capability()
        return Availability(True, f"C++ kernels at ISA level {level}, chosen at run time "
                                  "(ATEN_CPU_CAPABILITY=default|avx2|avx512 forces one)" if level else "")
    if name == "cuda":
        if device_type == "cpu":  # only the SIMT test harness runs the CUDA kernels on CPU tensors
            err = _ext.simt_load_error()
            if err is not None:
                return Availability(False, f"the cuda backend runs CUDA tensors, not cpu tensors ({err})")
            return Availability(True)
        if device_type not in (None, "cuda"):
            return Availability(False, f"the cuda backend runs CUDA tensors, not {device_type} tensors")
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA GPU is available (torch.cuda.is_available() is False)")
        err = _ext.load_error()
        if err is not None:
            return Availability(False, err)
        if not _ext.has_kernel("attention_fwd", "CUDA"):
            return Availability(False, "fastformer._C was built without CUDA kernels (torch had no CUDA)")
        return Availability(True)
    # triton
    missing = _triton_missing()
    if missing:
        return Availability(False, missing)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device_type == "cpu" and not interpret:
        return Availability(False, "triton runs CPU tensors only under TRITON_INTERPRET=1")
    if device_type in (None, "cuda") and not torch.cuda.is_available() and not interpret:
        return Availability(False, "no CUDA GPU is available and TRITON_INTERPRET=1 is not set")
    return Availability(True)


def available_backends() -> Dict[str, Availability]:
    """Each backend name -> :class:`Availability` (``.available`` and the ``.reason`` if not)."""
    return {name: availability(name) for name in NAMES}


class Kernels:
    """The kernel functions of one kernel backend (``attention_fwd``, ``attention_bwd``, ...)."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, fn: str):
        if self.name == "triton":
            return getattr(importlib.import_module("triton_kernels"), fn)
        if self.name == "cuda" and _ext.simt_load_error() is None:
            return _by_device(fn)
        return getattr(torch.ops.fastformer, fn)

    def bind(self, module, op: str) -> None:
        """Keep ``op``'s ``_fwd``/``_bwd`` functions of ``module`` as plain attributes, so reading
        them needs no ``__getattr__`` (whose ``import_module`` torch.compile cannot trace: a
        graph break around every triton op call)."""
        for fn in (f"{op}_fwd", f"{op}_bwd"):
            if fn not in self.__dict__ and hasattr(module, fn):
                self.__dict__[fn] = getattr(module, fn)

    def __repr__(self) -> str:
        return f"Kernels({self.name!r})"


def _by_device(fn: str):
    """The cuda backend's op ``fn`` when the SIMT harness is loaded: the harness's kernel for CPU
    tensors, the real one (``torch.ops.fastformer``) for CUDA tensors."""
    def call(*args, **kwargs):
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        ns = torch.ops.fastformer_simt if device is not None and device.type == "cpu" else torch.ops.fastformer
        return getattr(ns, fn)(*args, **kwargs)

    call.__name__ = fn
    return call


_KERNELS = {name: Kernels(name) for name in ("cpu", "triton", "cuda")}


def _cannot_run(name: str, op: str, device: torch.device, dtype: torch.dtype,
                limitation: Optional[str]) -> Optional[str]:
    """Why backend ``name`` cannot run this call of ``op``, or None if it can."""
    avail = availability(name, device.type)
    if not avail:
        return avail.reason
    if name == "reference":
        return None
    if dtype not in _DTYPES[name]:
        return f"the {name} backend does not support dtype {dtype} on {device.type}"
    if limitation:
        return limitation
    if name == "cuda" and device.type == "cpu":
        if not _ext.has_kernel(f"{op}_fwd", "CPU", namespace="fastformer_simt"):
            return f"the SIMT harness has no kernel for {op} (csrc/cuda has no glue for it)"
    elif name in ("cpu", "cuda"):
        key = "CPU" if name == "cpu" else "CUDA"
        if not _ext.has_kernel(f"{op}_fwd", key):
            return f"fastformer._C has no {key} kernel for {op}"
    else:
        module = importlib.import_module("triton_kernels")
        if not hasattr(module, f"{op}_fwd"):
            return f"triton_kernels has no kernel for {op}"
        _KERNELS["triton"].bind(module, op)  # here: _choose runs untraced under torch.compile
    return None


def _choose(requested: str, op: str, device_type: str, dtype: torch.dtype,
            limitation: Optional[str]) -> Tuple[str, str]:
    """(backend name, "") for the backend that runs the call, or ("", error) for a forced one
    that cannot. Pure in its arguments, so torch.compile evaluates it once while tracing."""
    device = torch.device(device_type)
    if requested != "auto":
        why = _cannot_run(requested, op, device, dtype, limitation)
        if why is not None:
            return "", f"fastformer backend {requested!r} was forced but cannot run {op}: {why}"
        return requested, ""
    for candidate in AUTO_ORDER.get(device_type, ("reference",)):
        if _cannot_run(candidate, op, device, dtype, limitation) is None:
            return candidate, ""
    return "reference", ""


# What torch.compiler.assume_constant_result(_choose) does, written out: that call would import
# torch._dynamo (and with it triton) at `import fastformer` time.
_choose._dynamo_marked_constant = True


def select(op: str, device: torch.device, dtype: torch.dtype,
           limitation: Optional[str] = None) -> Optional[Kernels]:
    """The kernels that run this call of ``op``, or None for the reference implementation.

    ``limitation``: why no kernel backend can take this particular call (e.g. a mask
    that requires grad), or None. Forced backends raise ``RuntimeError`` with the reason.
    """
    name, error = _choose(get_backend(), op, device.type, dtype, limitation)
    if error:
        raise RuntimeError(error)
    return None if name == "reference" else _KERNELS[name]


def resolve(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None) -> str:
    """The name of the backend :func:`select` would use (for logs and tests)."""
    kernels = select(op, device, dtype, limitation)
    return "reference" if kernels is None else kernels.name
