"""Checkpoints: atomic writes, and resuming (after a stop or a Ctrl-C) reproduces the run exactly."""
import os
import signal

import pytest
import torch

from fastformer.jobs import checkpoint as ckpt
from fastformer.jobs.config import resolve_config
from fastformer.jobs.train import Trainer

# a few steps of a very small model; ~7 batches per epoch, so 10 steps cross an epoch boundary
TINY = dict(task_train=240, task_test=8, d_model=32, heads=2, layers=1, ffn=64, batch_tokens=800, warmup=4,
            save_every=0, progress=False, dropout=0.1, seed=5, threads=1)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    threads = torch.get_num_threads()  # the tiny runs use one thread (set by Trainer)
    yield
    torch.set_num_threads(threads)


# -- atomic writes --------------------------------------------------------------------------------
def test_save_and_load_round_trip(tmp_path):
    state = {"format": ckpt.FORMAT_VERSION, "w": torch.arange(6.0), "meta": {"step": 3}}
    path = ckpt.save(state, str(tmp_path / "run" / "checkpoint.pt"))
    loaded = ckpt.load(str(tmp_path / "run"))  # a directory means its checkpoint.pt
    assert path == str(tmp_path / "run" / "checkpoint.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"step": 3}


def test_load_rejects_other_files(tmp_path):
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a fastformer checkpoint"):
        ckpt.load(str(tmp_path / "other.pt"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.load(str(tmp_path / "missing"))


@pytest.mark.parametrize("crash_in", ["replace", "write"])
def test_crash_while_saving_keeps_the_old_checkpoint(tmp_path, monkeypatch, crash_in):
    path = str(tmp_path / "checkpoint.pt")
    ckpt.save({"format": ckpt.FORMAT_VERSION, "version": "old", "w": torch.ones(1000)}, path)
    before = open(path, "rb").read()

    def crash(*args, **kwargs):
        if crash_in == "write":  # die halfway through writing the new file
            args[1].write(b"torn")
        raise OSError("simulated crash")

    if crash_in == "replace":
        monkeypatch.setattr(os, "replace", crash)
    else:
        monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save({"format": ckpt.FORMAT_VERSION, "version": "new", "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert ckpt.load(path)["version"] == "old"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temporary file left behind


# -- resume ---------------------------------------------------------------------------------------
def _trainer(out, **options):
    return Trainer(resolve_config(dict(TINY, out=str(out), **options)))


def _resume(out, **options):
    state = ckpt.load(str(out))
    return Trainer(resolve_config(dict(out=str(out), **options), state["config"]), state)


def _assert_same_params(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _assert_resumes_to_the_straight_run(out, straight, step):
    """The checkpoint in ``out`` holds ``step`` steps of ``straight``'s history; resumed from it,
    the run ends as the uninterrupted one (history and parameters)."""
    saved = ckpt.load(str(out))
    assert saved["step"] == step and saved["history"] == straight.history[:step]
    resumed = _resume(out)
    resumed.fit()
    assert resumed.history == straight.history
    _assert_same_params(resumed, straight)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 10-step run."""
    t = _trainer(tmp_path_factory.mktemp("straight"), steps=10)
    t.fit()
    return t


def test_resume_matches_an_uninterrupted_run(straight, tmp_path):
    first = _trainer(tmp_path, steps=4)
    first.fit()
    assert first.history == straight.history[:4]
    resumed = _resume(tmp_path, steps=10)
    assert resumed.step == 4 and resumed.history == straight.history[:4]
    resumed.fit()
    assert len(resumed.history) == 10
    assert resumed.history == straight.history  # exactly the same loss curve
    assert (resumed.epoch, resumed.batch) == (straight.epoch, straight.batch)
    assert straight.epoch >= 1  # the run crossed an epoch boundary
    _assert_same_params(resumed, straight)
    saved = ckpt.load(str(tmp_path))
    assert saved["step"] == 10 and saved["history"] == straight.history
    assert saved["optimizer"]["state"] and saved["scheduler"]["last_epoch"] == 10
    assert set(saved["rng"]) >= {"torch", "python"} and saved["data_position"] == (straight.epoch, straight.batch)


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(straight, tmp_path):
    t = _trainer(tmp_path, steps=10)

    def press_ctrl_c(trainer):
        if trainer.step == 6:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        t.fit(on_step=press_ctrl_c)
    assert t.step == 6
    _assert_resumes_to_the_straight_run(tmp_path, straight, 6)


def test_resume_refuses_to_change_the_model(straight, tmp_path):
    _trainer(tmp_path, steps=1).fit()
    state = ckpt.load(str(tmp_path))
    with pytest.raises(ValueError, match="--d-model"):
        resolve_config({"d_model": 64}, state["config"])
    assert resolve_config({"steps": 50}, state["config"]).steps == 50


def test_interrupt_inside_a_step_saves_the_last_completed_one(straight, tmp_path):
    t = _trainer(tmp_path, steps=10)
    real_loss = t.model.loss

    def loss_then_interrupt(*args, **kwargs):
        if t.step == 3:  # the 4th forward pass is cut short: KeyboardInterrupt mid-step
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    t.model.loss = loss_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    _assert_resumes_to_the_straight_run(tmp_path, straight, 3)
