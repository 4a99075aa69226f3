"""Hostile command lines: ``python -m fastformer train | translate | bench | check`` with an option
out of range, of the wrong type or an impossible combination exits with status 2 and an error
that names the flag, before any work (no data generated, no checkpoint written)."""
import re

import pytest

from fastformer.jobs.cli import main

TRAIN = {
    "heads_indivisible": (["--d-model", "30", "--heads", "4"], "--d-model \\(30\\) must be divisible by --heads \\(4\\)"),
    "heads_0": (["--heads", "0"], "--heads must be an integer >= 1, got 0"),
    "d_model_neg": (["--d-model", "-8"], "--d-model must be an integer >= 1"),
    "layers_0": (["--layers", "0"], "--layers"),
    "ffn_0": (["--ffn", "0"], "--ffn"),
    "dropout_one": (["--dropout", "1.0"], "--dropout must be a number in \\[0, 1\\), got 1.0"),
    "dropout_neg": (["--dropout", "-0.1"], "--dropout"),
    "dropout_nan": (["--dropout", "nan"], "--dropout"),
    "label_smoothing": (["--label-smoothing", "1.5"], "--label-smoothing must be a number in \\[0, 1\\]"),
    "label_smoothing_neg": (["--label-smoothing", "-0.1"], "--label-smoothing"),
    "lr_factor_0": (["--lr-factor", "0"], "--lr-factor"),
    "lr_factor_inf": (["--lr-factor", "inf"], "--lr-factor"),
    "clip_norm_neg": (["--clip-norm", "-1"], "--clip-norm"),
    "warmup_0": (["--warmup", "0"], "--warmup must be an integer >= 1"),
    "batch_tokens_0": (["--batch-tokens", "0"], "--batch-tokens"),
    "steps_neg": (["--steps", "-5"], "--steps must be an integer >= 0"),
    "epochs_0": (["--epochs", "0"], "--epochs"),
    "task_train_0": (["--task-train", "0"], "--task-train"),
    "task_test_neg": (["--task-test", "-1"], "--task-test"),
    "vocab_size_1": (["--vocab-size", "1"], "--vocab-size"),
    "max_len_0": (["--max-len", "0"], "--max-len"),
    "test_fraction_1": (["--test-fraction", "1.0"], "--test-fraction"),
    "threads_0": (["--threads", "0"], "--threads"),
    "save_every_neg": (["--save-every", "-1"], "--save-every"),
    "beam_0": (["--beam", "0"], "--beam"),
    "examples_neg": (["--examples", "-2"], "--examples"),
    "seed_neg": (["--seed", "-1"], "--seed"),
    "data_tgt_without_data": (["--data-tgt", "missing.txt"], "--data-tgt needs --data"),
}


@pytest.mark.parametrize("argv, match", [pytest.param(*v, id=k) for k, v in TRAIN.items()])
def test_train_rejects_bad_options(tmp_path, capsys, argv, match):
    out = tmp_path / "run"
    code = main(["train", "--no-progress", "--out", str(out)] + argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "fastformer train: error:" in err
    assert re.search(match, err), f"{match!r} not in {err!r}"
    assert not out.exists(), "validation must come before any work"


@pytest.mark.parametrize("argv, match", [
    pytest.param(["--beam", "0"], "--beam must be at least 1", id="beam_0"),
    pytest.param(["--batch-size", "0"], "--batch-size must be at least 1", id="batch_size_0"),
    pytest.param(["--batch-size", "-3"], "--batch-size", id="batch_size_neg"),
    pytest.param(["--max-len", "1"], "--max-len must be at least 2", id="max_len_1"),
])
def test_translate_rejects_bad_options(tmp_path, capsys, argv, match):
    code = main(["translate", "--checkpoint", str(tmp_path / "nothing")] + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "fastformer translate: error:" in err and match in err, err


def test_translate_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code = main(["translate", "--checkpoint", str(tmp_path / "nothing")])
    err = capsys.readouterr().err
    assert code == 2 and "nothing" in err, err


@pytest.mark.parametrize("argv, match", [
    pytest.param(["--threads", "0"], "--threads must be at least 1", id="threads_0"),
    pytest.param(["--providers", "no-such-provider"], "--providers: unknown provider", id="provider"),
])
def test_bench_rejects_bad_options(tmp_path, capsys, argv, match):
    out = tmp_path / "bench"
    code = main(["bench", "--quick", "--no-plots", "--out", str(out)] + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "fastformer bench: error:" in err and match in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv, flag", [
    pytest.param(["check", "--op", "softmax"], "--op", id="check_op"),
    pytest.param(["check", "--backend", "opencl"], "--backend", id="check_backend"),
    pytest.param(["train", "--steps", "ten"], "--steps", id="train_steps_not_int"),
    pytest.param(["train", "--dtype", "fp8"], "--dtype", id="train_dtype"),
    pytest.param(["translate"], "--checkpoint", id="translate_no_checkpoint"),
    pytest.param(["bench", "--ops", "conv"], "--ops", id="bench_op"),
])
def test_argparse_rejects_wrong_types_and_choices(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"PK\x03\x04 truncated zip"],
                         ids=["empty", "text", "truncated_zip"])
def test_translate_unreadable_checkpoint_is_a_clear_error(tmp_path, capsys, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    code = main(["translate", "--checkpoint", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "is not a fastformer checkpoint" in err and "bad.pt" in err, err


def test_train_resume_from_unreadable_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    from fastformer.jobs import checkpoint as ckpt

    open(ckpt.checkpoint_path(str(out)), "wb").write(b"garbage")
    code = main(["train", "--resume", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "is not a fastformer checkpoint" in err, err
