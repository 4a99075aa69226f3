"""Tokenizers: characters, or byte-level BPE trained on the data with the ``tokenizers`` package.

Both reserve the same special ids, which the model's ``pad_idx``/``bos_idx``/``eos_idx`` use:
``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<unk>`` = 3. ``encode`` returns the ids of the
text alone (no ``<s>``/``</s>``); ``decode`` stops at ``</s>`` and drops the other specials.
A tokenizer is saved inside checkpoints as the plain dict of :meth:`Tokenizer.to_dict`.
"""
import abc
from typing import Dict, Iterable, List, Sequence

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
KINDS = ("char", "bpe")


class Tokenizer(abc.ABC):
    """The interface shared by :class:`CharTokenizer` and :class:`BPETokenizer`."""

    kind = ""
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, the four specials included."""

    @abc.abstractmethod
    def encode(self, text: str) -> List[int]:
        """The ids of ``text`` (no ``<s>``/``</s>`` added)."""

    @abc.abstractmethod
    def _decode(self, ids: List[int]) -> str:
        """Text of ids that hold no special id but ``<unk>``."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, read up to the first ``</s>``, without ``<pad>`` and ``<s>``."""
        kept = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                kept.append(i)
        return self._decode(kept)

    @abc.abstractmethod
    def to_dict(self) -> Dict:
        """A plain (picklable, JSON-able) description that :meth:`from_dict` rebuilds."""

    @staticmethod
    def from_dict(state: Dict) -> "Tokenizer":
        """Rebuild the tokenizer that :meth:`to_dict` described."""
        kind = state.get("kind")
        if kind == "char":
            return CharTokenizer(state["chars"])
        if kind == "bpe":
            return BPETokenizer.from_json(state["json"])
        raise ValueError(f"unknown tokenizer kind {kind!r} (expected one of {KINDS})")


class CharTokenizer(Tokenizer):
    """One id per character seen in training; an unseen character encodes as ``<unk>``."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        self.chars = list(chars)
        self._index = {c: i + len(SPECIALS) for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, texts: Iterable[str]) -> "CharTokenizer":
        seen = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str) -> List[int]:
        return [self._index.get(c, UNK_ID) for c in text]

    def _decode(self, ids: List[int]) -> str:
        n = len(SPECIALS)
        return "".join(self.chars[i - n] if n <= i < self.vocab_size else "\ufffd" for i in ids)

    def to_dict(self) -> Dict:
        return {"kind": "char", "chars": list(self.chars)}


class BPETokenizer(Tokenizer):
    """Byte-level BPE (lossless: every string encodes, and decodes back to itself)."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        for want, name in enumerate(SPECIALS):
            got = tokenizer.token_to_id(name)
            if got != want:
                raise ValueError(f"BPE vocabulary must map {name!r} to id {want}, it maps it to {got}")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2) -> "BPETokenizer":
        return cls(train_byte_level_bpe(texts, vocab_size, SPECIALS, min_frequency))

    @classmethod
    def from_json(cls, text: str) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(text))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def to_dict(self) -> Dict:
        return {"kind": "bpe", "json": self._tok.to_str()}


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, specials: Sequence[str], min_frequency: int = 2):
    """A ``tokenizers`` byte-level BPE trained on ``texts``, ``specials`` at ids 0, 1, ... in order
    (``"<unk>"`` among them)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(specials),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int = 8000) -> Tokenizer:
    """A ``kind`` (``"char"`` or ``"bpe"``) tokenizer trained on ``texts``."""
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size=vocab_size)
    raise ValueError(f"tokenizer must be one of {KINDS}, got {kind!r}")
