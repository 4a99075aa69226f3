"""cross_entropy and linear_cross_entropy in bf16 at mT5's vocabulary (V = 250,112): loss and
gradients against the fp64 reference within FlashAttention's rule (the kernel's error at most
about twice that of PyTorch's own bf16 computation, ``F.linear`` in bf16 then ``F.cross_entropy``
as transformers computes its loss), and proof that the log-sum-exp over the 250k classes is
accumulated in fp32: with every logit equal, lse = log(V) + x, which a bf16 running sum cannot
reach (it stops at 256)."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer.ops import cross_entropy, linear_cross_entropy, reference
from utils import assert_close_lowp, device_for, kernel_backends

pytestmark = pytest.mark.usefixtures("one_thread_module")

V = 250_112  # mT5's vocabulary
E = 64
BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends("cpu", "triton")
# The Triton interpreter runs each row's program in numpy: fewer rows keep its cases to seconds.
ROWS = {"reference": 7, "cpu": 7, "triton": 4}
# FlashAttention's rule; Triton's interpreter truncates fp32 -> bf16 where torch rounds (twice
# the error of a rounding, at most), hence its factor in tests/test_linear_cross_entropy.py too.
FACTOR = {"reference": 2.0, "cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0}
ATOL = 1e-5


@functools.lru_cache(maxsize=4)  # the cases with and without smoothing share them (never written to)
def _inputs(N, equal_logits=False, seed=0):
    """hidden (N, E), weight (V, E), bias (V,) in bf16, logits O(1..3); target (N,) with every third
    row ignored (-100). ``equal_logits``: every weight row the same and no bias, so each row's
    logits are all equal."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, E, generator=gen)
    if equal_logits:
        weight = (torch.randn(1, E, generator=gen) / E ** 0.5).expand(V, E).contiguous()
        bias = None
    else:
        weight = 2.0 * torch.randn(V, E, generator=gen) / E ** 0.5
        bias = torch.randn(V, generator=gen)
    target = torch.randint(0, V, (N,), generator=gen)
    target[1::3] = -100
    bf = lambda t: None if t is None else t.to(torch.bfloat16)  # noqa: E731
    return bf(hidden), bf(weight), bf(bias), target


def _loss_and_grads(fn, leaves):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    loss = fn(*leaves)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present)
    return loss.detach(), grads


def _torch_bf16(target, eps):
    """What transformers computes: the bf16 logits, then F.cross_entropy on them."""
    return lambda h, w, b: F.cross_entropy(F.linear(h, w, b), target, label_smoothing=eps)


def _check(backend, hidden, weight, bias, target, eps):
    device = device_for(backend)
    inputs = [None if t is None else t.to(device) for t in (hidden, weight, bias)]
    target = target.to(device)

    def fused(h, w, b):
        with fastformer.use_backend(backend):
            return linear_cross_entropy(h, w, target, linear_bias=b, label_smoothing=eps)

    loss, grads = _loss_and_grads(fused, inputs)
    lp_loss, lp_grads = _loss_and_grads(_torch_bf16(target, eps), inputs)
    ref_loss, ref_grads = _loss_and_grads(
        lambda h, w, b: reference.linear_cross_entropy(h, w, target, linear_bias=b, label_smoothing=eps),
        [None if t is None else t.double() for t in inputs])
    assert loss.dtype == torch.bfloat16 and ref_loss.dtype == torch.float64
    assert_close_lowp("loss", loss, ref_loss, lp_loss, factor=FACTOR[backend], atol=ATOL)
    for name, g, ref, lp in zip(("dhidden", "dweight", "dbias"), grads, ref_grads, lp_grads):
        assert g.dtype == torch.bfloat16
        assert_close_lowp(name, g, ref, lp, factor=FACTOR[backend], atol=ATOL)
    return loss


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_bf16_at_mt5_vocab(backend, eps):
    _check(backend, *_inputs(ROWS[backend]), eps)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_bf16_at_mt5_vocab(backend, eps):
    device = device_for(backend)
    hidden, weight, bias, target = _inputs(ROWS[backend], seed=1)
    logits = F.linear(hidden, weight, bias).to(device)  # (N, V) bf16
    target = target.to(device)

    def fused(x):
        with fastformer.use_backend(backend):
            return cross_entropy(x, target, label_smoothing=eps)

    (loss, (grad,)) = _loss_and_grads(fused, [logits])
    (lp_loss, (lp_grad,)) = _loss_and_grads(lambda x: F.cross_entropy(x, target, label_smoothing=eps), [logits])
    (ref_loss, (ref_grad,)) = _loss_and_grads(
        lambda x: reference.cross_entropy(x, target, label_smoothing=eps), [logits.double()])
    assert loss.dtype == grad.dtype == torch.bfloat16
    assert_close_lowp("loss", loss, ref_loss, lp_loss, factor=FACTOR[backend], atol=ATOL)
    assert_close_lowp("dlogits", grad, ref_grad, lp_grad, factor=FACTOR[backend], atol=ATOL)


def test_a_bf16_running_sum_stops_at_256():
    """Why the equal-logits case tells fp32 from bf16 accumulation: bf16 has 8 significant bits, so
    a running sum of exp(0) = 1 over the classes stops at 256 (256 + 1 rounds back to 256), and its
    lse would be log(256) + x, 6.9 below the true log(250112) + x."""
    s = torch.tensor(256.0, dtype=torch.bfloat16)
    assert s + 1 == s
    assert math.log(V) - math.log(256) > 6.8


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_logits_sum_250k_terms_in_fp32(backend, eps):
    """Every logit of a row equal to x: lse = log(V) + x, so the loss (smoothed or not) is log(V)
    exactly, and d(loss)/d(weight) of a class other than the target is softmax = 1/V times the
    rows' hidden states; a bf16 accumulator would give log(256) and 1/256 (977 times too large)."""
    hidden, weight, bias, target = _inputs(ROWS[backend], equal_logits=True, seed=2)
    loss = _check(backend, hidden, weight, bias, target, eps)
    # bf16's spacing at 12.4 is 1/16: the loss is log(V) to its rounding
    assert abs(loss.item() - math.log(V)) <= 1 / 32, loss.item()
