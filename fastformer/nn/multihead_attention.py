"""``fastformer.nn.MultiheadAttention``: ``torch.nn.MultiheadAttention`` on ``fastformer.ops.attention``."""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .. import ops, philox
from ..internal.twins import share_state, twin_of
from ..internal import validation
from .packing import Packing

KV = Tuple[torch.Tensor, torch.Tensor]


def _same_map(fn, query, key, value):
    """Apply ``fn`` to query/key/value keeping the ``query is key is value`` identities."""
    if query is key and key is value:
        q = fn(query)
        return q, q, q
    if key is value:
        k = fn(key)
        return fn(query), k, k
    return fn(query), fn(key), fn(value)


def _causal_bool(Sq: int, Sk: int, device) -> torch.Tensor:
    """(Sq, Sk) bool, True where query i may not see key j (bottom-right aligned, as the op)."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    return j > i + (Sk - Sq)


def _append_key_column(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """One more key (last dim) that nothing masks: False for bool masks, 0 for float masks."""
    if mask is None:
        return None
    return torch.cat([mask, mask.new_zeros(mask.shape[:-1] + (1,))], dim=-1)


def attention_probs(q, k, key_padding_mask, attn_mask, is_causal, scale) -> torch.Tensor:
    """The explicit ``(B, H, Sq, Sk)`` attention probabilities the fused op never materialises.

    Same masking rules as :func:`fastformer.ops.attention`; a row with no visible key is 0.
    """
    s = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # (B, H, Sq, Sk)
    if attn_mask is not None:
        s = s.masked_fill(attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if is_causal:
        s = s.masked_fill(_causal_bool(q.shape[2], k.shape[2], q.device), float("-inf"))
    visible = (s > float("-inf")).any(dim=-1, keepdim=True)  # (B, H, Sq, 1)
    p = torch.softmax(torch.where(visible, s, torch.zeros_like(s)), dim=-1) * visible
    return p.to(q.dtype)


@twin_of(torch.nn.MultiheadAttention)
class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in twin of :class:`torch.nn.MultiheadAttention`.

    Same constructor (``embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn,
    kdim, vdim, batch_first, device, dtype``), parameters and ``state_dict`` keys, and the
    same ``forward`` arguments and outputs. The attention itself is one
    :func:`fastformer.ops.attention` call on ``(B, H, S, D)`` head views of the
    projections; padding and attention masks (bool or float) go to the op unexpanded.

    Differences from torch, all deliberate:

    * ``is_causal=True`` works without an ``attn_mask`` (torch raises): the op's causal
      mask is used, bottom-right aligned when query and key lengths differ. With an
      ``attn_mask`` and equal lengths the hint is trusted and the mask skipped, as torch's
      fast path does.
    * A query row whose keys are all masked gives 0 (torch gives NaN).
    * With ``need_weights=True`` the weights are computed explicitly next to the op
      (the op never forms them); in training with dropout the whole attention is then
      computed explicitly so that the returned (dropped-out) weights are the ones used.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None) -> None:
        validation.attention_config(embed_dim, num_heads, dropout)
        for name, dim in (("kdim", kdim), ("vdim", vdim)):
            if dim is not None:
                validation.positive_int(name, dim)
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                         batch_first, device, dtype)

    def _check_twin(self) -> None:
        """A converted torch module's configuration (torch does not check the dropout)."""
        validation.attention_config(self.embed_dim, self.num_heads, self.dropout)

    # ----------------------------------------------------------------------------- pieces
    def _in_projection(self, query, key, value):
        """Input projections in the inputs' own layout: (..., E) each, one GEMM for self-attention."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (b[:E], b[E:2 * E], b[2 * E:]) if b is not None else (None, None, None)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, bq), F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight  # (3E, E)
        if query is key and key is value:
            return F.linear(query, w, b).chunk(3, dim=-1)
        q = F.linear(query, w[:E], bq)
        if key is value:
            k, v = F.linear(key, w[E:], b[E:] if b is not None else None).chunk(2, dim=-1)
            return q, k, v
        return q, F.linear(key, w[E:2 * E], bk), F.linear(value, w[2 * E:], bv)

    def _split_heads(self, x: torch.Tensor, batch_first: bool = True) -> torch.Tensor:
        """(B, S, E) or (S, B, E) -> (B, H, S, D) view (last dim contiguous)."""
        H, D = self.num_heads, self.head_dim
        if batch_first:
            B, S, _ = x.shape
            return x.view(B, S, H, D).transpose(1, 2)
        S, B, _ = x.shape
        return x.view(S, B, H, D).permute(1, 2, 0, 3)

    def _merge_heads(self, x: torch.Tensor, batch_first: bool = True, add_out_bias: bool = True) -> torch.Tensor:
        """(B, H, L, D) -> (B, L, E) or (L, B, E), then the output projection."""
        B, H, L, D = x.shape
        if batch_first:
            x = x.transpose(1, 2).reshape(B, L, H * D)
        else:
            x = x.permute(2, 0, 1, 3).reshape(L, B, H * D)
        return F.linear(x, self.out_proj.weight, self.out_proj.bias if add_out_bias else None)

    def _canonical_masks(self, key_padding_mask, attn_mask, B, L, S, device):
        """Checked masks: key_padding_mask (B, S) bool or None, attn_mask broadcastable to (B, H, L, S).

        A float key_padding_mask is folded into a float attn_mask (the op takes bool padding).
        """
        H = self.num_heads
        if key_padding_mask is not None:
            validation.tensor("key_padding_mask", key_padding_mask)
            validation.same_device(query=torch.empty(0, device=device), key_padding_mask=key_padding_mask)
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(f"key_padding_mask must have shape (N, S) = {(B, S)}, got "
                                 f"{tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype != torch.bool and not key_padding_mask.is_floating_point():
                raise TypeError(f"key_padding_mask must be bool or floating point, got {key_padding_mask.dtype}")
        if attn_mask is not None:
            validation.tensor("attn_mask", attn_mask)
            validation.same_device(query=torch.empty(0, device=device), attn_mask=attn_mask)
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (L, S):
                    raise ValueError(f"a 2-D attn_mask must have shape (L, S) = {(L, S)}, got "
                                     f"{tuple(attn_mask.shape)}")
                attn_mask = attn_mask[None, None]  # (1, 1, L, S)
            elif attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (B * H, L, S):
                    raise ValueError(f"a 3-D attn_mask must have shape (N * num_heads, L, S) = "
                                     f"{(B * H, L, S)}, got {tuple(attn_mask.shape)}")
                attn_mask = attn_mask.view(B, H, L, S)
            else:
                raise ValueError(f"attn_mask must be 2-D (L, S) or 3-D (N * num_heads, L, S), got shape "
                                 f"{tuple(attn_mask.shape)}")
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            kpm_add = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
            if attn_mask is None:
                attn_mask = kpm_add
            elif attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=kpm_add.dtype, device=device).masked_fill(
                    attn_mask, float("-inf")) + kpm_add
            else:
                attn_mask = attn_mask + kpm_add
            key_padding_mask = None
        return key_padding_mask, attn_mask

    # ---------------------------------------------------------------------------- forward
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, packing: Optional[Tuple[Packing, Packing]] = None,
                add_out_bias: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """torch's contract; with ``packing`` (see :mod:`fastformer.nn.packing`), attention
        between packed tokens: ``packing = (query_packing, key_packing)``, ``query`` the
        ``(n_q, E)`` real rows of the query batch, ``key`` / ``value`` the ``(n_k, E)`` real
        rows of the key batch; each query attends to the keys of its own sequence (the i-th
        sequence of ``query_packing`` to the i-th of ``key_packing``), ``is_causal`` aligned
        bottom-right per sequence. Returns the ``(n_q, E)`` output and None (no weights).
        ``add_out_bias=False`` returns the output without ``out_proj.bias``: the layer twins add
        it in the ``add_layer_norm`` that follows (its ``x_bias``), which saves a pass."""
        if packing is not None:
            if need_weights or attn_mask is not None or key_padding_mask is not None:
                raise ValueError("with packing, the padding masks come from the packings: attn_mask and "
                                 "key_padding_mask must be None and need_weights False")
            return self._packed_forward(query, key, value, *packing, is_causal, add_out_bias), None
        like = self.out_proj.weight
        for name, t in (("query", query), ("key", key), ("value", value)):
            validation.hidden(name, t, t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else 0, like,
                             ranks=(2, 3))
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError("query, key and value must all be 3-D (batched) or all 2-D (unbatched), got "
                             f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        batched = query.dim() == 3
        batch_first = self.batch_first or not batched
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = _same_map(lambda t: t.unsqueeze(0), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        b_dim, s_dim = (0, 1) if batch_first else (1, 0)
        B, L, S = query.shape[b_dim], query.shape[s_dim], key.shape[s_dim]
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's last dimension must be embed_dim={self.embed_dim}, got shape "
                             f"{tuple(query.shape)}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(f"key and value must end in kdim={self.kdim} and vdim={self.vdim}, got shapes "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        if key.shape[b_dim] != B or value.shape[b_dim] != B or value.shape[s_dim] != S:
            raise ValueError(f"query, key and value must share the batch size and key/value the length; "
                             f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        kpm, mask = self._canonical_masks(key_padding_mask, attn_mask, B, L, S, query.device)

        q, k, v = self._in_projection(query, key, value)  # input layout, (..., E)
        if self.bias_k is not None:  # one extra key/value position from learned biases
            extra = (lambda t, bias: torch.cat([t, bias.expand(B, 1, -1)], 1)) if batch_first else \
                (lambda t, bias: torch.cat([t, bias.expand(1, B, -1)], 0))
            k, v = extra(k, self.bias_k), extra(v, self.bias_v)
        q, k, v = (self._split_heads(t, batch_first) for t in (q, k, v))  # (B, H, S, D)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(k.shape[:2] + (1, k.shape[3]))], 2)
            v = torch.cat([v, v.new_zeros(v.shape[:2] + (1, v.shape[3]))], 2)
        extra_keys = k.shape[2] - S
        if extra_keys:
            if is_causal and mask is None:  # causal over the real keys; the appended ones stay visible
                mask = _causal_bool(L, S, q.device)[None, None]
            for _ in range(extra_keys):
                kpm, mask = _append_key_column(kpm), _append_key_column(mask)
        causal = False
        if is_causal and (mask is None or L == k.shape[2]):
            causal, mask = True, None  # trust the hint, as torch does
        dropout_p = self.dropout if self.training else 0.0
        scale = 1.0 / math.sqrt(self.head_dim)

        weights = None
        if need_weights:
            weights = attention_probs(q, k, kpm, mask, causal, scale)  # (B, H, L, S)
            if dropout_p > 0.0:
                rng = philox.draw(dropout_p, q.device)  # (2,) tensor: no .item(), so no graph break
                weights = philox.attention_dropout(weights, dropout_p, rng[0], rng[1])  # the fused op's mask
                out = torch.matmul(weights, v)
        if weights is None or dropout_p == 0.0:
            out = ops.attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=causal,
                                scale=scale, dropout_p=dropout_p)  # (B, H, L, D)
        out = self._merge_heads(out, batch_first, add_out_bias)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    # ------------------------------------------------------------------- packed tokens
    def _packed_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        q_packing: Packing, kv_packing: Packing, is_causal: bool,
                        add_out_bias: bool = True) -> torch.Tensor:
        """Projections, attention (within each sequence, :func:`fastformer.ops.attention_varlen`) and
        the output projection, all on the packed rows: no padded position is computed."""
        if not self._qkv_same_embed_dim or self.bias_k is not None or self.add_zero_attn:
            raise ValueError("packed attention needs the packed q/k/v projection (kdim = vdim = embed_dim) and "
                             "no add_bias_kv / add_zero_attn")
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        for name, t, packing in (("query", query, q_packing), ("key", key, kv_packing), ("value", value, kv_packing)):
            validation.hidden(name, t, E, self.out_proj.weight, ranks=(2,), width_name="embed_dim")
            if t.shape[0] != packing.num_tokens:
                raise ValueError(f"packed {name} must have one row per real token, {packing.num_tokens}, got "
                                 f"shape {tuple(t.shape)}")
        if torch.compiler.is_compiling():  # with segment ids the counts are data: checked when the graph runs
            torch._check(q_packing.num_sequences == kv_packing.num_sequences,  # a constant message, or no graph
                         lambda: "query and key packings must hold the same number of sequences")
        elif q_packing.num_sequences != kv_packing.num_sequences:
            raise ValueError(f"query and key packings must hold the same number of sequences, got "
                             f"{q_packing.num_sequences} and {kv_packing.num_sequences}")
        w, b = self.in_proj_weight, self.in_proj_bias  # (3E, E), (3E,)
        options = dict(is_causal=is_causal, scale=1.0 / math.sqrt(D), dropout_p=self.dropout if self.training else 0.0)
        # the packed ops take the projections' outputs as they are: one gradient each, no stack of q/k/v's
        if query is key and key is value:  # self-attention: one GEMM
            qkv = F.linear(query, w, b).view(-1, 3, H, D)  # (n, 3, H, D)
            if q_packing is kv_packing:
                out = ops.attention_varlen_qkvpacked(qkv, q_packing.cu_seqlens, q_packing.max_seqlen, **options)
            else:
                out = ops.attention_varlen_kvpacked(qkv[:, 0], qkv[:, 1:], q_packing.cu_seqlens, kv_packing.cu_seqlens,
                                                    q_packing.max_seqlen, kv_packing.max_seqlen, **options)
        else:
            if key is not value:
                raise ValueError("packed cross-attention needs key is value (the memory)")
            q = F.linear(query, w[:E], b[:E] if b is not None else None).view(-1, H, D)  # (n_q, H, D)
            kv = F.linear(key, w[E:], b[E:] if b is not None else None).view(-1, 2, H, D)  # (n_k, 2, H, D)
            out = ops.attention_varlen_kvpacked(q, kv, q_packing.cu_seqlens, kv_packing.cu_seqlens,
                                                q_packing.max_seqlen, kv_packing.max_seqlen, **options)  # (n_q, H, D)
        return F.linear(out.reshape(q_packing.num_tokens, E), self.out_proj.weight,
                        self.out_proj.bias if add_out_bias else None)

    # -------------------------------------------------------------- incremental decoding
    def memory_key_value(self, memory: torch.Tensor) -> KV:
        """Keys and values of a batch-first ``memory`` (B, S, kdim), as (B, H, S, D) each.

        Cross-attention in incremental decoding computes these once per source.
        """
        E = self.embed_dim
        b = self.in_proj_bias
        if self._qkv_same_embed_dim:
            k, v = F.linear(memory, self.in_proj_weight[E:], b[E:] if b is not None else None).chunk(2, dim=-1)
        else:
            k = F.linear(memory, self.k_proj_weight, b[E:2 * E] if b is not None else None)
            v = F.linear(memory, self.v_proj_weight, b[2 * E:] if b is not None else None)
        return self._split_heads(k), self._split_heads(v)

    def cross_attention_step(self, x: torch.Tensor, memory_kv: KV,
                             key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Batch-first queries ``x`` (B, T, E) attending to :meth:`memory_key_value` -> (B, T, E)."""
        E = self.embed_dim
        b = self.in_proj_bias
        w = self.in_proj_weight[:E] if self._qkv_same_embed_dim else self.q_proj_weight
        q = self._split_heads(F.linear(x, w, b[:E] if b is not None else None))  # (B, H, T, D)
        out = ops.attention(q, memory_kv[0], memory_kv[1], key_padding_mask=key_padding_mask)
        return self._merge_heads(out)

    def self_attention_step(self, x: torch.Tensor, past_kv: Optional[KV]) -> Tuple[torch.Tensor, KV]:
        """Causal self-attention of new batch-first positions ``x`` (B, T, E) after a cache.

        ``past_kv``: the (B, H, t, D) keys and values of the earlier positions, or None.
        Returns the (B, T, E) output and the cache with the new positions appended. The
        op's bottom-right causal alignment lets the T new queries see all t + T keys up to
        their own position.
        """
        q, k, v = (self._split_heads(t) for t in self._in_projection(x, x, x))  # (B, H, T, D)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)  # (B, H, t + T, D)
            v = torch.cat([past_kv[1], v], dim=2)
        out = ops.attention(q, k, v, is_causal=True)
        return self._merge_heads(out), (k, v)

    @classmethod
    def from_torch(cls, module: torch.nn.MultiheadAttention) -> "MultiheadAttention":
        """The twin of ``module``, sharing its parameter objects (see :func:`fastformer.convert`)."""
        return share_state(cls, module)
