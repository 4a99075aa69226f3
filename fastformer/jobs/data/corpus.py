"""Parallel corpora from disk: one TSV file (``source<TAB>target``) or two aligned files.

Loading is all or nothing: the whole file is read and checked before anything is returned,
and a malformed line raises :class:`CorpusError` naming the file and the 1-based line number.
Lines are UTF-8; a trailing ``\\n`` / ``\\r\\n`` is stripped. Blank lines are skipped (in the
two-file form only when both sides are blank, so the files stay aligned).
"""
import os
import random
from typing import List, Optional, Tuple

Pair = Tuple[str, str]


class CorpusError(ValueError):
    """A malformed corpus file; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str, line: int, problem: str):
        self.path, self.line, self.problem = path, line, problem
        super().__init__(f"{path}:{line}: {problem}")


def _read_lines(path: str) -> List[str]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    out = []
    for number, line in enumerate(lines, start=1):
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            out.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CorpusError(path, number, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return out


def load_tsv(path: str) -> List[Pair]:
    """``(source, target)`` pairs from a file of ``source<TAB>target`` lines."""
    pairs = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise CorpusError(path, number, f"expected 'source<TAB>target' (exactly one tab), found "
                                            f"{len(fields) - 1} tabs in {line[:60]!r}")
        src, tgt = fields[0].strip(), fields[1].strip()
        if not src or not tgt:
            side = "source" if not src else "target"
            raise CorpusError(path, number, f"empty {side} in {line[:60]!r}")
        pairs.append((src, tgt))
    if not pairs:
        raise CorpusError(path, 1, "the file holds no sentence pairs")
    return pairs


def load_parallel(src_path: str, tgt_path: str) -> List[Pair]:
    """``(source, target)`` pairs from two files with one sentence per line, line i to line i."""
    src_lines, tgt_lines = _read_lines(src_path), _read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        shorter, n = (src_path, len(src_lines)) if len(src_lines) < len(tgt_lines) else (tgt_path, len(tgt_lines))
        longer = tgt_path if shorter == src_path else src_path
        raise CorpusError(shorter, n + 1, f"the file ends after {n} lines but {longer} has "
                                          f"{max(len(src_lines), len(tgt_lines))}: the files are not aligned")
    pairs = []
    for number, (src, tgt) in enumerate(zip(src_lines, tgt_lines), start=1):
        src, tgt = src.strip(), tgt.strip()
        if not src and not tgt:
            continue
        if not src or not tgt:
            path = src_path if not src else tgt_path
            raise CorpusError(path, number, "blank line while the other file's line is not")
        if "\t" in src or "\t" in tgt:
            path = src_path if "\t" in src else tgt_path
            raise CorpusError(path, number, "a tab inside a sentence (did you mean a TSV file for --data?)")
        pairs.append((src, tgt))
    if not pairs:
        raise CorpusError(src_path, 1, "the files hold no sentence pairs")
    return pairs


def load_corpus(path: str, tgt_path: Optional[str] = None) -> List[Pair]:
    """:func:`load_tsv` of ``path``, or :func:`load_parallel` when ``tgt_path`` is given."""
    return load_tsv(path) if tgt_path is None else load_parallel(path, tgt_path)


def split_pairs(pairs: List[Pair], test_fraction: float, seed: int,
                max_test: int = 2000) -> Tuple[List[Pair], List[Pair]]:
    """Hold out a test split: a seeded sample of distinct sources, none of which (nor their pairs)
    occurs in the returned training split."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")

    sources = sorted({s for s, _ in pairs})
    if len(sources) < 2:
        raise ValueError("the corpus needs at least two distinct sources to hold out a test split")
    n_test = max(1, min(max_test, int(round(len(sources) * test_fraction)), len(sources) - 1))
    held = set(random.Random(f"split-{seed}").sample(sources, n_test))
    train = [p for p in pairs if p[0] not in held]
    test, seen = [], set()
    for p in pairs:
        if p[0] in held and p[0] not in seen:
            seen.add(p[0])
            test.append(p)
    return train, test
