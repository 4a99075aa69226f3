"""examples/hf_seq2seq_dates.py: a MarianMTModel (``--model marian``) or a T5 v1.1-shaped
T5ForConditionalGeneration (``--model t5``) trained with transformers' Seq2SeqTrainer on the dates task,
plain and after ``fastformer.convert``, runs end to end at a tiny setting and reports both runs' step
times, exact match and BLEU; the converted run really runs fastformer's ops and the plain one none of
them. Each family's batches are what its model would build from the labels, and the T5 model is T5
v1.1's shape."""
import collections
import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_seq2seq_dates.py")
NEEDS = "the example needs transformers (pip install transformers accelerate tokenizers sacrebleu)"
OPS = ("attention", "attention_varlen", "add_layer_norm", "feed_forward", "linear_cross_entropy", "cross_entropy")
STEPS = 12
TINY = ["--quick", "--steps", str(STEPS), "--threads", "1", "--train-pairs", "800", "--test-pairs", "24",
        "--d-model", "32", "--heads", "2", "--layers", "1", "--ffn", "64", "--batch-size", "16",
        "--vocab-size", "300"]


def load_example():
    spec = importlib.util.spec_from_file_location("hf_seq2seq_dates", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_transformers():
    for name in ("transformers", "sacrebleu", "tokenizers"):
        pytest.importorskip(name, reason=NEEDS)


def test_cli_options():
    example = load_example()
    args = example.parse_args(["--quick"])
    assert (args.model, args.d_model, args.layers, args.activation) == ("marian", 128, 2, "swish")
    assert not args.no_fastformer
    full = example.parse_args([])
    assert 128 <= full.d_model <= 256 and full.heads == 4 and full.layers in (2, 3) and full.steps > args.steps
    assert example.parse_args(["--steps", "7"]).timing_warmup == 3
    # T5 v1.1's shape at the sizes the task names: d_kv = d_model / heads
    t5 = example.parse_args(["--model", "t5"])
    assert (t5.d_model, t5.heads, t5.d_model // t5.heads, t5.layers, t5.ffn) == (256, 4, 64, 3, 1024)
    assert t5.activation == "gated-gelu" and t5.steps == full.steps
    t5_quick = example.parse_args(["--model", "t5", "--quick"])
    assert t5_quick.d_model < t5.d_model and t5_quick.ffn < t5.ffn and t5_quick.steps < t5.steps
    for bad in (["--no-fastformer", "--only-fastformer"], ["--model", "bert"], ["--d-model", "100", "--heads", "3"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)


@pytest.mark.parametrize("model", ["marian", "t5"])
def test_collate_gives_the_decoder_inputs_the_model_shifts_from_the_labels(model):
    """The plain run's loss takes the labels away from the model, so the batch carries the decoder's
    inputs: they must be what the model itself makes of the labels (its start token, then the labels
    shifted right) at every position that has a label. (After a row's last label the model shifts in
    its ``</s>`` and the collate ``<pad>``: the decoder is causal and no loss reads those positions.)"""
    needs_transformers()
    example = load_example()
    args = example.parse_args(["--model", model] + TINY)
    family = example.FAMILIES[model]
    ref = example.build_model(args, family, 40)
    examples = [{"input_ids": [5, 6, family.eos_id], "labels": [7, 8, 9, family.eos_id]},
                {"input_ids": [5, family.eos_id], "labels": [10, family.eos_id]}]
    batch = family.collate(examples)
    assert batch["labels"].tolist() == [[7, 8, 9, family.eos_id], [10, family.eos_id, -100, -100]]
    assert batch["input_ids"].tolist() == [[5, 6, family.eos_id], [5, family.eos_id, family.pad_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    want = ref.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
    labelled = batch["labels"] != -100
    assert torch.equal(batch["decoder_input_ids"][labelled], want[labelled])
    assert (batch["decoder_input_ids"][~labelled] == family.pad_id).all()


def test_t5_vocabulary_has_t5s_special_ids():
    needs_transformers()
    example = load_example()
    texts = ["the 21st of March, 1999", "1999-03-21", "March 3, 2004", "2004-03-03"] * 20
    tok = example.T5Vocabulary(texts, 300)
    assert [tok._tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    ids = tok.encode("the 3rd of March, 2004")
    assert min(ids) > 2  # no special in plain text
    # generate()'s rows: the start <pad>, the text, </s>, then <pad> up to the batch's longest
    assert tok.decode([0] + ids + [1, 0, 0]) == "the 3rd of March, 2004"
    assert tok.decode([0] + ids + [1] + ids) == "the 3rd of March, 2004"  # read up to </s>


def run_counted(example, monkeypatch, argv):
    """``example.main(argv)`` with fastformer's op calls counted per run (``"transformers"``,
    ``"fastformer"``), the attention calls given a relative position bias table counted as
    ``"relative_bias"``; returns the report, the counts and the models built."""
    import fastformer

    phase = [None]
    calls = {"transformers": collections.Counter(), "fastformer": collections.Counter()}
    for name in OPS:
        def counted(*args, _op=getattr(fastformer.ops, name), _name=name, **kwargs):
            calls[phase[0]][_name] += 1
            if kwargs.get("relative_attention_bias") is not None:
                calls[phase[0]]["relative_bias"] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(fastformer.ops, name, counted)
    run_one, build_model, models = example.run_one, example.build_model, []

    def tracked(args, family, tok, examples, test_pairs, fused):
        phase[0] = "fastformer" if fused else "transformers"
        return run_one(args, family, tok, examples, test_pairs, fused)

    def kept(*args, **kwargs):
        models.append(build_model(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(example, "run_one", tracked)
    monkeypatch.setattr(example, "build_model", kept)
    return example.main(argv), calls, models


def check_report(report, printed, out):
    assert "| transformers |" in printed and "| fastformer |" in printed and "x the plain step's speed" in printed
    assert json.load(open(out))["runs"] == json.loads(json.dumps(report["runs"]))
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["transformers", "fastformer"]
    for r in runs.values():
        assert r["steps"] == STEPS and r["timed_steps"] == STEPS - report["settings"]["timing_warmup"] > 0
        assert 0 < r["step_ms_min"] <= r["step_ms_median"] and r["step_ms_mean"] > 0
        assert 0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["bleu"] <= 100.0 and r["n_test"] == 24
        assert len(r["logged_losses"]) > 0 and all(loss == loss for loss in r["logged_losses"])  # no NaN
    assert report["speedup"] == pytest.approx(runs["transformers"]["step_ms_median"]
                                              / runs["fastformer"]["step_ms_median"])
    return runs


def test_quick_run_reports_both_runs_and_the_converted_one_fuses(tmp_path, monkeypatch, capsys):
    needs_transformers()
    example = load_example()
    out = tmp_path / "report.json"
    report, calls, _ = run_counted(example, monkeypatch, TINY + ["--out", str(out)])
    runs = check_report(report, capsys.readouterr().out, out)
    assert report["settings"]["model"] == "marian"
    # the plain run never touches fastformer; the converted one trains with its fused loss and attention
    assert calls["transformers"] == {}
    fused = calls["fastformer"]
    assert fused["linear_cross_entropy"] == STEPS  # one fused LM-head loss per training step
    # encoder self-, decoder self- and cross-attention
    assert fused["attention"] + fused["attention_varlen"] >= 3 * STEPS
    summary = runs["fastformer"]["fusion"]
    assert summary["attn_implementation"] == "fastformer" and summary["fused_loss"] is True
    assert summary["transformer_layers"] == 2
    if summary["fused_layers"]:  # swish needs a feed_forward with silu; where it has none the layers stay
        assert summary["fused_layers"] == 2 and fused["feed_forward"] >= 2 * STEPS


def test_t5_quick_run_is_v1_1_shaped_and_the_converted_one_fuses(tmp_path, monkeypatch, capsys):
    needs_transformers()
    example = load_example()
    out = tmp_path / "report.json"
    report, calls, models = run_counted(example, monkeypatch, ["--model", "t5"] + TINY + ["--out", str(out)])
    printed = capsys.readouterr().out
    runs = check_report(report, printed, out)
    assert report["settings"]["model"] == "t5" and "T5ForConditionalGeneration" in printed
    # T5 v1.1: gated-gelu, an untied output layer, no biases, RMSNorm, a relative position bias
    assert len(models) == 2
    for model in models:
        cfg = model.config
        assert type(model).__name__ == "T5ForConditionalGeneration"
        assert cfg.feed_forward_proj == "gated-gelu" and cfg.is_gated_act
        # untied: (transformers 5 keeps T5's config.tie_word_embeddings True; False there means only no
        # output scaling) the head is its own weight, which transformers' own tying (saving, loading, the
        # internal tie_weights) leaves alone, as it does a v1.1 checkpoint's
        assert cfg.scale_decoder_outputs is False and model.lm_head.weight is not model.shared.weight
        assert "lm_head.weight" not in model.all_tied_weights_keys
        model.tie_weights(recompute_mapping=False)
        assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
        assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (0, 1, 0)
        assert not [n for n, _ in model.named_parameters() if n.endswith(".bias")]
        assert model.encoder.block[0].layer[0].SelfAttention.has_relative_attention_bias
        assert all(hasattr(b.layer[-1].DenseReluDense, "wi_1") for b in model.encoder.block)
    # the plain run never touches fastformer; the converted one trains with its fused loss, attention
    # with T5's relative bias table (encoder and decoder self-attention), add+RMSNorm and feed-forward
    assert calls["transformers"] == {}
    fused = calls["fastformer"]
    assert fused["linear_cross_entropy"] == STEPS
    assert fused["relative_bias"] >= 2 * STEPS
    assert fused["attention"] + fused["attention_varlen"] >= 3 * STEPS
    assert fused["add_layer_norm"] >= 5 * STEPS  # a norm per sub-layer: 2 in the encoder's block, 3 in the decoder's
    assert fused["feed_forward"] >= 2 * STEPS
    summary = runs["fastformer"]["fusion"]
    assert summary["attn_implementation"] == "fastformer" and summary["fused_loss"] is True
    assert summary["transformer_layers"] == summary["fused_layers"] == 2
