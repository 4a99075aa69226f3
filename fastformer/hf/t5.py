"""Fused forwards for transformers' T5 family: T5 (Flan-T5, ByT5), mT5 and UMT5, installed per module instance.

A T5 block is pre-norm with RMSNorm (``T5LayerNorm``: no mean, no bias) around each of its sub-layers
(self-attention, the decoder's cross-attention, the feed-forward), each ending in ``h + dropout(out)``.
The fused block forward (:func:`t5_block_forward`, :func:`umt5_block_forward`) mirrors ``T5Block.forward``
with its sub-layers' forwards inlined:

* the residual add that ends a sub-layer and the RMSNorm that starts the next one ->
  ``add_layer_norm(out, h, weight, None, eps, dropout_p, prenorm=True, rms_norm=True)``;
* ``wo(dropout(act(wi_0 x) * wi_1 x))`` (v1.1, Flan-T5, mT5, UMT5: gated-gelu) or ``wo(dropout(act(wi x)))``
  (v1.0: relu) -> one ``feed_forward`` (``w3=wi_1`` for the gated one);
* attention (:func:`t5_attention_forward`, the fused ``T5Attention``, called as a module) gives the
  op the learned ``(num_buckets, H)`` table as ``relative_attention_bias`` with ``scale=1.0``, never the
  dense ``(1, H, Sq, Sk)`` position bias transformers builds: T5 computes it in the first layer of each
  stack and hands it on (the fused block hands on the table instead: the stack's ``position_bias`` is
  the table from layer 1 on); UMT5 has a table in every self-attention; cross-attention none;
* an encoder block whose mask is key padding, and a decoder block where the fused loss marked the
  positions after each row's last label unused, run on the real rows only (``layers._layer_packing``),
  attention through ``attention_varlen`` with positions within each sentence. The encoder packs only
  where each row's real tokens are contiguous (left or right padding): the relative bias reads the
  distance ``j - i`` of the padded layout, which a packed row with a hole would shorten. Under
  torch.compile that is data, so there T5's encoder keeps its padding (key padding mask, exact); the
  decoder packs there only where a kernel takes the biased packed call (the reference loops on the host).

Where a fused op cannot stand in exactly the module itself runs, as transformers runs it: a swapped
or hooked norm, Linear or embedding, mixed dtypes (a ``wo`` kept in fp32 by ``_keep_in_fp32_modules``
in a bf16 model), an activation ``feed_forward`` lacks, and fp16, whose clamps sit between the
residual add and the next norm.
"""
from dataclasses import dataclass

import torch
from torch import nn

from .. import backends, ops
from ..internal import validation
from .attention import RELATIVE, VARLEN, fastformer_attention_forward
from .layers import (_cache_kwarg, _decoder_packing, _layer_packing, _memory_packing, _padded, _rows,
                     fsdp_unit, fused_subclass, plain)


@dataclass(frozen=True)
class Layout:
    """The class names of one T5-shaped family in its modeling module."""
    prefix: str                  # "T5", "MT5", "UMT5": the classes are f"{prefix}Block", ...
    umt5: bool = False           # UMT5's signatures: a table in every self-attention, blocks return a tensor

    def cls(self, mod, name):
        return getattr(mod, self.prefix + name)


def _p(module, p):
    return p if module.training else 0.0


def _dropout_p(module):
    """The probability of a hook-free ``nn.Dropout`` ``module``, or None (then it is called)."""
    return module.p if plain(module, nn.Dropout) else None


def _norm_fusable(block, ln, *tensors) -> bool:
    """Whether ``add_layer_norm(rms_norm=True)`` computes exactly what the T5 norm ``ln`` does to these
    inputs: the family's own hook-free class, and one dtype for inputs and weight (transformers casts the
    normalised value to a half-precision weight's dtype; the op casts the weight to the input's), or
    autocast, which casts them all."""
    if not plain(ln, block._fastformer_norm):
        return False
    if torch.is_autocast_enabled(tensors[0].device.type):
        return True
    return all(t.dtype == ln.weight.dtype for t in tensors)


def _norm(block, ln, x):
    if _norm_fusable(block, ln, x):
        return ops.add_layer_norm(x, None, ln.weight, None, ln.variance_epsilon, 0.0, rms_norm=True)
    return ln(x)


def _clamp_fp16(h):
    """T5Block's fp16 guard after each sub-layer: clamp to finfo.max - 1000 where something is inf."""
    if h.dtype == torch.float16:
        max_dtype = torch.finfo(h.dtype).max
        clamp_value = torch.where(torch.isinf(h).any(), max_dtype - 1000, max_dtype)
        h = torch.clamp(h, min=-clamp_value, max=clamp_value)
    return h


def _add_norm(block, sub, out, residual, ln):
    """``(ln(h), h)`` for ``h = residual + dropout(out)``, the end of sub-layer ``sub`` (its ``dropout``)
    and the norm ``ln`` that starts the next one."""
    p = _dropout_p(sub.dropout)
    if p is not None and residual.dtype != torch.float16 and _norm_fusable(block, ln, out, residual):
        return ops.add_layer_norm(out, residual, ln.weight, None, ln.variance_epsilon, _p(sub, p), prenorm=True,
                                  rms_norm=True)
    h = _clamp_fp16(residual + sub.dropout(out))
    return _norm(block, ln, h), h


def _add(block, sub, out, residual):
    """``residual + dropout(out)``, the end of a block's last sub-layer ``sub``, whose norm is the next
    block's. In training with dropout it runs through ``add_layer_norm``, whose dropout costs a
    fraction of torch's (``bernoulli_`` is most of a T5 block's elementwise time on a CPU); its
    normalised output, by ``sub``'s own norm weight detached (no gradient to it), is not used."""
    p = _dropout_p(sub.dropout)
    ln = sub.layer_norm
    if (p is not None and _p(sub, p) > 0.0 and residual.dtype != torch.float16
            and _norm_fusable(block, ln, out, residual)):
        return ops.add_layer_norm(out, residual, ln.weight.detach(), None, ln.variance_epsilon, p, prenorm=True,
                                  rms_norm=True)[1]
    return _clamp_fp16(residual + sub.dropout(out))


def stack_dropout_forward(self, x):
    """``T5Stack.dropout`` (an ``nn.Dropout``, of the embeddings and of the final norm's output) in
    training: fastformer's Philox dropout through ``add_layer_norm`` (``h = dropout(x)``; the normalised
    output is not used), a fraction of torch's ``bernoulli_`` on a CPU. Otherwise torch's own."""
    if (self.training and 0.0 < self.p < 1.0 and not self.inplace and x.dtype in (torch.float32, torch.bfloat16)
            and x.dim() >= 1 and x.shape[-1] > 0 and not torch.is_autocast_enabled(x.device.type)):
        ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return ops.add_layer_norm(x, None, ones, None, 1e-6, self.p, prenorm=True, rms_norm=True)[1]
    return nn.Dropout.forward(self, x)


def _dense(block, dense, x):
    """The feed-forward ``DenseReluDense`` (``T5DenseActDense`` or ``T5DenseGatedActDense``) on ``x``."""
    act = block._fastformer_activation
    gated = hasattr(dense, "wi_0")
    linears = (dense.wi_0, dense.wo, dense.wi_1) if gated else (dense.wi, dense.wo)
    p = _dropout_p(dense.dropout)
    if act is None or p is None or not all(plain(m, nn.Linear) for m in linears):
        return dense(x)
    if not torch.is_autocast_enabled(x.device.type) and any(m.weight.dtype != x.dtype for m in linears):
        return dense(x)  # wo kept in fp32 in a half-precision model: transformers' casts
    w1, w2 = linears[0], linears[1]
    gate = dict(w3=linears[2].weight, b3=linears[2].bias) if gated else {}
    return ops.feed_forward(x, w1.weight, w1.bias, w2.weight, w2.bias, activation=act, dropout_p=_p(dense, p),
                            **gate)


# ---- attention ----------------------------------------------------------------------------------
def untie_lm_head(model) -> None:
    """Give a config-built T5 v1.1-style model (``tie_word_embeddings=False``) its own LM head, as a
    v1.1 checkpoint has. transformers 5 reads the flag only as "do not rescale the decoder output"
    and ties the head to the shared embedding anyway; ``from_pretrained`` unties it only when a
    checkpoint holds two different weights. This unties it the way that path does (its own
    Parameter, dropped from ``all_tied_weights_keys``), drawn as T5X draws it: fan-in N(0, 1/d_model)
    (transformers' N(0, 1) for an untied head, there for a checkpoint to overwrite, starts the
    logits ~sqrt(d_model) wide: a first loss near 30)."""
    weight = torch.randn_like(model.shared.weight) * model.config.d_model ** -0.5
    model.lm_head.weight = nn.Parameter(weight)
    model.all_tied_weights_keys.pop("lm_head.weight", None)


def _own_table(attn):
    """The attention's ``(num_buckets, H)`` relative bias table where the op may read it (a hook-free
    ``nn.Embedding``), else None."""
    emb = getattr(attn, "relative_attention_bias", None) if attn.has_relative_attention_bias else None
    return emb.weight if emb is not None and plain(emb, nn.Embedding) else None


def _attention(self, hidden_states, key_value_states, mask, position_bias, cache, kwargs):
    """``T5Attention.forward`` (and ``UMT5Attention.forward``) with the bias passed as the table:
    ``(output, position_bias)``, the latter the table (or dense bias, or None) the next layer reuses."""
    from transformers.cache_utils import EncoderDecoderCache

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.key_value_proj_dim)
    past_seen_tokens = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    # cloned as transformers does: a StaticCache's count is the tensor it updates below
    past_seen_tokens = past_seen_tokens.clone() if isinstance(past_seen_tokens, torch.Tensor) else past_seen_tokens
    is_cross_attention = key_value_states is not None
    query_states = self.q(hidden_states).view(hidden_shape).transpose(1, 2)

    is_updated = False
    if isinstance(cache, EncoderDecoderCache):
        is_updated = cache.is_updated.get(self.layer_idx)
        curr_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
    else:
        curr_cache = cache
    current_states = key_value_states if is_cross_attention else hidden_states
    if is_cross_attention and cache is not None and is_updated:
        key_states = curr_cache.layers[self.layer_idx].keys
        value_states = curr_cache.layers[self.layer_idx].values
    else:
        kv_shape = (*current_states.shape[:-1], -1, self.key_value_proj_dim)
        key_states = self.k(current_states).view(kv_shape).transpose(1, 2)
        value_states = self.v(current_states).view(kv_shape).transpose(1, 2)
        if cache is not None:
            key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True

    if position_bias is None and self.has_relative_attention_bias:
        table = _own_table(self)
        if table is not None and not isinstance(past_seen_tokens, torch.Tensor):
            position_bias = table
        else:  # a swapped or hooked embedding, or a tensor offset (StaticCache): transformers' dense bias
            position_bias = self.compute_bias(input_shape[1], key_states.shape[-2], device=query_states.device,
                                              past_seen_tokens=past_seen_tokens)
    call = dict(kwargs)
    if position_bias is not None and position_bias.dim() == 2:  # the table: the query's position past key 0
        offset = int(past_seen_tokens) if isinstance(past_seen_tokens, torch.Tensor) else past_seen_tokens
        call[RELATIVE] = (position_bias, not self.is_decoder, self.relative_attention_max_distance, offset)
    elif position_bias is not None:
        call["position_bias"] = position_bias
    attn_output, _ = fastformer_attention_forward(self, query_states, key_states, value_states, mask,
                                                  dropout=0.0 if not self.training else self.dropout,
                                                  scaling=self.scaling, **call)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o(attn_output), position_bias


def t5_attention_forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None,
                         **kwargs):
    """``T5Attention.forward``: ``(output, position_bias, None)``; ``position_bias`` may be the table."""
    cache = _cache_kwarg(cache, kwargs)
    out, position_bias = _attention(self, hidden_states, key_value_states, mask, position_bias, cache, kwargs)
    return out, position_bias, None


def umt5_attention_forward(self, hidden_states, encoder_hidden_states=None, cache=None, attention_mask=None,
                           **kwargs):
    """``UMT5Attention.forward``: ``(output, None)``, the bias its own table's."""
    cache = _cache_kwarg(cache, kwargs)
    return _attention(self, hidden_states, encoder_hidden_states, attention_mask, None, cache, kwargs)[0], None


def _call(block, attn, x, memory, mask, position_bias, cache, kwargs):
    """The (fused) attention module ``attn`` called with its family's signature: ``(out, position_bias)``."""
    if block._fastformer_umt5:
        out, _ = attn(x, encoder_hidden_states=memory, cache=cache, attention_mask=mask, **kwargs)
        return out, None
    out, position_bias, _ = attn(x, mask=mask, key_value_states=memory, position_bias=position_bias, cache=cache,
                                 **kwargs)
    return out, position_bias


def _packed_call(block, attn, x, memory, position_bias, q_packing, k_packing, causal, kwargs):
    """``attn`` on packed rows ``x`` (n, E) (keys: ``memory`` (m, E) or ``x``) through ``attention_varlen``."""
    kwargs = dict(kwargs)
    kwargs[VARLEN] = (q_packing, k_packing, causal)
    out, position_bias = _call(block, attn, x[None], None if memory is None else memory[None], None,
                               position_bias, None, kwargs)
    return out[0], position_bias


# ---- which rows a block computes ----------------------------------------------------------------
def _contiguous_rows(packing) -> bool:
    """Whether each row's real tokens form one run (left or right padding), checked once per mask."""
    ok = getattr(packing, "_fastformer_contiguous", None)
    if ok is None:
        real = ~packing.padding_mask
        starts = (real[:, 1:] & ~real[:, :-1]).sum(dim=1) + real[:, 0].long()  # (B,) runs of real tokens
        ok = bool(starts.le(1).all())
        packing._fastformer_contiguous = ok
    return ok


def _traceable_packed_bias(attn, x) -> bool:
    """Whether, traced by torch.compile, attention on packed rows with a relative bias has a kernel: the
    reference ``attention_varlen`` loops over the sequences on the host, which cannot trace their
    data-dependent lengths (so the padded layout, until the backend's kernels take the bias)."""
    dtype = validation.autocast_dtype(x.device) or x.dtype
    try:
        return backends.select("attention_varlen", x.device, dtype, head_dim=attn.key_value_proj_dim,
                               relative_bias=True) is not None
    except RuntimeError:  # a forced backend that cannot: the op will say so, padded or not
        return False


def _block_packing(block, attn, attention_mask, hidden_states, position_bias, cache):
    """The rows block ``block`` may skip (a Packing), or None. Packed, the bias must be a table (positions
    within each sentence), which a dense bias is not."""
    if position_bias is not None and position_bias.dim() != 2:
        return None
    has_bias = position_bias is not None or attn.has_relative_attention_bias
    if position_bias is None and has_bias and _own_table(attn) is None:
        return None
    if torch.compiler.is_compiling():
        if not block.is_decoder:
            return None  # the runs of real tokens are data: the padded layout, exact for any mask
        if has_bias and not _traceable_packed_bias(attn, hidden_states):
            return None
    if block.is_decoder:
        return _decoder_packing(attention_mask, hidden_states, cache)
    packing = _layer_packing(attention_mask, hidden_states)
    return packing if packing is not None and _contiguous_rows(packing) else None


# ---- the block ------------------------------------------------------------------------------------
def _block(self, hidden_states, attention_mask, position_bias, memory, memory_mask, cross_bias, cache, kwargs):
    """``T5Block.forward`` fused: ``(hidden_states, position_bias, cross position_bias)``."""
    self_layer, ff_layer = self.layer[0], self.layer[-1]
    attn = self_layer.SelfAttention
    packing = _block_packing(self, attn, attention_mask, hidden_states, position_bias, cache)
    residual = _rows(packing, hidden_states)  # (n, E) where rows are skipped, attention included
    x = _norm(self, self_layer.layer_norm, residual)
    if packing is None:
        out, position_bias = _call(self, attn, x, None, attention_mask, position_bias, cache, kwargs)
    else:
        out, position_bias = _packed_call(self, attn, x, None, position_bias, packing, packing, self.is_decoder,
                                          kwargs)
    ln = ff_layer.layer_norm
    if self.is_decoder and memory is not None:
        cross = self.layer[1]
        x, residual = _add_norm(self, self_layer, out, residual, cross.layer_norm)
        out, cross_bias = _cross_attention(self, cross.EncDecAttention, x, packing, cache, memory, memory_mask,
                                           cross_bias, kwargs)
        x, residual = _add_norm(self, cross, out, residual, ln)
    else:
        x, residual = _add_norm(self, self_layer, out, residual, ln)
    h = _add(self, ff_layer, _dense(self, ff_layer.DenseReluDense, x), residual)
    if isinstance(position_bias, nn.Parameter) and fsdp_unit(self):
        # the block's own table, which FSDP2 frees with the unit's other unsharded parameters once this
        # forward returns: the later blocks get a copy (buckets x H)
        position_bias = position_bias.clone()
    return _padded(packing, h), position_bias, cross_bias


def _cross_attention(block, attn, x, packing, cache, memory, memory_mask, cross_bias, kwargs):
    """Cross-attention for the block's rows ``x``: packed on both sides where it can (no cache, a key
    padding mask), else padded. Returns ``(rows, cross position_bias)``."""
    mem_packing = None if packing is None or cross_bias is not None else _memory_packing(memory_mask, memory,
                                                                                          packing)
    if mem_packing is not None:
        return _packed_call(block, attn, x, mem_packing.pack(memory), None, packing, mem_packing, False, kwargs)
    out, cross_bias = _call(block, attn, _padded(packing, x), memory, memory_mask, cross_bias, cache, kwargs)
    return _rows(packing, out), cross_bias


def t5_block_forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                     encoder_attention_mask=None, encoder_decoder_position_bias=None, cache=None, **kwargs):
    cache = _cache_kwarg(cache, kwargs)
    return _block(self, hidden_states, attention_mask, position_bias, encoder_hidden_states, encoder_attention_mask,
                  encoder_decoder_position_bias, cache, kwargs)


def umt5_block_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                       encoder_attention_mask=None, cache=None, **kwargs):
    cache = _cache_kwarg(cache, kwargs)
    return _block(self, hidden_states, attention_mask, None, encoder_hidden_states, encoder_attention_mask, None,
                  cache, kwargs)[0]


def fuse(model, layout: Layout, mod, activation) -> dict:
    """Fuse (in place) every block and attention module of ``model`` of the family ``layout`` of the
    modeling module ``mod``, and its stacks' dropout (:func:`stack_dropout_forward`). ``activation(fn, gated)`` -> fastformer's name for the activation module
    ``fn`` or ``(None, why)``. Returns ``{activation name: why}`` for feed-forwards left to transformers."""
    block_cls, attn_cls, norm_cls = (layout.cls(mod, n) for n in ("Block", "Attention", "LayerNorm"))
    block_forward = umt5_block_forward if layout.umt5 else t5_block_forward
    attn_forward = umt5_attention_forward if layout.umt5 else t5_attention_forward
    unsupported = {}
    stack_cls = layout.cls(mod, "Stack")
    for m in model.modules():
        if type(m) is stack_cls and plain(getattr(m, "dropout", None), nn.Dropout):
            m.dropout.__class__ = fused_subclass(nn.Dropout, stack_dropout_forward, "_t5_stack")
        if type(m) is attn_cls:
            m.__class__ = fused_subclass(attn_cls, attn_forward, "_t5")
        elif type(m) is block_cls:
            dense = m.layer[-1].DenseReluDense
            act, why = activation(getattr(dense, "act", None), hasattr(dense, "wi_0"))
            if act is None:
                unsupported[model.config.feed_forward_proj] = why
            m._fastformer_activation = act
            m._fastformer_norm = norm_cls
            m._fastformer_umt5 = layout.umt5
            m.__class__ = fused_subclass(block_cls, block_forward, "_t5")
    return unsupported
