"""``python -m fastformer bench --ops hf_bart_step``: Hugging Face BART's training step, plain
(``transformers``), ``torch.compile``d (``transformers-compile``) and after ``fastformer.convert``
(``transformers-fastformer``, and compiled: ``transformers-fastformer-compile``): its smoke size
runs, every provider's step computes plain transformers' loss, and without transformers every
provider says why it cannot run."""
import json
import sys

import pytest
import torch

from fastformer.jobs.bench import hf_step
from fastformer.jobs.cli import main

import hf_models as H

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: no thread start-up on 2 shared cores

NEEDS_TRANSFORMERS = "transformers is an optional dependency (pip install transformers)"
CPU = torch.device("cpu")


def test_batch_is_bart_shaped_with_a_quarter_padding():
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)  # the decoder inputs are BART's shift
    shape = hf_step.sweep("cpu", "full")[0]
    assert (shape["d_model"], shape["heads"], shape["layers"], shape["ffn"], shape["vocab"], shape["B"],
            shape["S"], shape["dropout"]) == (256, 4, 3, 1024, 8000, 32, 64, 0.1)
    batch = hf_step.make_batch(shape, CPU)
    assert all(t.shape == (32, 64) for t in batch.values())
    assert batch["attention_mask"].float().mean().item() == pytest.approx(0.75, abs=0.01)
    assert (batch["labels"] != hf_step.IGNORE).float().mean().item() == pytest.approx(0.75, abs=0.01)
    real = batch["attention_mask"].bool()
    assert (batch["input_ids"][~real] == hf_step.PAD).all() and (batch["input_ids"][real] != hf_step.PAD).all()
    assert hf_step.tokens(batch) == int(real.sum()) + int((batch["labels"] != hf_step.IGNORE).sum())


def test_without_transformers_every_provider_says_why(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    for provider in hf_step.PROVIDERS:
        reason = hf_step.why_not(provider, CPU)
        assert reason is not None and "transformers is not installed" in reason, (provider, reason)
    assert "unknown" in hf_step.why_not("transformers-magic", CPU)
    code = main(["bench", "--quick", "--sweep", "smoke", "--ops", "hf_bart_step", "--no-plots", "--threads", "1",
                 "--providers", *hf_step.PROVIDERS, "--out", str(tmp_path)])
    assert code == 0
    assert "skipped: transformers is not installed" in capsys.readouterr().out
    records = json.load(open(tmp_path / "results.json"))["results"]
    assert sorted(r["provider"] for r in records) == sorted(hf_step.PROVIDERS)
    assert all(r["status"].startswith("skipped: transformers is not installed") for r in records)


def test_smoke_size_runs_for_the_providers_that_can_run_here(tmp_path, capsys):
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    code = main(["bench", "--quick", "--sweep", "smoke", "--ops", "hf_bart_step", "--no-plots", "--threads", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    table = capsys.readouterr().out
    assert "### hf_bart_step" in table and "| transformers |" in table
    records = {r["provider"]: r for r in json.load(open(tmp_path / "results.json"))["results"]}
    # --quick leaves out the compiled providers (a minute of compilation each on a CPU) unless named
    runnable = [p for p in hf_step.PROVIDERS if p not in hf_step.COMPILED and hf_step.why_not(p, CPU) is None]
    assert "transformers" in runnable and sorted(records) == sorted(runnable)
    for name in runnable:
        r = records[name]
        assert r["status"] == "ok", r["status"]
        assert r["op"] == "hf_bart_step" and r["dtype"] == "fp32" and r["mode"] == "step"
        assert 0 < r["min_ms"] <= r["median_ms"] and r["tokens_per_s"] > 0 and r["throughput"] > 0
    assert records["transformers"]["speedup_vs_eager"] == pytest.approx(1.0)
    if "transformers-fastformer" in records:  # the ratio to plain transformers' step, from the same run
        fused = records["transformers-fastformer"]
        assert fused["speedup_vs_eager"] == pytest.approx(records["transformers"]["min_ms"] / fused["min_ms"])


def _losses(provider, shape, steps=3):
    step = hf_step.build_step(provider, shape, CPU, "fp32")
    return torch.stack([step.run().detach() for _ in range(steps)])


@pytest.mark.parametrize("smoothing", [0.1, 0.0], ids=["smoothed", "unsmoothed"])
@pytest.mark.parametrize("provider", [
    "transformers-fastformer",
    pytest.param("transformers-compile", marks=pytest.mark.slow),
    pytest.param("transformers-fastformer-compile", marks=pytest.mark.slow),
])
def test_every_provider_computes_plain_transformers_loss(provider, smoothing):
    """At dropout 0, from the same weights on the same batch: the same loss at the first step (the
    forward), and at the next two (the gradients and Adam's updates in between); with smoothing 0
    plain transformers' loss is the model's own (``labels=``)."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    reason = hf_step.why_not(provider, CPU)
    if reason is not None:
        pytest.skip(reason)
    shape = dict(hf_step.sweep("cpu", "smoke")[0], dropout=0.0, smoothing=smoothing)
    want = _losses("transformers", shape)
    got = _losses(provider, shape)
    assert torch.isfinite(want).all() and want[0] > want[-1]  # it trains
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fastformer_provider_runs_fastformers_ops(monkeypatch):
    """The converted model really fuses: its step calls fastformer's attention, layer ops and
    fused LM-head loss (BART's gelu is one fastformer's feed_forward has)."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    reason = hf_step.why_not("transformers-fastformer", CPU)
    if reason is not None:
        pytest.skip(reason)
    calls, attention = H.count_op_calls(monkeypatch)
    shape = hf_step.sweep("cpu", "smoke")[0]
    hf_step.build_step("transformers", shape, CPU).run()
    assert not calls  # plain transformers runs none of them
    step = hf_step.build_step("transformers-fastformer", shape, CPU)
    calls.clear()  # convert()'s probe of feed_forward's activations, when this process has not run it yet
    step.run()
    L = shape["layers"]
    assert calls.get("linear_cross_entropy") == 1
    # encoder self, decoder self and cross-attention, on the packed rows (the batch has padding both sides)
    assert calls["attention"] == 3 * L and all(a.get("varlen") for a in attention)
    assert calls["feed_forward"] == 2 * L and calls["add_layer_norm"] >= 5 * L


def test_gemm_flops_are_the_bart_models_matrix_products():
    """The TFLOP/s column's work: 3x (forward + both backward products) the forward products
    torch's flop counter sees in plain BART's loss step."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    from torch.utils.flop_counter import FlopCounterMode

    shape = dict(hf_step.sweep("cpu", "smoke")[0], dropout=0.0)
    model = hf_step.build_model(shape, CPU)
    model.set_attn_implementation("eager")  # attention's products as matmuls the counter sees (not SDPA's CPU kernel)
    batch = hf_step.make_batch(shape, CPU)
    with FlopCounterMode(display=False) as counter:
        hf_step.loss_fn("transformers", model, shape, batch)()
    assert hf_step.gemm_flops(shape, batch) == 3 * counter.get_total_flops()
