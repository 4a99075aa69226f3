"""NaN and inf are never hidden: every kernel backend gives the reference's NaN/inf pattern in
outputs and gradients (a user's NaN check must fire), and masking a non-finite key hides it as
the reference does. (cross_entropy's cases live in tests/test_cross_entropy.py.)"""
import pytest
import torch

import fastformer
from fastformer.ops import attention, reference
from utils import device_for, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")

# name: (tensor to poison, index, value, is_causal, how the poisoned key is hidden or None)
CASES = {
    "nan_key": ("k", (0, 0, 3, 5), float("nan"), False, None),
    "nan_key_causal": ("k", (0, 0, 3, 5), float("nan"), True, None),
    "nan_query": ("q", (0, 1, 2, 0), float("nan"), False, None),
    "nan_value": ("v", (0, 0, 4, 7), float("nan"), False, None),
    "inf_query": ("q", (0, 0, 6, 1), float("inf"), False, None),
    "nan_key_padded_away": ("k", (0, 0, 3, 5), float("nan"), False, "key_padding_mask"),
    "nan_key_bool_mask_hides_it": ("k", (0, 0, 3, 5), float("nan"), False, "bool"),
    "nan_key_minus_inf_mask_hides_it": ("k", (0, 0, 3, 5), float("nan"), False, "float"),
}


def _run(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_non_finite_like_the_reference(backend, case):
    name, index, value, causal, hide = CASES[case]
    device = device_for(backend)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 2, 7, 16, generator=gen) for _ in range(4))
    dict(q=q, k=k, v=v)[name][index] = value
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    hidden = torch.zeros(2, 1, 1, 7, dtype=torch.bool)  # (B, 1, 1, Sk): the key for every query
    if hide is not None:
        (kpm if hide == "key_padding_mask" else hidden)[index[0], ..., index[2]] = True
    attn_mask = {"bool": hidden, "float": torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))}.get(hide)
    q, k, v, dout, kpm = (t.to(device) for t in (q, k, v, dout, kpm))
    kwargs = dict(key_padding_mask=kpm, is_causal=causal,
                  attn_mask=None if attn_mask is None else attn_mask.to(device))

    def kernel(q, k, v):
        with fastformer.use_backend(backend):
            return attention(q, k, v, **kwargs)

    out, grads = _run(kernel, q, k, v, dout)
    want, want_grads = _run(lambda q, k, v: reference.attention(q, k, v, **kwargs), q, k, v, dout)
    assert want.isnan().any() == (hide is None), "the probe must (or, hidden, must not) produce NaN"
    torch.testing.assert_close(out, want, equal_nan=True, atol=2e-5, rtol=1e-5)
    for grad_name, got, ref in zip("qkv", grads, want_grads):
        assert torch.equal(got.isnan(), ref.isnan()), (
            f"d{grad_name}: NaN at {got.isnan().sum().item()} places, the reference at {ref.isnan().sum().item()}")
        torch.testing.assert_close(got, ref, equal_nan=True, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"d{grad_name}: {m}")
