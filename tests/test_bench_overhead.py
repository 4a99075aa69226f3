"""`python -m fastformer bench --ops overhead`: every op's host cost a call beside PyTorch's
composition of the same work (fastformer/jobs/bench/overhead.py). Speed is not asserted here;
what the table is made of is."""
import pytest
import torch

from fastformer import op_table
from fastformer.jobs import bench
from fastformer.jobs.bench import overhead


def test_every_op_of_the_table_has_a_case_with_and_without_dropout():
    cases = overhead.cases()
    ops = {c.op for c in cases}
    # attention_varlen has no PyTorch composition to compare with (its packed layout)
    assert ops == set(op_table.NAMES) - {"attention_varlen"}
    with_dropout = {c.op for c in cases if c.p > 0}
    assert with_dropout == {"attention", "add_layer_norm", "feed_forward", "embedding"}


@pytest.mark.parametrize("case", [c for c in overhead.cases() if c.p == 0], ids=lambda c: c.op)
def test_both_sides_compute_the_same_op(case):
    """The fused call and the composition agree (without dropout: the two sides draw other masks),
    so the table compares like work."""
    torch.manual_seed(0)
    leaves = case.leaves()
    got, want = case.fastformer(*leaves), case.torch(*leaves)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_records_and_table(monkeypatch):
    recs = overhead.bench(torch.device("cpu"), reps=3, ops=["add_layer_norm", "cross_entropy"])
    labels = {r["label"] for r in recs}
    assert labels == {"add_layer_norm p=0", "add_layer_norm p=0.1", "cross_entropy p=0"}
    for label in labels:
        ff = next(r for r in recs if r["label"] == label and r["provider"] == "fastformer")
        pt = next(r for r in recs if r["label"] == label and r["provider"] == "torch-eager")
        assert ff["reps"] == pt["reps"] == 3
        assert ff["ratio_vs_torch"] == pytest.approx(ff["host_us_per_call"] / pt["host_us_per_call"])
        assert ff["host_us_per_call"] > 0 and ff["q25_ms"] <= ff["median_ms"] <= ff["q75_ms"]
        assert ff["target"] == (0.7 if label.startswith("add_layer_norm") else 1.0)
    table = overhead.markdown(recs)
    assert table.count("\n") == 2 + 3  # header, rule, a row per case
    assert "| add_layer_norm | 0.1 |" in table


def test_the_cli_offers_it():
    assert overhead.OP in bench.ALL_OPS


def test_a_gpu_gets_a_reason_not_a_table():
    rec, = overhead.bench(torch.device("meta"))
    assert rec["status"].startswith("skipped: the host-overhead table runs on a CPU")


def test_the_command_writes_its_table_and_no_plot_of_it(tmp_path, monkeypatch):
    # `python -m fastformer bench --ops overhead` with plots on (the default): the overhead rows have no
    # sweep to plot, so the run writes its table and profile and no overhead.png (it used to fail there)
    one = [c for c in overhead.cases(["add_layer_norm"]) if c.p > 0]
    monkeypatch.setattr(overhead, "cases", lambda ops=None: one)
    bench.run(ops=[overhead.OP], out=str(tmp_path), plots=True, verbose=False, reps=2)
    results = (tmp_path / "results.md").read_text()
    assert "| add_layer_norm | 0.1 |" in results
    assert "## add_layer_norm, dropout 0.1" in (tmp_path / "overhead_profile.md").read_text()
    assert not (tmp_path / "overhead.png").exists()
