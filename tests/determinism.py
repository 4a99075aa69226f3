"""The determinism harness of the op files (``tests/test_<op>_determinism.py``) and of
tests/test_determinism.py (a whole training run): with the same seed and thread count, forward and
backward are bit-identical from run to run, also under ``torch.use_deterministic_algorithms(True)``.

No fastformer kernel has a reduction whose order depends on thread scheduling: the C++ kernels
split work by thread index (at::parallel_for hands thread i a fixed range) and add per-block
partial sums in block order, or (attention) let threads take whole tasks from a shared counter,
each task writing only its own rows, so which thread ran a task changes no bit; the Triton
kernels use no atomics, so none needs another path.
What can change from process to process is the Triton autotuner's pick of tile sizes on a GPU
(a tile size changes the summation order); under deterministic mode the kernels skip autotuning
and run their first listed config. Results depend on the thread count (the C++ kernels' partial
sums), as torch's own CPU reductions do.

An op's cases are ``make(g, dev, big) -> (inputs, run)``: the inputs (to differentiate) from the
generator ``g`` on device ``dev`` and the function of them that runs the op. On the cpu backend
(``big``) the shapes are large enough for 2 threads to split rows and for the attention's two-pass
backward; elsewhere they are small (Triton's interpreter runs every program in numpy) but still
span several tiles of the interpreter's 32-wide blocks."""
import contextlib
import os

import pytest
import torch

import fastformer
from utils import device_for, kernel_backends, num_threads, skip_without_kernels

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()
SEED = 1234


def _with_threads(param, threads):
    return pytest.param(param.values[0], threads, id=f"{param.id}-{threads}thread", marks=param.marks)


# the cpu backend also with 2 threads: its kernels then add per-thread partial sums
BACKEND_THREADS = [_with_threads(p, 1) for p in BACKENDS] + [_with_threads(p, 2) for p in kernel_backends("cpu")]


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` (which also fills every ``torch.empty`` with
    NaN, so a kernel reading memory it never wrote shows up as NaN), restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if torch.cuda.is_available():  # torch refuses cuBLAS GEMMs in deterministic mode without it
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas or ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def targets(g, n, classes, dev):
    """Class indices for ``n`` rows, every 7th row ignored (-100)."""
    target = torch.randint(0, classes, (n,), generator=g)
    target[::7] = -100
    return target.to(dev)


def forward_backward(op, make, backend, seed=SEED, backward=True):
    """[output, grad of each input] of case ``make`` of ``op``: inputs from a fixed generator,
    dropout from ``seed``."""
    skip_without_kernels(backend, op)
    dev = device_for(backend)
    g = torch.Generator().manual_seed(0)
    inputs, run = make(g, dev, backend == "cpu")
    inputs = [t.requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    with fastformer.use_backend(backend):
        out = run(*inputs)
        if not backward:
            return [out.detach()]
        grad_out = torch.randn(out.shape, generator=g).to(dev)
        grads = torch.autograd.grad(out, inputs, grad_out)
    return [out.detach()] + list(grads)


def assert_identical(first, second, what):
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.isfinite(a).all(), f"{what}: tensor {i} has non-finite values"
        assert torch.equal(a, b), (f"{what}: tensor {i} differs between two runs "
                                   f"(max diff {(a.double() - b.double()).abs().max().item():.3e})")


def op_tests(op, cases, dropout=()):
    """The two tests of ``op``'s ``cases`` ({name: make}) on every backend: two runs give the same
    bits (1 thread, and 2 on cpu), also under deterministic algorithms. For the cases named in
    ``dropout`` the equality is not vacuous: another seed gives another output."""
    names = sorted(cases)

    @pytest.mark.parametrize("case", names)
    @pytest.mark.parametrize("backend, threads", BACKEND_THREADS)
    def test_forward_and_backward_are_bit_identical(backend, threads, case):
        with num_threads(threads):
            first = forward_backward(op, cases[case], backend)
            second = forward_backward(op, cases[case], backend)
            assert_identical(first, second, f"{case} on {backend}, {threads} thread(s)")
            if case in dropout:
                other = forward_backward(op, cases[case], backend, seed=SEED + 1, backward=False)
                assert not torch.equal(other[0], first[0]), f"{case}: dropout ignored the seed"

    @pytest.mark.parametrize("case", names)
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_under_deterministic_algorithms_is_bit_identical(backend, case):
        with deterministic_algorithms():
            first = forward_backward(op, cases[case], backend)
            second = forward_backward(op, cases[case], backend)
        assert_identical(first, second, f"{case} on {backend} under use_deterministic_algorithms(True)")

    return test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical


class RecordLaunch:
    """Stands in for ``torch.library.wrap_triton``: records which kernel runs with which arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel):
        def index(grid):
            return lambda *args, **kwargs: self.calls.append((kernel, grid, kwargs))
        return type("Launcher", (), {"__getitem__": lambda _, grid: index(grid)})()
