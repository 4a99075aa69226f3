"""Fused forwards for the Transformer layers of transformers' BART family, installed per layer instance.

Each function mirrors the forward of the transformers layer it replaces (same arguments, same
calls to the layer's attention modules, whose attention runs through the ``"fastformer"``
attention implementation) and swaps the elementwise tail for fastformer's fused ops:

* post-LN (BART, Marian): ``LayerNorm(residual + dropout(x))`` -> ``add_layer_norm(x, residual, ...)``;
* pre-LN (mBART, M2M100, Whisper): ``residual + dropout(x)`` followed by the next block's
  LayerNorm -> ``add_layer_norm(x, residual, ..., prenorm=True)`` (``(LayerNorm(h), h)``);
* ``fc2(dropout(act(fc1(x))))`` -> ``feed_forward(x, ..., activation=, dropout_p=activation_dropout)``;
* an encoder layer whose mask is key padding runs everything after its attention on the real tokens
  alone (:class:`~fastformer.nn.packing.Packing`): its output is zero at the padded positions, which
  every later attention masks out (transformers computes values there that nothing uses). A decoder
  layer does the same (its cross-attention on the padded layout) where the fused loss marked the
  target positions after each row's last counted label as padding: causal, nothing reads them.

The layer object stays (parameters, hooks, submodules); its class becomes a subclass of its transformers
class that only overrides ``forward`` (:func:`fused_subclass`).
"""
import torch
from torch import nn

from .. import ops
from ..nn.packing import Packing, may_pack
from .attention import _PARTS, ROWS_UNUSED


def _p(layer, p):
    return p if layer.training else 0.0


def plain(module, cls) -> bool:
    """Whether ``module`` is exactly a ``cls`` (``nn.Linear`` / ``nn.LayerNorm``) without hooks, so a fused op
    may read its parameters in its place. A module swapped or wrapped after transformers built it (a PEFT
    LoRA ``fc1``, a quantised Linear, accelerate's offloading hooks) is called instead, as transformers does."""
    return type(module) is cls and not (module._forward_hooks or module._forward_pre_hooks)


def _aln(layer, x, residual, ln, prenorm=False, x_bias=None):
    """``LayerNorm(residual + dropout(x + x_bias))``, or with ``prenorm`` ``(LayerNorm(h), h)`` for that sum ``h``."""
    p = _p(layer, layer.dropout)
    if plain(ln, nn.LayerNorm):
        return ops.add_layer_norm(x, residual, ln.weight, ln.bias, ln.eps, p, prenorm=prenorm, x_bias=x_bias)
    x = x if x_bias is None else x + x_bias
    h = residual + nn.functional.dropout(x, p=p, training=layer.training)
    return (ln(h), h) if prenorm else ln(h)


def _ln(x, ln):
    if plain(ln, nn.LayerNorm):
        return ops.add_layer_norm(x, None, ln.weight, ln.bias, ln.eps, 0.0)
    return ln(x)


def _ffn(layer, x, defer_bias=False):
    """``fc2(dropout(act(fc1(x))))`` as one ``feed_forward``. With ``defer_bias``: ``(output, fc2's bias
    or None)``, the bias left to the add_layer_norm that follows (``x_bias``) when the block is fused."""
    p = _p(layer, layer.activation_dropout)
    if plain(layer.fc1, nn.Linear) and plain(layer.fc2, nn.Linear):
        bias = layer.fc2.bias if defer_bias else None
        out = ops.feed_forward(x, layer.fc1.weight, layer.fc1.bias, layer.fc2.weight,
                               None if defer_bias else layer.fc2.bias, activation=layer._fastformer_activation,
                               dropout_p=p)
    else:
        h = nn.functional.dropout(layer.activation_fn(layer.fc1(x)), p=p, training=layer.training)
        out, bias = layer.fc2(h), None
    return (out, bias) if defer_bias else out


def _ffn_aln(layer, x, ln):
    """``LayerNorm(x + dropout(ffn(x)))`` (post-LN), fc2's bias added by the add_layer_norm."""
    out, bias = _ffn(layer, x, defer_bias=True)
    return _aln(layer, out, x, ln, x_bias=bias)


def _cache_kwarg(cache, kwargs):
    """transformers' decoder layers take the KV cache as ``cache``; ``past_key_values``, its deprecated name
    (renamed by their ``@deprecate_kwarg``, until 5.40), is accepted the same way."""
    if "past_key_values" in kwargs:
        old = kwargs.pop("past_key_values")
        cache = old if cache is None else cache
    return cache


def _clamp_fp16(h, only_if_not_finite):
    """The encoder layers' fp16 overflow guard: BART/Marian clamp only when something is not finite,
    mBART/M2M100/Whisper always; the decoder layers have none."""
    if h.dtype == torch.float16 and (not only_if_not_finite or not torch.isfinite(h).all()):
        clamp_value = torch.finfo(h.dtype).max - 1000
        h = torch.clamp(h, min=-clamp_value, max=clamp_value)
    return h


def _layer_packing(attention_mask, hidden_states, decoder=False):
    """The real tokens of ``hidden_states`` (B, S, E) where a layer may skip the rest, else None: an
    encoder mask that is exactly key padding (the parts ``fastformer_mask`` attached), or a decoder's
    causal mask with key padding whose padded rows nothing reads (``ROWS_UNUSED``). Built once per
    forward: it is kept on the mask, which every layer of the stack shares."""
    parts = getattr(attention_mask, _PARTS, None)
    if parts is None or parts[0] is None or parts[1] != decoder or tuple(parts[0].shape) != tuple(hidden_states.shape[:2]):
        return None
    if decoder and not getattr(attention_mask, ROWS_UNUSED, False):
        return None  # a caller's decoder padding: its rows are outputs (the hidden states, a loss on them)
    if not may_pack():
        return None  # compiled without data-dependent sizes: padded, in one graph
    packing = getattr(attention_mask, "_fastformer_packing", None)
    if packing is None:
        packing = Packing(parts[0])
        try:
            attention_mask._fastformer_packing = packing
        except Exception:  # noqa: BLE001 (a tensor that takes no attributes: build it per layer)
            pass
    return None if packing.dense else packing


def _packed(packing, *tensors):
    packed = tensors if packing is None else tuple(packing.pack(t) for t in tensors)
    return packed[0] if len(packed) == 1 else packed


def _unpacked(packing, x):
    return x if packing is None else packing.unpack(x)


# ---- post-LN: BART, Marian ----------------------------------------------------------------------
def post_ln_encoder_forward(self, hidden_states, attention_mask, **kwargs):
    residual = hidden_states
    h, _ = self.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)
    packing = _layer_packing(attention_mask, h)
    h, residual = _packed(packing, h, residual)  # (n, E) each with padding skipped
    h = _aln(self, h, residual, self.self_attn_layer_norm)
    h = _ffn_aln(self, h, self.final_layer_norm)
    return _clamp_fp16(_unpacked(packing, h), only_if_not_finite=True)


def post_ln_decoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                            encoder_attention_mask=None, cache=None, use_cache=True, **kwargs):
    cache = _cache_kwarg(cache, kwargs)
    residual = hidden_states
    h, _ = self.self_attn(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    packing = _layer_packing(attention_mask, h, decoder=True)
    h, residual = _packed(packing, h, residual)  # (n, E) each with unused rows skipped
    h = _aln(self, h, residual, self.self_attn_layer_norm)
    if encoder_hidden_states is not None:
        residual = h
        h, _ = self.encoder_attn(_unpacked(packing, h), key_value_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask, cache=cache, **kwargs)
        h = _aln(self, _packed(packing, h), residual, self.encoder_attn_layer_norm)
    return _unpacked(packing, _ffn_aln(self, h, self.final_layer_norm))


# ---- pre-LN: mBART, M2M100, Whisper --------------------------------------------------------------
def _pre_ln_ffn_tail(self, x, h):
    """``h + dropout(fc2(dropout(act(fc1(x)))))``: no LayerNorm follows inside the layer."""
    return h + nn.functional.dropout(_ffn(self, x), p=self.dropout, training=self.training)


def pre_ln_encoder_forward(self, hidden_states, attention_mask, **kwargs):
    residual = hidden_states
    x = _ln(hidden_states, self.self_attn_layer_norm)
    a, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, **kwargs)
    packing = _layer_packing(attention_mask, a)
    a, residual = _packed(packing, a, residual)  # (n, E) each with padding skipped
    x, h = _aln(self, a, residual, self.final_layer_norm, prenorm=True)
    h = _pre_ln_ffn_tail(self, x, h)
    return _clamp_fp16(_unpacked(packing, h), only_if_not_finite=False)


def pre_ln_decoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                           encoder_attention_mask=None, cache=None, use_cache=True, **kwargs):
    cache = _cache_kwarg(cache, kwargs)
    residual = hidden_states
    x = _ln(hidden_states, self.self_attn_layer_norm)
    a, _ = self.self_attn(x, cache=cache, attention_mask=attention_mask, **kwargs)
    packing = _layer_packing(attention_mask, a, decoder=True)
    a, residual = _packed(packing, a, residual)  # (n, E) each with unused rows skipped
    if encoder_hidden_states is not None:
        x, residual = _aln(self, a, residual, self.encoder_attn_layer_norm, prenorm=True)
        a, _ = self.encoder_attn(_unpacked(packing, x), key_value_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask, cache=cache, **kwargs)
        a = _packed(packing, a)
    x, h = _aln(self, a, residual, self.final_layer_norm, prenorm=True)
    return _unpacked(packing, _pre_ln_ffn_tail(self, x, h))


FORWARDS = {
    ("post", "encoder"): post_ln_encoder_forward,
    ("post", "decoder"): post_ln_decoder_forward,
    ("pre", "encoder"): pre_ln_encoder_forward,
    ("pre", "decoder"): pre_ln_decoder_forward,
}


def fused_subclass(cls, forward, tag: str = ""):
    """A subclass of transformers' class ``cls`` whose ``forward`` is ``forward``, made once per
    (class, ``tag``). It keeps ``cls.__name__`` (what ``_no_split_modules``, device maps and
    ``save_pretrained``'s architectures match) and is a module-level name here, so pickling and
    deepcopy work. transformers' ``GradientCheckpointingLayer`` wraps a subclass's ``forward``, so
    checkpointing keeps working."""
    qualname = f"Fused_{cls.__module__.replace('.', '_')}_{cls.__name__}{tag}"
    if qualname not in globals():
        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__,
                                          "_fastformer_original_class": cls})
        sub.__qualname__ = qualname
        globals()[qualname] = sub
    return globals()[qualname]


def fuse_layer(layer, norm: str, kind: str, activation: str) -> None:
    """Make ``layer`` (in place) an instance of its fused subclass: same object, parameters, hooks."""
    layer._fastformer_activation = activation
    layer.__class__ = fused_subclass(type(layer), FORWARDS[(norm, kind)], f"_{norm}_{kind}")
