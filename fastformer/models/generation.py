"""Greedy and beam-search decoding with an incremental key/value cache.

The encoder runs once. Every decoder layer keeps the keys and values of the target
positions decoded so far (its self-attention cache, one new position appended per
step) and the keys and values of the encoder memory (cross-attention, computed once),
so a step costs one position, not the whole prefix. The new query attends through
:func:`fastformer.ops.attention`, whose bottom-right causal alignment makes one query
against ``t`` cached keys correct.

Beam search keeps ``beam_size`` hypotheses per source, ranked by the **sum of token
log-probabilities** (no length normalisation). A finished hypothesis (it emitted eos)
stays in the beam with its score frozen and only pads appended; since extending a
hypothesis can only lower its score, the search for a source ends as soon as its best
hypothesis is finished, and that hypothesis is returned (trailing columns that are pad
in every row are dropped, so the output ends where its longest sequence ends, as with
greedy search). ``beam_size=1`` is greedy search, and the two give the same tokens.
"""
from typing import List, Optional

import torch

from ..nn.multihead_attention import KV


class IncrementalDecoder:
    """The decoder of a :class:`~fastformer.models.Seq2SeqTransformer` one position at a time."""

    def __init__(self, model, memory: torch.Tensor, src_key_padding_mask: torch.Tensor):
        self.model = model
        self.memory_kvs = model.decoder.memory_key_values(memory)  # per layer (B, H, Ss, D) x 2
        self.src_key_padding_mask = src_key_padding_mask
        self.past: Optional[List[KV]] = None
        self.position = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (N,) at the next position -> fp32 log-probabilities (N, V) of the one after."""
        m = self.model
        x = m.embed(m.tgt_embed, tokens[:, None], offset=self.position)  # (N, 1, d)
        h, self.past = m.decoder.forward_step(x, self.past, self.memory_kvs, self.src_key_padding_mask)
        self.position += 1
        logits = m.output_proj(h[:, 0]).float()  # (N, V)
        logp = torch.log_softmax(logits, dim=-1)
        logp[:, m.pad_idx] = float("-inf")  # never emitted: pad only fills after eos, bos only starts
        logp[:, m.bos_idx] = float("-inf")
        return logp

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the caches of rows ``index`` (N,) (beam search reordering)."""
        self.past = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.past]


def greedy_search(model, src: torch.Tensor, max_len: int) -> torch.Tensor:
    """Most likely next token at every step -> (B, T) ids, T <= max_len."""
    memory, src_kpm = model.encode(src)
    decoder = IncrementalDecoder(model, memory, src_kpm)
    B = src.shape[0]
    ys = torch.full((B, 1), model.bos_idx, dtype=torch.long, device=src.device)  # (B, 1)
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(max_len - 1):
        nxt = decoder.step(ys[:, -1]).argmax(dim=-1)  # (B,)
        nxt = nxt.masked_fill(finished, model.pad_idx)
        ys = torch.cat([ys, nxt[:, None]], dim=1)
        finished |= nxt == model.eos_idx
        if bool(finished.all()):
            break
    return ys


def beam_search(model, src: torch.Tensor, max_len: int, beam_size: int) -> torch.Tensor:
    """Beam search over summed log-probabilities -> (B, T) ids of each source's best hypothesis."""
    B, K = src.shape[0], beam_size
    device = src.device
    memory, src_kpm = model.encode(src)
    decoder = IncrementalDecoder(model, memory.repeat_interleave(K, dim=0), src_kpm.repeat_interleave(K, dim=0))
    tokens = torch.full((B * K, 1), model.bos_idx, dtype=torch.long, device=device)  # (B*K, t)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start as the same hypothesis: expand only the first
    finished = torch.zeros(B * K, dtype=torch.bool, device=device)
    base = torch.arange(B, device=device)[:, None] * K  # (B, 1) first row of each source
    for _ in range(max_len - 1):
        logp = decoder.step(tokens[:, -1])  # (B*K, V)
        V = logp.shape[1]
        logp[finished] = float("-inf")  # a finished hypothesis only appends pad, at no cost
        logp[finished, model.pad_idx] = 0.0
        cand = (scores.reshape(B * K, 1) + logp).reshape(B, K * V)
        scores, flat = cand.topk(K, dim=1)  # (B, K), best first
        rows = (base + flat // V).reshape(-1)  # (B*K,) the hypothesis each new beam extends
        nxt = (flat % V).reshape(-1)
        tokens = torch.cat([tokens.index_select(0, rows), nxt[:, None]], dim=1)
        finished = finished.index_select(0, rows) | (nxt == model.eos_idx)
        decoder.reorder(rows)
        if bool(finished.reshape(B, K)[:, 0].all()):
            break
    best = tokens.reshape(B, K, -1)[:, 0]  # (B, T)
    # The best hypothesis may have finished steps before the search ended: drop all-pad tail columns.
    used = (best != model.pad_idx).any(dim=0).nonzero()
    return best[:, : int(used.max()) + 1]


@torch.no_grad()
def generate(model, src: torch.Tensor, max_len: Optional[int] = None, beam_size: int = 1) -> torch.Tensor:
    """Decode ``src`` (B, Ss) with ``model`` (a Seq2SeqTransformer); see the module docstring.

    ``max_len`` bounds the returned length including the leading bos (default Ss + 50).
    The model runs in eval mode (no dropout); its training mode is restored afterwards.
    """
    model._check_tokens("src", src)
    if max_len is None:
        max_len = src.shape[1] + 50
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if src.shape[0] == 0:  # no sentence: (0, 1), the shape of a batch that stops after bos
        return torch.full((0, 1), model.bos_idx, dtype=torch.long, device=src.device)
    was_training = model.training
    model.eval()
    try:
        if beam_size == 1:
            return greedy_search(model, src, max_len)
        return beam_search(model, src, max_len, beam_size)
    finally:
        model.train(was_training)
