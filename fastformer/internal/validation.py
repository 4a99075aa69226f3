"""Validation shared by the functional ops, the modules and the models: before any work, a
ValueError / TypeError naming the argument, what it got and what it wants (torch's own modules
assert or fail deep inside a GEMM instead). Tensor-level checks first, then the modules' checks of
their configuration and inputs, built on them."""
import contextlib
import math
import numbers
from typing import Callable, Optional, Sequence, TypeVar

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
T = TypeVar("T")


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


def kv_heads(name: str, H_kv: int, H: int) -> None:
    """k/v (``name``) may have fewer heads than q when they divide q's (grouped-query attention)."""
    if H_kv != H and (H_kv < 1 or H % H_kv):
        raise ValueError(f"{name} has {H_kv} heads, which must divide q's {H} heads (grouped-query "
                         f"attention: query head h reads k/v head h // (H // H_kv))")


def _same(attr: str, error, message: str, tensors) -> None:
    first_name = first = None  # one pass, no list: this runs on every op call
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        value = getattr(t, attr)
        if first_name is None:
            first_name, first = name, value
        elif value != first:
            raise error(message.format(name=name, first=first_name, value=value, first_value=first))


def same_device(**tensors) -> None:
    _same("device", ValueError, "{name} is on {value} but {first} is on {first_value}; "
          "all inputs must be on one device", tensors)


def same_dtype(**tensors) -> None:
    _same("dtype", TypeError, "{name} has dtype {value} but {first} has dtype {first_value}; "
          "they must match (or run under torch.autocast)", tensors)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def probability(name: str, p) -> float:
    if not is_number(p) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"{name} must be a number in [0, 1), got {p!r}")
    return float(p)


def unit_interval(name: str, x) -> float:
    """``x`` as a float in [0, 1] (a label smoothing); ValueError otherwise."""
    if not is_number(x) or not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")
    return float(x)


def positive(name: str, x) -> float:
    if not is_number(x) or not 0.0 < float(x) < math.inf:
        raise ValueError(f"{name} must be a positive number (and finite), got {x!r}")
    return float(x)


def positive_int(name: str, x, *, minimum: int = 1) -> int:
    """``x`` as an int >= ``minimum`` (module sizes, counts); TypeError for a non-int. A
    ``torch.SymInt`` (a size torch.compile keeps symbolic) counts as an int."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x}")
    return x


def integer(name: str, x) -> int:
    """``x`` as an int of any sign (an offset); TypeError for a bool or a non-int."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
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
    if not torch._C._is_any_autocast_enabled():  # the common case, in a fifth of a microsecond
        return None
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


_NO_CONTEXT = contextlib.nullcontext()  # stateless: one for every call


def autocast_off(device: torch.device):
    """The context a kernel call runs in: autocast turned off for ``device``'s type, or nothing to
    enter when it is off already (entering a disabled ``torch.autocast`` costs ~9 us a call)."""
    if torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NO_CONTEXT


# The backends whose kernels check index values (class targets, embedding ids) themselves, as they
# read them (csrc/cpu): for these the Python check is not made first; it runs only to word the error.
CHECK_VALUES = ("cpu",)


def values_checked(kernels, check_values: Callable[[], None], call: Callable[[], T]) -> T:
    """``call()``, with the values ``check_values`` checks checked once: by the kernels where they
    check them (then ``check_values`` runs only after their error, to raise the op's own message),
    else by ``check_values`` first (reading the values: a device sync on a GPU)."""
    if kernels is None or kernels.name not in CHECK_VALUES:
        check_values()
        return call()
    try:
        return call()
    except RuntimeError:
        check_values()  # a bad value raises the op's ValueError; any other error is the kernel's
        raise


def cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t.to(dtype)`` for floating tensors (differentiable), leaving None and dtype=None alone."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.to(dtype)


# The modules' checks of their configuration and inputs.


def attention_config(embed_dim, num_heads, dropout, embed_name: str = "embed_dim",
                     heads_name: str = "num_heads") -> None:
    """Sizes of a multi-head attention: positive ints, ``embed_dim`` a multiple of ``num_heads``."""
    positive_int(embed_name, embed_dim)
    positive_int(heads_name, num_heads)
    if embed_dim % num_heads:
        raise ValueError(f"{embed_name} ({embed_dim}) must be divisible by {heads_name} ({num_heads})")
    probability("dropout", dropout)


def layer_config(d_model, nhead, dim_feedforward, dropout, layer_norm_eps) -> None:
    """A Transformer layer's constructor arguments."""
    attention_config(d_model, nhead, dropout, "d_model", "nhead")
    positive_int("dim_feedforward", dim_feedforward)
    positive("layer_norm_eps", layer_norm_eps)


def hidden(name: str, x, width: int, like: Optional[torch.Tensor], ranks=(2, 3),
           width_name: str = "d_model") -> None:
    """A module input ``x``: a floating tensor of one of ``ranks`` ending in ``width``, on the
    device of the module's parameter ``like`` and (outside autocast) of its dtype."""
    tensor(name, x, floating=True)
    if x.dim() not in ranks:
        raise ValueError(f"{name} must have {' or '.join(map(str, ranks))} dimensions, got shape {tuple(x.shape)}")
    if x.shape[-1] != width:
        raise ValueError(f"{name}'s last dimension must be {width_name}={width}, got shape {tuple(x.shape)}")
    if like is None:
        return
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the module's parameters are on {like.device}")
    if autocast_dtype(x.device) is None and x.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the module's parameters have dtype {like.dtype}; "
                        "they must match (or run under torch.autocast)")


def key_padding_mask(name: str, mask, B: int, S: int, device) -> None:
    """``(B, S)`` bool (True = padded) or float (added) on ``device``."""
    tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = padded) or floating point, got {mask.dtype}")
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"{name} must have shape (N, S) = {(B, S)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the input is on {device}")


def attn_mask(name: str, mask, B: int, H: int, L: int, S: int, device) -> None:
    """``(L, S)`` or ``(B * H, L, S)``, bool (True = masked out) or float (added), on ``device``."""
    tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = masked out) or floating point, got {mask.dtype}")
    if mask.dim() == 2:
        if tuple(mask.shape) != (L, S):
            raise ValueError(f"a 2-D {name} must have shape (L, S) = {(L, S)}, got {tuple(mask.shape)}")
    elif mask.dim() == 3:
        if tuple(mask.shape) != (B * H, L, S):
            raise ValueError(f"a 3-D {name} must have shape (N * num_heads, L, S) = {(B * H, L, S)}, got "
                             f"{tuple(mask.shape)}")
    else:
        raise ValueError(f"{name} must be 2-D (L, S) or 3-D (N * num_heads, L, S), got shape {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the input is on {device}")


def sequence_dims(x: torch.Tensor, batch_first: bool):
    """(B, S) of a (B, S, E) / (S, B, E) batched or (S, E) unbatched input."""
    if x.dim() == 2:
        return 1, x.shape[0]
    return (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])


def layer_masks(x: torch.Tensor, batch_first: bool, nhead: int, mask, mask_name: str, kpm, kpm_name: str,
                keys: Optional[torch.Tensor] = None) -> None:
    """A layer's attention mask and key padding mask for input ``x`` (and ``keys``: the memory)."""
    B, L = sequence_dims(x, batch_first)
    S = sequence_dims(keys, batch_first)[1] if keys is not None else L
    if mask is not None:
        attn_mask(mask_name, mask, B, nhead, L, S, x.device)
    if kpm is not None:
        if x.dim() == 2:  # unbatched: (S,)
            tensor(kpm_name, kpm, ndim=1)
            kpm = kpm[None]
        key_padding_mask(kpm_name, kpm, B, S, x.device)
