"""``fastformer.convert``: swap torch.nn Transformer modules inside any model for fastformer's twins."""
import copy

import torch

from . import nn as _nn  # noqa: F401  (importing the twins registers them)
from .nn._twin import TWINS, swap_tree


def convert(model: torch.nn.Module, inplace: bool = False) -> torch.nn.Module:
    """Replace every ``torch.nn`` ``MultiheadAttention``, ``TransformerEncoderLayer``,
    ``TransformerDecoderLayer``, ``TransformerEncoder``, ``TransformerDecoder``,
    ``Transformer`` and ``LayerNorm`` inside ``model`` (at any depth) by its
    :mod:`fastformer.nn` twin.

    Each twin shares the parameter and buffer objects of the module it replaces, keeps its
    training mode, hooks and attributes, and computes the same outputs and gradients (up
    to floating-point rounding; with dropout the random masks differ). Subclasses of those
    torch classes are left alone (their behaviour may differ), but their children are
    converted.

    Args:
        model: any ``torch.nn.Module``.
        inplace: if False (default) ``model`` is deep-copied first and left untouched; if
            True its submodules are swapped inside ``model`` itself.

    Returns:
        The converted model. When ``model`` is itself one of the classes above, the
        returned object is a new twin (sharing ``model``'s parameters even with
        ``inplace=True``), so always use the return value.

    Raises:
        ValueError: a Transformer layer uses an activation other than relu or gelu, which
            the fused feed-forward does not implement.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    return swap_tree(model)


__all__ = ["convert", "TWINS"]
