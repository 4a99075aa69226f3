"""Token-count batching: length-bucketed batches, reshuffled per epoch, deterministic by seed;
or, packed (``--pack``), batches of sentence pairs in random order, several pairs a row.

An epoch's batches depend only on ``(seed, epoch)``, so a data position ``(epoch, batch)``
is all a checkpoint needs to continue the exact order of an interrupted run.
"""
import random
from typing import Iterator, List, Optional, Sequence, Tuple

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
    the batch order is shuffled; both depend only on ``(seed, epoch)``. ``packed``: for
    :func:`collate_packed`, examples in a seeded random order (no length bucketing) cut into
    batches of at most ``batch_tokens`` real tokens (the sum of their sizes).
    """

    def __init__(self, sizes: Sequence[int], batch_tokens: int, seed: int = 0, shuffle: bool = True,
                 packed: bool = False):
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be a positive number of tokens, got {batch_tokens}")
        if not len(sizes):
            raise ValueError("cannot batch an empty dataset")
        self.sizes = list(sizes)
        self.batch_tokens = int(batch_tokens)
        self.seed = seed
        self.shuffle = shuffle
        self.packed = packed
        self._cache = {}

    def epoch(self, epoch: int) -> List[List[int]]:
        """The batches of epoch ``epoch`` (a list of lists of example indices)."""
        if epoch not in self._cache:
            self._cache = {epoch: self._make(epoch)}
        return self._cache[epoch]

    def _make(self, epoch: int) -> List[List[int]]:
        rng = random.Random(f"batches-{self.seed}-{epoch}")
        if self.packed:
            return self._make_packed(rng)
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

    def _make_packed(self, rng: random.Random) -> List[List[int]]:
        order = list(range(len(self.sizes)))
        if self.shuffle:
            rng.shuffle(order)
        batches, current, tokens = [], [], 0
        for i in order:
            if current and tokens + self.sizes[i] > self.batch_tokens:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += self.sizes[i]
        if current:
            batches.append(current)
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


def collate_packed(examples: Sequence[Example], indices: Sequence[int],
                   pad_id: int = PAD_ID) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several pairs a row: ``(src, tgt, src_segments, tgt_segments)``, each ``(rows, width)``.

    First-fit decreasing into rows as wide as the batch's largest example (its
    :func:`example_size`): a pair goes to the first row where both its sides fit. A row's pairs
    sit one after the other on both sides, numbered 0, 1, ... in the segment ids (-1 on the
    padding), so the i-th source sentence of the batch (row-major) pairs with the i-th target
    sentence, as :meth:`fastformer.models.Seq2SeqTransformer.loss` reads them.
    """
    chosen = sorted((examples[i] for i in indices), key=example_size, reverse=True)
    width = max(example_size(e) for e in chosen)
    rows: List[List[Example]] = []
    used: List[List[int]] = []  # per row: tokens used on the source and the target side
    for s, t in chosen:
        row = next((r for r, (us, ut) in enumerate(used) if us + len(s) <= width and ut + len(t) <= width), None)
        if row is None:
            rows.append([])
            used.append([0, 0])
            row = len(rows) - 1
        rows[row].append((s, t))
        used[row][0] += len(s)
        used[row][1] += len(t)

    def side(k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        tokens = pad_batch([[x for pair in row for x in pair[k]] for row in rows], pad_id)
        segments = torch.full_like(tokens, -1)
        for r, row in enumerate(rows):
            at = 0
            for n, pair in enumerate(row):
                segments[r, at:at + len(pair[k])] = n
                at += len(pair[k])
        return tokens, segments
    (src, src_seg), (tgt, tgt_seg) = side(0), side(1)
    return src, tgt, src_seg, tgt_seg


def target_tokens(tgt: torch.Tensor, segments: Optional[torch.Tensor] = None, pad_id: int = PAD_ID) -> int:
    """Tokens a batch's loss predicts: each target sentence's tokens but its first."""
    if segments is None:
        return int((tgt[:, 1:] != pad_id).sum())
    real = tgt != pad_id
    starts = real.clone()
    starts[:, 1:] &= segments[:, 1:] != segments[:, :-1]  # a sentence's first token
    return int(real.sum() - starts.sum())
