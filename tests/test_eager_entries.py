"""The C++ ops' direct eager entries (csrc/eager.h, ``fastformer._C.<op>_eager``) and their philox
draw in C++. The draw must be philox.py's, bit for bit (the pair, and torch's CPU generator state
after it), so a model drops the same elements whichever path a call takes; an entry must give
what the registered op gives, and answer None (so the checked path words the error) where the op
refuses a call. The fast path's results against the checked path's are tests/test_fast_path.py's."""
import contextlib
import sys

import pytest
import torch
import torch.utils._python_dispatch
from torch.utils.checkpoint import checkpoint

import fastformer
from fastformer import _ext, backends, ops, philox
from fastformer.internal import fast
from fastformer.ops import reference

ENTRIES = ("add_layer_norm", "feed_forward", "embedding")


def _lacking():
    if _ext.load_error() is not None:
        return _ext.load_error()
    ext = _ext.module()
    missing = [op for op in ENTRIES if not hasattr(ext, op + "_eager")]
    if missing or not hasattr(ext, "draw_philox"):
        return f"the loaded library predates csrc/eager.h (no {', '.join(missing) or 'draw_philox'}); rebuild it"
    return None


pytestmark = pytest.mark.skipif(_lacking() is not None, reason=str(_lacking()))
CPU = torch.device("cpu")


def _cpp_draw():
    return _ext.module().draw_philox(CPU)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 7])
def test_the_cpp_draw_is_the_python_draw_and_leaves_the_same_generator_state(seed):
    torch.manual_seed(seed)
    want = [philox._draw_on(CPU) for _ in range(5)]
    want_state = torch.get_rng_state()
    torch.manual_seed(seed)
    got = [_cpp_draw() for _ in range(5)]
    assert torch.equal(torch.get_rng_state(), want_state)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and a.shape == (2,) and a.device == CPU
        assert torch.equal(a, b)
    seeds = [int(a[0]) for a in got]
    assert all(0 <= s < 2**62 for s in seeds) and len(set(seeds)) == 5 and all(int(a[1]) == 0 for a in got)


def test_the_cpp_draw_interleaves_with_torchs_own_rng():
    # the same stream as torch's ops: a draw between two randn consumes what the Python draw does
    torch.manual_seed(3)
    want = (torch.randn(3), philox._draw_on(CPU), torch.randn(3))
    torch.manual_seed(3)
    got = (torch.randn(3), _cpp_draw(), torch.randn(3))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_cpp_draw_follows_saved_and_forked_generator_states():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = _cpp_draw()
    torch.set_rng_state(state)
    assert torch.equal(_cpp_draw(), first)  # restored: the same pair
    after = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        inside = _cpp_draw()
    assert torch.equal(torch.get_rng_state(), after)  # fork_rng put the state back
    torch.manual_seed(99)
    assert torch.equal(_cpp_draw(), inside)


def _case(op, p, g):
    """(registered op's arguments without philox, index philox goes at, leaves) for a small call."""
    r = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    if op == "add_layer_norm":
        leaves = [r(2, 3, 16), r(2, 3, 16), r(16), r(16)]
        return (*leaves, 1e-5, p, True, None, False), 7, leaves
    if op == "feed_forward":
        leaves = [r(2, 3, 16), r(32, 16), r(32), r(16, 32), r(16)]
        return (*leaves, "gelu", p, None, None), 7, leaves
    leaves = [r(11, 8), r(9, 8)]
    ids = torch.randint(0, 11, (2, 5), generator=g)
    pos = torch.arange(5).expand(2, 5)
    return (ids, leaves[0], leaves[1], pos, 2.0, p, 1), 7, leaves


def _outputs(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("op", ENTRIES)
def test_an_entry_is_the_registered_op_with_philox_drawn(op, p):
    registered = getattr(torch.ops.fastformer, op)
    entry = getattr(_ext.module(), op + "_eager")
    results = []
    for call in ("registered", "entry"):
        args, at, leaves = _case(op, p, torch.Generator().manual_seed(1))
        torch.manual_seed(21)
        if call == "registered":
            out = registered(*args[:at], philox.draw(p, CPU), *args[at:])
        else:
            out = entry(*args)
        outs = _outputs(out)
        grads = torch.autograd.grad(outs[0], leaves, torch.ones_like(outs[0]))
        results.append(([o.detach() for o in outs], grads, torch.get_rng_state()))
    (want_outs, want_grads, want_state), (got_outs, got_grads, got_state) = results
    assert len(got_outs) == len(want_outs)
    for a, b in zip(got_outs + list(got_grads), want_outs + list(want_grads)):
        assert torch.equal(a, b)
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("op", ENTRIES)
def test_the_profiler_sees_an_entrys_input_shapes_as_the_registered_ops(op):
    # record_shapes: the entry's event lists what the registered op's does, less its philox pair
    def shapes(call):
        args, at, _ = _case(op, 0.0, torch.Generator().manual_seed(1))
        with torch.no_grad(), torch.profiler.profile(record_shapes=True) as prof:
            if call == "registered":
                getattr(torch.ops.fastformer, op)(*args[:at], philox.draw(0.0, CPU), *args[at:])
            else:
                getattr(_ext.module(), op + "_eager")(*args)
        (event,) = [e for e in prof.events() if e.name == f"fastformer::{op}"]
        return [list(s) for s in event.input_shapes], at

    want, at = shapes("registered")
    got, _ = shapes("entry")
    assert want[at] == [2]  # the philox pair
    assert got == want[:at] + want[at + 1:] and got[0] != []


def test_an_entry_answers_none_where_the_op_refuses_the_call():
    entry = _ext.module().add_layer_norm_eager
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    assert entry(x, None, w, b, 1e-5, 0.0, False, None, False) is not None
    # a residual of another shape: the op's RuntimeError, answered as None
    assert entry(x, torch.randn(4, 9), w, b, 1e-5, 0.0, False, None, False) is None
    # a tensor on another device than x: never reaches a kernel
    assert entry(x, torch.empty(4, 8, device="meta"), w, b, 1e-5, 0.0, False, None, False) is None
    # not what the entry takes: a list for a tensor, a string for a number, the wrong argument count
    assert entry(x, None, [1.0] * 8, b, 1e-5, 0.0, False, None, False) is None
    assert entry(x, None, w, b, "1e-5", 0.0, False, None, False) is None
    assert entry(x, None, w, b, 1e-5, 0.0, False, None) is None
    assert _ext.module().feed_forward_eager(x, torch.randn(16, 8), None, torch.randn(8, 16), None, 3, 0.0,
                                            None, None) is None  # an int activation


def test_the_add_layer_norm_entry_declines_what_the_python_fast_path_no_longer_checks():
    """ops.add_layer_norm's fast path checks only the class of x before its entry: the entry itself
    answers None (the checked path's call) for everything else that path handles."""
    entry = _ext.module().add_layer_norm_eager
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)

    class Sub(torch.Tensor):
        pass

    want = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    y = entry(x, None, w, b, 1e-5, 0.0, False, None, False)
    assert isinstance(y, torch.Tensor) and torch.allclose(y, want, atol=1e-5)  # y alone without prenorm
    y, h = entry(x, None, w, b, 1, 0, True, None, False)  # ints for the numbers; (y, h) with prenorm
    assert torch.equal(h, x) and y.shape == x.shape
    assert entry(torch.nn.Parameter(x), None, torch.nn.Parameter(w), b, 1e-5, 0.0, False, None, False) is not None
    declined = [
        (x.as_subclass(Sub), None, w, b, 1e-5, 0.0, False, None, False),  # a subclass: __torch_function__
        (x, None, w.as_subclass(Sub), b, 1e-5, 0.0, False, None, False),
        (x, None, w, b, True, 0.0, False, None, False),  # a bool for eps
        (x, None, w, b, 1e-5, torch.tensor(0.0), False, None, False),  # a tensor for dropout_p
        (x, None, w, b, 1e-5, 0.0, 1, None, False),  # an int for prenorm
        (x, None, w.double(), b, 1e-5, 0.0, False, None, False),  # the checked path casts it
        (x, None, w, b.half(), 1e-5, 0.0, False, None, False),
        (x, None, w, b, 1e-5, 0.0, False, torch.zeros(8, dtype=torch.float64), False),
        (x, None, None, b, 1e-5, 0.0, False, None, False),  # no weight
        (x, None, w, None, 1e-5, 0.0, False, None, False),  # no bias, LayerNorm
        (x, None, torch.ones(1, 8), None, 1e-5, 0.0, False, None, True),  # no bias, a 2-D weight
        (torch.randn(()), None, w, b, 1e-5, 0.0, False, None, False),  # no hidden size
        (torch.randn(4, 0), None, torch.ones(0), torch.zeros(0), 1e-5, 0.0, False, None, False),
    ]
    for args in declined:
        assert entry(*args) is None, args

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class DispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    # not eager (fast.ready()'s thread-local half): the checked path's
    with Mode():
        assert entry(x, None, w, b, 1e-5, 0.0, False, None, False) is None
    with DispatchMode():
        assert entry(x, None, w, b, 1e-5, 0.0, False, None, False) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert entry(x, None, w, b, 1e-5, 0.0, False, None, False) is None
    assert entry(x, None, w, b, 1e-5, 0.0, False, None, False) is not None  # each mode left: taken again
    # RMSNorm without a bias: the entry adds zeros, as the registered op given them
    want = torch.ops.fastformer.add_layer_norm(x, None, w * 2, b, 1e-5, 0.0, False, philox.NO_DROPOUT, None, True)[0]
    assert torch.equal(entry(x, None, w * 2, None, 1e-5, 0.0, False, None, True), want)


@pytest.fixture
def cpu_backend():
    with fastformer.use_backend("cpu"):
        yield


def _public(op, p, leaves):
    if op == "add_layer_norm":
        return ops.add_layer_norm(*leaves, 1e-5, p)
    if op == "feed_forward":
        return ops.feed_forward(*leaves, activation="gelu", dropout_p=p)
    ids = torch.arange(10).reshape(2, 5) % 11
    return ops.embedding(ids, leaves[0], scale=2.0, positional=leaves[1], dropout_p=p, padding_idx=1)


@pytest.mark.parametrize("op", ENTRIES)
def test_the_fast_path_calls_the_entry_and_without_it_the_registered_op_alike(op, cpu_backend, monkeypatch):
    calls = []
    entries = dict(fast.DIRECT)
    module = sys.modules[f"fastformer.ops.{op}"]
    monkeypatch.setattr(module, "_checked", lambda *a: pytest.fail("the checked path ran"))
    for key, entry in list(entries.items()):
        if entry is getattr(_ext.module(), op + "_eager"):
            monkeypatch.setitem(fast.DIRECT, key, lambda *a, _e=entry: calls.append(a) or _e(*a))
    results = []
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(fast, "DIRECT", {})  # a library without entries: the registered op
        _, _, leaves = _case(op, 0.1, torch.Generator().manual_seed(2))
        torch.manual_seed(8)
        out = _public(op, 0.1, leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append((out.detach(), grads, torch.get_rng_state()))
    assert len(calls) == 1  # the entry ran once, then (DIRECT emptied) the registered op
    (a_out, a_grads, a_state), (b_out, b_grads, b_state) = results
    assert torch.equal(a_out, b_out) and torch.equal(a_state, b_state)
    for a, b in zip(a_grads, b_grads):
        assert torch.equal(a, b)


def test_activation_checkpointing_recomputes_the_entries_masks(cpu_backend):
    """torch.utils.checkpoint restores the generator before it recomputes: the entries' C++ draws
    repeat, so the gradients equal an uncheckpointed run's at the same seed."""
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    w1, b1, w2, b2, lw, lb, x0 = r(24, 16), r(24), r(16, 24), r(16), r(16), r(16), r(5, 16)
    params = (x0, w1, b1, w2, b2, lw, lb)

    def block(x):
        return ops.add_layer_norm(ops.feed_forward(x, w1, b1, w2, b2, dropout_p=0.2), x, lw, lb, 1e-5, 0.2)

    def run(checkpointed):
        torch.manual_seed(9)
        out = checkpoint(block, x0, use_reentrant=False) if checkpointed else block(x0)
        return [out.detach()] + list(torch.autograd.grad(out.square().sum(), params))

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_a_torch_function_mode_sees_the_registered_op(cpu_backend):
    """The entries bypass __torch_function__: under a TorchFunctionMode the fast path calls the
    registered op, which the mode sees (as it sees torch's own ops)."""
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        ops.add_layer_norm(torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-5, 0.1)
    assert "fastformer.add_layer_norm.default" in seen


def test_add_layer_norms_fast_path_asks_for_the_backend_on_every_call(monkeypatch):
    """The fast path's backend lookup (backends.select_eager) reads the request on each call: the
    variable changed between calls, and use_backend, send the next call where they say."""
    monkeypatch.setattr(backends._state, "name", None)
    entry = _ext.module().add_layer_norm_eager
    calls, refs = [], []
    for key, e in list(fast.DIRECT.items()):
        if e is entry:
            monkeypatch.setitem(fast.DIRECT, key, lambda *a: calls.append(1) or entry(*a))
    real = reference.add_layer_norm
    monkeypatch.setattr(reference, "add_layer_norm", lambda *a, **k: refs.append(1) or real(*a, **k))
    x, r, w, b = (torch.randn(4, 16), torch.randn(4, 16), torch.randn(16), torch.randn(16))
    want = torch.nn.functional.layer_norm(r + x, (16,), w, b, 1e-5)
    expected = []
    for env, use in (("reference", None), ("cpu", None), ("cpu", "reference"), (None, None), ("reference", "cpu")):
        if env is None:
            monkeypatch.delenv("FASTFORMER_BACKEND", raising=False)
        else:
            monkeypatch.setenv("FASTFORMER_BACKEND", env)
        with backends.use_backend(use) if use else contextlib.nullcontext():
            torch.testing.assert_close(ops.add_layer_norm(x, r, w, b, 1e-5, 0.0), want)
        expected.append("reference" if (use or env) == "reference" else "cpu")
        assert (len(refs), len(calls)) == (expected.count("reference"), expected.count("cpu")), (env, use)
