"""torch's CausalBias objects as attention's attn_mask: the fused causal mask in SDPA's two
alignments, against F.scaled_dot_product_attention with the same object, values and every gradient."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import fastformer
from fastformer import ops

from utils import assert_close_lowp, device_for, forward_backward, kernel_backends, skip_without_kernels

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()
BIASES = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}
# (Sq, Sk): fewer queries, more queries (lower-right leaves the first rows without keys), square
LENGTHS = [(5, 13), (13, 5), (9, 9)]


def _bias(kind, Sq, Sk):
    with warnings.catch_warnings():  # torch warns of NaN rows for lower-right with Sq > Sk; SDPA gives 0
        warnings.simplefilter("ignore", UserWarning)
        return BIASES[kind](Sq, Sk)


def _sdpa(q, k, v, bias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(BIASES))
@pytest.mark.parametrize("Sq,Sk", LENGTHS, ids=lambda n: str(n))
def test_causal_bias_matches_sdpa(backend, kind, Sq, Sk):
    skip_without_kernels(backend, "attention")
    dev = device_for(backend)
    gen = torch.Generator().manual_seed(Sq * 100 + Sk)
    B, H, D = 2, 3, 16
    q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for S in (Sq, Sk, Sk))
    dout = torch.randn(B, H, Sq, D, generator=gen, dtype=torch.float64)
    bias = _bias(kind, Sq, Sk)

    def run(fn, dtype):
        return forward_backward(fn, [t.to(dev, dtype) for t in (q, k, v)], (dout.to(dev, dtype),), "qkv")

    with fastformer.use_backend(backend):
        (out,), grads = run(lambda q, k, v: ops.attention(q, k, v, attn_mask=bias), torch.float32)
    (truth,), truth_grads = run(lambda q, k, v: _sdpa(q, k, v, bias), torch.float64)
    (ref32,), ref32_grads = run(lambda q, k, v: _sdpa(q, k, v, bias), torch.float32)
    # FlashAttention's rule: at most ~2x the error of PyTorch's own fp32 against fp64
    assert_close_lowp(f"out[{kind}]", out.cpu(), truth.cpu(), ref32.cpu())
    for name in "qkv":
        assert_close_lowp(f"d{name}[{kind}]", grads[name].cpu(), truth_grads[name].cpu(), ref32_grads[name].cpu())


@pytest.mark.parametrize("Sq,Sk", LENGTHS, ids=lambda n: str(n))
def test_causal_bias_fp64_matches_sdpa(Sq, Sk):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(1, 2, S, 8, generator=gen, dtype=torch.float64) * 18 - 9 for S in (Sq, Sk, Sk))
    dout = torch.randn(1, 2, Sq, 8, generator=gen, dtype=torch.float64)
    bias = _bias("upper_left", Sq, Sk)
    with fastformer.use_backend("cpu"):
        (out,), grads = forward_backward(lambda *a: ops.attention(*a, attn_mask=bias), (q, k, v), (dout,), "qkv")
    (want,), want_grads = forward_backward(lambda *a: _sdpa(*a, bias), (q, k, v), (dout,), "qkv")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for name in "qkv":
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-10, atol=1e-9)


def test_causal_bias_with_padding_and_dropout_matches_reference():
    """Key padding and dropout go through the same mapping on every backend: same bits as the
    reference for the same generator state."""
    Sq, Sk = 6, 11
    q, k, v = (torch.randn(2, 2, S, 8) for S in (Sq, Sk, Sk))
    kpm = torch.zeros(2, Sk, dtype=torch.bool)
    kpm[1, 3:] = True  # also hides keys the top-left rows of entry 1 would see
    outs = {}
    for backend in ("reference", "cpu"):
        torch.manual_seed(7)
        with fastformer.use_backend(backend):
            outs[backend] = ops.attention(q, k, v, attn_mask=_bias("upper_left", Sq, Sk), key_padding_mask=kpm,
                                          dropout_p=0.3)
    torch.testing.assert_close(outs["cpu"], outs["reference"], rtol=1e-5, atol=1e-6)


def test_causal_bias_refusals():
    q = torch.zeros(1, 1, 4, 8)
    k = torch.zeros(1, 1, 6, 8)
    with pytest.raises(ValueError, match="is_causal=False"):
        ops.attention(q, k, k, attn_mask=causal_upper_left(4, 6), is_causal=True)
    with pytest.raises(ValueError, match=r"CausalBias for \(Sq, Sk\) = \(4, 5\).*\(4, 6\)"):
        ops.attention(q, k, k, attn_mask=causal_upper_left(4, 5))
