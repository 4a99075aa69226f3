"""The encoder-decoder Transformer of "Attention Is All You Need" on fastformer's fused modules."""
import math

import torch

from .. import nn as fnn
from .. import ops
from ..nn.packing import Packing
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

    ``skip_padding`` (default True): :meth:`loss` runs every position-wise part (embeddings,
    projections, feed-forward, add & LayerNorm, output projection and loss) on the real
    tokens only, packed into rows of their own (:mod:`fastformer.nn.packing`), and moves to
    the padded layout only around the attention op. Padding never reaches a real token, so
    the loss and the gradients are those of the padded computation (up to rounding); with
    dropout on, the dropout masks are drawn over the packed rows, so they are other (equally
    distributed) draws than the padded computation's, unless nothing is padded. Under
    ``torch.compile`` (the number of real tokens is data-dependent) and with
    ``skip_padding=False``, :meth:`loss` computes the padded positions too. :meth:`forward`
    always returns the logits of every position.
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
        self.embed_dropout = torch.nn.Dropout(dropout)
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
        if tokens.numel() == 0 or torch.compiler.is_compiling():
            return  # a value check would read the data (a graph break); the embedding checks it too
        vocab = table.num_embeddings
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name} token ids must be in [0, {vocab}) (the {name} vocabulary), got values "
                             f"in [{lo}, {hi}]")

    def embed(self, embedding: torch.nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``dropout(embedding(tokens) * sqrt(d_model) + PE[offset : offset + S])`` -> (B, S, d_model)."""
        x = embedding(tokens) * math.sqrt(self.d_model)  # (B, S, d)
        x = x + self.positional(tokens.shape[1], offset).to(x.dtype)
        return self.embed_dropout(x)

    def embed_packed(self, embedding: torch.nn.Embedding, tokens: torch.Tensor, packing: Packing) -> torch.Tensor:
        """:meth:`embed` of the real tokens only -> (n, d_model) rows, in ``packing``'s order."""
        x = embedding(packing.pack(tokens)) * math.sqrt(self.d_model)  # (n, d)
        x = x + self.positional(tokens.shape[1])[packing.positions].to(x.dtype)
        return self.embed_dropout(x)

    def encode(self, src: torch.Tensor):
        """Source ids (B, Ss) -> (memory (B, Ss, d_model), source padding mask (B, Ss) bool)."""
        self._check_tokens("src", src)
        src_kpm = padding_mask(src, self.pad_idx)
        memory = self.encoder(self.embed(self.src_embed, src), src_key_padding_mask=src_kpm, is_causal=False)
        return memory, src_kpm

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
        memory, src_kpm = self.encode(src)
        return self.output_proj(self.decode(tgt, memory, src_kpm))

    def loss(self, src: torch.Tensor, tgt: torch.Tensor, label_smoothing: float = 0.1) -> torch.Tensor:
        """Teacher-forced label-smoothed cross-entropy, mean over non-pad target tokens.

        The decoder reads ``tgt[:, :-1]`` and predicts ``tgt[:, 1:]``; targets equal to
        ``pad_idx`` are ignored. The logits are never materialised in full:
        :func:`fastformer.ops.linear_cross_entropy` fuses the output projection and the loss.
        """
        self._check_tokens("tgt", tgt)
        if tgt.shape[1] < 2:
            raise ValueError(f"tgt must hold at least 2 positions (input and target), got shape {tuple(tgt.shape)}")
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].long()
        if self.skip_padding and not torch.compiler.is_compiling():
            self._check_tokens("src", src)
            src_packing = Packing(padding_mask(src, self.pad_idx))
            tgt_packing = Packing(padding_mask(tgt_in, self.pad_idx))
            if src_packing.num_tokens and tgt_packing.num_tokens and tgt.shape[0] == src.shape[0]:
                return self._packed_loss(src, tgt_in, tgt_out, src_packing, tgt_packing, label_smoothing)
        memory, src_kpm = self.encode(src)
        hidden = self.decode(tgt_in, memory, src_kpm)  # (B, St - 1, d)
        return ops.linear_cross_entropy(hidden, self.output_proj.weight, tgt_out, linear_bias=self.output_proj.bias,
                                        label_smoothing=label_smoothing, ignore_index=self.pad_idx)

    def _packed_loss(self, src, tgt_in, tgt_out, src_packing: Packing, tgt_packing: Packing,
                     label_smoothing: float) -> torch.Tensor:
        """:meth:`loss` on the real tokens only (``skip_padding``)."""
        memory = self.encoder(self.embed_packed(self.src_embed, src, src_packing), packing=src_packing)  # (n_s, d)
        hidden = self.decoder(self.embed_packed(self.tgt_embed, tgt_in, tgt_packing), memory,
                              tgt_is_causal=True, packing=(tgt_packing, src_packing))  # (n_t, d)
        return ops.linear_cross_entropy(hidden, self.output_proj.weight, tgt_packing.pack(tgt_out),
                                        linear_bias=self.output_proj.bias, label_smoothing=label_smoothing,
                                        ignore_index=self.pad_idx)

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
