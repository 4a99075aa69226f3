"""`python -m fastformer bench --ops dropout_cost`: attention + add_layer_norm forward + backward
with dropout 0.1 against without (fastformer/jobs/bench/dropout_cost.py). Speed is not asserted
here; that the op runs, interleaves the two steps and reports its ratios is."""
import pytest
import torch

from fastformer import _ext
from fastformer.jobs import bench
from fastformer.jobs.bench import dropout_cost

pytestmark = pytest.mark.skipif(_ext.load_error() is not None, reason=str(_ext.load_error()))

TINY = (dict(B=1, H=2, S=16, D=8),)  # seconds, not the training shape's minutes on a busy machine


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(dropout_cost, "SHAPES", TINY)


def test_records_carry_both_medians_and_their_ratios(tiny):
    recs = dropout_cost.bench(torch.device("cpu"), reps=3)
    assert [r["dtype"] for r in recs] == ["fp32", "bf16"]
    for r in recs:
        assert r["status"] == "ok" and r["op"] == dropout_cost.OP and r["reps"] == 3
        assert r["shape"]["dropout_p"] == dropout_cost.P == 0.1
        assert r["median_ms"] > 0 and r["median_ms_no_dropout"] > 0
        assert r["ratio"] == pytest.approx(r["median_ms"] / r["median_ms_no_dropout"])
        assert r["cpu_ratio"] == pytest.approx(r["cpu_median_ms"] / r["cpu_median_ms_no_dropout"])
        assert len(r["ratios"]) == 3 and min(r["ratios"]) <= r["median_paired_ratio"] <= max(r["ratios"])
        assert r["target"] == 1.10 and r["threads"] == torch.get_num_threads()
    table = dropout_cost.markdown(recs)
    assert table.count("\n") == 2 + 2  # header, rule, a row per dtype
    assert "| fp32 |" in table and "| bf16 |" in table


def test_the_steps_alternate_and_the_dropout_step_drops(tiny, monkeypatch):
    # measure() runs the step with P and with 0 on every repetition, in alternating order, and the
    # P step's ops really get P (so the ratio compares dropout against none)
    from fastformer import ops

    seen = []
    for name in ("attention", "add_layer_norm"):
        real = getattr(ops, name)

        def spy(*args, real=real, name=name, **kw):
            p = kw["dropout_p"] if "dropout_p" in kw else args[-1]
            seen.append((name, p))
            return real(*args, **kw)

        monkeypatch.setattr(ops, name, spy)
    samples = dropout_cost.measure(TINY[0], torch.float32, reps=2, warmup=1)
    assert all(len(s) == 2 for s in samples.values())
    ps = [p for name, p in seen if name == "attention"]
    assert ps == [0.1, 0.0, 0.0, 0.1, 0.1, 0.0]  # 3 repetitions, the order flipping each time
    assert [p for name, p in seen if name == "add_layer_norm"] == ps


def test_the_cli_offers_it():
    assert dropout_cost.OP in bench.ALL_OPS


def test_a_gpu_gets_a_reason_not_a_table():
    rec, = dropout_cost.bench(torch.device("meta"))
    assert rec["status"].startswith("skipped: the dropout-cost table measures the CPU kernels")


def test_the_command_writes_its_table_and_no_plot_of_it(tiny, tmp_path):
    bench.run(ops=[dropout_cost.OP], out=str(tmp_path), plots=True, verbose=False, reps=2, dtypes=["fp32"],
              device="cpu")
    results = (tmp_path / "results.md").read_text()
    assert "### dropout's cost" in results and "| fp32 | " in results
    assert not (tmp_path / f"{dropout_cost.OP}.png").exists()
