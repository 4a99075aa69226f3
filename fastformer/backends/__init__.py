"""The backend registry: which kernels run an op, and why a backend cannot.

Backends (declared in ``builtin.py`` as :class:`~.declaration.Backend` objects): ``reference``
(pure PyTorch, anywhere), ``cpu`` (C++ kernels in ``fastformer._C``), ``triton``
(``fastformer.triton_kernels``; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and
``cuda`` (CUDA kernels in ``fastformer._C``). Each declares its devices, dtypes per device,
requirements and limits, and answers :meth:`~.declaration.Backend.why_not` from that.

``set_backend(name)``, ``with use_backend(name):`` and the environment variable
``FASTFORMER_BACKEND`` choose. ``"auto"`` (the default) takes, per tensor device, the first
backend that accepts the call: ``cuda: triton, cuda, reference`` and ``cpu: cpu, reference``.
On CUDA it also passes over a backend measured slower than PyTorch's own composition for the
call's class, where the next one was measured faster (``measured.py``: the table and the rule).
A forced backend that cannot run a call raises an error that names it and the reason;
:func:`explain` gives every backend's answer for a call (``auto=True``: ``auto``'s answers).

**The decision is made once.** :func:`select` keeps each decision, keyed by (requested backend
name, op, device, dtype, limitation, facts), so a repeated call costs a dict lookup; an error
(a forced backend that cannot run the call) is kept as its message and raised again, anew, on
every call. The requested name is read on every call (``use_backend``, ``set_backend``, then
``FASTFORMER_BACKEND``), so changing it needs nothing. A change to the declarations clears the
cache by itself (``register``, ``Backend.add_device``, setting an attribute of a ``Backend`` or
``Device``, ``AUTO_ORDER[...] = ...``: see ``declaration.py``). What a decision reads from the
process, once, and does not watch: ``torch.cuda.is_available()``, ``TRITON_INTERPRET``, whether
triton and ``fastformer._C`` import, the kernel modules' limits, the module globals
``AUTO_ORDER`` and ``measured.TABLE`` when replaced whole. After changing one of those (tests
monkeypatch them), call :func:`clear_cache`. Under ``torch.compile`` the cache is not used:
dynamo evaluates :func:`_choose` once while tracing, as before.

Ops call :func:`select` (the facts as keywords) or :func:`select_cached` (the same decision and
cache entry, the facts as a tuple of names, a module constant, and a tuple of values: no keyword
packing, which costs about a microsecond with several facts). An op's fast path that has asked
``torch.compiler.is_compiling()`` itself calls :func:`select_eager` (the same, without asking again).
"""
import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from . import builtin  # noqa: F401  (declares and registers the four backends)
from .declaration import (_CACHES, _REGISTRY, GENERATION, OPS, Backend, Device, Kernels, Limit, OpLibrary,
                          PythonModules, Requirement, invalidate)

BACKENDS: Dict[str, Backend] = _REGISTRY
NAMES = tuple(BACKENDS)
CHOICES = ("auto",) + NAMES  # what a user may ask for: the CLI's and the training config's --backend


class _Declared(dict):
    """A dict whose changes clear the decisions made from it (``monkeypatch.setitem`` included)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        invalidate()

    def __delitem__(self, key):
        super().__delitem__(key)
        invalidate()


def _changes(method):
    def changed(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            invalidate()
    return changed


for _method in ("update", "pop", "popitem", "clear", "setdefault", "__ior__"):
    setattr(_Declared, _method, _changes(getattr(dict, _method)))


AUTO_ORDER = _Declared({"cuda": ("triton", "cuda", "reference"), "cpu": ("cpu", "reference")})

__all__ = ["AUTO_ORDER", "Availability", "BACKENDS", "Backend", "CHOICES", "Device", "Kernels", "Limit", "NAMES", "OPS",
           "OpLibrary", "PythonModules", "Requirement", "availability", "available_backends", "clear_cache",
           "explain", "get_backend", "resolve", "select", "select_cached", "select_eager", "set_backend",
           "use_backend"]


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why."""
    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


_state = threading.local()
# Whether any thread ever requested a backend (set_backend, use_backend: _state.name's writers):
# until one did, no thread's request needs reading (an op's fast path skips it: ops/add_layer_norm.py)
ASKED = [False]


def _validate_name(name: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"backend must be 'auto' or one of {NAMES}, got {name!r}")
    return name


_ENV = "FASTFORMER_BACKEND"
if hasattr(os.environ, "_data") and hasattr(os.environ, "encodekey"):  # CPython's os.environ
    # its own storage and key: a dict lookup, without the KeyError os.environ.get raises (and
    # catches) for an unset variable; os.environ's setters and monkeypatch.setenv write there
    _env_raw, _ENV_KEY, _env_decode = os.environ._data.get, os.environ.encodekey(_ENV), os.environ.decodevalue
else:
    _env_raw, _ENV_KEY, _env_decode = os.environ.get, _ENV, str
_is_compiling = torch.compiler.is_compiling


def _requested() -> str:
    """The name in force, unvalidated, read cheaply: the thread's own ``__dict__`` (no
    AttributeError raised and caught when unset), then the environment variable."""
    name = _state.__dict__.get("name")
    if name is None:
        raw = _env_raw(_ENV_KEY)
        name = "auto" if raw is None else _env_decode(raw)
    return name


def _requested_traced() -> str:
    """:func:`_requested` as dynamo traces it: it guards on the thread-local and the variable."""
    name = getattr(_state, "name", None)
    if name is None:
        name = os.environ.get(_ENV, "auto")
    return name


def get_backend() -> str:
    """The backend name in force: the innermost ``use_backend``, else ``set_backend``, else env."""
    return _validate_name(_requested_traced() if _is_compiling() else _requested())


def set_backend(name: str) -> None:
    """Choose the backend for every following op call in this thread (``"auto"`` restores)."""
    _state.name = _validate_name(name)
    ASKED[0] = True


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: run the enclosed op calls on backend ``name``."""
    previous = getattr(_state, "name", None)
    _state.name = _validate_name(name)
    ASKED[0] = True
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
            *, auto: bool = False, **facts: int) -> Dict[str, Optional[str]]:
    """Each backend name -> why it cannot take this call of ``op`` when forced, or None if it can.

    ``auto=True``: what ``auto`` does instead, in its order for the device: each backend it tried
    -> why it passed that one over (the measured reason included: "measured slower than PyTorch's
    composition on nvidia-h200 at ..."), and None for the one it takes (the last key); a backend
    it never tries is left out."""
    facts = {key: int(value) for key, value in facts.items()}
    if auto:
        return dict(_auto_answers(op, device.type, dtype, limitation, facts))
    return {name: backend.why_not(op, device.type, dtype, limitation, **facts) for name, backend in BACKENDS.items()}


_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _measured_skip(name: str, later: Tuple[str, ...], op: str, device_type: str, dtype: torch.dtype,
                   limitation: Optional[str], facts: Dict[str, int]) -> Optional[str]:
    """Why ``auto`` passes over ``name`` (which accepts the call) for speed, or None: the call is
    in a class of :data:`measured.TABLE` where ``name`` was slower than PyTorch's composition and
    the next backend of ``later`` that accepts the call was measured faster there."""
    from . import measured  # here, not at import: `python -m fastformer.backends.measured` runs it as __main__

    table = measured.TABLE
    if not table:
        return None
    found = measured.lookup(table, op, device_type, _DTYPE_NAMES.get(dtype, str(dtype)), facts)
    if found is None or not found.slower(name):
        return None
    mine = found.time(name)
    nxt = next((n for n in later
                if BACKENDS[n].why_not(op, device_type, dtype, limitation, auto=True, **facts) is None), None)
    theirs = None if nxt is None else found.time(nxt)
    if theirs is None or theirs >= mine:
        return None
    return (f"measured slower than PyTorch's composition on {found.machine} at {found.label} ({found.dtype}, "
            f"forward + backward): {mine:g} ms vs {found.composition_ms:g} ms; {nxt} took {theirs:g} ms there")


def _auto_answers(op: str, device_type: str, dtype: torch.dtype, limitation: Optional[str],
                  facts: Dict[str, int]) -> List[Tuple[str, Optional[str]]]:
    """``auto``'s walk: (backend, why passed over) for each backend tried, in order, up to the one it
    takes, answered None (absent if none takes the call)."""
    order = tuple(AUTO_ORDER.get(device_type, ("reference",)))
    answers = []
    for i, name in enumerate(order):
        why = BACKENDS[name].why_not(op, device_type, dtype, limitation, auto=True, **facts)
        if why is None:
            why = _measured_skip(name, order[i + 1:], op, device_type, dtype, limitation, facts)
        answers.append((name, why))
        if why is None:
            break
    return answers


def _choose(requested: str, op: str, device_type: str, dtype: torch.dtype, limitation: Optional[str],
            **facts: int) -> Tuple[str, str]:
    """(backend name, "") for the backend that takes the call, or ("", error) when none can. Pure in
    its arguments (and the declarations), so torch.compile evaluates it once while tracing (and the
    kernels it binds stay outside the graph)."""
    where = f"{op} on {device_type} {dtype}"
    if requested != "auto":
        why = BACKENDS[requested].why_not(op, device_type, dtype, limitation, **facts)
        if why is not None:
            return "", f"fastformer backend {requested!r} was forced but cannot run {op}: {why}"
        return requested, ""
    answers = _auto_answers(op, device_type, dtype, limitation, facts)
    if answers and answers[-1][1] is None:
        return answers[-1][0], ""
    return "", f"no fastformer backend can run {where}: " + "; ".join(f"{name}: {why}" for name, why in answers)


# What torch.compiler.assume_constant_result(_choose) does, written out: that call would import
# torch._dynamo (and with it triton) at `import fastformer` time.
_choose._dynamo_marked_constant = True

# The decisions: (requested name, op, device, dtype, limitation, fact names, fact values) -> the Kernels,
# None (the reference), or the error's message (a str). Cleared by declaration.invalidate().
_CACHE: Dict[tuple, object] = {}
_CACHES.append(_CACHE)
_CACHE_SIZE = 4096  # distinct calls kept; past it the cache starts over (shapes as facts can vary without end)


def memo() -> dict:
    """A dict of an op's own that :func:`invalidate` (and so :func:`clear_cache`) clears with the
    decisions: an op's fast path may keep what it derived from a decision there."""
    kept: dict = {}
    _CACHES.append(kept)
    return kept


def clear_cache() -> None:
    """Forget every decision :func:`select` kept (after changing what it reads from the process:
    see the module's docstring)."""
    invalidate()


def _decide(key: Optional[tuple], requested: str, op: str, device, dtype: torch.dtype, limitation: Optional[str],
            names: Tuple[str, ...], values: Tuple[int, ...]):
    """The decision for a call not in the cache, kept under ``key`` (None: not kept) unless the
    declarations changed meanwhile."""
    if len(names) != len(values):
        raise ValueError(f"{op}: {len(names)} fact names {names} for {len(values)} values")
    generation = GENERATION[0]
    device_type = device if isinstance(device, str) else device.type
    facts = {name: int(value) for name, value in zip(names, values)}
    name, error = _choose(_validate_name(requested), op, device_type, dtype, limitation, **facts)
    result = error or (None if name == "reference" else BACKENDS[name].kernels(device_type))
    if key is not None and GENERATION[0] == generation:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = result
    return result


def _select_traced(op: str, device, dtype: torch.dtype, limitation: Optional[str], names, values) -> Optional[Kernels]:
    """:func:`select` as dynamo traces it: no cache, :func:`_choose` evaluated once as a constant."""
    device_type = device if isinstance(device, str) else device.type
    facts = {name: int(value) for name, value in zip(names, values)}  # a SymInt is not a constant for _choose
    name, error = _choose(_validate_name(_requested_traced()), op, device_type, dtype, limitation, **facts)
    if error:
        raise RuntimeError(error)
    return None if name == "reference" else BACKENDS[name].kernels(device_type)


def select(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None,
           **facts: int) -> Optional[Kernels]:
    """The kernels that run this call of ``op``, or None for the reference implementation.

    ``limitation``: why no kernel backend can take this particular call (e.g. a mask that requires
    grad), or None. ``facts``: the sizes the backends' declared limits bound (``head_dim=D`` for
    attention, ``hidden_size=C`` for add_layer_norm) and the ones the measured table's classes
    name (``measured.FACTS_OF``). A forced backend that cannot take the call, or no backend at all,
    raises ``RuntimeError`` with the reasons. Decided once per distinct call (see the module).
    """
    return select_cached(op, device, dtype, limitation, tuple(facts), tuple(facts.values()))


def select_cached(op: str, device, dtype: torch.dtype, limitation: Optional[str] = None,
                  names: Tuple[str, ...] = (), values: Tuple[int, ...] = ()) -> Optional[Kernels]:
    """:func:`select` with the facts as two tuples, their names (a constant of the op's module) and
    their values::

        _FACTS = ("head_dim", "q_len", "k_len")
        kernels = backends.select_cached("attention", q.device, q.dtype, limitation, _FACTS, (D, Sq, Sk))

    The same answer and cache entry as ``select(..., head_dim=D, q_len=Sq, k_len=Sk)``, without
    packing keywords (about a microsecond with several facts). ``device``: a ``torch.device``
    (hashed as it is: reading ``device.type`` costs more than the lookup) or a device type string.
    A value may be a bool (the flags: ``causal``, ``dropout``) or any int-like."""
    if _is_compiling():
        return _select_traced(op, device, dtype, limitation, names, values)
    requested = _state.__dict__.get("name")  # _requested(), inline
    if requested is None:
        raw = _env_raw(_ENV_KEY)
        requested = "auto" if raw is None else _env_decode(raw)
    key = (requested, op, device, dtype, limitation, names, values)
    try:
        result = _CACHE[key]
    except KeyError:
        result = _decide(key, requested, op, device, dtype, limitation, names, values)
    except TypeError:  # an unhashable value (a SymInt outside dynamo): decide without keeping it
        result = _decide(None, requested, op, device, dtype, limitation, names, values)
    if result.__class__ is str:
        raise RuntimeError(result)
    return result


def select_eager(op: str, device, dtype: torch.dtype, names: Tuple[str, ...] = (),
                 values: Tuple[int, ...] = ()) -> Optional[Kernels]:
    """:func:`select_cached` without a limitation, for a caller that has seen
    ``torch.compiler.is_compiling()`` answer False itself (an op's fast path: internal/fast.py); the
    same answer and cache entry, without asking again (a Python call of two, ~15% of the lookup)."""
    requested = _state.__dict__.get("name")  # _requested(), inline
    if requested is None:
        raw = _env_raw(_ENV_KEY)
        requested = "auto" if raw is None else _env_decode(raw)
    key = (requested, op, device, dtype, None, names, values)
    try:
        result = _CACHE[key]
    except KeyError:
        result = _decide(key, requested, op, device, dtype, None, names, values)
    except TypeError:  # an unhashable value: decide without keeping it
        result = _decide(None, requested, op, device, dtype, None, names, values)
    if result.__class__ is str:
        raise RuntimeError(result)
    return result


def resolve(op: str, device: torch.device, dtype: torch.dtype, limitation: Optional[str] = None,
            **facts: int) -> str:
    """The name of the backend :func:`select` would use (for logs and tests)."""
    kernels = select(op, device, dtype, limitation, **facts)
    return "reference" if kernels is None else kernels.name
