"""The data pipeline: built-in tasks, corpus loading, tokenizers, token batching."""
import datetime
import re

import pytest

from fastformer.jobs.data import (BOS_ID, EOS_ID, PAD_ID, UNK_ID, BPETokenizer, CharTokenizer, CorpusError,
                             TokenBatches, Tokenizer, collate, collate_packed, encode_pairs, load_corpus,
                             load_parallel, load_tsv, make_task, split_pairs, target_tokens)
from fastformer.jobs.data import tasks
from fastformer.jobs.data.batching import example_size


# -- built-in tasks -------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["dates", "numbers"])
def test_task_is_deterministic_by_seed(task):
    a = make_task(task, 300, 40, seed=7)
    b = make_task(task, 300, 40, seed=7)
    c = make_task(task, 300, 40, seed=8)
    assert a == b
    assert a != c
    train, test = a
    assert len(train) == 300 and len(test) == 40


@pytest.mark.parametrize("task", ["dates", "numbers"])
def test_task_test_split_never_overlaps_training(task):
    train, test = make_task(task, 5000, 300, seed=1)
    assert not {s for s, _ in train} & {s for s, _ in test}
    assert not {t for _, t in train} & {t for _, t in test}  # held-out values, not only held-out strings
    assert len({t for _, t in test}) == len(test)


def test_dates_targets_are_iso_dates_and_numeric_sources_agree():
    train, test = make_task("dates", 3000, 100, seed=2)
    checked = 0
    for src, tgt in train + test:
        date = datetime.date.fromisoformat(tgt)  # raises if the target is not an ISO date
        m = re.fullmatch(r"(\d{1,2})/(\d{1,2})/(\d{4})", src)
        if m:  # US order with slashes
            assert date == datetime.date(int(m[3]), int(m[1]), int(m[2])), src
            checked += 1
        m = re.fullmatch(r"(\d{1,2})\.(\d{1,2})\.(\d{4})", src)
        if m:  # European order with dots
            assert date == datetime.date(int(m[3]), int(m[2]), int(m[1])), src
            checked += 1
        m = re.fullmatch(r"(\d{4})/(\d{2})/(\d{2})", src)
        if m:
            assert date == datetime.date(int(m[1]), int(m[2]), int(m[3])), src
            checked += 1
        if str(date.year) in src:
            assert src.count(str(date.year)) == 1
    assert checked > 300
    forms = {re.sub(r"\d", "9", s) for s, _ in train}
    assert len(forms) > 200  # many surface forms, not a handful of templates


def test_date_words():
    assert tasks.ordinal_words(1) == "first"
    assert tasks.ordinal_words(12) == "twelfth"
    assert tasks.ordinal_words(21) == "twenty-first"
    assert tasks.ordinal_words(30) == "thirtieth"
    assert tasks.ordinal_suffix(11) == "11th" and tasks.ordinal_suffix(22) == "22nd" and tasks.ordinal_suffix(3) == "3rd"
    import random
    rng = random.Random(0)
    assert tasks.year_words(1999, rng) == "nineteen ninety-nine"
    assert tasks.year_words(1905, rng) == "nineteen oh five"
    assert tasks.year_words(1900, rng) == "nineteen hundred"
    assert tasks.year_words(2000, rng) == "two thousand"
    variants = {tasks.year_words(2005, random.Random(i)) for i in range(50)}
    assert variants == {"two thousand five", "two thousand and five", "twenty oh five"}


_UNITS = {w: i for i, w in enumerate(tasks._ONES)}
_UNITS.update({w: 10 * i for i, w in enumerate(tasks._TENS) if w})


def _parse_number(text: str) -> int:
    """An independent reader of English number words (the numbers task's sources)."""
    total, group = 0, 0
    for word in text.replace(",", " ").replace("-", " ").split():
        if word == "and":
            continue
        if word == "hundred":
            group *= 100
        elif word in ("thousand", "million"):
            total += group * (1000 if word == "thousand" else 1_000_000)
            group = 0
        else:
            group += _UNITS[word]
    return total + group


def test_numbers_sources_say_their_targets():
    train, test = make_task("numbers", 2000, 100, seed=3)
    for src, tgt in train + test:
        assert _parse_number(src) == int(tgt), (src, tgt)


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="task must be one of"):
        make_task("weather", 10, 2, seed=0)


# -- corpus files ---------------------------------------------------------------------------------
def test_load_tsv(tmp_path):
    p = tmp_path / "c.tsv"
    p.write_bytes("hello\tbonjour\r\n\nthank you\tmerci\n  a b \t c \n".encode())
    assert load_tsv(str(p)) == [("hello", "bonjour"), ("thank you", "merci"), ("a b", "c")]


@pytest.mark.parametrize("bad, line, what", [
    ("one\tun\ntwo deux\nthree\ttrois\n", 2, "exactly one tab"),
    ("one\tun\ntwo\tdeux\tzwei\n", 2, "exactly one tab"),
    ("one\tun\n\nthree\t \n", 3, "empty target"),
    ("\tun\n", 1, "empty source"),
])
def test_malformed_tsv_line_is_named(tmp_path, bad, line, what):
    p = tmp_path / "bad.tsv"
    p.write_text(bad)
    with pytest.raises(CorpusError, match=what) as info:
        load_tsv(str(p))
    assert info.value.line == line
    assert str(info.value).startswith(f"{p}:{line}:")


def test_invalid_utf8_is_named(tmp_path):
    p = tmp_path / "bad.tsv"
    p.write_bytes(b"ok\tfine\nbad \xff\tbyte\n")
    with pytest.raises(CorpusError, match="UTF-8") as info:
        load_tsv(str(p))
    assert info.value.line == 2


def test_load_two_files(tmp_path):
    src, tgt = tmp_path / "train.en", tmp_path / "train.fr"
    src.write_text("hello\n\nthank you\n")
    tgt.write_text("bonjour\n\nmerci\n")
    assert load_parallel(str(src), str(tgt)) == [("hello", "bonjour"), ("thank you", "merci")]
    assert load_corpus(str(src), str(tgt)) == load_parallel(str(src), str(tgt))


def test_two_files_misaligned_are_named(tmp_path):
    src, tgt = tmp_path / "a.src", tmp_path / "a.tgt"
    src.write_text("one\ntwo\nthree\n")
    tgt.write_text("un\ndeux\n")
    with pytest.raises(CorpusError, match="not aligned") as info:
        load_parallel(str(src), str(tgt))
    assert info.value.path == str(tgt) and info.value.line == 3
    tgt.write_text("un\n\ntrois\n")
    with pytest.raises(CorpusError, match="blank line") as info:
        load_parallel(str(src), str(tgt))
    assert info.value.path == str(tgt) and info.value.line == 2


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        load_tsv(str(tmp_path / "nope.tsv"))


def test_split_pairs_holds_out_whole_sources():
    pairs = [(f"s{i % 50}", f"t{i}") for i in range(200)]  # each source has 4 targets
    train, test = split_pairs(pairs, 0.1, seed=0)
    assert len(test) == 5
    assert not {s for s, _ in train} & {s for s, _ in test}
    assert split_pairs(pairs, 0.1, seed=0) == (train, test)


# -- tokenizers -----------------------------------------------------------------------------------
TEXTS = ["March 21st, 1999", "the twenty-first of March, nineteen ninety-nine", "3/21/1999",
         "Grüße aus Köln — ça va?", "  spaced  out\t", "1999-03-21"]


def test_char_round_trip_and_specials():
    tok = CharTokenizer.train(TEXTS)
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) == len(text) and min(ids) > UNK_ID
        assert tok.decode(ids) == text
        assert tok.decode([BOS_ID] + ids + [EOS_ID, 7, 8, PAD_ID]) == text  # stops at </s>
    assert tok.encode("§") == [UNK_ID]
    again = Tokenizer.from_dict(tok.to_dict())
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.vocab_size == tok.vocab_size


def test_bpe_round_trip_any_text():
    corpus = [s for s, _ in make_task("dates", 2000, 10, seed=0)[0]]
    tok = BPETokenizer.train(corpus, vocab_size=400)
    assert 256 < tok.vocab_size <= 400
    for text in TEXTS + ["日本語のテキスト", "emoji 🚀 ok", ""]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(i > UNK_ID for i in ids)
    assert len(tok.encode("the twenty-first of March")) < len("the twenty-first of March") / 2  # merges learnt
    again = Tokenizer.from_dict(tok.to_dict())
    assert again.encode(TEXTS[0]) == tok.encode(TEXTS[0])


# -- batching -------------------------------------------------------------------------------------
def _examples(n=300):
    train, _ = make_task("dates", n, 10, seed=4)
    src = CharTokenizer.train(s for s, _ in train)
    tgt = CharTokenizer.train(t for _, t in train)
    return encode_pairs(train, src, tgt, max_len=64)


def test_encode_pairs_adds_bos_eos_and_truncates():
    src = CharTokenizer.train(["abcdef"])
    (s, t), = encode_pairs([("abcdef", "abc")], src, src, max_len=4)
    assert s == src.encode("abc") + [EOS_ID]
    assert t == [BOS_ID] + src.encode("ab") + [EOS_ID]


def test_token_batches_cover_each_example_once_within_budget():
    ex = _examples()
    sizes = [example_size(e) for e in ex]
    batches = TokenBatches(sizes, batch_tokens=200, seed=0)
    for epoch in range(2):
        seen = sorted(i for b in batches.epoch(epoch) for i in b)
        assert seen == list(range(len(ex)))
        for b in batches.epoch(epoch):
            assert len(b) == 1 or len(b) * max(sizes[i] for i in b) <= 200
    assert batches.epoch(0) != batches.epoch(1)  # reshuffled each epoch
    assert TokenBatches(sizes, 200, seed=0).epoch(1) == batches.epoch(1)  # ... deterministically
    stream = batches.iterate(0, len(batches.epoch(0)) - 1)
    assert [next(stream)[:2] for _ in range(2)] == [(0, len(batches.epoch(0)) - 1), (1, 0)]


def test_collate_pads():
    ex = [([5, 6, EOS_ID], [BOS_ID, 7, EOS_ID]), ([5, EOS_ID], [BOS_ID, 7, 8, 9, EOS_ID])]
    src, tgt = collate(ex, [0, 1])
    assert src.tolist() == [[5, 6, EOS_ID], [5, EOS_ID, PAD_ID]]
    assert tgt.tolist() == [[BOS_ID, 7, EOS_ID, PAD_ID, PAD_ID], [BOS_ID, 7, 8, 9, EOS_ID]]


def test_packed_batches_cover_each_example_once_in_random_order():
    ex = _examples()
    sizes = [example_size(e) for e in ex]
    batches = TokenBatches(sizes, batch_tokens=60, seed=0, packed=True)
    for epoch in range(2):
        seen = sorted(i for b in batches.epoch(epoch) for i in b)
        assert seen == list(range(len(ex)))
        for b in batches.epoch(epoch):
            assert len(b) == 1 or sum(sizes[i] for i in b) <= 60  # real tokens, not padded ones
    assert batches.epoch(0) != batches.epoch(1)
    assert TokenBatches(sizes, 60, seed=0, packed=True).epoch(1) == batches.epoch(1)
    spread = max(max(sizes[i] for i in b) - min(sizes[i] for i in b) for b in batches.epoch(0))
    assert spread >= (max(sizes) - min(sizes)) // 2  # no length bucketing: short and long pairs mix


def test_collate_packed_puts_whole_pairs_in_rows_and_numbers_them():
    ex = [([5, 6, EOS_ID], [BOS_ID, 7, EOS_ID]), ([5, EOS_ID], [BOS_ID, 7, 8, 9, EOS_ID]),
          ([4, 4, 4, 4, 4, EOS_ID], [BOS_ID, 3, EOS_ID]), ([9, EOS_ID], [BOS_ID, EOS_ID])]
    src, tgt, src_seg, tgt_seg = collate_packed(ex, [0, 1, 2, 3])
    assert src.shape[1] <= 6 and tgt.shape[1] <= 6 and src.shape[0] < len(ex)  # rows as wide as the largest pair
    pairs = []
    for r in range(src.shape[0]):  # row-major: the i-th source sentence pairs with the i-th target one
        for n in range(int(src_seg[r].max()) + 1):
            pairs.append((src[r][src_seg[r] == n].tolist(), tgt[r][tgt_seg[r] == n].tolist()))
    assert sorted(pairs) == sorted(ex)
    assert ((src == PAD_ID) == (src_seg == -1)).all() and ((tgt == PAD_ID) == (tgt_seg == -1)).all()
    assert target_tokens(tgt, tgt_seg) == sum(len(t) - 1 for _, t in ex)
    padded_src, padded_tgt = collate(ex, [0, 1, 2, 3])
    assert target_tokens(padded_tgt) == sum(len(t) - 1 for _, t in ex)
