"""``python -m fastformer bench --ops hf_t5_step``: Hugging Face T5 v1.1's training step, plain
(``transformers``), ``torch.compile``d and after ``fastformer.convert``: the model is the issue's
layout, the batch T5-shaped with a quarter padding, every provider's first step computes plain
transformers' label-smoothed loss and its gradients, the smoke size runs from the command line,
and an unknown provider is refused by name."""
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from fastformer.jobs.bench import hf_step
from fastformer.jobs.cli import main

import hf_models as H

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes: no thread start-up on 2 shared cores

NEEDS_TRANSFORMERS = "transformers is an optional dependency (pip install transformers)"
CPU = torch.device("cpu")
T5 = hf_step.T5


def _smoke(**overrides):
    return dict(hf_step.sweep("cpu", "smoke")[0], **overrides)


def test_model_is_the_issues_t5_v1_1_layout():
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    shape = hf_step.sweep("cpu", "full")[0]
    model = hf_step.build_model(shape, CPU, family=T5)
    c = model.config
    assert type(model).__name__ == "T5ForConditionalGeneration" and model.training
    assert (c.d_model, c.num_heads, c.d_kv, c.num_layers, c.num_decoder_layers, c.d_ff, c.vocab_size) == \
        (256, 4, 64, 3, 3, 1024, 8000)
    assert (c.feed_forward_proj, c.dropout_rate, c.relative_attention_num_buckets,
            c.relative_attention_max_distance) == ("gated-gelu", 0.1, 32, 128)
    assert (c.pad_token_id, c.eos_token_id, c.decoder_start_token_id) == (0, 1, 0)
    assert (shape["B"], shape["S"], shape["smoothing"]) == (32, 64, 0.1)
    # v1.1: untied head (no d_model**-0.5 rescale), a gated feed-forward without biases
    assert model.lm_head.weight is not model.shared.weight
    ff = model.encoder.block[0].layer[-1].DenseReluDense
    assert [tuple(ff.wi_0.weight.shape), tuple(ff.wi_1.weight.shape), tuple(ff.wo.weight.shape)] == \
        [(1024, 256), (1024, 256), (256, 1024)]
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert hf_step.label(shape, T5).startswith("T5 v1.1 d256 h4 L3+3 ffn1024 V8000 B32x64")


def test_batch_is_t5_shaped_with_a_quarter_padding():
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)  # the decoder inputs are T5's own shift
    shape = hf_step.sweep("cpu", "full")[0]
    batch = hf_step.make_batch(shape, CPU, family=T5)
    assert all(t.shape == (32, 64) for t in batch.values())
    real, target = batch["attention_mask"].bool(), batch["labels"] != hf_step.IGNORE
    assert real.float().mean().item() == pytest.approx(0.75, abs=0.01)
    assert target.float().mean().item() == pytest.approx(0.75, abs=0.01)
    ids, labels = batch["input_ids"], batch["labels"]
    assert (ids[~real] == 0).all() and (ids[real] != 0).all()  # pad 0, right padding
    last = real.sum(1) - 1
    assert (ids.gather(1, last[:, None]) == 1).all() and (ids[:, 0] >= 3).all()  # ... </s>, no <s>
    assert (labels.gather(1, (target.sum(1) - 1)[:, None]) == 1).all()
    # the decoder starts at the pad id and reads the labels one step late, -100 as padding
    shifted = torch.cat([torch.zeros(32, 1, dtype=torch.long), labels[:, :-1]], 1)
    assert torch.equal(batch["decoder_input_ids"], shifted.masked_fill(shifted == -100, 0))
    assert hf_step.tokens(batch) == int(real.sum() + target.sum())


def _plain_smoothed(shape):
    """Plain transformers' first-step loss and gradients: its logits, F.cross_entropy with label
    smoothing over the non-pad targets; and the model's own (unsmoothed) loss."""
    model = hf_step.build_model(shape, CPU, family=T5)
    batch = hf_step.make_batch(shape, CPU, family=T5)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    logits = model(**inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                           label_smoothing=shape["smoothing"])
    loss.backward()
    own = model(**inputs, labels=batch["labels"]).loss.detach()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, own


# The compiled providers wrap this same loss in hf_step.loss_fn's torch.compile, which
# test_hf_bench checks for BART; a converted T5 under torch.compile is test_hf_compile's: compiling
# T5 twice more here would cost minutes of the suite for no new path.
@pytest.mark.parametrize("provider", ["transformers", "transformers-fastformer"])
def test_first_step_computes_plain_transformers_loss_and_gradients(provider):
    """At dropout 0, the same weights and batch: the provider's loss (the converted model's fused
    linear_cross_entropy) and every gradient are plain transformers' with label smoothing 0.1."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    reason = hf_step.why_not(provider, CPU, T5)
    if reason is not None:
        pytest.skip(reason)
    shape = _smoke(dropout=0.0)
    want, want_grads, unsmoothed = _plain_smoothed(shape)
    assert (want - unsmoothed).abs() > 1e-3  # the smoothing is in the comparison
    model, _, loss = hf_step.build_loss(provider, shape, CPU, T5)
    got = loss()
    got.backward()
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if provider == "transformers-fastformer":  # the timed step itself: the same loss, then it trains
        step = hf_step.build_step(provider, shape, CPU, "fp32", T5)
        losses = torch.stack([step.run().detach() for _ in range(3)])
        torch.testing.assert_close(losses[0], want, rtol=1e-5, atol=1e-5)
        assert losses[-1] < losses[0]


def test_converted_step_runs_fastformers_ops(monkeypatch):
    """The converted T5 really fuses: attention with the relative bias on the packed rows, the
    gated feed-forward, RMSNorm adds and the fused LM-head loss."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    reason = hf_step.why_not("transformers-fastformer", CPU, T5)
    if reason is not None:
        pytest.skip(reason)
    calls, attention = H.count_op_calls(monkeypatch)
    shape = _smoke()
    step = hf_step.build_step("transformers-fastformer", shape, CPU, family=T5)
    calls.clear()  # convert()'s probe of feed_forward's activations
    step.run()
    L = shape["layers"]
    assert calls["linear_cross_entropy"] == 1 and calls["feed_forward"] == 2 * L
    assert calls["attention"] == 3 * L and len(attention) == 3 * L
    # self-attention of both stacks with the relative bias table, cross-attention without
    assert sum(a.get("relative_attention_bias") is not None for a in attention) == 2 * L
    assert calls["add_layer_norm"] >= 5 * L


def test_gemm_flops_are_the_t5_models_matrix_products():
    """The TFLOP/s column's work: 3x (forward + both backward products) the forward products
    torch's flop counter sees in plain T5's loss step (gated feed-forward: three matrices)."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    from torch.utils.flop_counter import FlopCounterMode

    shape = _smoke(dropout=0.0)
    model = hf_step.build_model(shape, CPU, family=T5)
    model.set_attn_implementation("eager")  # attention's products as matmuls the counter sees
    batch = hf_step.make_batch(shape, CPU, family=T5)
    with FlopCounterMode(display=False) as counter:
        hf_step.loss_fn("transformers", model, shape, batch)()
    assert hf_step.gemm_flops(shape, batch, T5) == 3 * counter.get_total_flops()


def test_smoke_size_runs_from_the_command_line(tmp_path, capsys):
    """Records with tokens/s and peak memory for each provider that runs here, and the training
    steps' bar plot (matplotlib is optional: without it the run goes on with --no-plots)."""
    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    try:
        import matplotlib  # noqa: F401
        plots = []
    except ImportError:
        plots = ["--no-plots"]
    code = main(["bench", "--quick", "--sweep", "smoke", "--ops", "hf_t5_step", "--threads", "1",
                 "--out", str(tmp_path), *plots])
    assert code == 0
    assert plots or (tmp_path / "hf_t5_step.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "### hf_t5_step" in table and "| transformers |" in table
    records = {r["provider"]: r for r in json.load(open(tmp_path / "results.json"))["results"]}
    runnable = [p for p in hf_step.PROVIDERS if p not in hf_step.COMPILED and hf_step.why_not(p, CPU, T5) is None]
    assert "transformers" in runnable and sorted(records) == sorted(runnable)
    tokens = hf_step.tokens(hf_step.make_batch(_smoke(), CPU, family=T5))
    for name in runnable:
        r = records[name]
        assert r["status"] == "ok", r["status"]
        assert r["op"] == "hf_t5_step" and r["label"].startswith("T5 v1.1 ") and r["dtype"] == "fp32"
        assert r["tokens_per_s"] == pytest.approx(tokens / (r["median_ms"] / 1e3))
        assert r["peak_mem_mb"] is not None and r["peak_mem_mb"] > 0
    assert records["transformers"]["speedup_vs_eager"] == pytest.approx(1.0)


def test_unknown_provider_is_refused_by_name(tmp_path, capsys):
    reason = hf_step.why_not("transformers-magic", CPU, T5)
    assert "unknown hf_t5_step provider 'transformers-magic'" in reason
    code = main(["bench", "--sweep", "smoke", "--ops", "hf_t5_step", "--no-plots", "--threads", "1",
                 "--providers", "transformers", "transformers-magic", "--out", str(tmp_path)])
    assert code == 2
    assert "--providers: unknown provider(s) ['transformers-magic']" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_without_transformers_every_provider_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    for provider in hf_step.PROVIDERS:
        reason = hf_step.why_not(provider, CPU, T5)
        assert reason is not None and "transformers is not installed" in reason, (provider, reason)
    records = hf_step.bench_hf_step(CPU, "smoke", None, family=T5)
    assert records and all(r["op"] == "hf_t5_step" and r["status"].startswith("skipped: transformers is not installed")
                           for r in records)
