"""Twins of torch's Transformer layers and stacks, built on fastformer's fused ops.

Each twin subclasses the torch class and is constructed by torch's own ``__init__``
(same arguments, same random initialisation, same parameter names), after which its
``MultiheadAttention`` and ``LayerNorm`` children are swapped for their twins. Only
``forward`` differs:

* post-LN (default): every ``LayerNorm(x + dropout(sublayer(x)))`` is one
  :func:`fastformer.ops.add_layer_norm` call;
* pre-LN (``norm_first=True``): every ``LayerNorm(x + dropout(sublayer(...)))`` that
  feeds the next sub-layer is one ``add_layer_norm(..., prenorm=True)`` call returning
  the normalised input and the new residual. The residual add that ends a layer is
  carried to the next layer's first norm (or the stack's final norm) and fused there;
  a layer called on its own finishes it with a plain add;
* the feed-forward block ``linear2(dropout(act(linear1(x))))`` is one
  :func:`fastformer.ops.feed_forward` call;
* the bias of the linear layer that ends a sub-layer (attention's ``out_proj``, the
  feed-forward's ``linear2``) is added by the ``add_layer_norm`` that follows it
  (its ``x_bias``), not by the layer: that spares a pass over the output and one over
  its gradient. Only within a layer: pre-LN's feed-forward, whose add is carried to the
  next layer, keeps its bias.

Dropout probabilities are passed to the ops only in training mode. The activation must
be ``"relu"`` or ``"gelu"`` (or ``F.relu``, ``F.gelu``, ``nn.ReLU()``, exact
``nn.GELU()``), or the callable ``F.silu`` / ``nn.SiLU()`` (torch's layers take no
``"silu"`` string): those are what the fused feed-forward kernels implement.
"""
import warnings
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .. import ops
from ..internal.twins import drop_activation_shadow, share_state, swap_children, twin_of
from ..internal import validation
from .multihead_attention import KV
from .packing import Packing

ACTIVATIONS = ("relu", "gelu")  # the strings torch's layers accept


def activation_name(activation) -> str:
    """``"relu"``, ``"gelu"`` or ``"silu"`` for the activations the fused FFN supports; ValueError
    otherwise. silu only as a callable: torch's layers reject the string."""
    if isinstance(activation, str):
        if activation in ACTIVATIONS:
            return activation
    elif activation in (F.relu, torch.relu) or isinstance(activation, torch.nn.ReLU):
        return "relu"
    elif activation is F.gelu or (isinstance(activation, torch.nn.GELU) and activation.approximate == "none"):
        return "gelu"
    elif activation is F.silu or isinstance(activation, torch.nn.SiLU):
        return "silu"
    raise ValueError(f"activation must be 'relu' or 'gelu' (or F.relu, F.gelu, F.silu, nn.ReLU(), nn.GELU(), "
                     f"nn.SiLU()): those are what fastformer's fused feed-forward implements; got {activation!r}")


class Biased(NamedTuple):
    """A linear layer's output ``value`` whose ``bias`` (or None) is not added yet."""
    value: torch.Tensor
    bias: Optional[torch.Tensor]


class Pending(NamedTuple):
    """A residual add not done yet: the value ``h + dropout(f, p)``."""
    f: torch.Tensor
    h: torch.Tensor
    p: float


Hidden = Union[torch.Tensor, Pending]


def resolve(x: Hidden) -> torch.Tensor:
    """Finish a :class:`Pending` residual add (no norm follows it)."""
    if not isinstance(x, Pending):
        return x
    return x.h + (F.dropout(x.f, x.p) if x.p > 0.0 else x.f)


def _norm_input(x: Hidden, norm) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x) with a pending residual add fused into the norm (pre-LN)."""
    if isinstance(x, Pending):
        return ops.add_layer_norm(x.f, x.h, norm.weight, norm.bias, norm.eps, x.p, prenorm=True)
    return ops.add_layer_norm(x, None, norm.weight, norm.bias, norm.eps), x


def _fusable_norm(norm) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) and len(norm.normalized_shape) == 1


def _final_norm(x: Hidden, norm) -> torch.Tensor:
    """A stack's optional final norm, fused with a pending residual add when possible."""
    if isinstance(x, Pending) and _fusable_norm(norm):
        return ops.add_layer_norm(x.f, x.h, norm.weight, norm.bias, norm.eps, x.p)
    x = resolve(x)
    return norm(x) if norm is not None else x


def _add_norm(x: Biased, residual: torch.Tensor, norm, p: float) -> torch.Tensor:
    """Post-LN ``norm(residual + dropout(x))`` in one op."""
    return ops.add_layer_norm(x.value, residual, norm.weight, norm.bias, norm.eps, p, x_bias=x.bias)


def _add_prenorm(x: Biased, residual: torch.Tensor, norm, p: float):
    """Pre-LN ``(norm(h), h)`` with ``h = residual + dropout(x)`` in one op."""
    return ops.add_layer_norm(x.value, residual, norm.weight, norm.bias, norm.eps, p, prenorm=True,
                              x_bias=x.bias)


def _attend(attn, *args, **kwargs) -> Biased:
    """A twin attention's output, its out_proj bias left to the add_layer_norm that follows. Not for
    a module with forward hooks (FSDP's fully_shard among them): its hooks see the output torch's
    would, and its parameters are read only within its own forward."""
    defer = not (attn._forward_hooks or attn._forward_pre_hooks)
    out = attn(*args, need_weights=False, add_out_bias=not defer, **kwargs)[0]
    return Biased(out, attn.out_proj.bias if defer else None)


def detect_is_causal_mask(mask: Optional[torch.Tensor], is_causal: Optional[bool], size: int) -> bool:
    """torch's rule: an explicit ``is_causal`` wins; if None, is ``mask`` exactly the causal mask?"""
    if is_causal is not None or mask is None:
        return bool(is_causal)
    if tuple(mask.shape) != (size, size):
        return False
    causal = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)  # True above the diagonal
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    want = torch.zeros(size, size, dtype=mask.dtype, device=mask.device).masked_fill(causal, float("-inf"))
    return bool((mask == want).all())


def _seq_len(x: torch.Tensor, batch_first: bool) -> int:
    if x.dim() == 2:
        return x.shape[0]
    return x.shape[1] if batch_first else x.shape[0]


def _check_encoder_input(layer, src, mask, kpm, mask_name: str = "src_mask") -> None:
    """An encoder layer's (or stack's, checked against its first layer) input and masks."""
    attn = layer.self_attn
    validation.hidden("src", src, attn.embed_dim, layer.linear1.weight)
    validation.layer_masks(src, attn.batch_first, attn.num_heads, mask, mask_name, kpm, "src_key_padding_mask")


def _check_decoder_input(layer, tgt, memory, tgt_mask, memory_mask, tgt_kpm, memory_kpm) -> None:
    """A decoder layer's (or stack's) target, memory and masks."""
    attn = layer.self_attn
    validation.hidden("tgt", tgt, attn.embed_dim, layer.linear1.weight)
    validation.hidden("memory", memory, attn.embed_dim, layer.linear1.weight, ranks=(tgt.dim(),))
    batch_first = attn.batch_first
    B, B_mem = validation.sequence_dims(tgt, batch_first)[0], validation.sequence_dims(memory, batch_first)[0]
    if B != B_mem:
        raise ValueError(f"tgt and memory must have the same batch size, got shapes {tuple(tgt.shape)} and "
                         f"{tuple(memory.shape)} (batch_first={batch_first})")
    validation.layer_masks(tgt, batch_first, attn.num_heads, tgt_mask, "tgt_mask", tgt_kpm, "tgt_key_padding_mask")
    validation.layer_masks(tgt, batch_first, attn.num_heads, memory_mask, "memory_mask", memory_kpm,
                          "memory_key_padding_mask", keys=memory)


def _check_packed_input(layer, name: str, x: Hidden, packing: Packing, **must_be_none) -> None:
    """Packed rows ``(n, E)`` for ``packing`` (see :mod:`fastformer.nn.packing`); the masks of the
    padded layout must be None (the packings carry the padding)."""
    if not isinstance(packing, Packing):
        raise TypeError(f"packing must be a fastformer.nn.packing.Packing, got {type(packing).__name__}")
    for arg, value in must_be_none.items():
        if value is not None:
            raise ValueError(f"{arg} must be None with packing (the packing carries the padding; packed layers "
                             "support no other mask)")
    if isinstance(x, Pending):
        x = x.f
    validation.hidden(name, x, layer.self_attn.embed_dim, layer.linear1.weight, ranks=(2,))
    if x.shape[0] != packing.num_tokens:
        raise ValueError(f"packed {name} must have one row per real token, {packing.num_tokens}, got shape "
                         f"{tuple(x.shape)}")


class _LayerTwin:
    """What the encoder and decoder layer twins share. torch's two layers take the same
    constructor arguments, so one ``__init__`` (checks, then torch's, then the twin children) serves both."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device=None, dtype=None) -> None:
        activation_name(activation)
        validation.layer_config(d_model, nhead, dim_feedforward, dropout, layer_norm_eps)
        super().__init__(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps,
                         batch_first, norm_first, bias, device, dtype)
        swap_children(self)

    def _dropout_p(self, dropout: torch.nn.Dropout) -> float:
        return dropout.p if self.training else 0.0

    def _feed_forward(self, x: torch.Tensor, defer_bias: bool = True) -> Biased:
        """The feed-forward block, linear2's bias left to the add_layer_norm that follows (``defer_bias``).
        Pre-LN adds it here: its residual add is done by the next layer, outside this layer's forward,
        where a sharded model (FSDP) no longer holds this layer's parameters."""
        b2 = self.linear2.bias
        out = ops.feed_forward(x, self.linear1.weight, self.linear1.bias, self.linear2.weight,
                               None if defer_bias else b2, activation=activation_name(self.activation),
                               dropout_p=self._dropout_p(self.dropout))
        return Biased(out, b2 if defer_bias else None)

    def _check_twin(self) -> None:
        activation_name(self.activation)

    def __setstate__(self, state) -> None:  # deepcopy and pickle: torch's, then its relu shadow dropped
        super().__setstate__(state)
        drop_activation_shadow(self)


@twin_of(torch.nn.TransformerEncoderLayer)
class TransformerEncoderLayer(_LayerTwin, torch.nn.TransformerEncoderLayer):
    """Drop-in twin of :class:`torch.nn.TransformerEncoderLayer` (see the module docstring)."""

    def forward(self, src: torch.Tensor, src_mask: Optional[torch.Tensor] = None,
                src_key_padding_mask: Optional[torch.Tensor] = None, is_causal: bool = False, *,
                pending_output: bool = False, packing: Optional[Packing] = None) -> Hidden:
        """torch's contract. ``pending_output=True`` is for stacks (the encoder calls each layer
        through ``__call__``, so module hooks such as FSDP's fire): ``src`` may then be a
        :class:`Pending` residual add and a pre-LN layer returns one, fused by the next layer
        into its first LayerNorm. With ``packing`` (:mod:`fastformer.nn.packing`), ``src`` holds
        the ``(n, E)`` real rows of a padded batch (batch first) and so does the output; the
        padding comes from the packing, so ``src_mask`` and ``src_key_padding_mask`` must be None."""
        if packing is not None:
            _check_packed_input(self, "src", src, packing, src_mask=src_mask,
                                src_key_padding_mask=src_key_padding_mask)

            def self_attend(y):
                return _attend(self.self_attn, y, y, y, is_causal=is_causal, packing=(packing, packing))
        else:
            if not pending_output:
                _check_encoder_input(self, src, src_mask, src_key_padding_mask)

            def self_attend(y):
                return _attend(self.self_attn, y, y, y, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                               is_causal=is_causal)
        out = self._forward(src, self_attend)
        return out if pending_output else resolve(out)

    def _forward(self, x: Hidden, self_attend) -> Hidden:
        p1, p2 = self._dropout_p(self.dropout1), self._dropout_p(self.dropout2)
        if self.norm_first:
            y, x = _norm_input(x, self.norm1)
            y, h = _add_prenorm(self_attend(y), x, self.norm2, p1)
            return Pending(self._feed_forward(y, defer_bias=False).value, h, p2)
        x = resolve(x)
        x = _add_norm(self_attend(x), x, self.norm1, p1)
        return _add_norm(self._feed_forward(x), x, self.norm2, p2)

    @classmethod
    def from_torch(cls, module: torch.nn.TransformerEncoderLayer) -> "TransformerEncoderLayer":
        """The twin of ``module`` sharing its parameters (children are swapped by :func:`fastformer.convert`)."""
        return share_state(cls, module)


@twin_of(torch.nn.TransformerDecoderLayer)
class TransformerDecoderLayer(_LayerTwin, torch.nn.TransformerDecoderLayer):
    """Drop-in twin of :class:`torch.nn.TransformerDecoderLayer` (see the module docstring).

    :meth:`forward_step` runs new target positions against a key/value cache, for
    incremental decoding.
    """

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, tgt_mask: Optional[torch.Tensor] = None,
                memory_mask: Optional[torch.Tensor] = None, tgt_key_padding_mask: Optional[torch.Tensor] = None,
                memory_key_padding_mask: Optional[torch.Tensor] = None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False, *, pending_output: bool = False,
                packing: Optional[Tuple[Packing, Packing]] = None) -> Hidden:
        """torch's contract; ``pending_output`` as in :meth:`TransformerEncoderLayer.forward`.
        With ``packing = (tgt_packing, memory_packing)``, ``tgt`` and ``memory`` hold the real rows
        ``(n_t, E)`` and ``(n_s, E)`` of their padded batches and the output those of ``tgt``; the
        masks but ``tgt_is_causal`` must then be None (the packings carry the padding)."""
        if packing is not None:
            tgt_packing, memory_packing = packing
            _check_packed_input(self, "tgt", tgt, tgt_packing, tgt_mask=tgt_mask, memory_mask=memory_mask,
                                tgt_key_padding_mask=tgt_key_padding_mask,
                                memory_key_padding_mask=memory_key_padding_mask)
            _check_packed_input(self, "memory", memory, memory_packing)
            attenders = self._packed_attenders(memory, tgt_packing, memory_packing, tgt_is_causal)
        else:
            if not pending_output:
                _check_decoder_input(self, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                     memory_key_padding_mask)
            attenders = self._attenders(memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                                        memory_key_padding_mask, tgt_is_causal, memory_is_causal)
        out = self._forward(tgt, *attenders)
        return out if pending_output else resolve(out)

    def _packed_attenders(self, memory, tgt_packing: Packing, memory_packing: Packing, tgt_is_causal):
        def self_attend(y):
            return _attend(self.self_attn, y, y, y, is_causal=tgt_is_causal, packing=(tgt_packing, tgt_packing))

        def cross_attend(y):
            return _attend(self.multihead_attn, y, memory, memory, packing=(tgt_packing, memory_packing))
        return self_attend, cross_attend

    def _attenders(self, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                   tgt_is_causal, memory_is_causal):
        def self_attend(y):
            return _attend(self.self_attn, y, y, y, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                           is_causal=tgt_is_causal)

        def cross_attend(y):
            return _attend(self.multihead_attn, y, memory, memory, attn_mask=memory_mask,
                           key_padding_mask=memory_key_padding_mask, is_causal=memory_is_causal)
        return self_attend, cross_attend

    def _forward(self, x: Hidden, self_attend, cross_attend) -> Hidden:
        p1, p2, p3 = (self._dropout_p(d) for d in (self.dropout1, self.dropout2, self.dropout3))
        if self.norm_first:
            y, x = _norm_input(x, self.norm1)
            y, h = _add_prenorm(self_attend(y), x, self.norm2, p1)
            y, h = _add_prenorm(cross_attend(y), h, self.norm3, p2)
            return Pending(self._feed_forward(y, defer_bias=False).value, h, p3)
        x = resolve(x)
        x = _add_norm(self_attend(x), x, self.norm1, p1)
        x = _add_norm(cross_attend(x), x, self.norm2, p2)
        return _add_norm(self._feed_forward(x), x, self.norm3, p3)

    def _step(self, x: Hidden, past_kv: Optional[KV], memory_kv: KV,
              memory_key_padding_mask: Optional[torch.Tensor]) -> Tuple[Hidden, KV]:
        new_kv: List[KV] = []

        def self_attend(y):
            out, kv = self.self_attn.self_attention_step(y, past_kv)
            new_kv.append(kv)
            return Biased(out, None)

        def cross_attend(y):
            return Biased(self.multihead_attn.cross_attention_step(y, memory_kv, memory_key_padding_mask), None)
        out = self._forward(x, self_attend, cross_attend)
        return out, new_kv[0]

    def forward_step(self, x: torch.Tensor, past_kv: Optional[KV], memory_kv: KV,
                     memory_key_padding_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, KV]:
        """Incremental decoding: new batch-first positions ``x`` (B, T, E) after cached ones.

        Args:
            past_kv: this layer's self-attention keys/values (B, H, t, D) of the earlier
                positions, or None at the start.
            memory_kv: ``self.multihead_attn.memory_key_value(memory)``, computed once.
            memory_key_padding_mask: (B, S) bool, True = padded source position.

        Returns the (B, T, E) output, equal to the rows ``t .. t + T - 1`` of a causal
        ``forward`` over all ``t + T`` positions, and the extended cache.
        """
        out, kv = self._step(x, past_kv, memory_kv, memory_key_padding_mask)
        return resolve(out), kv

    @classmethod
    def from_torch(cls, module: torch.nn.TransformerDecoderLayer) -> "TransformerDecoderLayer":
        """The twin of ``module`` sharing its parameters (children are swapped by :func:`fastformer.convert`)."""
        return share_state(cls, module)


def _packed_stack(stack, x: Hidden, packing, call_layer) -> torch.Tensor:
    """A stack's layers on packed rows (each through ``__call__``), then its final norm."""
    for layer in stack.layers:
        if not isinstance(layer, (TransformerEncoderLayer, TransformerDecoderLayer)):
            raise TypeError(f"packed rows need fastformer.nn layers, got {type(layer).__name__}")
        x = call_layer(layer, x)
    return _final_norm(x, stack.norm)


@twin_of(torch.nn.TransformerEncoder)
class TransformerEncoder(torch.nn.TransformerEncoder):
    """Drop-in twin of :class:`torch.nn.TransformerEncoder`. Never uses nested tensors:
    padded positions are computed like the others (and returned, not zeroed)."""

    def __init__(self, encoder_layer: torch.nn.TransformerEncoderLayer, num_layers: int,
                 norm: Optional[torch.nn.Module] = None, enable_nested_tensor: bool = True,
                 mask_check: bool = True) -> None:
        validation.positive_int("num_layers", num_layers)
        super().__init__(encoder_layer, num_layers, norm, enable_nested_tensor=False, mask_check=mask_check)
        self.enable_nested_tensor = enable_nested_tensor
        swap_children(self)

    def forward(self, src: torch.Tensor, mask: Optional[torch.Tensor] = None,
                src_key_padding_mask: Optional[torch.Tensor] = None,
                is_causal: Optional[bool] = None, *, packing: Optional[Packing] = None) -> torch.Tensor:
        """torch's contract; with ``packing``, ``src`` and the output are the ``(n, E)`` real rows
        of a padded batch (see :meth:`TransformerEncoderLayer.forward`)."""
        if packing is not None:
            _check_packed_input(self.layers[0], "src", src, packing, mask=mask,
                                src_key_padding_mask=src_key_padding_mask)
            return _packed_stack(self, src, packing, lambda layer, x: layer(
                x, None, None, bool(is_causal), pending_output=True, packing=packing))
        _check_encoder_input(self.layers[0], src, mask, src_key_padding_mask, mask_name="mask")
        batch_first = self.layers[0].self_attn.batch_first
        is_causal = detect_is_causal_mask(mask, is_causal, _seq_len(src, batch_first))
        x: Hidden = src
        for layer in self.layers:
            if isinstance(layer, TransformerEncoderLayer):
                x = layer(x, mask, src_key_padding_mask, is_causal, pending_output=True)
            else:
                x = layer(resolve(x), src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                          is_causal=is_causal)
        return _final_norm(x, self.norm)

    @classmethod
    def from_torch(cls, module: torch.nn.TransformerEncoder) -> "TransformerEncoder":
        """The twin of ``module`` sharing its parameters (children are swapped by :func:`fastformer.convert`)."""
        return share_state(cls, module)


@twin_of(torch.nn.TransformerDecoder)
class TransformerDecoder(torch.nn.TransformerDecoder):
    """Drop-in twin of :class:`torch.nn.TransformerDecoder`, plus incremental decoding
    (:meth:`memory_key_values`, :meth:`forward_step`)."""

    def __init__(self, decoder_layer: torch.nn.TransformerDecoderLayer, num_layers: int,
                 norm: Optional[torch.nn.Module] = None) -> None:
        validation.positive_int("num_layers", num_layers)
        super().__init__(decoder_layer, num_layers, norm)
        swap_children(self)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, tgt_mask: Optional[torch.Tensor] = None,
                memory_mask: Optional[torch.Tensor] = None, tgt_key_padding_mask: Optional[torch.Tensor] = None,
                memory_key_padding_mask: Optional[torch.Tensor] = None, tgt_is_causal: Optional[bool] = None,
                memory_is_causal: bool = False, *,
                packing: Optional[Tuple[Packing, Packing]] = None) -> torch.Tensor:
        """torch's contract; with ``packing = (tgt_packing, memory_packing)``, ``tgt``, ``memory``
        and the output are real rows (see :meth:`TransformerDecoderLayer.forward`)."""
        if packing is not None:
            _check_packed_input(self.layers[0], "tgt", tgt, packing[0], tgt_mask=tgt_mask, memory_mask=memory_mask,
                                tgt_key_padding_mask=tgt_key_padding_mask,
                                memory_key_padding_mask=memory_key_padding_mask)
            _check_packed_input(self.layers[0], "memory", memory, packing[1])
            return _packed_stack(self, tgt, packing, lambda layer, x: layer(
                x, memory, tgt_is_causal=bool(tgt_is_causal), pending_output=True, packing=packing))
        _check_decoder_input(self.layers[0], tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                             memory_key_padding_mask)
        batch_first = self.layers[0].self_attn.batch_first
        tgt_is_causal = detect_is_causal_mask(tgt_mask, tgt_is_causal, _seq_len(tgt, batch_first))
        x: Hidden = tgt
        for layer in self.layers:
            if isinstance(layer, TransformerDecoderLayer):
                x = layer(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                          tgt_is_causal, memory_is_causal, pending_output=True)
            else:
                x = layer(resolve(x), memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                          tgt_key_padding_mask=tgt_key_padding_mask,
                          memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                          memory_is_causal=memory_is_causal)
        return _final_norm(x, self.norm)

    def memory_key_values(self, memory: torch.Tensor) -> List[KV]:
        """Every layer's cross-attention keys/values of batch-first ``memory`` (B, S, E)."""
        return [layer.multihead_attn.memory_key_value(memory) for layer in self.layers]

    def forward_step(self, x: torch.Tensor, past_kvs: Optional[List[Optional[KV]]], memory_kvs: List[KV],
                     memory_key_padding_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, List[KV]]:
        """Incremental decoding through the stack and its final norm.

        ``x`` (B, T, E) batch-first new positions; ``past_kvs`` one self-attention cache per
        layer (or None at the start); ``memory_kvs`` from :meth:`memory_key_values`.
        Returns the (B, T, E) output and the extended caches. Requires fastformer twin layers.
        """
        if past_kvs is None:
            past_kvs = [None] * len(self.layers)
        h: Hidden = x
        new_kvs = []
        for layer, past, mem in zip(self.layers, past_kvs, memory_kvs):
            if not isinstance(layer, TransformerDecoderLayer):
                raise TypeError(f"forward_step needs fastformer.nn.TransformerDecoderLayer layers, got "
                                f"{type(layer).__name__}")
            h, kv = layer._step(h, past, mem, memory_key_padding_mask)
            new_kvs.append(kv)
        return _final_norm(h, self.norm), new_kvs

    @classmethod
    def from_torch(cls, module: torch.nn.TransformerDecoder) -> "TransformerDecoder":
        """The twin of ``module`` sharing its parameters (children are swapped by :func:`fastformer.convert`)."""
        return share_state(cls, module)


@twin_of(torch.nn.Transformer)
class Transformer(torch.nn.Transformer):
    """Drop-in twin of :class:`torch.nn.Transformer`.

    torch's constructor builds and initialises the model (same random numbers, same
    parameters), then the encoder and decoder (custom ones included) are swapped for
    twins sharing those parameters; ``forward`` is torch's, which calls them.
    """

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable] = F.relu, custom_encoder: Optional[torch.nn.Module] = None,
                 custom_decoder: Optional[torch.nn.Module] = None, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True,
                 device=None, dtype=None) -> None:
        activation_name(activation)
        validation.layer_config(d_model, nhead, dim_feedforward, dropout, layer_norm_eps)
        if custom_encoder is None:
            validation.positive_int("num_encoder_layers", num_encoder_layers)
        if custom_decoder is None:
            validation.positive_int("num_decoder_layers", num_decoder_layers)
        with warnings.catch_warnings():  # torch's nested-tensor warning: the twin never uses them
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            super().__init__(d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward,
                             dropout, activation, custom_encoder, custom_decoder, layer_norm_eps,
                             batch_first, norm_first, bias, device, dtype)
        swap_children(self)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """torch's forward, after checking ``src`` and ``tgt`` (the stacks check the masks)."""
        for name, x in (("src", src), ("tgt", tgt)):
            validation.hidden(name, x, self.d_model, None)
        if src.dim() != tgt.dim():
            raise ValueError(f"src and tgt must both be batched (3-D) or both unbatched (2-D), got shapes "
                             f"{tuple(src.shape)} and {tuple(tgt.shape)}")
        b = 0 if self.batch_first else 1
        if src.dim() == 3 and src.shape[b] != tgt.shape[b]:
            raise ValueError(f"src and tgt must have the same batch size, got shapes {tuple(src.shape)} and "
                             f"{tuple(tgt.shape)} (batch_first={self.batch_first})")
        return super().forward(src, tgt, *args, **kwargs)

    @classmethod
    def from_torch(cls, module: torch.nn.Transformer) -> "Transformer":
        """The twin of ``module`` sharing its parameters (children are swapped by :func:`fastformer.convert`)."""
        return share_state(cls, module)
