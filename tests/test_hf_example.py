"""examples/hf_marian_dates.py: a MarianMTModel trained with transformers' Seq2SeqTrainer on the
dates task, plain and after ``fastformer.convert``, runs end to end at a tiny setting and reports
both runs' step times, exact match and BLEU; the converted run really runs fastformer's ops and the
plain one none of them."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_marian_dates.py")
NEEDS = "the example needs transformers (pip install transformers accelerate sacrebleu)"
OPS = ("attention", "add_layer_norm", "feed_forward", "linear_cross_entropy", "cross_entropy")
STEPS = 12


def load_example():
    spec = importlib.util.spec_from_file_location("hf_marian_dates", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_options():
    example = load_example()
    args = example.parse_args(["--quick"])
    assert (args.d_model, args.layers, args.activation) == (128, 2, "swish") and not args.no_fastformer
    full = example.parse_args([])
    assert 128 <= full.d_model <= 256 and full.heads == 4 and full.layers in (2, 3) and full.steps > args.steps
    assert example.parse_args(["--steps", "7"]).timing_warmup == 3
    with pytest.raises(SystemExit):
        example.parse_args(["--no-fastformer", "--only-fastformer"])


def test_quick_run_reports_both_runs_and_the_converted_one_fuses(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason=NEEDS)
    pytest.importorskip("sacrebleu", reason=NEEDS)
    pytest.importorskip("tokenizers", reason=NEEDS)
    import fastformer

    example = load_example()
    phase = [None]
    calls = {"transformers": {}, "fastformer": {}}
    for name in OPS:  # count fastformer's op calls of each run
        def counted(*args, _op=getattr(fastformer.ops, name), _name=name, **kwargs):
            mine = calls[phase[0]]
            mine[_name] = mine.get(_name, 0) + 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(fastformer.ops, name, counted)
    run_one = example.run_one

    def tracked(args, tok, examples, test_pairs, fused):
        phase[0] = "fastformer" if fused else "transformers"
        return run_one(args, tok, examples, test_pairs, fused)

    monkeypatch.setattr(example, "run_one", tracked)
    out = tmp_path / "report.json"
    report = example.main(["--quick", "--steps", str(STEPS), "--threads", "1", "--train-pairs", "800",
                           "--test-pairs", "24", "--d-model", "32", "--heads", "2", "--layers", "1", "--ffn", "64",
                           "--batch-size", "16", "--vocab-size", "300", "--out", str(out)])
    printed = capsys.readouterr().out
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
    # the plain run never touches fastformer; the converted one trains with its fused loss and attention
    assert calls["transformers"] == {}
    fused = calls["fastformer"]
    assert fused.get("linear_cross_entropy") == STEPS  # one fused LM-head loss per training step
    assert fused.get("attention", 0) >= 3 * STEPS  # encoder self-, decoder self- and cross-attention
    summary = runs["fastformer"]["fusion"]
    assert summary["attn_implementation"] == "fastformer" and summary["fused_loss"] is True
    assert summary["transformer_layers"] == 2
    if summary["fused_layers"]:  # swish needs a feed_forward with silu; where it has none the layers stay
        assert summary["fused_layers"] == 2 and fused.get("feed_forward", 0) >= 2 * STEPS
