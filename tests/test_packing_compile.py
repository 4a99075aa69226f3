"""Seq2SeqTransformer under torch.compile: on the packed rows where dynamo may capture the number
of real tokens (``capture_dynamic_output_shape_ops``), in the padded layout otherwise; one graph
either way (``fullgraph=True`` raises at a break).

Most graphs run through a recording backend that runs dynamo's graph as it is (the kernels eager
code calls); one test goes through AOTAutograd (``aot_eager``: fake kernels with a data-dependent
row count, the joint graph and its partition), whose results must be the eager bits.
"""
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fastformer
from test_packed_sequences import make_model, packed_rows, pairs
from test_packing import TOL, loss_and_grads, model_and_batch
from utils import assert_close, kernel_backends

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

capture_token_counts = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


class Recorder:
    """A dynamo backend that keeps each graph's code (with its autograd bodies) and runs it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    def ops(self):
        """The fastformer ops the graphs call."""
        return {name for code in self.graphs for name in re.findall(r"fastformer\.(\w+)", code)}


def compiled_loss(model, backend):
    torch._dynamo.reset()
    return torch.compile(lambda s, t: model.loss(s, t, label_smoothing=0.1), fullgraph=True, backend=backend)


@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton"))
def test_compiled_loss_runs_on_the_packed_rows_with_the_eager_bits(backend):
    """Dropout on: the compiled graph draws the same Philox (seed, offset) pairs in the same order,
    over the same packed rows, so loss and every gradient are eager's bits (aot_eager runs the very
    kernels eager code runs)."""
    model, src, tgt = model_and_batch(dropout=0.1)
    with fastformer.use_backend(backend):
        want_loss, want = loss_and_grads(model, src, tgt, True, seed=3)
        with capture_token_counts:
            compiled = compiled_loss(model, "aot_eager")
            torch.manual_seed(3)
            loss = compiled(src, tgt)
            got = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.equal(loss.detach(), want_loss)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert torch.equal(a, b), f"grad {name} differs by {(a - b).abs().max().item():.3e}"


def test_the_packed_graph_calls_varlen_attention_and_takes_any_token_count():
    model, src, tgt = model_and_batch()
    recorder = Recorder()
    counter = CompileCounterWithBackend(recorder)
    with capture_token_counts:
        compiled = compiled_loss(model, counter)
        for cut_src, cut_tgt in ((None, None), (2, 5), (6, 1)):  # the same (B, S), other token counts
            s, t = src.clone(), tgt.clone()
            if cut_src is not None:
                s[0, cut_src:] = 0
                t[2, cut_tgt + 1:] = 0
            assert_close("compiled loss", compiled(s, t), model.loss(s, t, label_smoothing=0.1), *TOL["out"])
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for one batch shape"
    assert {"attention_varlen_fwd", "attention_varlen_bwd"} <= recorder.ops()
    assert not {"attention_fwd", "attention_bwd"} & recorder.ops(), "the packed graph computed padded attention"


def test_one_graph_takes_any_batch_shape_where_b_and_s_are_dynamic():
    """B and S marked dynamic (as dynamo's automatic dynamic shapes does after a second shape): one
    compile serves every (B, S), with eager's bits and dropout on. The ops' sizes that follow S
    (attention_varlen's max_seqlen, the embedding backward's num_positions) are SymInts in the
    schema; were one an int, dynamo would specialize S and raise at mark_dynamic."""
    model, _, _ = model_and_batch(dropout=0.1)
    counter = CompileCounterWithBackend("aot_eager")  # fake kernels with symbolic sizes too
    with capture_token_counts:
        compiled = compiled_loss(model, counter)
        for B, S in ((3, 7), (3, 12), (5, 9)):
            g = torch.Generator().manual_seed(S)
            src = torch.randint(3, 17, (B, S), generator=g)
            tgt = torch.randint(3, 19, (B, S + 1), generator=g)
            src[0, S - 2:], tgt[1, S - 3:], tgt[:, 0] = 0, 0, 1
            for t in (src, tgt):
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 1)
            want_loss, want = loss_and_grads(model, src, tgt, True, seed=B * S)
            torch.manual_seed(B * S)
            loss = compiled(src, tgt)
            got = torch.autograd.grad(loss, list(model.parameters()))
            assert torch.equal(loss.detach(), want_loss), (B, S)
            for (name, _), a, b in zip(model.named_parameters(), got, want):
                assert torch.equal(a, b), f"(B, S) = {(B, S)}: grad {name} differs by {(a - b).abs().max().item():.3e}"
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for three batch shapes"


def test_without_capture_the_compiled_loss_computes_the_padding_in_one_graph():
    model, src, tgt = model_and_batch()
    recorder = Recorder()
    want = model.loss(src, tgt, label_smoothing=0.1)
    assert_close("compiled loss", compiled_loss(model, recorder)(src, tgt), want, *TOL["out"])
    assert "attention_fwd" in recorder.ops() and "attention_varlen_fwd" not in recorder.ops()


def test_on_the_reference_backend_the_compiled_loss_stays_padded():
    """The reference attention_varlen steps through the sequences in Python, branching on each
    length: traced, those are data, so the model keeps the padded layout there."""
    model, src, tgt = model_and_batch()
    recorder = Recorder()
    with fastformer.use_backend("reference"), capture_token_counts:
        got = compiled_loss(model, recorder)(src, tgt)
        want = model.loss(src, tgt, label_smoothing=0.1)
    assert_close("compiled loss", got, want, *TOL["out"])
    code = "".join(recorder.graphs)
    assert "nonzero" not in code, "the reference backend's graph packed the rows"


def test_compiled_forward_and_encode_run_packed():
    model, src, tgt = model_and_batch()
    model.eval()
    recorder = Recorder()
    with torch.no_grad(), capture_token_counts:
        torch._dynamo.reset()
        logits = torch.compile(model, fullgraph=True, backend=recorder)(src, tgt)
        memory, kpm = torch.compile(model.encode, fullgraph=True, backend=recorder)(src)
        want_logits, (want_memory, want_kpm) = model(src, tgt), model.encode(src)
    assert_close("logits", logits, want_logits, *TOL["out"])
    assert_close("memory", memory, want_memory, *TOL["out"])
    assert torch.equal(kpm, want_kpm)
    assert len(recorder.graphs) == 2 and all("attention_varlen_fwd" in code for code in recorder.graphs)


def test_a_compiled_batch_without_source_tokens_matches_the_padded_loss():
    """Traced, the model cannot fall back to the padded layout for an empty side, as eager code
    does: the packed layers run on zero rows, and cross-attention over no key gives zeros."""
    model, src, tgt = model_and_batch()
    empty = torch.zeros_like(src)
    with capture_token_counts:
        got_loss = compiled_loss(model, Recorder())(empty, tgt)
    want_loss, _ = loss_and_grads(model, empty, tgt, False)
    assert_close("loss", got_loss.detach(), want_loss, *TOL["out"])


def test_packed_sentence_pairs_compile_with_the_eager_bits():
    """Several sentences a row (src_segments / tgt_segments): the sentence count is data too,
    captured as a size; the pairs' count check runs with the graph."""
    model = make_model(dropout=0.1)
    (src, tgt, src_seg, tgt_seg), _ = packed_rows(pairs(), rows=3)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    with capture_token_counts:
        compiled = torch.compile(lambda *a: model.loss(*a[:2], 0.1, src_segments=a[2], tgt_segments=a[3]),
                                 fullgraph=True, backend=counter)
        torch.manual_seed(5)
        loss = compiled(src, tgt, src_seg, tgt_seg)
        got = torch.autograd.grad(loss, list(model.parameters()))
        torch.manual_seed(5)
        want_loss = model.loss(src, tgt, 0.1, src_segments=src_seg, tgt_segments=tgt_seg)
        want = torch.autograd.grad(want_loss, list(model.parameters()))
        assert torch.equal(loss.detach(), want_loss.detach())
        for (name, _), a, b in zip(model.named_parameters(), got, want):
            assert torch.equal(a, b), f"grad {name} differs by {(a - b).abs().max().item():.3e}"
        bad = tgt_seg.clone()
        bad[0, :] = 0  # row 0's target sentences merged into one
        with pytest.raises(RuntimeError, match="must hold the same number of sentences"):
            compiled(src, tgt, src_seg, bad)
    assert counter.frame_count == 1


def test_packed_sentence_pairs_without_capture_are_a_clear_error():
    model = make_model()
    (src, tgt, src_seg, tgt_seg), _ = packed_rows(pairs(), rows=3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: model.loss(*a[:2], src_segments=a[2], tgt_segments=a[3]), fullgraph=True,
                             backend="eager")
    with pytest.raises(RuntimeError, match="capture_dynamic_output_shape_ops = True"):
        compiled(src, tgt, src_seg, tgt_seg)


def test_compiled_cross_attention_over_sentence_packings_checks_their_counts():
    """Packings with segment ids built inside the compiled code: their sentence counts are data,
    so the module checks them with the graph (eagerly: a ValueError before any kernel)."""
    from fastformer.nn import MultiheadAttention
    from fastformer.nn.packing import Packing

    torch.manual_seed(0)
    attn = MultiheadAttention(24, 3, batch_first=True)
    x, mem = torch.randn(2, 6, 24), torch.randn(2, 5, 24)
    q_seg = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    kv_seg = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])

    def cross(x, mem, q_seg, kv_seg):
        qp = Packing(torch.zeros(x.shape[:2], dtype=torch.bool), q_seg)
        kp = Packing(torch.zeros(mem.shape[:2], dtype=torch.bool), kv_seg)
        memp = kp.pack(mem)
        return attn(qp.pack(x), memp, memp, need_weights=False, packing=(qp, kp))[0]

    torch._dynamo.reset()
    with capture_token_counts:
        compiled = torch.compile(cross, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x, mem, q_seg, kv_seg), cross(x, mem, q_seg, kv_seg))
        merged = torch.zeros_like(kv_seg)  # one key sentence a row: 2 against 4 query sentences
        with pytest.raises(ValueError, match="same number of sequences"):
            cross(x, mem, q_seg, merged)
        with pytest.raises(RuntimeError, match="same number of sequences"):
            compiled(x, mem, q_seg, merged)
