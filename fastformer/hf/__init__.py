"""fastformer for Hugging Face transformers' encoder-decoders (BART, Marian, mBART, M2M100/NLLB, Whisper, Pegasus,
T5/Flan-T5/ByT5, mT5, UMT5).

Nothing here imports transformers at import time: ``import fastformer`` stays free of it, and
this package imports it only when a transformers model is converted or :func:`register` is called.

    import fastformer
    model = fastformer.convert(model)          # a transformers model: fused in place
    model = fastformer.convert(model, label_smoothing=0.1)

    import fastformer.hf
    fastformer.hf.register()                   # only the attention:
    model = AutoModel.from_config(cfg, attn_implementation="fastformer")
"""
import sys

SUPPORTED_MODEL_TYPES = ("bart", "marian", "mbart", "m2m_100", "whisper", "pegasus", "t5", "mt5", "umt5")


def is_transformers_model(model) -> bool:
    """True if ``model`` is a transformers ``PreTrainedModel``, checked without importing transformers: a
    model of that class can exist only once ``transformers.modeling_utils`` is loaded."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling_utils, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def register() -> None:
    """Register ``"fastformer"`` as a transformers attention implementation (and its mask builder)."""
    from .attention import register as _register
    _register()


def convert(model, **kwargs):
    """Fuse a supported transformers model in place; see :func:`fastformer.convert`."""
    from .patch import convert_model
    return convert_model(model, **kwargs)


__all__ = ["SUPPORTED_MODEL_TYPES", "is_transformers_model", "register", "convert"]
