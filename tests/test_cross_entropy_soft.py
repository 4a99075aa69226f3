"""Probability ("soft") targets in cross_entropy and linear_cross_entropy, as torch's
``F.cross_entropy(logits, probs)``: the reference against torch (fp64, every layout, reduction,
smoothing, class weights, every gradient); ``auto`` computes them with the reference, and a
kernel backend chosen by name declines them with the reason (its kernels take class indices)."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import ops
from fastformer.ops import reference
from utils import assert_close, forward_backward, kernel_backends

REDUCTIONS = ("none", "mean", "sum")


def _probs(shape, dim):
    return torch.softmax(2.0 * torch.randn(shape, dtype=torch.float64), dim=dim)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", [(9, 13), (13,), (4, 13, 5), (1, 1023)])
def test_reference_matches_torch(shape, eps, reduction, weighted):
    C = shape[1] if len(shape) > 1 else shape[0]
    x, q = 2.0 * torch.randn(shape, dtype=torch.float64), _probs(shape, 1 if len(shape) > 1 else 0)
    w = torch.rand(C, dtype=torch.float64) if weighted else None
    kw = dict(weight=w, label_smoothing=eps, reduction=reduction)
    out_shape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
    up = torch.randn(out_shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
    (loss,), g = forward_backward(lambda a, b: reference.cross_entropy(a, b, **kw), [x, q], [up], ["logits", "probs"])
    (want,), want_g = forward_backward(lambda a, b: F.cross_entropy(a, b, **kw), [x, q], [up], ["logits", "probs"])
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    for name in want_g:
        assert_close(name, g[name], want_g[name], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_reference_matches_torch(reduction):
    h, lw, lb = (torch.randn(s, dtype=torch.float64) for s in ((10, 8), (11, 8), (11,)))
    q, w = _probs((10, 11), -1), torch.rand(11, dtype=torch.float64)
    kw = dict(weight=w, label_smoothing=0.1, reduction=reduction)
    up = torch.randn(10, dtype=torch.float64) if reduction == "none" else torch.tensor(0.7, dtype=torch.float64)
    names = ["input", "linear_weight", "linear_bias"]
    (loss,), g = forward_backward(lambda a, b, c: reference.linear_cross_entropy(a, b, q, linear_bias=c, **kw),
                                  [h, lw, lb], [up], names)
    (want,), want_g = forward_backward(lambda a, b, c: F.linear_cross_entropy(a, b, q, linear_bias=c, **kw),
                                       [h, lw, lb], [up], names)
    assert_close("loss", loss, want, atol=1e-12, rtol=1e-12)
    for name in names:
        assert_close(name, g[name], want_g[name], atol=1e-12, rtol=1e-10)


def test_auto_takes_the_reference():
    x, q = torch.randn(4, 13, 5), _probs((4, 13, 5), 1).float()
    h, lw = torch.randn(6, 8), torch.randn(13, 8)
    q2 = _probs((6, 13), -1).float()
    assert_close("ce", ops.cross_entropy(x, q, label_smoothing=0.1), F.cross_entropy(x, q, label_smoothing=0.1),
                 atol=1e-6, rtol=1e-5)
    assert_close("lce", ops.linear_cross_entropy(h, lw, q2), F.linear_cross_entropy(h, lw, q2), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", kernel_backends("cpu", "triton", "cuda"))
def test_a_kernel_backend_declines_them(backend):
    x, q = torch.randn(4, 7), _probs((4, 7), -1).float()
    with fastformer.use_backend(backend):
        with pytest.raises(RuntimeError, match="probability targets"):
            ops.cross_entropy(x, q)
        with pytest.raises(RuntimeError, match="probability targets"):
            ops.linear_cross_entropy(torch.randn(4, 5), torch.randn(7, 5), q)
