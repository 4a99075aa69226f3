"""Packed rows end to end: Packing's sequence lengths and positions (one sequence a row, or
several sentences a row with segment_ids), the model running attention on the packed rows
(fastformer.ops.attention_varlen, no padded position anywhere), packed sentence pairs whose loss
and gradients equal one pair a row, and generation unchanged."""
import pytest
import torch

import fastformer
from fastformer import ops
from fastformer.nn.packing import Packing
from seq2seq_models import perturbed_model
from utils import assert_close, kernel_backends

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

BACKENDS = ["reference"] + kernel_backends("cpu")
TOL = {"out": (2e-5, 1e-4), "grad": (5e-5, 5e-4)}
PAD, BOS, EOS = 0, 1, 2


# ----------------------------------------------------------------------------------- Packing
def test_one_sequence_a_row_empty_rows_included():
    mask = torch.tensor([[False, False, True], [True, True, True], [False, True, False]])  # holes allowed
    p = Packing(mask)
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 2, 2, 4]
    assert p.num_sequences == 3 and p.max_seqlen == 3  # the row width, a bound read from no data
    assert p.positions.tolist() == [0, 1, 0, 2]  # the padded layout's columns


def test_segments_split_rows_into_sentences_and_restart_positions():
    mask = torch.tensor([[False] * 5 + [True], [False] * 6, [True] * 6])
    seg = torch.tensor([[0, 0, 1, 1, 1, 9], [4, 5, 5, 5, 5, 7], [0] * 6])
    p = Packing(mask, seg)
    assert p.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 11]  # rows: [2, 3], [1, 4, 1], none
    assert p.num_sequences == 5 and p.max_seqlen == 6  # the row width, not the longest sentence
    assert p.positions.tolist() == [0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("bad", [torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long), "ids",
                                 torch.zeros(2, 3, dtype=torch.bool)])
def test_bad_segment_ids_are_a_clear_error(bad):
    with pytest.raises(ValueError, match="segment_ids must be an integer tensor of padding_mask's shape"):
        Packing(torch.zeros(2, 3, dtype=torch.bool), bad)


# -------------------------------------------------------------------------------- the model
def make_model(dropout=0.0, norm_first=False):
    return perturbed_model(23, 29, d_model=24, nhead=3, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=40, dropout=dropout, norm_first=norm_first)


def pairs(n=7, seed=2):
    """n sentence pairs: sources of 1..6 tokens, targets BOS .. EOS of 3..7 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = torch.randint(3, 23, (int(torch.randint(1, 7, (), generator=g)),), generator=g)
        t = torch.randint(3, 29, (int(torch.randint(1, 6, (), generator=g)),), generator=g)
        out.append((s, torch.cat([torch.tensor([BOS]), t, torch.tensor([EOS])])))
    return out


def one_pair_a_row(ps):
    src = torch.nn.utils.rnn.pad_sequence([s for s, _ in ps], batch_first=True, padding_value=PAD)
    tgt = torch.nn.utils.rnn.pad_sequence([t for _, t in ps], batch_first=True, padding_value=PAD)
    return src, tgt


def packed_rows(ps, rows):
    """Pairs dealt round-robin into ``rows`` rows, concatenated, segment ids 0, 1, ... per row."""
    src_rows, tgt_rows, src_seg, tgt_seg = ([[] for _ in range(rows)] for _ in range(4))
    for i, (s, t) in enumerate(ps):
        r, sentence = i % rows, i // rows  # the sentence's number within its row
        src_rows[r] += s.tolist()
        tgt_rows[r] += t.tolist()
        src_seg[r] += [sentence] * len(s)
        tgt_seg[r] += [sentence] * len(t)
    # a row-major walk must meet the pairs in the same order in src and tgt: order them by row
    order = sorted(range(len(ps)), key=lambda i: (i % rows, i))

    def grid(lists, fill):
        width = max(len(x) for x in lists) + 1  # some padding at the end of every row
        return torch.tensor([x + [fill] * (width - len(x)) for x in lists])
    return (grid(src_rows, PAD), grid(tgt_rows, PAD), grid(src_seg, -1), grid(tgt_seg, -1)), order


def loss_and_grads(model, fn, seed=0):
    torch.manual_seed(seed)
    loss = fn()
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_packed_pairs_have_the_loss_and_gradients_of_one_pair_a_row(backend, norm_first):
    model, ps = make_model(norm_first=norm_first), pairs()
    (src, tgt, src_seg, tgt_seg), order = packed_rows(ps, rows=3)
    assert src.shape[0] == 3 and tgt.shape[0] == 3
    src1, tgt1 = one_pair_a_row([ps[i] for i in order])
    with fastformer.use_backend(backend):
        got_loss, got = loss_and_grads(model, lambda: model.loss(src, tgt, 0.1, src_segments=src_seg,
                                                                 tgt_segments=tgt_seg))
        model.skip_padding = False  # the plain padded computation as the oracle
        want_loss, want = loss_and_grads(model, lambda: model.loss(src1, tgt1, 0.1))
    assert_close("loss", got_loss, want_loss, *TOL["out"])
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert_close(f"grad {name}", a, b, *TOL["grad"])


def test_packed_pairs_are_checked():
    model = make_model()
    (src, tgt, src_seg, tgt_seg), _ = packed_rows(pairs(), rows=3)
    with pytest.raises(ValueError, match="give src_segments and tgt_segments together"):
        model.loss(src, tgt, src_segments=src_seg)
    with pytest.raises(ValueError, match="tgt_segments must be an integer tensor of the tokens' shape"):
        model.loss(src, tgt, src_segments=src_seg, tgt_segments=tgt_seg[:, :-1])
    bad = tgt_seg.clone()
    bad[0, :] = 0  # row 0's target sentences merged into one: the sentence counts differ
    with pytest.raises(ValueError, match="must hold the same number of sentences"):
        model.loss(src, tgt, src_segments=src_seg, tgt_segments=bad)
    model.skip_padding = False
    with pytest.raises(ValueError, match="need skip_padding=True"):
        model.loss(src, tgt, src_segments=src_seg, tgt_segments=tgt_seg)


def _record_attention(monkeypatch):
    calls = []
    for name in ("attention_varlen", "attention_varlen_qkvpacked", "attention_varlen_kvpacked"):  # packed rows
        monkeypatch.setattr(ops, name, lambda q, *a, _op=getattr(ops, name), **k: calls.append(("varlen", q.shape[0]))
                            or _op(q, *a, **k))
    padded = ops.attention
    monkeypatch.setattr(ops, "attention", lambda q, *a, **k: calls.append(("padded", q.shape)) or padded(q, *a, **k))
    return calls


def test_no_padded_position_reaches_attention(monkeypatch):
    """loss, forward and encode: every attention call is the varlen op on the real rows only."""
    model = make_model()
    src, tgt = one_pair_a_row(pairs())
    calls = _record_attention(monkeypatch)
    n_src, n_tgt_in = int((src != PAD).sum()), int((tgt[:, :-1] != PAD).sum())
    model.loss(src, tgt)
    assert calls == [("varlen", n_src)] * 2 + [("varlen", n_tgt_in)] * 4  # 2 encoder; 2 x (self, cross)
    calls.clear()
    logits = model(src, tgt)
    assert {c[0] for c in calls} == {"varlen"} and len(calls) == 6
    assert not logits[tgt == PAD].any()
    calls.clear()
    memory, kpm = model.encode(src)
    assert calls == [("varlen", n_src)] * 2 and not memory[kpm].any()


@pytest.mark.parametrize("beam_size", [1, 3])
def test_generation_is_unchanged_by_skipping_padding(beam_size):
    model = make_model()
    src, _ = one_pair_a_row(pairs())
    got = model.generate(src, max_len=9, beam_size=beam_size)
    model.skip_padding = False
    assert torch.equal(got, model.generate(src, max_len=9, beam_size=beam_size))
