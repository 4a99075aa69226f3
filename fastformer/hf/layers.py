"""Fused forwards for the Transformer layers of transformers' BART family, installed per layer instance.

Each function mirrors the forward of the transformers layer it replaces (same arguments, same
calls to the layer's attention modules, whose attention runs through the ``"fastformer"``
attention implementation) and swaps the elementwise tail for fastformer's fused ops:

* post-LN (BART, Marian): ``LayerNorm(residual + dropout(x))`` -> ``add_layer_norm(x, residual, ...)``;
* pre-LN (mBART, M2M100, Whisper): ``residual + dropout(x)`` followed by the next block's
  LayerNorm -> ``add_layer_norm(x, residual, ..., prenorm=True)`` (``(LayerNorm(h), h)``);
* ``fc2(dropout(act(fc1(x))))`` -> ``feed_forward(x, ..., activation=, dropout_p=activation_dropout)``;
* an encoder layer whose mask is key padding runs on the real tokens alone
  (:class:`~fastformer.nn.packing.Packing`), attention included: its attention module gets the packed
  rows as one (1, n, E) sequence and the interface runs ``attention_varlen`` within each sentence.
  Its output is zero at the padded positions, which every later attention masks out (transformers
  computes values there that nothing uses). A decoder layer does the same where the fused loss marked
  the target positions after each row's last counted label as padding (causal: nothing reads them),
  its cross-attention from its packed rows to the encoder's.

The layer object stays (parameters, hooks, submodules); its class becomes a subclass of its transformers
class that only overrides ``forward`` (:func:`fused_subclass`).
"""
import sys

import torch
from torch import nn

from .. import ops
from ..nn.packing import Packing, may_pack
from .attention import _PARTS, ROWS_UNUSED, VARLEN


def _p(layer, p):
    return p if layer.training else 0.0


def plain(module, cls) -> bool:
    """Whether ``module`` is exactly a ``cls`` (``nn.Linear`` / ``nn.LayerNorm``) without hooks, so a fused op
    may read its parameters in its place. A module swapped or wrapped after transformers built it (a PEFT
    LoRA ``fc1``, a quantised Linear, accelerate's offloading hooks) is called instead, as transformers does."""
    return type(module) is cls and not (module._forward_hooks or module._forward_pre_hooks)


def fsdp_unit(module) -> bool:
    """Whether FSDP2's ``fully_shard`` made ``module`` a unit of its own (an ``FSDPModule``: its
    parameters unsharded from its forward's start to its end, and again for its backward). FSDP is
    looked up among the imported modules, never imported: where it is not, nothing is sharded."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return fsdp_module is not None and isinstance(module, fsdp_module)


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


def _cached_packing(holder, padding_mask):
    """A Packing of ``padding_mask()`` kept on ``holder`` (a mask every layer of the stack shares), so it
    is built once per forward."""
    packing = getattr(holder, "_fastformer_packing", None)
    if packing is None:
        packing = Packing(padding_mask())
        try:
            holder._fastformer_packing = packing
        except Exception:  # noqa: BLE001 (a tensor that takes no attributes: build it per layer)
            pass
    return packing


def _layer_packing(attention_mask, hidden_states, decoder=False):
    """The real tokens of ``hidden_states`` (B, S, E) where a layer may skip the rest, else None: an
    encoder mask that is exactly key padding (the parts ``fastformer_mask`` attached), or a decoder's
    causal mask with key padding whose padded rows nothing reads (``ROWS_UNUSED``)."""
    parts = getattr(attention_mask, _PARTS, None)
    if parts is None or parts[0] is None or parts[1] != decoder or tuple(parts[0].shape) != tuple(hidden_states.shape[:2]):
        return None
    if decoder and not getattr(attention_mask, ROWS_UNUSED, False):
        return None  # a caller's decoder padding: its rows are outputs (the hidden states, a loss on them)
    if not may_pack():
        return None  # compiled without data-dependent sizes: padded, in one graph
    packing = _cached_packing(attention_mask, lambda: parts[0])
    return None if packing.dense else packing


def _memory_packing(mask, memory, packing):
    """The rows of the encoder output ``memory`` (B, S, E) that cross-attention's keys are: its mask's
    key padding skipped, or every row without a mask (kept on the target ``packing``); None where the
    mask is anything else."""
    parts = (None, False) if mask is None else getattr(mask, _PARTS, None)
    if parts is None or parts[1] or (parts[0] is not None and tuple(parts[0].shape) != tuple(memory.shape[:2])):
        return None
    if parts[0] is None:
        return _cached_packing(packing, lambda: memory.new_zeros(memory.shape[:2], dtype=torch.bool))
    return _cached_packing(mask, lambda: parts[0])


def _rows(packing, x):
    """``x`` (B, S, E) as packed rows (n, E) when there is a packing, else as it is."""
    return x if packing is None else packing.pack(x)


def _padded(packing, x):
    """Packed rows (n, E) back in the padded layout (B, S, E), zeros at the skipped positions."""
    return x if packing is None else packing.unpack(x)


def _attend(attn, x, mask, packing, kv_packing=None, causal=False, **kwargs):
    """transformers attention module ``attn`` (its own projections) on ``x``: padded (B, S, E) under
    ``mask``, or packed rows (n, E) through ``attention_varlen`` within the sequences of ``packing``
    (keys: ``kv_packing``'s, default the same; a ``key_value_states`` packed likewise)."""
    if packing is None:
        return attn(x, attention_mask=mask, **kwargs)[0]
    kv = kwargs.pop("key_value_states", None)
    kwargs[VARLEN] = (packing, packing if kv_packing is None else kv_packing, causal)
    out, _ = attn(x[None], key_value_states=None if kv is None else kv[None], attention_mask=None, **kwargs)
    return out[0]  # (n, E)


def _decoder_packing(attention_mask, hidden_states, cache):
    """The rows a decoder layer skips (see :func:`_layer_packing`); none with a KV cache, which holds
    every position as transformers computes it."""
    return None if cache is not None else _layer_packing(attention_mask, hidden_states, decoder=True)


def _decoder_self_attention(layer, hidden_states, attention_mask, cache, kwargs, ln=None):
    """What both decoder forwards start with: ``(cache, packing, rows, attention)``, the layer's rows of
    ``hidden_states`` (packed where it may skip some) and its causal self-attention on them, pre-LN on
    their LayerNorm ``ln``. Pops ``past_key_values`` from ``kwargs`` (:func:`_cache_kwarg`)."""
    cache = _cache_kwarg(cache, kwargs)
    packing = _decoder_packing(attention_mask, hidden_states, cache)
    rows = _rows(packing, hidden_states)  # (n, E) with unused rows skipped, attention included
    x = rows if ln is None else _ln(rows, ln)
    return cache, packing, rows, _attend(layer.self_attn, x, attention_mask, packing, causal=True, cache=cache,
                                         **kwargs)


def _cross_attention(layer, x, packing, cache, memory, memory_mask, **kwargs):
    """The decoder layer's cross-attention for its rows ``x`` (packed where ``packing``), returned in
    the layout of ``x``: on the packed rows of both sides where it can, else padded."""
    mem_packing = None if packing is None else _memory_packing(memory_mask, memory, packing)
    if mem_packing is not None:
        return _attend(layer.encoder_attn, x, None, packing, mem_packing, key_value_states=mem_packing.pack(memory),
                       **kwargs)
    out, _ = layer.encoder_attn(_padded(packing, x), key_value_states=memory, attention_mask=memory_mask,
                                cache=cache, **kwargs)
    return _rows(packing, out)


# ---- post-LN: BART, Marian ----------------------------------------------------------------------
def post_ln_encoder_forward(self, hidden_states, attention_mask, **kwargs):
    packing = _layer_packing(attention_mask, hidden_states)
    x = _rows(packing, hidden_states)  # (n, E) with padding skipped, attention included
    h = _aln(self, _attend(self.self_attn, x, attention_mask, packing, **kwargs), x, self.self_attn_layer_norm)
    h = _ffn_aln(self, h, self.final_layer_norm)
    return _clamp_fp16(_padded(packing, h), only_if_not_finite=True)


def post_ln_decoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                            encoder_attention_mask=None, cache=None, use_cache=True, **kwargs):
    cache, packing, x, h = _decoder_self_attention(self, hidden_states, attention_mask, cache, kwargs)
    h = _aln(self, h, x, self.self_attn_layer_norm)
    if encoder_hidden_states is not None:
        a = _cross_attention(self, h, packing, cache, encoder_hidden_states, encoder_attention_mask, **kwargs)
        h = _aln(self, a, h, self.encoder_attn_layer_norm)
    return _padded(packing, _ffn_aln(self, h, self.final_layer_norm))


# ---- pre-LN: mBART, M2M100, Whisper --------------------------------------------------------------
def _pre_ln_ffn_tail(self, x, h):
    """``h + dropout(fc2(dropout(act(fc1(x)))))``: no LayerNorm follows inside the layer."""
    return h + nn.functional.dropout(_ffn(self, x), p=self.dropout, training=self.training)


def pre_ln_encoder_forward(self, hidden_states, attention_mask, **kwargs):
    packing = _layer_packing(attention_mask, hidden_states)
    residual = _rows(packing, hidden_states)  # (n, E) with padding skipped, attention included
    a = _attend(self.self_attn, _ln(residual, self.self_attn_layer_norm), attention_mask, packing, **kwargs)
    x, h = _aln(self, a, residual, self.final_layer_norm, prenorm=True)
    h = _pre_ln_ffn_tail(self, x, h)
    return _clamp_fp16(_padded(packing, h), only_if_not_finite=False)


def pre_ln_decoder_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                           encoder_attention_mask=None, cache=None, use_cache=True, **kwargs):
    cache, packing, residual, a = _decoder_self_attention(self, hidden_states, attention_mask, cache, kwargs,
                                                          ln=self.self_attn_layer_norm)
    if encoder_hidden_states is not None:
        x, residual = _aln(self, a, residual, self.encoder_attn_layer_norm, prenorm=True)
        a = _cross_attention(self, x, packing, cache, encoder_hidden_states, encoder_attention_mask, **kwargs)
    x, h = _aln(self, a, residual, self.final_layer_norm, prenorm=True)
    return _padded(packing, _pre_ln_ffn_tail(self, x, h))


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
