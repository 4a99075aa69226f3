"""add_layer_norm's CPU fast path keeps its backend question's answer (ops/add_layer_norm.py:
_CPU_KERNELS, keyed by what select_eager reads): a request, the environment variable or the
declarations changed after a call are followed by the next call, as select's own cache follows them."""
import sys
import threading

import pytest
import torch

from fastformer import backends, ops
from fastformer.internal import fast

aln = sys.modules["fastformer.ops.add_layer_norm"]
C = 8


def _args():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, C, generator=g), torch.randn(4, C, generator=g), torch.rand(C, generator=g) + 0.5,
            torch.randn(C, generator=g))


@pytest.fixture
def entry_calls(monkeypatch):
    """The calls that reached the CPU direct entry of add_layer_norm (a counting wrapper in DIRECT)."""
    kernels = backends.select("add_layer_norm", torch.device("cpu"), torch.float32, hidden_size=C)
    entry = fast.DIRECT.get(kernels.add_layer_norm) if kernels is not None else None
    if entry is None:
        pytest.skip("needs fastformer._C with add_layer_norm's direct entry (the C++ library is not built)")
    calls = []
    monkeypatch.setitem(fast.DIRECT, kernels.add_layer_norm, lambda *a: calls.append(1) or entry(*a))
    return calls


def _expected(x, r, w, b):
    return torch.nn.functional.layer_norm(r + x, (C,), w, b, 1e-5)


def test_a_request_after_a_call_is_followed(entry_calls):
    x, r, w, b = _args()
    torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 1 and len(aln._CPU_KERNELS) >= 1
    with backends.use_backend("reference"):
        torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 1  # the reference ran, not the entry
    ops.add_layer_norm(x, r, w, b)
    assert len(entry_calls) == 2


def test_the_environment_variable_after_a_call_is_followed(entry_calls, monkeypatch):
    # the variable counts where this thread requested nothing (conftest's set_backend("auto") is a request)
    monkeypatch.delattr(backends._state, "name")
    x, r, w, b = _args()
    ops.add_layer_norm(x, r, w, b)
    assert len(entry_calls) == 1
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 1
    # a forced backend that cannot run the call: its error on every call, not a kept answer (fp64:
    # the cuda backend has none, on a GPU or on the SIMT harness that runs it on CPU tensors in tests)
    monkeypatch.setenv("FASTFORMER_BACKEND", "cuda")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="'cuda' was forced but cannot run add_layer_norm"):
            ops.add_layer_norm(x.double(), r.double(), w.double(), b.double())
    monkeypatch.delenv("FASTFORMER_BACKEND")
    ops.add_layer_norm(x, r, w, b)
    assert len(entry_calls) == 2


def test_the_first_request_of_any_thread_is_read(entry_calls, monkeypatch):
    # as in a process where no thread has requested a backend yet (conftest's set_backend("auto") has)
    monkeypatch.setattr(backends, "ASKED", [False])
    monkeypatch.setattr(aln, "_ASKED", backends.ASKED)
    monkeypatch.delattr(backends._state, "name")
    x, r, w, b = _args()
    ops.add_layer_norm(x, r, w, b)
    assert len(entry_calls) == 1
    with backends.use_backend("reference"):
        torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 1
    backends.ASKED[0] = False
    backends.set_backend("reference")
    torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 1


def test_another_threads_request_leaves_this_threads_calls_alone(entry_calls):
    x, r, w, b = _args()
    ran = []

    def other():
        with backends.use_backend("reference"):
            ran.append(ops.add_layer_norm(x, r, w, b))

    ops.add_layer_norm(x, r, w, b)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    ops.add_layer_norm(x, r, w, b)
    assert len(ran) == 1 and len(entry_calls) == 2  # the other thread's call took the reference


def test_clear_cache_and_a_declaration_change_forget_the_answers(entry_calls, monkeypatch):
    x, r, w, b = _args()
    ops.add_layer_norm(x, r, w, b)
    assert aln._CPU_KERNELS
    backends.clear_cache()
    assert not aln._CPU_KERNELS
    ops.add_layer_norm(x, r, w, b)
    assert aln._CPU_KERNELS
    # a declaration changed: auto's CPU order without the cpu backend -> the reference
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("reference",))
    assert not aln._CPU_KERNELS
    torch.testing.assert_close(ops.add_layer_norm(x, r, w, b), _expected(x, r, w, b))
    assert len(entry_calls) == 2
