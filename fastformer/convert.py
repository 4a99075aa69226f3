"""``fastformer.convert``: swap torch.nn Transformer modules inside any model for fastformer's twins."""
from copy import deepcopy

import torch

from . import nn as _nn  # noqa: F401  (importing the twins registers them)
from .internal.twins import TWINS, drop_activation_shadow, swap_tree

_INPLACE_REMOVED = (
    "convert(): the 'inplace' argument was removed. convert(model) now always swaps the modules "
    "inside `model` and shares every parameter and buffer object with it (what inplace=True did), "
    "so an optimizer made before the call still trains the result; for the old default "
    "(inplace=False: convert a deep copy, leave `model` untouched) pass copy=True")


def _is_transformers_model(model) -> bool:
    from .hf import is_transformers_model  # imports nothing from transformers
    return is_transformers_model(model)


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

    A Hugging Face transformers model (BART, Marian, mBART, M2M100/NLLB, Whisper, Pegasus: the
    ``*ForConditionalGeneration`` / ``MarianMTModel`` and bare ``*Model`` classes; T5 / Flan-T5 /
    ByT5, mT5, UMT5: those and ``*EncoderModel``) is fused in place by :func:`fastformer.hf.convert`
    instead: its attention runs ``fastformer.ops.attention`` (``attn_implementation="fastformer"``;
    T5's relative position bias as its table), its layers ``add_layer_norm`` and ``feed_forward``, and
    its training loss ``linear_cross_entropy``; it keeps its class name, parameter objects,
    ``state_dict`` keys and config, so ``save_pretrained`` writes a plain transformers checkpoint.
    transformers is never imported by fastformer itself: a model is recognised as a transformers
    one only when transformers is already loaded.

    Args:
        model: any ``torch.nn.Module``.
        copy: if True, convert a ``copy.deepcopy`` of ``model`` and leave ``model`` (its modules
            and its parameter values) untouched; the result then owns new parameters, so an
            optimizer built on ``model`` does not train it. Keyword-only.
        label_smoothing: transformers models only (keyword-only): the label smoothing of the
            fused training loss (default 0, or the value of an earlier convert).

    Returns:
        The converted model.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, ``copy`` is not a bool, the
            removed ``inplace`` argument was passed (the default is now what ``inplace=True``
            did; ``copy=True`` is what ``inplace=False`` did), ``label_smoothing`` was passed
            for a model that is not a transformers one, or a transformers model of a class
            fastformer does not fuse.
        ValueError: a Transformer layer uses an activation other than relu, gelu (exact) or
            silu, which the fused feed-forward does not implement.
        RuntimeError: a transformers model, with a transformers version other than the one
            fastformer's integration is tested with.
    """
    if "inplace" in kwargs:
        raise TypeError(_INPLACE_REMOVED)
    if _is_transformers_model(model):
        unknown = sorted(set(kwargs) - {"label_smoothing"})
        if unknown:
            raise TypeError(f"convert() got unexpected keyword argument(s) {unknown}; for a transformers model "
                            f"it takes `model` and the keywords `copy` and `label_smoothing`")
        from . import hf
        return hf.convert(model, copy=copy, label_smoothing=kwargs.get("label_smoothing"))
    if "label_smoothing" in kwargs:
        raise TypeError(f"convert(): label_smoothing applies to Hugging Face transformers models only (their "
                        f"fused training loss); {type(model).__name__} is not one. For a fastformer model, pass "
                        f"label_smoothing to its loss (fastformer.ops.cross_entropy / linear_cross_entropy)")
    if kwargs:
        raise TypeError(f"convert() got unexpected keyword argument(s) {sorted(kwargs)}; it takes `model` "
                        f"and the keyword `copy`")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
    if copy:
        model = _deepcopy(model)
    return swap_tree(model)


def _deepcopy(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy``, with torch's activation shadow dropped from every layer of the copy (see
    :func:`~fastformer.internal.twins.drop_activation_shadow`)."""
    out = deepcopy(model)
    for m in out.modules():
        drop_activation_shadow(m)
    return out
