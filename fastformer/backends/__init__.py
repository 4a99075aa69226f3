"""The backend registry: which kernels run an op, and why a backend cannot.

Backends (declared in ``builtin.py`` as :class:`~.declaration.Backend` objects): ``reference``
(pure PyTorch, anywhere), ``cpu`` (C++ kernels in ``fastformer._C``), ``triton``
(``fastformer.triton_kernels``; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and
``cuda`` (CUDA kernels in ``fastformer._C``). Each declares its devices, dtypes per device,
requirements and limits, and answers :meth:`~.declaration.Backend.why_not` from that.

``set_backend(name)``, ``with use_backend(name):`` and the environment variable
``FASTFORMER_BACKEND`` choose. ``"auto"`` (the default) takes, per tensor device, the first
backend that accepts the call: ``cuda: triton, cuda, reference`` and ``cpu: cpu, reference``.
A forced backend that cannot run a call raises an error that names it and the reason;
:func:`explain` gives every backend's answer for a call.
"""
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch

from . import builtin  # noqa: F401  (declares and registers the four backends)
from .declaration import _REGISTRY, OPS, Backend, Device, Kernels, Limit, OpLibrary, PythonModules, Requirement

BACKENDS: Dict[str, Backend] = _REGISTRY
NAMES = tuple(BACKENDS)
CHOICES = ("auto",) + NAMES  # what a user may ask for: the CLI's and the training config's --backend
AUTO_ORDER = {"cuda": ("triton", "cuda", "reference"), "cpu": ("cpu", "reference")}

__all__ = ["AUTO_ORDER", "Availability", "BACKENDS", "Backend", "CHOICES", "Device", "Kernels", "Limit", "NAMES", "OPS",
           "OpLibrary", "PythonModules", "Requirement", "availability", "available_backends", "explain",
           "get_backend", "resolve", "select", "set_backend", "use_backend"]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why."""
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


_state = threading.local()


def _validate_name(name: str) -> str:
    if name not in CHOICES:
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


def availability(name: str, device_type: Optional[str] = None) -> Availability:
    """Whether backend ``name`` can run here (on ``device_type`` if given; else on any of its own
    devices); the reason if not, a note (the cpu kernels' ISA level) if so."""
    backend = BACKENDS[_validate_name(name)]
    why = backend.unavailable(device_type)
    return Availability(False, why) if why else Availability(True, backend.note())


def available_backends() -> Dict[str, Availability]:
    """Each backend name -> :class:`Availability` (``.available`` and the ``.reason`` if not)."""
    return {name: availability(name) for name in NAMES}


def explain(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None,
            **facts: int) -> Dict[str, Optional[str]]:
    """Each backend name -> why it cannot take this call of ``op`` when forced, or None if it can."""
    return {name: backend.why_not(op, device.type, dtype, limitation, **facts) for name, backend in BACKENDS.items()}


def _choose(requested: str, op: str, device_type: str, dtype: torch.dtype, limitation: Optional[str],
            **facts: int) -> Tuple[str, str]:
    """(backend name, "") for the backend that takes the call, or ("", error) when none can. Pure in
    its arguments, so torch.compile evaluates it once while tracing (and the kernels it binds stay
    outside the graph)."""
    where = f"{op} on {device_type} {dtype}"
    if requested != "auto":
        why = BACKENDS[requested].why_not(op, device_type, dtype, limitation, **facts)
        if why is not None:
            return "", f"fastformer backend {requested!r} was forced but cannot run {op}: {why}"
        return requested, ""
    rejected = []
    for name in AUTO_ORDER.get(device_type, ("reference",)):
        why = BACKENDS[name].why_not(op, device_type, dtype, limitation, auto=True, **facts)
        if why is None:
            return name, ""
        rejected.append(f"{name}: {why}")
    return "", f"no fastformer backend can run {where}: " + "; ".join(rejected)


# What torch.compiler.assume_constant_result(_choose) does, written out: that call would import
# torch._dynamo (and with it triton) at `import fastformer` time.
_choose._dynamo_marked_constant = True


def select(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None,
           **facts: int) -> Optional[Kernels]:
    """The kernels that run this call of ``op``, or None for the reference implementation.

    ``limitation``: why no kernel backend can take this particular call (e.g. a mask that requires
    grad), or None. ``facts``: the sizes the backends' declared limits bound (``head_dim=D`` for
    attention, ``hidden_size=C`` for add_layer_norm). A forced backend that cannot take the call,
    or no backend at all, raises ``RuntimeError`` with the reasons.
    """
    facts = {key: int(value) for key, value in facts.items()}  # a SymInt is not a constant for _choose
    name, error = _choose(get_backend(), op, device.type, dtype, limitation, **facts)
    if error:
        raise RuntimeError(error)
    return None if name == "reference" else BACKENDS[name].kernels(device.type)


def resolve(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None,
            **facts: int) -> str:
    """The name of the backend :func:`select` would use (for logs and tests)."""
    kernels = select(op, device, dtype, limitation, **facts)
    return "reference" if kernels is None else kernels.name
