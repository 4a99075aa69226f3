"""Determinism of what spans ops: a whole training run is bit-identical from run to run (also
under ``torch.use_deterministic_algorithms(True)``, and in a new process), and on a GPU
deterministic mode runs the Triton matmul's first tile config instead of autotuning. Each op's
own forward and backward: tests/test_<op>_determinism.py (the harness and why the kernels are
deterministic: tests/determinism.py)."""
import contextlib
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer.jobs.config import resolve_config
from fastformer.jobs.train import Trainer
import determinism


# -- a whole training run -----------------------------------------------------------------------------
TINY = dict(task_train=160, task_test=8, d_model=32, heads=2, layers=1, ffn=64, batch_tokens=600, warmup=4,
            steps=4, save_every=0, progress=False, dropout=0.1, seed=3)


def _train(out, backend, threads):
    """A few steps of the Seq2SeqTransformer with dropout 0.1: (losses, parameters)."""
    before = torch.get_num_threads()
    try:
        trainer = Trainer(resolve_config(dict(TINY, out=str(out), backend=backend, threads=threads)))
        losses = trainer.fit()
    finally:
        torch.set_num_threads(before)
    return losses, trainer.model.state_dict()


@pytest.mark.parametrize("backend, threads, deterministic_mode",
                         [("reference", 1, False), ("cpu", 1, True)],
                         ids=["reference", "cpu-deterministic"])
def test_training_run_is_bit_identical(tmp_path, backend, threads, deterministic_mode):
    if not fastformer.backends.availability(backend, "cpu"):
        pytest.skip(f"the {backend} backend is unavailable: {fastformer.backends.availability(backend, 'cpu').reason}")
    with determinism.deterministic_algorithms() if deterministic_mode else contextlib.nullcontext():
        losses_a, params_a = _train(tmp_path / "a", backend, threads)
        losses_b, params_b = _train(tmp_path / "b", backend, threads)
    assert len(losses_a) == TINY["steps"]
    assert losses_a == losses_b, f"losses differ between two runs: {losses_a} vs {losses_b}"
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), f"{name} differs between two runs"
    assert losses_a[-1] != losses_a[0], "the run must train for the comparison to mean anything"


_TRAIN_IN_A_NEW_PROCESS = """
import torch
from fastformer.jobs.config import resolve_config
from fastformer.jobs.train import Trainer
trainer = Trainer(resolve_config({options!r}))
torch.save((trainer.fit(), trainer.model.state_dict()), {result!r})
"""


@pytest.mark.slow
def test_training_run_is_bit_identical_in_a_new_process(tmp_path):
    """A second process (fresh allocations, fresh library state) gives the same bits as this one
    (cpu, 1 thread, as the deterministic-mode pair above: on this 2-core machine shared by
    test runs, 2 OpenMP threads mostly wait for each other; the op tests cover 2 threads)."""
    if not fastformer.backends.availability("cpu", "cpu"):
        pytest.skip(f"the cpu backend is unavailable: {fastformer.backends.availability('cpu', 'cpu').reason}")
    result = tmp_path / "there.pt"
    options = dict(TINY, out=str(tmp_path / "there"), backend="cpu", threads=1)
    code = _TRAIN_IN_A_NEW_PROCESS.format(options=options, result=str(result))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        losses, params = _train(tmp_path / "here", "cpu", 1)  # while the other process starts
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    other_losses, other_params = torch.load(result)
    assert losses == other_losses, f"losses differ between processes: {losses} vs {other_losses}"
    for name in params:
        assert torch.equal(params[name], other_params[name]), f"{name} differs between processes"




# -- the GPU launch path, without a GPU: deterministic mode fixes the Triton tile configs ---------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_on_gpu_runs_a_fixed_config_under_deterministic_mode(monkeypatch, dtype):
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from fastformer.triton_kernels import matmul

    record = determinism.RecordLaunch()
    monkeypatch.setattr(matmul, "INTERPRET", False)
    a, b = torch.ones(5, 3, dtype=dtype), torch.ones(3, 4, dtype=dtype)
    with determinism.deterministic_algorithms():
        matmul.launch(a, b, torch.empty(5, 4, dtype=dtype), wrap=record)
        first = matmul.kernel_for(dtype).configs[0]  # the autotuner's first candidate (interpreter configs here)
    (launched, grid, kwargs), = record.calls
    assert launched is matmul._matmul, "deterministic mode must not autotune"
    assert {k: kwargs[k] for k in first.kwargs} == first.kwargs
    assert (kwargs["num_warps"], kwargs["num_stages"]) == (first.num_warps, first.num_stages)
