"""``fastformer.convert``: swap torch.nn Transformer modules inside any model for fastformer's twins."""
from copy import deepcopy

import torch

from . import nn as _nn  # noqa: F401  (importing the twins registers them)
from .internal.twins import TWINS, swap_tree

_INPLACE_REMOVED = (
    "convert(): the 'inplace' argument was removed. convert(model) now always swaps the modules "
    "inside `model` and shares every parameter and buffer object with it (what inplace=True did), "
    "so an optimizer made before the call still trains the result; for the old default "
    "(inplace=False: convert a deep copy, leave `model` untouched) pass copy=True")


def convert(model: torch.nn.Module, *, copy: bool = False, **kwargs) -> torch.nn.Module:
    """Replace every ``torch.nn`` ``MultiheadAttention``, ``TransformerEncoderLayer``,
    ``TransformerDecoderLayer``, ``TransformerEncoder``, ``TransformerDecoder``,
    ``Transformer`` and ``LayerNorm`` inside ``model`` (at any depth) by its
    :mod:`fastformer.nn` twin.

    Each twin shares the parameter and buffer objects of the module it replaces, keeps its
    training mode, hooks and attributes, and computes the same outputs and gradients (up
    to floating-point rounding; with dropout the random masks differ). Subclasses of those
    torch classes are left alone (their behaviour may differ), but their children are
    converted.

    By default nothing is copied: every parameter and buffer of the result *is* the
    corresponding object of ``model`` (``state_dict`` keys are unchanged too), so the
    optimizer-first order works::

        opt = torch.optim.Adam(model.parameters())
        model = fastformer.convert(model)   # opt still holds the parameters the result trains

    The twinned submodules are swapped inside ``model`` itself (its children change), except
    that a ``model`` which is itself one of the classes above cannot change class: then the
    result is a new twin object that shares ``model``'s parameters, buffers and hooks while
    ``model`` keeps its torch children. So always use the return value.

    Args:
        model: any ``torch.nn.Module``.
        copy: if True, convert a ``copy.deepcopy`` of ``model`` and leave ``model`` (its modules
            and its parameter values) untouched; the result then owns new parameters, so an
            optimizer built on ``model`` does not train it. Keyword-only.

    Returns:
        The converted model.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, ``copy`` is not a bool, or the
            removed ``inplace`` argument was passed (the default is now what ``inplace=True``
            did; ``copy=True`` is what ``inplace=False`` did).
        ValueError: a Transformer layer uses an activation other than relu or gelu, which
            the fused feed-forward does not implement.
    """
    if "inplace" in kwargs:
        raise TypeError(_INPLACE_REMOVED)
    if kwargs:
        raise TypeError(f"convert() got unexpected keyword argument(s) {sorted(kwargs)}; it takes `model` "
                        f"and the keyword `copy`")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
    if copy:
        model = deepcopy(model)
    return swap_tree(model)


__all__ = ["convert", "TWINS"]
