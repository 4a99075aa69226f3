"""transformers' attention interface run by ``fastformer.ops.attention``, registered as ``"fastformer"``.

transformers calls ``attention_interface(module, query, key, value, attention_mask, dropout=, scaling=,
**kwargs)`` with q/k/v ``(B, H, S, D)`` and expects ``(out (B, Sq, H, D), weights or None)``. The mask
it passes is built by the mask function registered for the same implementation name; ours is
transformers' own ``sdpa_mask`` (4-D bool, True = attend, or None where SDPA could use ``is_causal``
or needs no mask), and when that mask is exactly "causal (bottom-right) and/or key padding" we
attach the parts to it, so the kernel gets ``key_padding_mask`` + ``is_causal`` instead of a
materialised ``(B, 1, Sq, Sk)`` mask. Any other mask is passed on exactly:

* None: no mask, or causal where SDPA would use ``is_causal`` (``module.is_causal``, query length > 1),
  aligned top-left as SDPA aligns it (identical to bottom-right when Sq == Sk);
* 4-D bool (True = attend): inverted into ``attn_mask`` (True = masked out);
* float (0 / finfo.min, eager's form, or a user's bias): added to the scores, as SDPA and eager add it;
* 2-D (B, Sk) padding mask (flash-attention's form, 1/True = keep): ``key_padding_mask`` + ``module.is_causal``.

T5's relative position bias comes two ways. transformers' T5 attention (unconverted, the implementation
chosen by name) passes ``position_bias``, the dense ``(1, H, Sq, Sk)`` bias: it is added to the scores
with the mask (as SDPA adds it). The fused T5 attention (``t5.py``) passes ``RELATIVE`` instead, the
``(num_buckets, H)`` table and its settings, which the op turns into a bias by distance: no ``Sq x Sk``
tensor exists.
"""
import logging

import torch

from .. import ops

logger = logging.getLogger("fastformer.hf")

NAME = "fastformer"
_PARTS = "_fastformer_parts"  # attribute on a mask tensor: (key_padding_mask or None, is_causal, Sq, Sk)
# attribute on a mask with parts: nothing reads the outputs at its padded query positions (set by the
# fused loss on the decoder mask it derives from trailing ignored labels)
ROWS_UNUSED = "_fastformer_padded_rows_unused"
# keyword the fused layers pass through a transformers attention module to its attention interface
# when its input is packed rows (1, n, E): (query packing, key packing, is_causal)
VARLEN = "fastformer_varlen"
# keyword the fused T5 attention passes to the interface: (table (num_buckets, H), bidirectional,
# max_distance, query_offset), T5's learned relative position bias for fastformer.ops.attention
RELATIVE = "fastformer_relative_bias"
_warned = set()


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        import warnings
        warnings.warn(msg, stacklevel=3)


def fastformer_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask=None, **kwargs):
    """transformers' ``sdpa_mask`` with, where provable, the mask's parts attached for the kernel."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    mask = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        **kwargs)
    if mask is None or kwargs.get("use_vmap", False):
        return mask
    causal = mask_function is mu.causal_mask_function
    if not causal and mask_function is not mu.bidirectional_mask_function:
        return mask  # sliding windows, packed sequences, overlays: the 4-D mask as it is
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int)):
        return mask
    # causal_mask_function: query i (absolute i + q_offset) sees key j (absolute j + kv_offset) iff
    # j + kv_offset <= i + q_offset; fastformer's is_causal: j <= i + Sk - Sq. Equal iff:
    if causal and q_offset - kv_offset != kv_length - q_length:
        return mask
    kpm = None
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if padding.dim() != 2 or padding.shape[-1] != kv_length:
            return mask
        kpm = (~padding.to(torch.bool)).expand(batch_size, kv_length)
    try:
        setattr(mask, _PARTS, (kpm, causal, q_length, kv_length))
    except Exception:  # noqa: BLE001 (a tensor that takes no attributes, e.g. under tracing)
        pass
    return mask


def _top_left_causal(Sq, Sk, device):
    """SDPA's ``is_causal`` (top-left aligned) as a bool mask, True = masked out."""
    return torch.ones(Sq, Sk, dtype=torch.bool, device=device).triu(1)


def translate_mask(module, attention_mask, Sq, Sk, B, device, is_causal=None):
    """-> (key_padding_mask, attn_mask, is_causal) for ``fastformer.ops.attention``, exactly the
    semantics transformers' SDPA path gives ``attention_mask`` (see the module docstring)."""
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not (causal and Sq > 1):
            return None, None, False
        if Sq == Sk:
            return None, None, True
        return None, _top_left_causal(Sq, Sk, device), False
    parts = getattr(attention_mask, _PARTS, None)
    if parts is not None:
        kpm, causal, q_len, kv_len = parts
        if (q_len, kv_len) == (Sq, Sk) and (kpm is None or tuple(kpm.shape) == (B, Sk)):
            return kpm, None, causal
    if attention_mask.dim() == 2:  # (B, Sk), 1/True = keep (flash-attention's form)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        kpm = ~attention_mask[:, -Sk:].to(torch.bool)
        return kpm, None, bool(causal and Sq > 1)
    if attention_mask.dtype == torch.bool:
        return None, ~attention_mask, False
    return None, attention_mask, False


def fastformer_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
    """transformers ``AttentionInterface`` entry running :func:`fastformer.ops.attention`."""
    for unsupported in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attn_implementation='fastformer' does not support `{unsupported}`; use 'sdpa' "
                             f"or 'eager' for this model")
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "attn_implementation='fastformer' does not return attention weights "
                   "(output_attentions=True gives None); set attn_implementation='eager' to get them")
    n_rep = getattr(module, "num_key_value_groups", 1)
    if n_rep > 1:
        B_, Hk, S_, D_ = key.shape
        key = key[:, :, None].expand(B_, Hk, n_rep, S_, D_).reshape(B_, Hk * n_rep, S_, D_)
        value = value[:, :, None].expand(B_, Hk, n_rep, S_, value.shape[-1]).reshape(B_, Hk * n_rep, S_, -1)
    relative = kwargs.get(RELATIVE)
    position_bias = kwargs.get("position_bias")
    packings = kwargs.get(VARLEN)
    if packings is not None:
        if position_bias is not None:
            raise ValueError("fastformer: packed rows cannot take a dense position_bias (its positions are the "
                             "padded layout's); the fused layers pass the relative bias table instead")
        return _varlen_attention(query, key, value, *packings, dropout, scaling, relative), None
    B, H, Sq, D = query.shape
    Sk = key.shape[2]
    kpm, mask, causal = translate_mask(module, attention_mask, Sq, Sk, B, query.device, is_causal)
    if position_bias is not None:
        mask = _with_position_bias(position_bias, mask)
    rel = {}
    if relative is not None:
        table, bidirectional, max_distance, query_offset = relative
        rel = dict(relative_attention_bias=table, bidirectional=bidirectional,
                   relative_attention_max_distance=max_distance, query_offset=query_offset)
    out = ops.attention(query, key, value, key_padding_mask=kpm, attn_mask=mask, is_causal=causal,
                        scale=scaling, dropout_p=dropout, **rel)
    return out.transpose(1, 2).contiguous(), None


def _with_position_bias(position_bias, mask):
    """A dense additive ``position_bias`` (T5's ``(1, H, Sq, Sk)``) merged with the translated ``attn_mask``
    (None, bool True = masked out, or float added) into one float mask: -inf where the mask hides a key
    (the op hides a key at -inf exactly as at True)."""
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(mask, float("-inf"))
    return position_bias + mask


def _varlen_attention(query, key, value, q_packing, k_packing, causal, dropout, scaling, relative=None):
    """q/k/v (1, H, n, D) of packed rows (what a transformers attention module makes of a (1, n, E)
    input) -> (1, n, H, D): attention within each sequence of the packings, no padding computed; T5's
    ``relative`` bias (table, bidirectional, max_distance, query offset) by positions within each sequence
    (its queries the last of its keys: the offset is the op's own)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n, H, D)
    rel = {}
    if relative is not None:
        table, bidirectional, max_distance, _ = relative
        rel = dict(relative_attention_bias=table, bidirectional=bidirectional,
                   relative_attention_max_distance=max_distance)
    out = ops.attention_varlen(q, k, v, q_packing.cu_seqlens, k_packing.cu_seqlens, q_packing.max_seqlen,
                               k_packing.max_seqlen, is_causal=causal, scale=scaling, dropout_p=dropout, **rel)
    return out[None]


_registered = False


def register() -> None:
    """Register ``"fastformer"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .fingerprint import check
    check()  # the mask and attention code the interface relies on
    AttentionInterface.register(NAME, fastformer_attention_forward)
    AttentionMaskInterface.register(NAME, fastformer_mask)
    _registered = True


__all__ = ["NAME", "register", "fastformer_attention_forward", "fastformer_mask", "translate_mask"]
