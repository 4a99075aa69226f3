"""``auto`` on a GPU never takes a backend measured slower than PyTorch's composition when the next
one was measured faster (fastformer/backends/measured.py: the rule, the table, its source).

The table is checked against the committed results (benchmarks/results/nvidia-h200/results.json):
re-derived, it must equal the committed block. The choice is checked on a declared GPU
(``fake_gpu`` from test_backends_cache.py: nothing runs), with the committed table and with fake
ones."""
import dataclasses
import json
import os

import pytest
import torch

from fastformer import backends
from fastformer.backends import measured
from test_backends_cache import CUDA, declare_gpu, fake_gpu  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, measured.RESULTS)
BF16 = torch.bfloat16


@pytest.fixture
def table(monkeypatch):
    """Install a table for this test: ``table(*classes)``; the cache is cleared on both sides."""
    def install(*classes):
        monkeypatch.setattr(measured, "TABLE", tuple(classes))
        backends.clear_cache()
    yield install
    monkeypatch.undo()
    backends.clear_cache()


def slower(op="add_layer_norm", dtype="bf16", label="N1000 C512", composition=1.0, **ms):
    """A fake class: hidden size 256-724 with dropout, rows 500-2000, where each backend of ``ms`` took that."""
    where = (("rows", 500, 2000), ("hidden_size", 256, 724), ("dropout", 1, 1))
    return measured.Measured(op, dtype, where, tuple(sorted(ms.items())), composition, label, "fake-gpu")


IN_CLASS = dict(rows=1000, hidden_size=512, dropout=1)


# ------------------------------------------------------------------------------------ the table


def test_the_committed_table_is_derived_from_the_committed_results():
    assert measured.derive_file(RESULTS) == measured.TABLE
    with open(measured.__file__) as f:
        assert measured.render(measured.TABLE) in f.read()


def test_each_class_holds_its_measured_shape_and_times():
    with open(RESULTS) as f:
        results = json.load(f)
    assert measured.TABLE, "the H200 results have classes where a backend was slower"
    for m in measured.TABLE:
        rows = [r for r in results["results"] if (r["op"], r["label"], r["dtype"]) == (m.op, m.label, m.dtype)]
        assert m.holds(measured.FACTS_OF[m.op](rows[0]["shape"])), m

        def total(provider):
            return round(sum(r[measured.STATISTIC] for r in rows if r["provider"] == provider), 4)
        assert m.composition_ms == total("torch-eager")
        for backend, ms in m.ms:
            assert ms == total("fastformer-" + backend)
        assert any(m.slower(b) for b, _ in m.ms)


def test_a_measured_size_stands_for_its_octave():
    assert measured._ranges([512, 2048]) == {512: (256, 1024), 2048: (1025, 4096)}
    assert measured._ranges([64, 128]) == {64: (32, 90), 128: (91, 256)}
    assert measured._ranges([32768]) == {32768: (16384, 65536)}


def test_derive_renders_and_writes_what_it_reads(tmp_path):
    with open(RESULTS) as f:
        results = json.load(f)
    table = measured.derive(results, "some-gpu")
    assert {m.machine for m in table} == {"some-gpu"}
    copy = tmp_path / "measured.py"
    with open(measured.__file__) as f:
        copy.write_text(f.read())
    measured.write(table[:2], str(copy))
    text = copy.read_text()
    assert measured.render(table[:2]) in text and measured.render(measured.TABLE) not in text
    namespace = {"__file__": str(copy), "__name__": "measured_copy"}
    exec(compile(text, str(copy), "exec"), namespace)
    assert [dataclasses.astuple(m) for m in namespace["TABLE"]] == [dataclasses.astuple(m) for m in table[:2]]


# ------------------------------------------------------------------------------------ auto's choice


def test_auto_passes_over_a_slower_backend_for_a_faster_one(fake_gpu, table):
    table(slower(triton=2.0, cuda=0.5))
    assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "cuda"
    why = backends.explain("add_layer_norm", CUDA, BF16, auto=True, **IN_CLASS)
    assert why == {"triton": "measured slower than PyTorch's composition on fake-gpu at N1000 C512 (bf16, forward + "
                             "backward): 2 ms vs 1 ms; cuda took 0.5 ms there",
                   "cuda": None}
    assert backends.explain("add_layer_norm", CUDA, BF16, **IN_CLASS)["triton"] is None  # forced: it runs
    with backends.use_backend("triton"):
        assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "triton"


@pytest.mark.parametrize("facts", [dict(IN_CLASS, hidden_size=725), dict(IN_CLASS, rows=499), dict(IN_CLASS, dropout=0),
                                   dict(hidden_size=512, rows=1000)],  # a fact not passed: in no class naming it
                         ids=["hidden-size-above", "rows-below", "no-dropout", "dropout-not-passed"])
def test_auto_keeps_the_backend_outside_the_class(fake_gpu, table, facts):
    table(slower(triton=2.0, cuda=0.5))
    assert backends.resolve("add_layer_norm", CUDA, BF16, **facts) == "triton"
    assert backends.explain("add_layer_norm", CUDA, BF16, auto=True, **facts) == {"triton": None}


def test_other_ops_dtypes_and_the_cpu_are_unaffected(fake_gpu, table):
    table(slower(triton=2.0, cuda=0.5))
    assert backends.resolve("add_layer_norm", CUDA, torch.float16, **IN_CLASS) == "triton"
    assert backends.resolve("feed_forward", CUDA, BF16, **IN_CLASS) == "triton"
    cpu = torch.device("cpu")
    assert backends.explain("add_layer_norm", cpu, torch.float32, auto=True, **IN_CLASS) == \
        backends.explain("add_layer_norm", cpu, torch.float32, auto=True)


@pytest.mark.parametrize("ms", [dict(triton=2.0, cuda=3.0), dict(triton=2.0)],
                         ids=["cuda-slower-still", "cuda-not-measured"])
def test_auto_keeps_a_slower_backend_when_the_next_is_not_measured_faster(fake_gpu, table, ms):
    table(slower(**ms))
    assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "triton"


def test_never_to_the_reference_on_pytorchs_numbers(fake_gpu, table, monkeypatch):
    """cuda slower than PyTorch, triton unavailable: the reference is not PyTorch's composition
    (it materialises what the fused torch functions do not), so cuda stays unless the reference
    itself was measured faster."""
    declare_gpu(monkeypatch, names=("triton",), needs=(backends.Requirement("a GPU", lambda: "no GPU (test)"),))
    table(slower(cuda=2.0))
    assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "cuda"
    table(slower(cuda=2.0, reference=1.5))
    assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "reference"
    why = backends.explain("add_layer_norm", CUDA, BF16, auto=True, **IN_CLASS)
    assert why["triton"] == "no GPU (test)" and why["reference"] is None
    assert why["cuda"].endswith("2 ms vs 1 ms; reference took 1.5 ms there")


def test_the_cache_keeps_the_tables_answer(fake_gpu, table, monkeypatch):
    table()
    assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "triton"
    table(slower(triton=2.0, cuda=0.5))  # a new table clears the cache (the fixture does)
    calls = []
    real = backends._choose
    monkeypatch.setattr(backends, "_choose", lambda *a, **k: calls.append(a) or real(*a, **k))
    for _ in range(3):
        assert backends.resolve("add_layer_norm", CUDA, BF16, **IN_CLASS) == "cuda"
    assert len(calls) == 1
    names = ("rows", "hidden_size", "dropout")
    assert backends.select_cached("add_layer_norm", CUDA, BF16, None, names, (1000, 512, True)).name == "cuda"
    assert len(calls) == 1


# ------------------------------------------------------------------------------------ the H200 table


H200_ALN = dict(rows=32768, dropout=True)
H200_ATTENTION = dict(q_len=512, k_len=512, batch_heads=128, causal=False, dropout=False, masked=False)


@pytest.mark.parametrize("op, facts, want", [
    ("add_layer_norm", dict(H200_ALN, hidden_size=512), "cuda"),     # triton 0.65 ms, eager 0.45, cuda 0.37
    ("add_layer_norm", dict(H200_ALN, hidden_size=1024), "cuda"),    # triton 0.69, eager 0.62, cuda 0.48
    ("add_layer_norm", dict(H200_ALN, hidden_size=4096), "triton"),  # triton faster than eager
    ("add_layer_norm", dict(hidden_size=512), "triton"),             # what the op passes today
    ("attention", dict(H200_ATTENTION, head_dim=64), "cuda"),        # S 512: triton 1.29 ms, cuda 0.56
    ("attention", dict(H200_ATTENTION, head_dim=128, q_len=2048, k_len=2048), "triton"),  # cuda slower still
    ("attention", dict(H200_ATTENTION, head_dim=128, q_len=2048, k_len=2048, dropout=True), "cuda"),
    ("attention", dict(head_dim=64), "triton"),                      # what the op passes today
])
def test_the_h200_table_on_a_gpu(fake_gpu, op, facts, want):
    backends.clear_cache()
    assert backends.resolve(op, CUDA, BF16, **facts) == want
    answers = backends.explain(op, CUDA, BF16, auto=True, **facts)
    assert list(answers)[-1] == want
    if want != "triton":
        assert answers["triton"].startswith("measured slower than PyTorch's composition on nvidia-h200 at B8 H16" if
                                            op == "attention" else
                                            "measured slower than PyTorch's composition on nvidia-h200 at N32768")
