"""The ops' fast path (fastformer/internal/fast.py): the common eager call skips the Python checks
the C++ op repeats. It must be taken for that call, give what the checked path gives (bit for bit,
gradients and the generator's state after the draw too), and leave every other call to the checked
path. Wrong input still gets the checked path's words: the hostile-input suites (tests/hostile.py)
run through the public functions, so through this path first."""
import sys

import pytest
import torch

import fastformer
from fastformer import ops

from test_cpp_autograd_aln_ffn_emb import _missing

pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

OPS = ("attention", "add_layer_norm", "feed_forward", "embedding")


def _module(op):
    return sys.modules[f"fastformer.ops.{op}"]


def _case(op, p):
    """(leaves, public call, the same call on the checked path): leaves are fresh tensors each time."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "attention":
        kpm = torch.zeros(2, 5, dtype=torch.bool)
        kpm[1, 3:] = True
        leaves = [r(2, 2, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)]
        return (leaves, lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm, dropout_p=p),
                lambda q, k, v: _module(op)._checked(q, k, v, kpm, None, False, None, p))
    if op == "add_layer_norm":
        leaves = [r(2, 3, 16), r(2, 3, 16), 1 + r(16), r(16)]
        return (leaves, lambda x, res, w, b: ops.add_layer_norm(x, res, w, b, 1e-5, p),
                lambda x, res, w, b: _module(op)._checked(x, res, w, b, 1e-5, p, False, None))
    if op == "feed_forward":
        leaves = [r(2, 3, 16), r(32, 16) / 4, r(32), r(16, 32) / 6, r(16)]
        return (leaves, lambda *t: ops.feed_forward(*t, activation="gelu", dropout_p=p),
                lambda *t: _module(op)._checked(*t, "gelu", p))
    ids = torch.randint(0, 11, (2, 5), generator=g)
    leaves = [r(11, 8), r(9, 8)]
    return (leaves, lambda w, t: ops.embedding(ids, w, scale=2.0, positional=t, dropout_p=p, padding_idx=1),
            lambda w, t: _module(op)._checked(ids, w, 2.0, t, None, p, 1))


def _run(leaves, call):
    ts = [t.clone().requires_grad_() for t in leaves]
    torch.manual_seed(11)
    out = call(*ts)
    grads = torch.autograd.grad(out, ts, torch.ones_like(out))
    return out.detach(), grads, torch.get_rng_state()


@pytest.fixture(autouse=True)
def cpu_backend():
    with fastformer.use_backend("cpu"):
        yield


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("op", OPS)
def test_the_common_call_takes_the_fast_path_and_gives_the_checked_paths_result(op, p, monkeypatch):
    leaves, public, checked = _case(op, p)
    want = _run(leaves, checked)
    original = _module(op)._checked

    def refuse(*args):
        raise AssertionError("the checked path ran")

    monkeypatch.setattr(_module(op), "_checked", refuse)
    got = _run(leaves, public)
    monkeypatch.setattr(_module(op), "_checked", original)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    assert torch.equal(got[2], want[2])  # one draw, as the checked path makes


def _spy(monkeypatch, op):
    calls = []
    original = _module(op)._checked

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(_module(op), "_checked", spy)
    return calls


class Marked(torch.Tensor):
    """A tensor subclass: its calls are torch_function's, so the checked path's."""


@pytest.mark.parametrize("how", ["autocast", "subclass", "traced", "reference"])
@pytest.mark.parametrize("op", OPS)
def test_other_calls_take_the_checked_path(op, how, monkeypatch):
    leaves, public, _ = _case(op, 0.0)
    calls = _spy(monkeypatch, op)
    if how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            public(*leaves)
    elif how == "subclass":
        public(*[t.as_subclass(Marked) for t in leaves])
    elif how == "traced":
        torch.fx.experimental.proxy_tensor.make_fx(public)(*leaves)
    else:
        with fastformer.use_backend("reference"):
            public(*leaves)
    assert len(calls) == 1


def test_add_layer_norm_parameters_of_another_dtype_are_cast_by_the_checked_path(monkeypatch):
    calls = _spy(monkeypatch, "add_layer_norm")
    x = torch.randn(4, 8)
    y = ops.add_layer_norm(x, None, torch.ones(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64))
    assert len(calls) == 1 and y.dtype == torch.float32


def test_a_rejected_call_is_worded_by_the_checked_path(monkeypatch):
    # the C++ op refuses a float64 residual beside float32 x; the checked path says it in its words
    calls = _spy(monkeypatch, "add_layer_norm")
    with pytest.raises(TypeError, match="residual has dtype torch.float64 but x has dtype torch.float32"):
        ops.add_layer_norm(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64), torch.ones(8), torch.zeros(8))
    assert len(calls) == 1


def test_a_tensor_on_another_device_never_reaches_a_kernel():
    # the dispatcher would pick the meta kernel from the meta residual: the fast path checks devices
    with pytest.raises(ValueError, match="residual is on meta"):
        ops.add_layer_norm(torch.randn(4, 8), torch.empty(4, 8, device="meta"), torch.ones(8), torch.zeros(8))
