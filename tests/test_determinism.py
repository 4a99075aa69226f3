"""Determinism: with the same seed and thread count, forward and backward of every op on every
backend, and a whole training run, are bit-identical from run to run, also under
``torch.use_deterministic_algorithms(True)``.

No fastformer kernel has a reduction whose order depends on thread scheduling: the C++ kernels
split work by thread index (at::parallel_for hands thread i a fixed range) and add per-block
partial sums in block order, or (attention) let threads take whole tasks from a shared counter,
each task writing only its own rows, so which thread ran a task changes no bit; the Triton
kernels use no atomics, so none needs another path.
What can change from process to process is the Triton autotuner's pick of tile sizes on a GPU
(a tile size changes the summation order); under deterministic mode the kernels skip autotuning
and run their first listed config. Results depend on the thread count (the C++ kernels' partial
sums), as torch's own CPU reductions do.
"""
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer import ops
from fastformer.jobs.config import resolve_config
from fastformer.jobs.train import Trainer
from utils import device_for, kernel_backends, skip_without_kernels

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()
SEED = 1234


def _with_threads(param, threads):
    return pytest.param(param.values[0], threads, id=f"{param.id}-{threads}thread", marks=param.marks)


# the cpu backend also with 2 threads: its kernels then add per-thread partial sums
BACKEND_THREADS = [_with_threads(p, 1) for p in BACKENDS] + [_with_threads(p, 2) for p in kernel_backends("cpu")]


@pytest.fixture
def set_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def deterministic(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` for one test (which also fills every
    ``torch.empty`` with NaN, so a kernel reading memory it never wrote shows up as NaN)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if torch.cuda.is_available():  # torch refuses cuBLAS GEMMs in deterministic mode without it
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


# -- the ops: each case makes its inputs (those to differentiate first) and runs the op ----------------
# On the cpu backend (big=True) the shapes are large enough for 2 threads to split rows (add_layer_norm,
# feed_forward, cross_entropy) and for the attention's two-pass backward (several 64-query and 128-key
# blocks); elsewhere they are small (Triton's interpreter runs every program in numpy) but still span
# several tiles of the interpreter's 32-wide blocks.
def _attention_masks(g, dev, big):
    b, h, sq, sk = (2, 2, 70, 150) if big else (1, 1, 37, 45)
    q, k, v = (torch.randn(b, h, s, 24, generator=g).to(dev) for s in (sq, sk, sk))
    kpm = torch.rand(b, sk, generator=g) < 0.3
    kpm[:, 0] = False  # every query sees a key
    mask = torch.randn(sq, sk, generator=g).to(dev)  # additive float mask, broadcast over (B, H)
    return (q, k, v), lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm.to(dev), attn_mask=mask,
                                                    dropout_p=0.1)


def _attention_causal(g, dev, big):
    b, h, sq, sk = (2, 2, 70, 150) if big else (1, 1, 37, 45)
    q, k, v = (torch.randn(b, h, s, 24, generator=g).to(dev) for s in (sq, sk, sk))
    kpm = torch.rand(b, sk, generator=g) < 0.3
    kpm[:, 0] = False
    bool_mask = torch.rand(sq, sk, generator=g) < 0.2  # True = hidden
    bool_mask[:, 0] = False
    return (q, k, v), lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm.to(dev),
                                                    attn_mask=bool_mask.to(dev), is_causal=True, dropout_p=0.1)


def _add_layer_norm(prenorm):
    def case(g, dev, big):
        x, res = (torch.randn(600 if big else 9, 64, generator=g).to(dev) for _ in range(2))
        w, b = (1 + 0.1 * torch.randn(64, generator=g)).to(dev), (0.1 * torch.randn(64, generator=g)).to(dev)

        def run(x, res, w, b):
            out = ops.add_layer_norm(x, res, w, b, dropout_p=0.1, prenorm=prenorm)
            return torch.cat([t.flatten() for t in out]) if prenorm else out
        return (x, res, w, b), run
    return case


def _feed_forward(g, dev, big):
    x = torch.randn(600 if big else 37, 32, generator=g).to(dev)
    w1, w2 = (0.2 * torch.randn(64, 32, generator=g)).to(dev), (0.2 * torch.randn(32, 64, generator=g)).to(dev)
    b1, b2 = (0.1 * torch.randn(64, generator=g)).to(dev), (0.1 * torch.randn(32, generator=g)).to(dev)
    return (x, w1, b1, w2, b2), lambda *a: ops.feed_forward(*a, activation="gelu", dropout_p=0.1)


def _targets(g, n, classes, dev):
    target = torch.randint(0, classes, (n,), generator=g)
    target[::7] = -100  # ignored rows
    return target.to(dev)


def _cross_entropy(g, dev, big):
    n = 700 if big else 15
    logits = (3 * torch.randn(n, 50, generator=g)).to(dev)
    target = _targets(g, n, 50, dev)
    return (logits,), lambda logits: ops.cross_entropy(logits, target, label_smoothing=0.1)


def _linear_cross_entropy(g, dev, big):
    n = 700 if big else 15
    hidden = torch.randn(n, 32, generator=g).to(dev)
    weight, bias = (0.2 * torch.randn(50, 32, generator=g)).to(dev), (0.1 * torch.randn(50, generator=g)).to(dev)
    target = _targets(g, n, 50, dev)
    return (hidden, weight, bias), lambda h, w, b: ops.linear_cross_entropy(h, w, target, linear_bias=b, label_smoothing=0.1)


CASES = {"attention_masks": _attention_masks, "attention_causal": _attention_causal,
         "add_layer_norm": _add_layer_norm(False), "add_layer_norm_prenorm": _add_layer_norm(True),
         "feed_forward": _feed_forward, "cross_entropy": _cross_entropy,
         "linear_cross_entropy": _linear_cross_entropy}
DROPOUT_CASES = {"attention_masks", "attention_causal", "add_layer_norm", "add_layer_norm_prenorm", "feed_forward"}


def _forward_backward(case, backend, seed=SEED, backward=True):
    """[output, grad of each input]: inputs from a fixed generator, dropout from ``seed``."""
    skip_without_kernels(backend, next(op for op in ("linear_cross_entropy", "cross_entropy", "add_layer_norm",
                                                     "feed_forward", "attention") if case.startswith(op)))
    dev = device_for(backend)
    g = torch.Generator().manual_seed(0)
    inputs, run = CASES[case](g, dev, backend == "cpu")
    inputs = [t.requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    with fastformer.use_backend(backend):
        out = run(*inputs)
        if not backward:
            return [out.detach()]
        grad_out = torch.randn(out.shape, generator=g).to(dev)
        grads = torch.autograd.grad(out, inputs, grad_out)
    return [out.detach()] + list(grads)


def _assert_identical(first, second, what):
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.isfinite(a).all(), f"{what}: tensor {i} has non-finite values"
        assert torch.equal(a, b), (f"{what}: tensor {i} differs between two runs "
                                   f"(max diff {(a.double() - b.double()).abs().max().item():.3e})")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend, threads", BACKEND_THREADS)
def test_op_forward_and_backward_are_bit_identical(backend, threads, case, set_threads):
    set_threads(threads)
    first = _forward_backward(case, backend)
    second = _forward_backward(case, backend)
    _assert_identical(first, second, f"{case} on {backend}, {threads} thread(s)")
    if case in DROPOUT_CASES:  # the equality is not vacuous: the dropout mask follows the seed
        other = _forward_backward(case, backend, seed=SEED + 1, backward=False)
        assert not torch.equal(other[0], first[0]), f"{case}: dropout ignored the seed"


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_cpu_attention_does_not_depend_on_which_thread_runs_a_task(backend, set_threads):
    """The cpu attention's threads take (batch, head, block) tasks from a shared counter, so
    that rows of different lengths balance; each task writes only its rows, so 1 and 2 threads
    (which split the tasks differently, and differently from run to run) give the same bits."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(8, 2, 150, 24, generator=g) for _ in range(4))
    kpm = torch.arange(150)[None] >= torch.tensor([150, 140, 130, 120, 40, 30, 20, 10])[:, None]
    results = []
    for threads in (1, 2):
        set_threads(threads)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(SEED)
        with fastformer.use_backend(backend):
            out = ops.attention(*leaves, key_padding_mask=kpm, dropout_p=0.1)
        results.append([out.detach()] + list(torch.autograd.grad(out, leaves, dout)))
    _assert_identical(results[0], results[1], "attention on 1 and on 2 threads")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_under_deterministic_algorithms_is_bit_identical(backend, case, deterministic):
    first = _forward_backward(case, backend)
    second = _forward_backward(case, backend)
    _assert_identical(first, second, f"{case} on {backend} under use_deterministic_algorithms(True)")


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
def test_training_run_is_bit_identical(tmp_path, backend, threads, deterministic_mode, request):
    if not fastformer.backends.availability(backend, "cpu"):
        pytest.skip(f"the {backend} backend is unavailable: {fastformer.backends.availability(backend, 'cpu').reason}")
    if deterministic_mode:
        request.getfixturevalue("deterministic")
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
class _RecordLaunch:
    """Stands in for ``torch.library.wrap_triton``: records which kernel runs with which arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel):
        def index(grid):
            return lambda *args, **kwargs: self.calls.append((kernel, grid, kwargs))
        return type("Launcher", (), {"__getitem__": lambda _, grid: index(grid)})()


@pytest.mark.parametrize("deterministic_mode", [False, True], ids=["autotuned", "deterministic"])
def test_triton_attention_on_gpu_runs_a_fixed_config_under_deterministic_mode(monkeypatch, deterministic_mode,
                                                                              request):
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from fastformer.triton_kernels import attention as tk

    if deterministic_mode:
        request.getfixturevalue("deterministic")
    record = _RecordLaunch()
    monkeypatch.setattr(tk, "INTERPRET", False)  # take the GPU branch of the launcher
    monkeypatch.setattr(torch.library, "wrap_triton", record)
    monkeypatch.setattr(tk, "_tuned", lambda kind, fn, *rest: ("autotuner", kind, fn))
    kernel = object()
    tk._launch("fwd", kernel, lambda meta: (meta["BLOCK_M"], 1, 1), 64, 2, ("arg",),
               {"HAS_MASK": True, "HAS_DROPOUT": True})
    (launched, grid, kwargs), = record.calls
    if not deterministic_mode:
        assert launched == ("autotuner", "fwd", kernel)
        return
    first = tk._configs("fwd", 64, 2, True)[0]
    assert launched is kernel, "deterministic mode must not autotune"
    assert grid == (first.kwargs["BLOCK_M"], 1, 1)
    assert kwargs == dict(first.kwargs, HAS_MASK=True, HAS_DROPOUT=True, num_warps=first.num_warps,
                          num_stages=first.num_stages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matmul_on_gpu_runs_a_fixed_config_under_deterministic_mode(monkeypatch, deterministic, dtype):
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from fastformer.triton_kernels import matmul

    record = _RecordLaunch()
    monkeypatch.setattr(matmul, "INTERPRET", False)
    a, b = torch.ones(5, 3, dtype=dtype), torch.ones(3, 4, dtype=dtype)
    matmul.launch(a, b, torch.empty(5, 4, dtype=dtype), wrap=record)
    (launched, grid, kwargs), = record.calls
    first = matmul.kernel_for(dtype).configs[0]  # the autotuner's first candidate (interpreter configs here)
    assert launched is matmul._matmul, "deterministic mode must not autotune"
    assert {k: kwargs[k] for k in first.kwargs} == first.kwargs
    assert (kwargs["num_warps"], kwargs["num_stages"]) == (first.num_warps, first.num_stages)
