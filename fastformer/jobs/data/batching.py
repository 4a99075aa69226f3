"""Token-count batching: length-bucketed batches, reshuffled per epoch, deterministic by seed.

An epoch's batches depend only on ``(seed, epoch)``, so a data position ``(epoch, batch)``
is all a checkpoint needs to continue the exact order of an interrupted run.
"""
import random
from typing import Iterator, List, Sequence, Tuple

import torch

from .tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

Example = Tuple[List[int], List[int]]


def encode_pairs(pairs: Sequence[Tuple[str, str]], src_tok: Tokenizer, tgt_tok: Tokenizer,
                 max_len: int) -> List[Example]:
    """Token ids of each pair: source ``text </s>``, target ``<s> text </s>``, each cut to
    ``max_len`` ids (keeping the closing ``</s>``)."""
    if max_len < 3:
        raise ValueError(f"max_len must be at least 3, got {max_len}")
    out = []
    for src, tgt in pairs:
        s = src_tok.encode(src)[: max_len - 1] + [EOS_ID]
        t = [BOS_ID] + tgt_tok.encode(tgt)[: max_len - 2] + [EOS_ID]
        out.append((s, t))
    return out


def example_size(example: Example) -> int:
    """Padded tokens one example costs in a batch: the longer of its two sides."""
    return max(len(example[0]), len(example[1]))


class TokenBatches:
    """Batches of example indices holding at most ``batch_tokens`` padded tokens each
    (batch size x longest example in it; an example longer than that is a batch alone).

    Examples are sorted by size with seeded random tie-breaks, cut into batches greedily, and
    the batch order is shuffled; both depend only on ``(seed, epoch)``.
    """

    def __init__(self, sizes: Sequence[int], batch_tokens: int, seed: int = 0, shuffle: bool = True):
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be a positive number of tokens, got {batch_tokens}")
        if not len(sizes):
            raise ValueError("cannot batch an empty dataset")
        self.sizes = list(sizes)
        self.batch_tokens = int(batch_tokens)
        self.seed = seed
        self.shuffle = shuffle
        self._cache = {}

    def epoch(self, epoch: int) -> List[List[int]]:
        """The batches of epoch ``epoch`` (a list of lists of example indices)."""
        if epoch not in self._cache:
            self._cache = {epoch: self._make(epoch)}
        return self._cache[epoch]

    def _make(self, epoch: int) -> List[List[int]]:
        rng = random.Random(f"batches-{self.seed}-{epoch}")
        ties = [rng.random() for _ in self.sizes] if self.shuffle else list(range(len(self.sizes)))
        order = sorted(range(len(self.sizes)), key=lambda i: (self.sizes[i], ties[i]))
        batches, current, longest = [], [], 0
        for i in order:
            grown = max(longest, self.sizes[i])
            if current and grown * (len(current) + 1) > self.batch_tokens:
                batches.append(current)
                current, grown = [], self.sizes[i]
            current.append(i)
            longest = grown
        if current:
            batches.append(current)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __len__(self) -> int:
        return len(self.epoch(0))

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Tuple[int, int, List[int]]]:
        """``(epoch, batch_index, indices)`` from position ``(epoch, start)`` on, forever."""
        while True:
            batches = self.epoch(epoch)
            for b in range(start, len(batches)):
                yield epoch, b, batches[b]
            epoch, start = epoch + 1, 0


def collate(examples: Sequence[Example], indices: Sequence[int],
            pad_id: int = PAD_ID) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(src, tgt)`` int64 tensors ``(B, Ss)`` and ``(B, St)``, right-padded with ``pad_id``."""
    chosen = [examples[i] for i in indices]
    return pad_batch([s for s, _ in chosen], pad_id), pad_batch([t for _, t in chosen], pad_id)


def pad_batch(sequences: Sequence[List[int]], pad_id: int = PAD_ID) -> torch.Tensor:
    """Right-pad lists of ids into one int64 ``(B, max_len)`` tensor."""
    out = torch.full((len(sequences), max(1, max(len(s) for s in sequences))), pad_id, dtype=torch.long)
    for row, s in enumerate(sequences):
        if s:
            out[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
