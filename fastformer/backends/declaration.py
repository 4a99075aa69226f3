"""What a backend declares, and the answers it gives from that declaration.

A :class:`Backend` lists the devices it runs on (:class:`Device`: the dtypes there, the
:class:`Requirement` s it needs there, and where its kernels are) and the :class:`Limit` s its
kernels put on a call. :meth:`Backend.why_not` says why it cannot take a call, or None; the
registry (``fastformer/backends/__init__.py``) walks the backends with it.

:meth:`Backend.add_device` is the hook for test harnesses: it lets a backend run its kernels on
another device type through an emulator (``emulated=True``). An emulated device serves a forced
backend only: ``auto`` never takes it and ``available_backends()`` does not count it.

The registry keeps each decision (``backends.select``'s cache). Whatever a decision reads from a
declaration clears it when it changes: :func:`register`, :meth:`Backend.add_device`, and setting
any attribute of a :class:`Backend` or :class:`Device` (``devices``, ``limits``, ``dtypes``,
``needs``, a replaced ``_kernels``: what tests monkeypatch) call :func:`invalidate`.
"""
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import _ext, op_table

# The ops with kernels (fastformer/op_table.py): each kernel backend provides ``<op>_<fn>`` for the op's kernels.
OPS = op_table.NAMES
# Optional variants a C++ backend may add as overloads ``<op>_<fn>.<overload>``, found as ``<op>_<fn>_<overload>``
# (e.g. ``attention_varlen_bwd_into``).
OVERLOADS = {op.name: op.overloads for op in op_table.TABLE if op.overloads}

# What a kernel source finds for one op: its functions by name, or why it has none.
Found = Union[Dict[str, Callable], str]

# The caches of decisions made from the declarations (the registry's), and a count of the changes to
# them: a decision made while the count moved is not kept.
_CACHES: List[Dict] = []
GENERATION = [0]


def invalidate() -> None:
    """Forget every decision made from the declarations (they changed)."""
    GENERATION[0] += 1
    for cache in _CACHES:
        cache.clear()


def _device_noun(device_type: str) -> str:
    return {"cpu": "CPU", "cuda": "CUDA"}.get(device_type, device_type)


@dataclass(frozen=True)
class Requirement:
    """Something a backend needs on a device: ``missing()`` is None when met, else why it is not."""
    what: str
    missing: Callable[[], Optional[str]]


@dataclass(frozen=True)
class Limit:
    """An upper bound a backend's kernels put on one fact of an op's call, e.g. attention's head dim.

    The op passes the fact by name to ``backends.select`` (``head_dim=D``). ``maximum`` is read when
    the limit is first checked, so a limit can live in the kernel module that checks it (a Triton
    module, imported only once the backend is asked about a call)."""
    op: str
    fact: str
    noun: str
    maximum: Callable[[], int]

    def exceeded(self, backend: str, facts: Mapping[str, int]) -> Optional[str]:
        value = facts.get(self.fact)
        if value is None:
            return None
        limit = self.maximum()
        if value > limit:
            return f"{self.noun} {value} > {limit}, the {backend} backend's limit"
        return None


class OpLibrary:
    """Kernels registered as torch ops ``torch.ops.<namespace>.<op>_fwd`` / ``_bwd`` for one dispatch key."""

    def __init__(self, namespace: str, dispatch_key: str, what: str):
        self.namespace, self.dispatch_key, self.what = namespace, dispatch_key, what

    def find(self, op: str) -> Found:
        if not _ext.has_kernel(f"{op}_fwd", self.dispatch_key, self.namespace):
            return f"{self.what} has no {self.dispatch_key} kernel for {op}"
        ns = getattr(torch.ops, self.namespace)
        found = {fn: getattr(ns, fn) for fn in op_table.BY_NAME[op].functions if hasattr(ns, fn)}
        for overload in OVERLOADS.get(op, ()):
            if _ext.has_kernel(f"{op}_{overload}", self.dispatch_key, self.namespace):
                fn, name = overload.split(".")
                found[f"{op}_{fn}_{name}"] = getattr(getattr(ns, f"{op}_{fn}"), name)
        return found


    def autograd_op(self, op: str) -> Optional[Callable]:
        """The op with its backward in C++, or None when the library has none for ``op``: the
        callable behind ``torch.ops.<namespace>.<op>.default`` (``OpOverload._op``: the same call
        without the overload's Python frame, on the path of every eager call)."""
        if not _ext.has_kernel(op, "CompositeImplicitAutograd", self.namespace):
            return None
        overload = getattr(getattr(torch.ops, self.namespace), op).default
        return getattr(overload, "_op", overload)


class PythonModules:
    """Kernels defined as functions ``<op>_fwd`` / ``_bwd`` of Python modules ``<package>.<module>``."""

    def __init__(self, package: str, module_of: Mapping[str, str]):
        self.package, self.module_of = package, dict(module_of)

    def module(self, op: str):
        return importlib.import_module(f"{self.package}.{self.module_of[op]}")

    def find(self, op: str) -> Found:
        if op not in self.module_of:
            return f"{self.package} has no module for {op}"
        try:
            module = self.module(op)
        except ImportError as exc:
            return f"{self.package}.{self.module_of[op]} cannot be imported ({exc})"
        found = {fn: getattr(module, fn) for fn in op_table.BY_NAME[op].functions if hasattr(module, fn)}
        return found if f"{op}_fwd" in found else f"{module.__name__} defines no {op}_fwd"


@dataclass
class Device:
    """What a backend runs on one device type: the dtypes, what it needs there, where its kernels are.

    ``emulated``: the kernels of another device run here through an emulator (a test harness); only a
    forced backend takes it."""
    type: str
    dtypes: Tuple[torch.dtype, ...]
    source: Union[OpLibrary, PythonModules]
    needs: Tuple[Requirement, ...] = ()
    emulated: bool = False

    def __post_init__(self):
        self._kernels: Optional["Kernels"] = None

    def __setattr__(self, name, value):
        # binding the kernels the first time changes no decision; replacing them (a test) does
        first_binding = name == "_kernels" and self.__dict__.get("_kernels", None) is None
        object.__setattr__(self, name, value)
        if not first_binding:
            invalidate()

    def missing(self) -> Optional[str]:
        """Why a requirement is not met here, or None."""
        for req in self.needs:
            why = req.missing()
            if why:
                return why
        return None


class Backend:
    """One backend's declaration. ``devices`` empty and ``anywhere=True``: the reference, which runs
    every call on every device and has no kernels."""

    def __init__(self, name: str, devices: Sequence[Device] = (), limits: Sequence[Limit] = (),
                 note: Callable[[], str] = lambda: "", anywhere: bool = False):
        self.name = name
        self.devices: Tuple[Device, ...] = tuple(devices)
        self.limits: Tuple[Limit, ...] = tuple(limits)
        self.note = note  # said of the backend when it is available (e.g. the cpu kernels' ISA level)
        self.anywhere = anywhere

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, devices={[d.type for d in self.devices]})"

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        invalidate()

    def device(self, device_type: str) -> Optional[Device]:
        return next((d for d in self.devices if d.type == device_type), None)

    def add_device(self, device: Device) -> None:
        """Declare one more device type (the test-harness hook, see the module's docstring)."""
        if self.device(device.type) is not None:
            raise ValueError(f"the {self.name} backend already runs {device.type} tensors")
        self.devices += (device,)

    def unavailable(self, device_type: Optional[str] = None) -> Optional[str]:
        """Why this backend cannot run here on ``device_type`` (None: on any of its own, not emulated,
        devices), or None if it can."""
        if self.anywhere:
            return None
        if device_type is None:
            reasons = [(d.type, d.missing()) for d in self.devices if not d.emulated]
            if any(why is None for _, why in reasons):
                return None
            if len({why for _, why in reasons}) == 1:
                return reasons[0][1]
            return "; ".join(f"{_device_noun(t)} tensors: {why}" for t, why in reasons)
        dev = self.device(device_type)
        if dev is None:
            runs = " and ".join(_device_noun(d.type) for d in self.devices if not d.emulated)
            return f"the {self.name} backend runs {runs} tensors, not {device_type} tensors"
        return dev.missing()

    def home(self) -> str:
        """The device type this backend's kernels run on here: its first available device, its own
        devices before emulated ones; else its first device."""
        if not self.devices:
            raise ValueError(f"the {self.name} backend has no kernels")
        for dev in sorted(self.devices, key=lambda d: d.emulated):
            if dev.missing() is None:
                return dev.type
        return self.devices[0].type

    def kernels(self, device_type: str) -> "Kernels":
        """This backend's kernels on ``device_type``, bound once and kept."""
        dev = self.device(device_type)
        if dev is None:
            raise ValueError(self.unavailable(device_type))
        if dev._kernels is None:
            dev._kernels = Kernels(self.name, device_type)
        return dev._kernels

    def why_not(self, op: str, device_type: str, dtype: torch.dtype, limitation: Optional[str] = None,
                auto: bool = False, **facts: int) -> Optional[str]:
        """Why this backend cannot take this call of ``op``, or None if it can.

        ``limitation``: why no kernel can take this particular call (e.g. a mask that requires grad),
        computed by the op; ``auto``: asked by the automatic choice, which never takes an emulated
        device; ``facts``: what the declared limits bound, e.g. ``head_dim=300``."""
        if self.anywhere:
            return None
        why = self.unavailable(device_type)
        if why:
            return why
        dev = self.device(device_type)
        if auto and dev.emulated:
            return f"the {self.name} backend runs {device_type} tensors only emulated, when forced"
        if dtype not in dev.dtypes:
            return f"the {self.name} backend does not support dtype {dtype} on {device_type}"
        why = self.kernels(device_type).missing.get(op)
        if why:
            return why
        for limit in self.limits:
            why = limit.exceeded(self.name, facts) if limit.op == op else None
            if why:
                return why
        return limitation or None


_REGISTRY: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    invalidate()
    return backend


class Kernels:
    """The kernel functions of one backend on one device (``attention_fwd``, ``attention_bwd``, ...),
    bound as plain attributes when constructed: reading one is an attribute load, which
    torch.compile traces without a graph break. ``missing``: each op without a kernel here, and why.
    ``<op>`` (e.g. ``attention``): the C++ library's differentiable op for an eager call (its
    backward in C++, no Python per call), or None (Triton, an emulated device, no such op).

    ``Kernels("cpu")``: the cpu kernels; ``device_type`` defaults to where the backend runs here.
    ``select`` hands out the one instance each backend keeps per device (:meth:`Backend.kernels`).
    """

    def __init__(self, backend: str, device_type: Optional[str] = None):
        if backend not in _REGISTRY:
            raise ValueError(f"no backend named {backend!r}; the backends are {tuple(_REGISTRY)}")
        declared = _REGISTRY[backend]
        device_type = device_type or declared.home()
        dev = declared.device(device_type)
        if dev is None:
            raise ValueError(declared.unavailable(device_type))
        self.name, self.device_type = backend, device_type
        self.missing: Dict[str, str] = {}
        # the C++ library's differentiable op per op (csrc/autograd/<op>.cpp), or None: only where its
        # kernels are the device's own (an emulated device would reach another device's kernels)
        own = isinstance(dev.source, OpLibrary) and dev.source.dispatch_key.lower() == device_type
        bound: Dict[str, Dict[str, Callable]] = {}
        autograd: Dict[str, Optional[Callable]] = {}
        for op in OPS:
            setattr(self, op, None)
            found = dev.source.find(op)
            if isinstance(found, str):
                self.missing[op] = found
            else:
                for fn, kernel in found.items():
                    setattr(self, fn, kernel)
                bound[op] = dict(found)
                autograd[op] = dev.source.autograd_op(op) if own and not dev.emulated else None
                setattr(self, op, autograd[op])
        self._bound, self._autograd = bound, autograd  # from here on, replacing a kernel is watched

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        self._kernel_changed(name)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        self._kernel_changed(name)

    def _kernel_changed(self, name: str) -> None:
        """The C++ differentiable op runs the library's own kernels: while one of its op's kernel
        attributes is replaced or removed (a test, ``check``'s wrong kernels), the op is None, so the
        Python Function runs and calls what is bound."""
        bound = self.__dict__.get("_bound")
        op = next((o for o in sorted(bound or (), key=len, reverse=True) if name.startswith(o + "_")), None)
        if op is None:
            return
        intact = all(self.__dict__.get(fn) is kernel for fn, kernel in bound[op].items())
        object.__setattr__(self, op, self._autograd[op] if intact else None)

    def __repr__(self) -> str:
        return f"Kernels({self.name!r}, {self.device_type!r})"
