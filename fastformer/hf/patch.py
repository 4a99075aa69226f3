"""Which transformers classes are fused, and ``convert_model`` that fuses them in place."""
import importlib
import os
import sys
import warnings
from copy import deepcopy
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .. import backends, ops
from ..internal import validation
from . import layers as _layers
from . import loss as _loss
from . import t5 as _t5


@dataclass(frozen=True)
class ModelSpec:
    module: str                     # transformers' modeling module
    encoder_layer: str
    decoder_layer: str
    norm: str                       # "post" (BART, Marian) or "pre" (mBART, M2M100, Whisper, Pegasus, T5)
    lm_models: Tuple[str, ...]      # the *ForConditionalGeneration class(es): the fused loss
    base_models: Tuple[str, ...]    # the bare *Model class(es): layers and attention only
    shift: Callable                 # (modeling module, labels, model) -> decoder_input_ids, as the model's forward
    final_logits_bias: bool
    no_cache_with_labels: bool      # the model's forward sets use_cache=False when labels are given
    shift_ignores_embeds: bool = False  # M2M100 shifts labels whenever decoder_input_ids is None
    max_target_check: bool = False      # Whisper refuses labels longer than max_target_positions
    t5: Optional[_t5.Layout] = None     # T5-shaped blocks (t5.py) instead of BART-shaped layers (layers.py)
    # (modeling module, model, arguments) -> the base model's output, where the LM class has no base
    # model attribute to call (T5's encoder and decoder are its own); None: model.<base_model_prefix>
    base_forward: Optional[Callable] = None
    head_scale: Optional[Callable] = None  # model -> the factor on the decoder output before the head, or None


# The module is handed in, imported at convert(): an import in forward would break a torch.compile graph.
def _shift3(mod, labels, model):
    return mod.shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)


def _shift_mbart(mod, labels, model):
    return mod.shift_tokens_right(labels, model.config.pad_token_id)  # no start token: it wraps the language id


def _shift_t5(mod, labels, model):
    return model._shift_right(labels)


def _t5_base(prefix):
    """The LM forward's encoder and decoder calls: ``{prefix}ForConditionalGeneration.forward`` runs
    exactly ``{prefix}Model.forward``'s before its head (both fingerprinted), and the LM class has the
    ``encoder`` and ``decoder`` that forward reads, so it runs on the LM model itself."""
    def base(mod, model, a):
        return getattr(mod, prefix + "Model").forward(model, **a, return_dict=True)
    return base


def _scale_if_configured(model):
    """T5's and UMT5's rule: the decoder output times d_model ** -0.5 before the (tied) head when
    ``config.scale_decoder_outputs`` (what ``tie_word_embeddings`` was given as). mT5's forward has none."""
    return model.model_dim ** -0.5 if model.config.scale_decoder_outputs else None


def _t5_spec(name, prefix, umt5=False, scale=True):
    return ModelSpec(_M + f"{name}.modeling_{name}", prefix + "Block", prefix + "Block", "pre",
                     (prefix + "ForConditionalGeneration",), (prefix + "Model", prefix + "EncoderModel"), _shift_t5,
                     final_logits_bias=False, no_cache_with_labels=False, t5=_t5.Layout(prefix, umt5),
                     base_forward=_t5_base(prefix), head_scale=_scale_if_configured if scale else None)


_M = "transformers.models."
SPECS = {
    "bart": ModelSpec(_M + "bart.modeling_bart", "BartEncoderLayer", "BartDecoderLayer", "post",
                      ("BartForConditionalGeneration",), ("BartModel",), _shift3,
                      final_logits_bias=True, no_cache_with_labels=True),
    "marian": ModelSpec(_M + "marian.modeling_marian", "MarianEncoderLayer", "MarianDecoderLayer", "post",
                        ("MarianMTModel",), ("MarianModel",), _shift3,
                        final_logits_bias=True, no_cache_with_labels=True),
    "mbart": ModelSpec(_M + "mbart.modeling_mbart", "MBartEncoderLayer", "MBartDecoderLayer", "pre",
                       ("MBartForConditionalGeneration",), ("MBartModel",), _shift_mbart,
                       final_logits_bias=True, no_cache_with_labels=True),
    "m2m_100": ModelSpec(_M + "m2m_100.modeling_m2m_100", "M2M100EncoderLayer", "M2M100DecoderLayer", "pre",
                         ("M2M100ForConditionalGeneration",), ("M2M100Model",),
                         _shift3, final_logits_bias=False,
                         no_cache_with_labels=False, shift_ignores_embeds=True),
    "whisper": ModelSpec(_M + "whisper.modeling_whisper", "WhisperEncoderLayer", "WhisperDecoderLayer", "pre",
                         ("WhisperForConditionalGeneration",), ("WhisperModel",),
                         _shift3, final_logits_bias=False,
                         no_cache_with_labels=False, max_target_check=True),
    "pegasus": ModelSpec(_M + "pegasus.modeling_pegasus", "PegasusEncoderLayer", "PegasusDecoderLayer", "pre",
                         ("PegasusForConditionalGeneration",), ("PegasusModel",), _shift3,
                         final_logits_bias=True, no_cache_with_labels=True),
    "t5": _t5_spec("t5", "T5"),
    "mt5": _t5_spec("mt5", "MT5", scale=False),
    "umt5": _t5_spec("umt5", "UMT5", umt5=True),
}


def activation_name(fn) -> Optional[str]:
    """fastformer's name for transformers' activation module ``fn`` (``ACT2FN[...]``), or None if
    ``feed_forward`` has no exact equivalent (gelu_fast, quick_gelu, ... keep their own code)."""
    from transformers import activations as A
    if type(fn) is nn.ReLU:
        return "relu"
    if type(fn) is A.GELUActivation and getattr(fn, "act", None) is nn.functional.gelu:
        return "gelu"  # exact erf GELU, as fastformer's ("gelu_python" is the same function in Python)
    if type(fn) is nn.SiLU or type(fn) is getattr(A, "SiLUActivation", None):
        return "silu"  # "swish" (Marian) and "silu"
    if type(fn) is A.NewGELUActivation or type(fn) is getattr(A, "GELUTanh", None):
        return "gelu_tanh"  # "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh": the tanh approximation
    return None


_probed = {}


def activation_works(activation: str, device: torch.device, dtype: torch.dtype, gated: bool = False) -> bool:
    """Whether ``feed_forward`` runs ``activation`` (``gated``: with ``w3``, T5's gated form) on
    ``device``/``dtype`` with the backend chosen now and agrees with its reference (so an op or extension
    that lacks it, e.g. a build from before ``silu``, never gives a wrong model: its layers keep
    transformers' code instead)."""
    key = (activation, gated, device.type, dtype, backends.get_backend(), os.environ.get("FASTFORMER_EXT_LIBRARY"))
    if key not in _probed:
        g = torch.Generator().manual_seed(0)
        t = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in ((3, 8), (5, 8), (5,), (8, 5), (8,))]
        gate = dict(w3=torch.randn(5, 8, generator=g).to(device=device, dtype=dtype)) if gated else {}
        try:
            got = ops.feed_forward(*t, activation=activation, **gate)
            want = ops.reference.feed_forward(*t, activation=activation, **gate)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            _probed[key] = bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))
        except Exception:  # noqa: BLE001 (any refusal means: not available here)
            _probed[key] = False
    return _probed[key]


def _param_device_dtype(model):
    p = next(model.parameters(), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside fastformer."""
    f, level = sys._getframe(1), 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG_DIR + os.sep):
        f, level = f.f_back, level + 1
    return level


def _fuse_layers(model, spec, mod, activation) -> dict:
    """Fuse the BART-shaped encoder and decoder layers of ``model``; ``{activation name: why}`` for those
    left to transformers."""
    enc_cls, dec_cls = getattr(mod, spec.encoder_layer), getattr(mod, spec.decoder_layer)
    unsupported = {}
    for m in model.modules():
        kind = "encoder" if type(m) is enc_cls else "decoder" if type(m) is dec_cls else None
        if kind is None:
            continue  # not a layer, or one fused already
        act, why = activation(m.activation_fn)
        if act is None:
            name = getattr(model.config, "activation_function", None) or type(m.activation_fn).__name__
            unsupported[name] = why
            continue
        _layers.fuse_layer(m, spec.norm, kind, act)
    return unsupported


def convert_model(model, *, copy: bool = False, label_smoothing: Optional[float] = None):
    """Fuse a transformers BART / Marian / mBART / M2M100 / Whisper / Pegasus / T5 / mT5 / UMT5 model in place
    (see fastformer.convert)."""
    import transformers

    from .fingerprint import check
    from .attention import NAME, register

    if not isinstance(copy, bool):
        raise TypeError(f"copy must be a bool, got {type(copy).__name__}")
    if label_smoothing is not None:
        label_smoothing = validation.unit_interval("label_smoothing", label_smoothing)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = SPECS.get(model_type)
    names = ", ".join(n for s in SPECS.values() for n in s.lm_models + s.base_models)
    if spec is None:
        raise TypeError(f"fastformer.convert(): transformers model {type(model).__name__} (model type "
                        f"{model_type!r}) is not supported; fastformer fuses {names}")
    check(model_type)  # the code the fused forwards mirror is code they were tested against
    mod = importlib.import_module(spec.module)
    lm_classes = tuple(getattr(mod, n) for n in spec.lm_models)
    base_classes = tuple(getattr(mod, n) for n in spec.base_models)
    cls = getattr(type(model), "_fastformer_original_class", None) or type(model)  # a converted model again
    if cls not in lm_classes + base_classes:
        raise TypeError(f"fastformer.convert(): {type(model).__name__} is not supported; for model type "
                        f"{model_type!r} fastformer fuses {', '.join(spec.lm_models + spec.base_models)}")
    if copy:
        model = deepcopy(model)

    register()
    model.set_attn_implementation(NAME)

    device, dtype = _param_device_dtype(model)

    def activation(fn, gated=False):
        """(fastformer's name for the activation module ``fn``, None) where feed_forward runs it, else (None, why)."""
        act = activation_name(fn)
        if act is None:
            return None, "fastformer's feed_forward has no such activation"
        if not activation_works(act, device, dtype, gated):
            return None, (f"fastformer's feed_forward cannot run {act!r} here (backend {backends.get_backend()!r}, "
                          f"{device.type}, {dtype})")
        return act, None

    if spec.t5 is not None:
        unsupported = _t5.fuse(model, spec.t5, mod, activation)
        keeps = "feed-forward keeps transformers' own code (the rest of each block is fused)"
    else:
        unsupported = _fuse_layers(model, spec, mod, activation)
        keeps = "encoder and decoder layers keep transformers' own forward (their attention still runs " \
                "fastformer's kernel)"
    for name, why in unsupported.items():
        warnings.warn(f"fastformer.convert(): activation {name!r} of this {type(model).__name__}: {why}; its "
                      f"{keeps}", stacklevel=_user_stacklevel())
    if cls in lm_classes:
        ls = label_smoothing if label_smoothing is not None else getattr(model, "_fastformer_label_smoothing", 0.0)
        _loss.fuse_lm_loss(model, spec, ls)
    elif label_smoothing:
        warnings.warn(f"fastformer.convert(): label_smoothing has no effect on {type(model).__name__}, which "
                      f"computes no loss", stacklevel=_user_stacklevel())
    return model
