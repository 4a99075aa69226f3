"""The command line: ``train`` on the built-in task and on files, and ``translate`` from stdin."""
import io
import json
import os
import sys

import pytest
import torch

from fastformer.jobs import checkpoint as ckpt
from fastformer.jobs.cli import main

TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--ffn", "64", "--batch-tokens", "600",
        "--warmup", "10", "--threads", "1", "--no-progress", "--examples", "3"]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny checkpoint of the built-in task (a few steps: it need not be good)."""
    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("run")
    code = main(["train", "--task-train", "400", "--task-test", "20", "--steps", "8", "--out", str(out)] + TINY)
    torch.set_num_threads(threads)
    assert code == 0
    return out


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "translate" in out and "bench" in out


def test_train_writes_checkpoint_and_results(trained):
    state = ckpt.load(str(trained))
    assert state["step"] == 8 and len(state["history"]) == 8
    assert state["config"]["d_model"] == 32 and state["src_tokenizer"]["kind"] == "char"
    results = json.load(open(trained / "results.json"))
    assert 0.0 <= results["exact_match"] <= 100.0 and results["n_test"] == 20
    assert len(results["examples"]) == 3
    assert not [f for f in os.listdir(trained) if f.endswith(".tmp")]


@pytest.mark.parametrize("beam", [1, 3])
def test_translate_reads_stdin(trained, monkeypatch, capsys, beam):
    from fastformer.jobs.translate import load_model

    lines = ["March 21st, 1999", "", "3/4/2010", "the first of May, two thousand and five"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["translate", "--checkpoint", str(trained), "--beam", str(beam), "--max-len", "20"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[-1] == "" and len(out) == len(lines) + 1  # one output line per input line
    assert out[1] == ""  # an empty line stays empty
    model, src_tok, tgt_tok, _ = load_model(str(trained))
    allowed = set(tgt_tok.to_dict()["chars"]) | {"\ufffd"}  # target characters, or <unk>
    for hyp in out[:-1]:
        assert set(hyp) <= allowed  # only target-side characters
    # the same as generating directly with the model
    src = torch.tensor([src_tok.encode(lines[0]) + [src_tok.eos_id]])
    with torch.no_grad():
        ids = model.generate(src, max_len=20, beam_size=beam)[0].tolist()
    assert out[0] == tgt_tok.decode(ids)


def test_train_on_tsv_with_bpe_and_resume(tmp_path, restore_threads):
    from fastformer.jobs.data import make_task

    pairs, _ = make_task("dates", 300, 10, seed=0)
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    out = tmp_path / "run"
    args = ["train", "--data", str(data), "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(out)] + TINY
    assert main(args + ["--epochs", "1"]) == 0
    state = ckpt.load(str(out))
    assert state["src_tokenizer"]["kind"] == "bpe"
    n = state["step"]  # the batches of one epoch
    assert n > 1 and state["data_position"] == (0, n)
    assert main(args + ["--epochs", "2", "--resume"]) == 0
    state = ckpt.load(str(out))
    assert state["step"] == 2 * n and state["data_position"] == (1, n)


def test_train_bf16_autocast(tmp_path, restore_threads):
    out = tmp_path / "run"
    assert main(["train", "--task-train", "200", "--task-test", "5", "--steps", "2", "--dtype", "bf16",
                 "--out", str(out)] + TINY) == 0
    history = ckpt.load(str(out))["history"]
    assert len(history) == 2 and all(0.0 < h < 10.0 for h in history)


def test_train_packed_rows_records_the_option_and_learns(tmp_path, restore_threads):
    """--pack: several pairs a row; the loss falls (the packed rows train the model) and the
    checkpoint's config says so, for a resume to pack alike."""
    out = tmp_path / "run"
    assert main(["train", "--task-train", "400", "--task-test", "5", "--steps", "30", "--pack",
                 "--out", str(out)] + TINY) == 0
    state = ckpt.load(str(out))
    assert state["config"]["pack"] is True
    history = state["history"]
    assert len(history) == 30 and sum(history[-5:]) < 0.8 * sum(history[:5])


def test_malformed_data_fails_cleanly_and_writes_nothing(tmp_path, capsys, restore_threads):
    data = tmp_path / "bad.tsv"
    data.write_text("good\tline\nno tab here\n")
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out)] + TINY) == 2
    err = capsys.readouterr().err
    assert f"{data}:2:" in err and "tab" in err
    assert not out.exists()


def test_missing_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["translate", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["train", "--resume", "--out", str(tmp_path / "none")] + TINY) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_dtype_auto_is_bf16_on_a_cuda_gpu_with_bf16_and_fp32_elsewhere(monkeypatch):
    from fastformer.jobs.devices import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu")) == "fp32"
    assert resolve_dtype("bf16", torch.device("cpu")) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) == "bf16"
    assert resolve_dtype("fp32", torch.device("cuda")) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) == "fp32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp16", torch.device("cpu"))
