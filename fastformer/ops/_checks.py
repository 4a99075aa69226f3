"""Input validation shared by the functional ops: errors that name the argument."""
import math
import numbers
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, t, *, ndim: Optional[int] = None, min_ndim: Optional[int] = None,
           floating: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def shape(name: str, t: torch.Tensor, want: Sequence[int], meaning: str = "") -> None:
    if tuple(t.shape) != tuple(want):
        hint = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must have shape {tuple(want)}{hint}, got {tuple(t.shape)}")


def same_device(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")


def same_dtype(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}; "
                            "they must match (or run under torch.autocast)")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def probability(name: str, p) -> float:
    if not _is_number(p) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name} must be a number in [0, 1), got {p!r}")
    return float(p)


def positive(name: str, x) -> float:
    if not _is_number(x) or not 0.0 < float(x) < math.inf:
        raise ValueError(f"{name} must be a positive number (and finite), got {x!r}")
    return float(x)


def positive_int(name: str, x, *, minimum: int = 1) -> int:
    """``x`` as an int >= ``minimum`` (module sizes, counts); TypeError for a non-int."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x}")
    return x


def flag(name: str, x) -> bool:
    """``x`` must be a Python bool (a tensor or a string is not a flag)."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return x


def nonempty_dim(name: str, t: torch.Tensor, dim: int, what: str) -> None:
    """The size of ``t``'s dimension ``dim`` (``what``) must be at least 1."""
    if t.shape[dim] < 1:
        raise ValueError(f"{name}'s last dimension ({what}) must be at least 1, got shape {tuple(t.shape)}"
                         if dim == -1 else
                         f"{name}'s dimension {dim} ({what}) must be at least 1, got shape {tuple(t.shape)}")


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype in force for ``device``'s type, or None when autocast is off."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t.to(dtype)`` for floating tensors (differentiable), leaving None and dtype=None alone."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.to(dtype)
