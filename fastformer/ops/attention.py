import math
import sys
from typing import Optional

import torch

from .. import backends, philox
from ..autograd import AttentionFunction
from ..internal import fast, validation
from ..internal.eager import eager
from . import reference, relative_position

# what the backend choice reads of a call: the head dim bounds every backend; on a GPU the rest
# places the call in a class of the measured table (fastformer/backends/measured.py)
_FACTS = ("head_dim",)
_GPU_FACTS = ("head_dim", "q_len", "k_len", "batch_heads", "causal", "dropout", "masked")
# a call with a relative position bias also asks for kernels that take one
_REL_FACTS = _FACTS + ("relative_bias",)
_REL_GPU_FACTS = _GPU_FACTS + ("relative_bias",)


def _attn_mask_as_additive(attn_mask: torch.Tensor, B, H, Sq, Sk) -> torch.Tensor:
    """A bool or float mask broadcastable to (B, H, Sq, Sk) -> fp32 additive 4-D view (no copy of T x T)."""
    m = attn_mask
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(m, float("-inf"))
    else:
        m = m.float()
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m.expand(B, H, Sq, Sk)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              key_padding_mask: Optional[torch.Tensor] = None,
              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None, dropout_p: float = 0.0,
              relative_attention_bias: Optional[torch.Tensor] = None, bidirectional: bool = True,
              relative_attention_max_distance: int = 128, query_offset: Optional[int] = None) -> torch.Tensor:
    """Fused scaled-dot-product attention: ``softmax(q k^T * scale + mask + position bias) v``.

    Args:
        q: queries ``(B, H, Sq, D)``.
        k, v: keys and values ``(B, H_kv, Sk, D)``; ``Sk`` may differ from ``Sq``; any ``D <= 256``.
            ``H_kv`` may be smaller than ``H`` when it divides it (grouped-query attention, or
            multi-query with ``H_kv = 1``): query head ``h`` reads k/v head ``h // (H // H_kv)``,
            without k and v being repeated in memory; their gradients have k's and v's shapes.
        key_padding_mask: ``(B, Sk)`` bool, True marks a padded key that no query may see.
        attn_mask: bool (True = masked out, the opposite of SDPA's bool mask) or float (added
            to the scores), broadcastable to ``(B, H, Sq, Sk)``; or one of torch's causal-bias
            objects, ``torch.nn.attention.bias.causal_upper_left(Sq, Sk)`` /
            ``causal_lower_right(Sq, Sk)``, which run as the fused causal mask (nothing is
            materialized).
        is_causal: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq`` (bottom-right aligned,
            as incremental decoding needs, and as ``causal_lower_right``). SDPA's ``is_causal``
            is top-left aligned (``j <= i``): the two agree when ``Sq == Sk``; for ``Sq != Sk``
            pass ``attn_mask=causal_upper_left(Sq, Sk)`` to get SDPA's.
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: dropout probability on the attention probabilities (pass 0 in eval). The
            kernels decide with one random byte a probability, as FlashAttention-2: the rate
            applied is ``round(256 * dropout_p) / 256`` (0.1 -> 0.1016; below 1/512 nothing is
            dropped), and kept values are scaled by the inverse of the rate actually kept, so the
            output stays unbiased (:func:`fastformer.philox.attention_drop_rate`).
        relative_attention_bias: T5's learned relative position bias, the ``(num_buckets, H)``
            table (``T5Attention.relative_attention_bias.weight``): query ``i`` and key ``j`` of
            head ``h`` add ``table[bucket(j - (i + query_offset)), h]`` to their scaled score
            (T5 passes ``scale=1.0``), ``bucket`` being T5's
            (:func:`fastformer.ops.relative_position.relative_position_bucket`: ``bidirectional``
            in an encoder, not in a decoder; logarithmic up to ``relative_attention_max_distance``,
            one bucket beyond). No ``(Sq, Sk)`` bias is built: the kernels compute each score's
            distance and read the bias by distance; the table's gradient is reduced in a fixed
            order, so two runs give the same bits.
        query_offset: the position of query 0 relative to key 0 for the bias, default ``Sk - Sq``
            (the queries are the last ``Sq`` positions, as in cached decoding; 0 when ``Sq == Sk``).

    Returns:
        ``(B, H, Sq, D)`` in q's dtype. A query row with no visible key outputs zeros and
        receives zero gradient. Kernels never store the ``Sq x Sk`` matrix for backward:
        they keep the per-row log-sum-exp and recompute. A float ``attn_mask`` that
        requires grad is differentiated by the reference implementation. fp32 on a GPU follows
        ``torch.backends.cuda.matmul.allow_tf32``: with it, the products run as tf32 (10-bit
        mantissa operands, fp32 sums), as torch's own matmuls do; without it, in full fp32.

    Non-finite values: a NaN or +inf score at a visible key makes its row NaN, and a NaN or inf
    in ``v`` at a key that a row sees reaches that row (NaN or inf in that column), on every
    backend. At a key hidden from a row (causal, ``key_padding_mask``, ``attn_mask``) ``v`` gets a
    weight of exactly 0: whether a NaN or inf there turns that row's column NaN (``0 * NaN``) is
    left open, as in FlashAttention: the kernels skip key tiles that no query of a tile sees and
    multiply by 0 in the others, so it depends on the backend and the tiling. It never reaches
    another head, batch entry or column, nor a row with no visible key (zeros, as above). Where
    it is left open for the output, it is for the gradients too.
    """
    if relative_attention_bias is not None:
        return _checked(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p,
                        (relative_attention_bias, bidirectional, relative_attention_max_distance, query_offset))
    if (attn_mask is None and fast.plain(q, k, v, key_padding_mask) and is_causal.__class__ is bool
            and fast.number(dropout_p) and (scale is None or (fast.number(scale) and 0.0 < scale < math.inf))
            and fast.ready()):
        # (an IndexError: k is no 4-D tensor)
        out = fast.attempt(_fast, q, k, v, key_padding_mask, is_causal, scale, dropout_p,
                           errors=(RuntimeError, IndexError))
        if out is not None:
            return out
    return _checked(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p)


def _kernels(q, limitation, B, H, Sq, Sk, D, is_causal, dropout_p, masked, rel=False):
    """The backend's kernels for this call (both paths ask the same question; every backend takes
    grouped k/v heads, so the group size is no fact of the choice)."""
    if q.is_cuda:
        if rel:
            return backends.select_cached("attention", q.device, q.dtype, limitation, _REL_GPU_FACTS,
                                          (D, Sq, Sk, B * H, is_causal, dropout_p > 0.0, masked, True))
        return backends.select_cached("attention", q.device, q.dtype, limitation, _GPU_FACTS,
                                      (D, Sq, Sk, B * H, is_causal, dropout_p > 0.0, masked))
    if rel:
        return backends.select_cached("attention", q.device, q.dtype, limitation, _REL_FACTS, (D, True))
    return backends.select_cached("attention", q.device, q.dtype, limitation, _FACTS, (D,))


def _fast(q, k, v, key_padding_mask, is_causal, scale, dropout_p):
    """The checked path's kernel call without the checks the C++ op makes (internal/fast.py), or
    None where the call is the checked path's (an attn_mask to convert is)."""
    shape = q.shape
    if len(shape) != 4 or not shape[3] or not fast.on(q.device, k, v, key_padding_mask):
        return None
    B, H, Sq, D = shape
    H_kv = k.shape[1]
    if H_kv != H and (H_kv < 1 or H % H_kv):  # the checked path's error (validation.kv_heads)
        return None
    kernels = _kernels(q, None, B, H, Sq, k.shape[2], D, is_causal, dropout_p, key_padding_mask is not None)
    op = kernels.attention if kernels is not None else None
    if op is None:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    return op(q, k, v, kpm, None, is_causal, 1.0 / math.sqrt(D) if scale is None else scale, dropout_p,
              philox.draw(dropout_p, q.device))


def _causal_bias_module():
    """torch.nn.attention.bias if imported: a CausalBias exists only then, and importing it here
    would import triton (``import fastformer`` never does)."""
    return sys.modules.get("torch.nn.attention.bias")


def _causal_bias(q, k, v, key_padding_mask, bias, is_causal, scale, dropout_p):
    """torch's CausalBias as the fused causal mask. Top-left alignment with ``Sq != Sk`` becomes
    bottom-right on a square: with fewer queries, the first ``Sq`` keys (the only ones any query
    sees); with more, the first ``Sk`` queries causal and the rest seeing every key."""
    if is_causal is not False:
        raise ValueError("attn_mask is a CausalBias, which is the causal mask itself: "
                         "pass is_causal=False with it (as SDPA requires)")
    validation.tensor("q", q, ndim=4, floating=True)
    validation.tensor("k", k, ndim=4, floating=True)
    Sq, Sk = q.shape[2], k.shape[2]
    if (bias.seq_len_q, bias.seq_len_kv) != (Sq, Sk):
        raise ValueError(f"attn_mask is a CausalBias for (Sq, Sk) = ({bias.seq_len_q}, {bias.seq_len_kv}), "
                         f"but q and k have (Sq, Sk) = ({Sq}, {Sk})")
    call = dict(scale=scale, dropout_p=dropout_p)
    variants = _causal_bias_module().CausalVariant
    if bias.variant == variants.LOWER_RIGHT or Sq == Sk:
        return attention(q, k, v, key_padding_mask=key_padding_mask, is_causal=True, **call)
    if bias.variant != variants.UPPER_LEFT:
        raise ValueError(f"attn_mask is a CausalBias of an unknown variant {bias.variant!r}")
    if Sq < Sk:  # (B, H, Sq, D) against the first Sq keys
        kpm = key_padding_mask[:, :Sq] if key_padding_mask is not None else None
        return attention(q, k[:, :, :Sq], v[:, :, :Sq], key_padding_mask=kpm, is_causal=True, **call)
    head = attention(q[:, :, :Sk], k, v, key_padding_mask=key_padding_mask, is_causal=True, **call)
    tail = attention(q[:, :, Sk:], k, v, key_padding_mask=key_padding_mask, **call)
    return torch.cat([head, tail], dim=2)  # (B, H, Sq, D)


def _checked(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, position=None):
    """The checked call; ``position``: (table, bidirectional, max_distance, query_offset) of a
    relative position bias, or None."""
    bias_module = _causal_bias_module() if attn_mask is not None else None
    if bias_module is not None and isinstance(attn_mask, bias_module.CausalBias):
        if position is not None:
            raise ValueError("attn_mask is a CausalBias, which cannot be combined with relative_attention_bias: "
                             "pass is_causal=True (bottom-right aligned) instead")
        return _causal_bias(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p)
    validation.tensor("q", q, ndim=4, floating=True)
    validation.tensor("k", k, ndim=4, floating=True)
    validation.tensor("v", v, ndim=4, floating=True)
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    validation.shape("k", k, (B, H_kv, Sk, D), "(B, H_kv, Sk, D) with q's B and D")
    validation.kv_heads("k", H_kv, H)
    validation.shape("v", v, (B, H_kv, Sk, D), "(B, H_kv, Sk, D) matching k")
    validation.nonempty_dim("q", q, -1, "the head dim D")
    if key_padding_mask is not None:
        validation.tensor("key_padding_mask", key_padding_mask, ndim=2)
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = padded), got {key_padding_mask.dtype}")
        validation.shape("key_padding_mask", key_padding_mask, (B, Sk), "(B, Sk)")
    if attn_mask is not None:
        validation.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask must have at most 4 dimensions, got shape {tuple(attn_mask.shape)}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (B, H, Sq, Sk))
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, H, Sq, Sk) = {(B, H, Sq, Sk)}") from None
    validation.same_device(q=q, k=k, v=v, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    is_causal = validation.flag("is_causal", is_causal)
    dropout_p = validation.probability("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else validation.positive("scale", scale)
    if position is not None:
        table, bidirectional, max_distance, query_offset = position
        validation.same_device(q=q, relative_attention_bias=table)
        bidirectional, max_distance = relative_position.check_table(table, H, bidirectional, max_distance)
        query_offset = Sk - Sq if query_offset is None else validation.integer("query_offset", query_offset)

    lowp = validation.autocast_dtype(q.device)
    q, k, v = (validation.cast(t, lowp) for t in (q, k, v))
    validation.same_dtype(q=q, k=k, v=v)

    limitation = None
    if attn_mask is not None and attn_mask.requires_grad:
        limitation = "attn_mask requires grad, and only the reference differentiates the mask"
    kernels = _kernels(q, limitation, B, H, Sq, Sk, D, is_causal, dropout_p,
                       key_padding_mask is not None or attn_mask is not None, position is not None)
    if kernels is None:
        rel = {} if position is None else dict(
            relative_attention_bias=table, bidirectional=bidirectional,
            relative_attention_max_distance=max_distance, query_offset=query_offset)
        return reference.attention(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                   is_causal=is_causal, scale=scale, dropout_p=dropout_p, **rel)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
    am = _attn_mask_as_additive(attn_mask, B, H, Sq, Sk) if attn_mask is not None else None
    with validation.autocast_off(q.device):
        if position is not None:  # the bias by distance (H, 2R + 1) and the queries' shift past Sk - Sq
            rel = relative_position.bias_by_distance(table, bidirectional, max_distance,
                                                     torch.promote_types(q.dtype, torch.float32))
            return AttentionFunction.apply(q, k, v, kpm, am, bool(is_causal), float(scale), dropout_p, kernels,
                                           rel, query_offset - (Sk - Sq))
        if kernels.attention is not None and eager():  # the backward in C++
            return kernels.attention(q, k, v, kpm, am, is_causal, scale, dropout_p, philox.draw(dropout_p, q.device))
        return AttentionFunction.apply(q, k, v, kpm, am, bool(is_causal), float(scale), dropout_p, kernels)
