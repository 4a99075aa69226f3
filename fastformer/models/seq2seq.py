"""The encoder-decoder Transformer of "Attention Is All You Need" on fastformer's fused modules."""
import math

import torch

from .. import backends
from .. import nn as fnn
from .. import ops
from ..nn.packing import Packing, may_pack
from ..internal import validation
from .generation import generate
from .masks import padding_mask
from .positional import SinusoidalPositionalEncoding


class Seq2SeqTransformer(torch.nn.Module):
    """Token ids in, logits out: the full translation model, batch first.

    Token embeddings scaled by ``sqrt(d_model)`` plus sinusoidal positional encodings,
    dropout on the sum; ``num_encoder_layers`` encoder and ``num_decoder_layers``
    decoder layers (:mod:`fastformer.nn` twins, batch first); post-LN by default as in
    the paper (no final norms), pre-LN with ``norm_first=True`` (then the encoder and
    decoder end with a LayerNorm each, as ``torch.nn.Transformer``'s do); an output
    projection without bias, tied to the target embedding when ``tie_output``.
    ``share_embeddings`` uses one embedding table for source and target (the
    vocabularies must then have the same size).

    Padding masks come from ``pad_idx`` and the decoder's causal mask is built in.
    Initialisation: Xavier-uniform weight matrices (the packed q/k/v projection as one
    matrix, as torch does), zero biases, LayerNorm weight 1 and bias 0, embeddings
    ``N(0, d_model^-0.5)`` (unit variance after the ``sqrt(d_model)`` scaling).

    ``skip_padding`` (default True): :meth:`loss`, :meth:`forward` and :meth:`encode` run on the
    real tokens only, packed into rows of their own (:mod:`fastformer.nn.packing`): every
    position-wise part (embeddings, projections, feed-forward, add & LayerNorm, output projection
    and loss) and attention too (:func:`fastformer.ops.attention_varlen`, within each sequence).
    No padded position is computed. Padding never reaches a real token, so the results at the real
    positions are those of the padded computation (up to rounding); :meth:`forward` returns zero
    logits and :meth:`encode` a zero memory at the padded positions. With dropout on, the masks
    are drawn over the packed rows, so they are other (equally distributed) draws than the padded
    computation's, unless nothing is padded. With ``skip_padding=False`` the padded positions are
    computed too, and so they are under ``torch.compile`` unless dynamo may capture the number of
    real tokens as a data-dependent size (``torch._dynamo.config.capture_dynamic_output_shape_ops``)
    and attention_varlen runs on a kernel backend.

    Packed-sequence training: ``loss(src, tgt, src_segments=..., tgt_segments=...)`` takes rows
    holding several sentence pairs each (see :meth:`loss`).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, nhead: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str = "relu", norm_first: bool = False,
                 share_embeddings: bool = False, tie_output: bool = True, pad_idx: int = 0, bos_idx: int = 1,
                 eos_idx: int = 2, max_len: int = 1024, skip_padding: bool = True):
        super().__init__()
        validation.positive_int("src_vocab_size", src_vocab_size)
        validation.positive_int("tgt_vocab_size", tgt_vocab_size)
        validation.layer_config(d_model, nhead, dim_feedforward, dropout, 1e-5)
        validation.positive_int("num_encoder_layers", num_encoder_layers)
        validation.positive_int("num_decoder_layers", num_decoder_layers)
        validation.positive_int("max_len", max_len)
        specials = {"pad_idx": pad_idx, "bos_idx": bos_idx, "eos_idx": eos_idx}
        if len(set(specials.values())) != 3:
            raise ValueError(f"pad_idx, bos_idx and eos_idx must be distinct, got {specials}")
        for name, idx in specials.items():
            validation.positive_int(name, idx, minimum=0)
            if not 0 <= idx < min(src_vocab_size, tgt_vocab_size):
                raise ValueError(f"{name}={idx} must be a valid id of both vocabularies "
                                 f"(sizes {src_vocab_size} and {tgt_vocab_size})")
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"share_embeddings needs equal vocabulary sizes, got src_vocab_size="
                             f"{src_vocab_size} and tgt_vocab_size={tgt_vocab_size}")
        if num_encoder_layers < 1 or num_decoder_layers < 1:
            raise ValueError(f"num_encoder_layers and num_decoder_layers must be >= 1, got "
                             f"{num_encoder_layers} and {num_decoder_layers}")
        if not isinstance(skip_padding, bool):
            raise TypeError(f"skip_padding must be a bool, got {type(skip_padding).__name__}")
        self.d_model, self.pad_idx, self.bos_idx, self.eos_idx = d_model, pad_idx, bos_idx, eos_idx
        self.skip_padding = skip_padding
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size

        self.src_embed = torch.nn.Embedding(src_vocab_size, d_model)
        self.tgt_embed = self.src_embed if share_embeddings else torch.nn.Embedding(tgt_vocab_size, d_model)
        self.positional = SinusoidalPositionalEncoding(d_model, max_len)
        self.embed_dropout = torch.nn.Dropout(dropout)  # holds p: the embedding op applies it (ops.embedding)
        enc_layer = fnn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation,
                                                batch_first=True, norm_first=norm_first)
        dec_layer = fnn.TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, activation,
                                                batch_first=True, norm_first=norm_first)
        self.encoder = fnn.TransformerEncoder(enc_layer, num_encoder_layers,
                                              fnn.LayerNorm(d_model) if norm_first else None,
                                              enable_nested_tensor=False)
        self.decoder = fnn.TransformerDecoder(dec_layer, num_decoder_layers,
                                              fnn.LayerNorm(d_model) if norm_first else None)
        self.output_proj = torch.nn.Linear(d_model, tgt_vocab_size, bias=False)
        if tie_output:
            self.output_proj.weight = self.tgt_embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialisation described in the class docstring."""
        for m in self.modules():
            if isinstance(m, torch.nn.LayerNorm):
                if m.weight is not None:
                    torch.nn.init.ones_(m.weight)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
            elif isinstance(m, torch.nn.MultiheadAttention):
                for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                    if getattr(m, name) is not None:
                        torch.nn.init.xavier_uniform_(getattr(m, name))
                if m.in_proj_bias is not None:
                    torch.nn.init.zeros_(m.in_proj_bias)
            elif isinstance(m, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
        for m in (self.src_embed, self.tgt_embed):  # last: a tied output projection is an embedding
            torch.nn.init.normal_(m.weight, mean=0.0, std=self.d_model ** -0.5)

    # ------------------------------------------------------------------------------ parts
    def _check_tokens(self, name: str, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(f"{name} must be a (B, S) tensor of token ids, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must hold integer token ids (int64), got {tokens.dtype}")
        if tokens.shape[1] == 0:
            raise ValueError(f"{name} must hold at least one position, got shape {tuple(tokens.shape)}")
        table = self.src_embed if name == "src" else self.tgt_embed
        if tokens.device != table.weight.device:
            raise ValueError(f"{name} is on {tokens.device} but the model is on {table.weight.device}")
        if torch.compiler.is_compiling() or tokens.numel() == 0:
            return  # a value check would read the data (a graph break); the embedding checks it too
        vocab = table.num_embeddings
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name} token ids must be in [0, {vocab}) (the {name} vocabulary), got values "
                             f"in [{lo}, {hi}]")

    def _embed_dropout_p(self) -> float:
        return self.embed_dropout.p if self.training else 0.0

    def embed(self, embedding: torch.nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``dropout(embedding(tokens) * sqrt(d_model) + PE[offset : offset + S])`` -> (B, S, d_model), one
        fused op (:func:`fastformer.ops.embedding`; its dropout is the shared Philox one)."""
        table = self.positional(tokens.shape[1], offset).to(embedding.weight.dtype)  # (S, d): row s is PE[offset + s]
        return ops.embedding(tokens, embedding.weight, scale=math.sqrt(self.d_model), positional=table,
                             dropout_p=self._embed_dropout_p())

    def embed_packed(self, embedding: torch.nn.Embedding, tokens: torch.Tensor, packing: Packing) -> torch.Tensor:
        """:meth:`embed` of the real tokens only -> (n, d_model) rows, in ``packing``'s order."""
        table = self.positional(tokens.shape[1]).to(embedding.weight.dtype)  # (S, d)
        return ops.embedding(packing.pack(tokens), embedding.weight, scale=math.sqrt(self.d_model),
                             positional=table, positions=packing.positions, dropout_p=self._embed_dropout_p())

    def _runs_packed(self) -> bool:
        """Whether to run on the packed rows: asked for, and when traced by torch.compile, allowed
        to: the number of real tokens is then a data-dependent size, which dynamo captures only
        with ``capture_dynamic_output_shape_ops``, and the reference attention_varlen (one Python
        step a sequence, branching on its length) cannot be traced that way."""
        if not (self.skip_padding and torch.compiler.is_compiling()):
            return self.skip_padding
        weight = self.src_embed.weight
        dtype = validation.autocast_dtype(weight.device) or weight.dtype
        head_dim = self.encoder.layers[0].self_attn.head_dim
        return (may_pack()
                and backends.select("attention_varlen", weight.device, dtype, head_dim=head_dim) is not None)

    def encode(self, src: torch.Tensor):
        """Source ids (B, Ss) -> (memory (B, Ss, d_model), source padding mask (B, Ss) bool)."""
        self._check_tokens("src", src)
        src_kpm = padding_mask(src, self.pad_idx)
        if self._runs_packed():
            packing = Packing(src_kpm)
            if packing.has_tokens:
                return packing.unpack(self._encode_packed(src, packing)), src_kpm
        memory = self.encoder(self.embed(self.src_embed, src), src_key_padding_mask=src_kpm, is_causal=False)
        return memory, src_kpm

    def _encode_packed(self, src: torch.Tensor, packing: Packing) -> torch.Tensor:
        return self.encoder(self.embed_packed(self.src_embed, src, packing), packing=packing)  # (n_s, d)

    def _decode_packed(self, tgt: torch.Tensor, memory: torch.Tensor, tgt_packing: Packing,
                       src_packing: Packing) -> torch.Tensor:
        return self.decoder(self.embed_packed(self.tgt_embed, tgt, tgt_packing), memory, tgt_is_causal=True,
                            packing=(tgt_packing, src_packing))  # (n_t, d)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        """Target ids (B, St) attending causally to themselves and to ``memory`` -> (B, St, d_model)."""
        self._check_tokens("tgt", tgt)
        if tgt.shape[0] != memory.shape[0]:
            raise ValueError(f"tgt has batch size {tgt.shape[0]} but the source has {memory.shape[0]}")
        return self.decoder(self.embed(self.tgt_embed, tgt), memory,
                            tgt_key_padding_mask=padding_mask(tgt, self.pad_idx),
                            memory_key_padding_mask=src_key_padding_mask, tgt_is_causal=True)

    # ---------------------------------------------------------------------------- the API
    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """``src`` (B, Ss), ``tgt`` (B, St) token ids -> logits (B, St, tgt_vocab_size)."""
        if self._runs_packed():
            self._check_pair(src, tgt)
            src_packing, tgt_packing = Packing(padding_mask(src, self.pad_idx)), Packing(padding_mask(tgt, self.pad_idx))
            if src_packing.has_tokens and tgt_packing.has_tokens:
                memory = self._encode_packed(src, src_packing)
                return tgt_packing.unpack(self.output_proj(self._decode_packed(tgt, memory, tgt_packing, src_packing)))
        memory, src_kpm = self.encode(src)
        return self.output_proj(self.decode(tgt, memory, src_kpm))

    def _check_pair(self, src: torch.Tensor, tgt: torch.Tensor) -> None:
        self._check_tokens("src", src)
        self._check_tokens("tgt", tgt)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"tgt has batch size {tgt.shape[0]} but the source has {src.shape[0]}")

    def loss(self, src: torch.Tensor, tgt: torch.Tensor, label_smoothing: float = 0.1, *,
             src_segments=None, tgt_segments=None) -> torch.Tensor:
        """Teacher-forced label-smoothed cross-entropy, mean over non-pad target tokens.

        The decoder reads ``tgt[:, :-1]`` and predicts ``tgt[:, 1:]``; targets equal to
        ``pad_idx`` are ignored. The logits are never materialised in full:
        :func:`fastformer.ops.linear_cross_entropy` fuses the output projection and the loss.

        Packed sentence pairs: with ``src_segments`` and ``tgt_segments`` (``(B, Ss)`` and
        ``(B, St)`` integer ids), each row holds several sentence pairs, one after the other: a
        sentence is a run of equal ids over the row's non-pad positions, and the i-th source
        sentence of the batch (in row-major order) pairs with the i-th target sentence. Attention
        stays within each sentence, positions restart at 0 in each, and each target sentence is
        shifted on its own (its last token is read by nothing, its first predicted by nothing), so
        the loss equals that of the same pairs in a padded batch of one pair a row.
        """
        if (src_segments is None) != (tgt_segments is None):
            raise ValueError("give src_segments and tgt_segments together (packed sentence pairs), or neither")
        if src_segments is not None:
            return self._segment_loss(src, tgt, src_segments, tgt_segments, label_smoothing)
        self._check_tokens("tgt", tgt)
        if tgt.shape[1] < 2:
            raise ValueError(f"tgt must hold at least 2 positions (input and target), got shape {tuple(tgt.shape)}")
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].long()
        if self._runs_packed():
            self._check_pair(src, tgt)
            src_packing = Packing(padding_mask(src, self.pad_idx))
            tgt_packing = Packing(padding_mask(tgt_in, self.pad_idx))
            if src_packing.has_tokens and tgt_packing.has_tokens:
                return self._packed_loss(src, tgt_in, tgt_out, src_packing, tgt_packing, label_smoothing)
        memory, src_kpm = self.encode(src)
        hidden = self.decode(tgt_in, memory, src_kpm)  # (B, St - 1, d)
        return ops.linear_cross_entropy(hidden, self.output_proj.weight, tgt_out, linear_bias=self.output_proj.bias,
                                        label_smoothing=label_smoothing, ignore_index=self.pad_idx)

    def _packed_loss(self, src, tgt_in, tgt_out, src_packing: Packing, tgt_packing: Packing,
                     label_smoothing: float) -> torch.Tensor:
        """:meth:`loss` on the real tokens only (``skip_padding``)."""
        hidden = self._decode_packed(tgt_in, self._encode_packed(src, src_packing), tgt_packing, src_packing)
        return ops.linear_cross_entropy(hidden, self.output_proj.weight, tgt_packing.pack(tgt_out),
                                        linear_bias=self.output_proj.bias, label_smoothing=label_smoothing,
                                        ignore_index=self.pad_idx)

    def _segment_loss(self, src, tgt, src_segments, tgt_segments, label_smoothing: float) -> torch.Tensor:
        """:meth:`loss` of packed sentence pairs: each target sentence shifted within itself."""
        self._check_pair(src, tgt)
        for name, seg, tokens in (("src_segments", src_segments, src), ("tgt_segments", tgt_segments, tgt)):
            if not isinstance(seg, torch.Tensor) or seg.shape != tokens.shape or seg.is_floating_point():
                got = f"{seg.dtype} {tuple(seg.shape)}" if isinstance(seg, torch.Tensor) else type(seg).__name__
                raise ValueError(f"{name} must be an integer tensor of the tokens' shape {tuple(tokens.shape)}, "
                                 f"got {got}")
        traced = torch.compiler.is_compiling()
        if traced and not self._runs_packed():
            raise RuntimeError("packed sentence pairs (src_segments / tgt_segments) compile only on the packed rows: "
                               "set torch._dynamo.config.capture_dynamic_output_shape_ops = True (their sentence "
                               "count is data), with skip_padding=True and a backend with attention_varlen kernels")
        tgt_pad = padding_mask(tgt, self.pad_idx)
        seg = tgt_segments.to(tgt.device)
        # a sentence's last token: the row ends, the next position is padding or another sentence
        last = torch.ones_like(tgt_pad)
        last[:, :-1] = tgt_pad[:, 1:] | (seg[:, 1:] != seg[:, :-1])
        tgt_out = torch.cat([tgt[:, 1:], tgt.new_full((tgt.shape[0], 1), self.pad_idx)], dim=1).long()
        src_packing = Packing(padding_mask(src, self.pad_idx), src_segments.to(src.device))
        tgt_packing = Packing(tgt_pad | last, seg)  # the decoder reads all but each sentence's last token
        if traced:  # the counts are data: checked when the graph runs
            torch._check(src_packing.num_sequences == tgt_packing.num_sequences,  # a constant message, or no graph
                         lambda: "src_segments and tgt_segments must hold the same number of sentences")
            torch._check(src_packing.num_tokens > 0, lambda: "packed sentence pairs need at least one sentence pair")
        elif src_packing.num_sequences != tgt_packing.num_sequences:
            raise ValueError(f"src_segments and tgt_segments must hold the same number of sentences (of at least "
                             f"one source token and two target tokens), got {src_packing.num_sequences} and "
                             f"{tgt_packing.num_sequences}")
        elif not (self.skip_padding and src_packing.num_tokens and tgt_packing.num_tokens):
            raise ValueError("packed sentence pairs need skip_padding=True and at least one sentence pair")
        return self._packed_loss(src, tgt, tgt_out, src_packing, tgt_packing, label_smoothing)

    def generate(self, src: torch.Tensor, max_len=None, beam_size: int = 1) -> torch.Tensor:
        """Translate ``src`` (B, Ss): greedy (``beam_size=1``) or beam search.

        Returns (B, T) ids starting with ``bos_idx``, T <= ``max_len`` (default Ss + 50,
        counting the leading bos). No position after 0 holds ``pad_idx`` or ``bos_idx``
        except the ``pad_idx`` that fill a sequence after its ``eos_idx``. Beam search
        ranks hypotheses by their summed log-probability (no length normalisation).
        Runs in eval mode under ``torch.no_grad()`` and restores the training mode.
        See :mod:`fastformer.models.generation`.
        """
        return generate(self, src, max_len=max_len, beam_size=beam_size)
