"""The cuda backend's two forms of `philox` (csrc/cuda/glue.h, ff_philox_args): an int64 CPU
tensor (2,) = (seed, offset) read on the host and passed by value, or an int64 (2,) tensor on the
op's device whose values the kernels read through its pointer (ff_philox_resolve,
csrc/cuda/philox.cuh), so that a captured CUDA graph replays with a fresh mask.

Under the SIMT harness the "device" is the CPU: fastformer_simt_selftest.set_philox_on_device(True)
makes a CPU philox take the device form (checked, never read on the host; the launchers get its
pointer and wrong by-value numbers). The same (seed, offset) by value and by pointer must give
bit-equal outputs and gradients, on every kernel with dropout: attention (the FMA kernels for fp32,
the tensor-core ones for fp16 / bf16), attention_varlen, add_layer_norm, feed_forward, embedding;
and the device form's malformed tensors fail with messages naming `philox`."""
import contextlib
import math

import pytest
import torch

from simt import plugin

pytestmark = pytest.mark.skipif(plugin.load_error() is not None, reason=str(plugin.load_error()))

SEED, OFFSET = 0x123456789AB, 977  # nonzero both, so that the by-value zeros of the device form differ


def ops():
    return torch.ops.fastformer_simt


def selftest():
    return torch.ops.fastformer_simt_selftest


@contextlib.contextmanager
def philox_on_device(on=True):
    previous = selftest().set_philox_on_device(on)
    try:
        yield
    finally:
        selftest().set_philox_on_device(previous)


def _philox(seed=SEED, offset=OFFSET):
    return torch.tensor([seed, offset], dtype=torch.int64)


def _both(fn, *, seed=SEED, offset=OFFSET):
    """fn(philox) by value, then by pointer; the pointer run's philox is a fresh tensor."""
    by_value = fn(_philox(seed, offset))
    with philox_on_device():
        by_pointer = fn(_philox(seed, offset))
    return by_value, by_pointer


def _assert_equal(by_value, by_pointer, what):
    by_value = by_value if isinstance(by_value, (tuple, list)) else (by_value,)
    by_pointer = by_pointer if isinstance(by_pointer, (tuple, list)) else (by_pointer,)
    assert len(by_value) == len(by_pointer)
    for i, (a, b) in enumerate(zip(by_value, by_pointer)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}: output {i} is None one way only"
            continue
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
            f"{what}: output {i} differs by pointer (max diff {(a.double() - b.double()).abs().max().item()})"


def _differs(a, b):
    return not torch.equal(a, b)


# ---- the switch itself

def test_switch_reports_its_previous_setting():
    previous = selftest().set_philox_on_device(True)
    try:
        assert previous is False
        assert selftest().set_philox_on_device(True) is True
    finally:
        selftest().set_philox_on_device(previous)


# ---- attention (padded): fp32 runs the FMA kernels (attention.cu), fp16 / bf16 the tensor-core
# ones (flash_fwd_mma.cu / flash_bwd_mma.cu)

def _attn_inputs(dtype, B=1, H=2, Sq=19, Sk=37, D=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype) for S in (Sq, Sk, Sk))
    dout = torch.randn(B, H, Sq, D, generator=gen).to(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_attention_fwd_bwd_by_pointer_equals_by_value(dtype):
    q, k, v, dout = _attn_inputs(dtype)
    scale, p = 1.0 / math.sqrt(q.shape[-1]), 0.3

    def run(philox):
        out, lse = ops().attention_fwd(q, k, v, None, None, True, scale, p, philox)
        dq, dk, dv, _ = ops().attention_bwd(dout, q, k, v, out, lse, None, None, True, scale, p, philox)
        return out, lse, dq, dk, dv

    by_value, by_pointer = _both(run)
    _assert_equal(by_value, by_pointer, f"attention {dtype}")
    # the mask is the pair's: another offset by pointer gives another output
    with philox_on_device():
        other = run(_philox(SEED, OFFSET + 1))
    assert _differs(other[0], by_value[0])


def test_attention_no_dropout_reads_nothing():
    q, k, v, dout = _attn_inputs(torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    want = ops().attention_fwd(q, k, v, None, None, False, scale, 0.0, _philox())
    with philox_on_device():
        # p = 0: the pointer is not passed, whatever the (device) values, even negative ones
        got = ops().attention_fwd(q, k, v, None, None, False, scale, 0.0, _philox(-5, -7))
    _assert_equal(want, got, "attention p=0")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_flash_mma_test_ops_by_pointer(dtype):
    """The tensor-core kernels' own test ops take seed / offset as ints; by pointer they pass them
    through a (2,) tensor, with wrong values by value."""
    q, k, v, dout = _attn_inputs(dtype, Sq=24, Sk=40)
    scale, p = 1.0 / math.sqrt(q.shape[-1]), 0.25

    def run():
        out, lse = selftest().flash_fwd_mma(q, k, v, None, None, False, scale, p, SEED, OFFSET)
        grads = selftest().flash_bwd_mma(dout, q, k, v, out, lse, None, None, False, scale, p, SEED, OFFSET)
        return (out, lse, *grads)

    by_value = run()
    with philox_on_device():
        by_pointer = run()
    _assert_equal(by_value, by_pointer, f"flash_mma {dtype}")


# ---- attention_varlen

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_attention_varlen_by_pointer_equals_by_value(dtype):
    gen = torch.Generator().manual_seed(1)
    lens_q, lens_k, H, D = [5, 11, 3], [9, 4, 13], 2, 16
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), H, D, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), H, D, generator=gen).to(dtype)
    dout = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype)
    scale, p = 1.0 / math.sqrt(D), 0.4

    def run(philox):
        out, lse = ops().attention_varlen_fwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, scale, p, philox)
        grads = ops().attention_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                           False, scale, p, philox)
        return (out, lse, *grads)

    by_value, by_pointer = _both(run)
    _assert_equal(by_value, by_pointer, f"attention_varlen {dtype}")


# ---- add_layer_norm

@pytest.mark.parametrize("C", [40, 13, 1030], ids=["vec-warp-row", "scalar", "block-row"])
@pytest.mark.parametrize("residual", [True, False], ids=["res", "nores"])
def test_add_layer_norm_by_pointer_equals_by_value(C, residual):
    gen = torch.Generator().manual_seed(2)
    N = 7
    x = torch.randn(N, C, generator=gen)
    res = torch.randn(N, C, generator=gen) if residual else None
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    dy, dh = torch.randn(N, C, generator=gen), torch.randn(N, C, generator=gen)
    p = 0.35

    def run(philox):
        y, h, mean, rstd = ops().add_layer_norm_fwd(x, res, w, b, 1e-5, p, philox)
        grads = ops().add_layer_norm_bwd(dy, dh, h, w, mean, rstd, p, philox, residual)
        return (y, h, mean, rstd, *grads)

    by_value, by_pointer = _both(run)
    _assert_equal(by_value, by_pointer, f"add_layer_norm C={C}")
    with philox_on_device():
        other = run(_philox(SEED + 1, OFFSET))
    assert _differs(other[1], by_value[1])


# ---- feed_forward

@pytest.mark.parametrize("F", [48, 21], ids=["vec", "scalar"])
def test_feed_forward_by_pointer_equals_by_value(F):
    gen = torch.Generator().manual_seed(3)
    N, E = 9, 12
    x = torch.randn(N, E, generator=gen)
    w1, b1 = torch.randn(F, E, generator=gen), torch.randn(F, generator=gen)
    w2, b2 = torch.randn(E, F, generator=gen), torch.randn(E, generator=gen)
    dout = torch.randn(N, E, generator=gen)
    p = 0.3

    def run(philox):
        out, pre = ops().feed_forward_fwd(x, w1, b1, w2, b2, "gelu", p, philox)
        grads = ops().feed_forward_bwd(dout, x, w1, w2, pre, True, True, "gelu", p, philox)
        return (out, pre, *grads)

    by_value, by_pointer = _both(run)
    _assert_equal(by_value, by_pointer, f"feed_forward F={F}")
    with philox_on_device():
        other = run(_philox(SEED, OFFSET + 5))
    assert _differs(other[0], by_value[0])


# ---- embedding

def test_embedding_by_pointer_equals_by_value():
    gen = torch.Generator().manual_seed(4)
    V, P, D, N = 11, 8, 20, 15
    weight, positional = torch.randn(V, D, generator=gen), torch.randn(P, D, generator=gen)
    ids = torch.randint(0, V, (N,), generator=gen)
    positions = torch.randint(0, P, (N,), generator=gen)
    grad = torch.randn(N, D, generator=gen)
    p, scale = 0.25, 1.5

    def run(philox):
        out = ops().embedding_fwd(ids, weight, positional, positions, scale, p, philox)
        dw, dpos = ops().embedding_bwd(grad, ids, positions, V, P, True, True, 2, scale, p, philox)
        return out, dw, dpos

    by_value, by_pointer = _both(run)
    _assert_equal(by_value, by_pointer, "embedding")
    with philox_on_device():
        other = run(_philox(SEED, OFFSET + 1))
    assert _differs(other[0], by_value[0])


# ---- the device form's checks

def _ln_fwd(philox, p=0.1):
    x, w, b = torch.randn(3, 8), torch.ones(8), torch.zeros(8)
    return ops().add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([1.0, 2.0]), r"add_layer_norm_fwd: philox must be int64 \(shape \(2,\) = \(seed, offset\)\), got Float"),
    (torch.tensor([1, 2, 3]), r"add_layer_norm_fwd: philox must have shape \(2,\) = \(seed, offset\), got \[3\]"),
    (torch.tensor([[1, 2]]), r"add_layer_norm_fwd: philox must have shape \(2,\) = \(seed, offset\), got \[1, 2\]"),
    (torch.arange(4)[::2], r"add_layer_norm_fwd: philox must be contiguous, got strides \[2\]"),
], ids=["dtype", "shape", "dims", "contiguous"])
def test_device_form_is_checked(bad, message):
    with philox_on_device(), pytest.raises(RuntimeError, match=message):
        _ln_fwd(bad)


def test_device_form_on_another_device_names_both():
    """A philox neither on the CPU nor on the op's device (a meta tensor stands for another GPU:
    the ops themselves would dispatch to Meta), either way of the switch, through the glue's
    reader itself."""
    bad = torch.empty(2, dtype=torch.int64, device="meta")
    message = r"philox_args: philox must be an int64 CPU tensor or on the op's device cpu \(shape \(2,\) = " \
              r"\(seed, offset\)\), got a philox on device meta for tensors on cpu"
    for on in (True, False):
        with philox_on_device(on), pytest.raises(RuntimeError, match=message):
            selftest().philox_args(bad, torch.zeros(1), 0.1)


def test_glue_reader_forms():
    """Host form: the values, no pointer; device form: no values read, the pointer only when p > 0."""
    assert selftest().philox_args(_philox(), torch.zeros(1), 0.1) == [SEED, OFFSET, 0]
    assert selftest().philox_args(_philox(), torch.zeros(1), 0.0) == [SEED, OFFSET, 0]
    with philox_on_device():
        assert selftest().philox_args(_philox(-3, -4), torch.zeros(1), 0.1) == [0, 0, 1]
        assert selftest().philox_args(_philox(-3, -4), torch.zeros(1), 0.0) == [0, 0, 0]
    with pytest.raises(RuntimeError, match=r"philox_args: the philox offset philox\[1\] must be >= 0, got -4"):
        selftest().philox_args(_philox(3, -4), torch.zeros(1), 0.1)  # the host form checks the values


def test_device_form_is_checked_without_dropout_too():
    with philox_on_device(), pytest.raises(RuntimeError, match="philox must be int64"):
        _ln_fwd(torch.tensor([1.0, 2.0]), p=0.0)


def test_host_form_messages_unchanged():
    """A CPU philox read on the host keeps read_philox's checks: the values too."""
    with pytest.raises(RuntimeError, match=r"add_layer_norm_fwd: the philox seed philox\[0\] must be >= 0, got -1"):
        _ln_fwd(torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match=r"add_layer_norm_fwd: philox must be int64"):
        _ln_fwd(torch.tensor([1.0, 2.0]))
    with pytest.raises(RuntimeError, match=r"add_layer_norm_fwd: philox must be contiguous"):
        _ln_fwd(torch.arange(4)[::2])


# ---- the launches folded away (csrc/cuda/LAUNCHES.md)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_folded_launches(dtype):
    """feed_forward's db1 / db2 come out of the column-sum kernel in the dtype (fp32 sums rounded
    once: no cast launch); linear_cross_entropy's fp32 accumulators are written by its first chunk
    (no zero fill) and cross_entropy's sum / none skip the count kernel: the same values as the
    compositions they replace."""
    gen = torch.Generator().manual_seed(5)
    N, E, F = 37, 16, 24
    x = torch.randn(N, E, generator=gen).to(dtype)
    w1, b1 = torch.randn(F, E, generator=gen).to(dtype), torch.randn(F, generator=gen).to(dtype)
    w2, b2 = torch.randn(E, F, generator=gen).to(dtype), torch.randn(E, generator=gen).to(dtype)
    dout = torch.randn(N, E, generator=gen).to(dtype)
    out, pre = ops().feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.0, _philox())
    dx, dw1, db1, dw2, db2 = ops().feed_forward_bwd(dout, x, w1, w2, pre, True, True, "relu", 0.0, _philox())
    assert db1.dtype == dtype and db2.dtype == dtype and db1.shape == (F,) and db2.shape == (E,)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(db2.float(), dout.float().sum(0).to(dtype).float(), **tol)
    dpre = (dout.float() @ w2.float()) * (pre.float() > 0)
    torch.testing.assert_close(db1.float(), dpre.sum(0).to(dtype).float(), **(tol if dtype == torch.float32
                                                                              else dict(atol=5e-2, rtol=2e-2)))

    # linear_cross_entropy: a fresh accumulator per call, several calls in a row (a left-over
    # accumulator would show as a sum of two calls)
    n, D, V = 9, 8, 30
    hidden = torch.randn(n, D, generator=gen).to(dtype)
    weight, bias = torch.randn(V, D, generator=gen).to(dtype), torch.randn(V, generator=gen).to(dtype)
    target = torch.randint(0, V, (n,), generator=gen)
    first = ops().linear_cross_entropy_fwd(hidden, weight, bias, target, 0.0, -100, 1, True)
    again = ops().linear_cross_entropy_fwd(hidden, weight, bias, target, 0.0, -100, 1, True)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    logits = hidden.float() @ weight.float().t() + bias.float()
    dlogits = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(target, V)) / n
    torch.testing.assert_close(first[2].float(), (dlogits.t() @ hidden.float()).to(dtype).float(),
                               **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    torch.testing.assert_close(first[3].float(), dlogits.sum(0).to(dtype).float(),
                               **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    for reduction in (0, 2):  # none, sum: no count kernel
        loss, _ = ops().cross_entropy_fwd(logits.to(dtype), target, 0.0, -100, reduction, False)
        want = torch.nn.functional.cross_entropy(logits.to(dtype).float(), target,
                                                 reduction=("none", "mean", "sum")[reduction])
        torch.testing.assert_close(loss.float(), want.to(dtype).float(), **(tol if dtype == torch.float32
                                                                            else dict(atol=5e-2, rtol=1e-2)))
