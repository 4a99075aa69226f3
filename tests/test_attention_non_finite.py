"""attention's NaN and inf are never hidden: every kernel backend gives the reference's NaN/inf
pattern in outputs and gradients (a user's NaN check must fire), and masking a non-finite key
hides it as the reference does. (attention_varlen's and cross_entropy's cases live in their own
files, tests/test_attention_varlen.py and tests/test_cross_entropy.py.)"""
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


# Non-finite values of v at keys hidden from some rows (the contract of fastformer.ops.attention's
# docstring): the reference multiplies them by a weight of 0 (NaN), the kernels skip the key tiles
# that no query of a tile sees (cpu, triton, and both CUDA kernels alike), so only this much holds
# on every backend.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
def test_non_finite_v_at_hidden_keys(backend, dtype):
    """Sq 150 > Sk 130, causal (rows 0-19 see no key; later query tiles skip the key tiles past
    their diagonal, whatever the tile size), a padded key. A NaN / inf in v reaches every row
    that sees its key; it may reach the rows that do not, in its own column only, never a row with
    no visible key; every other element is exactly what v with those values zeroed gives."""
    device = device_for(backend)
    B, H, Sq, Sk, D = 2, 2, 150, 130, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    v[0, 0, Sk - 1, 3] = float("nan")  # seen by the last row only
    v[0, 1, 60, 5] = float("nan")      # seen by rows >= 80 = 60 + Sq - Sk
    v[0, 1, 10, 9] = float("inf")      # seen by rows >= 30
    v[1, 0, 3, 2] = float("nan")       # padded away: seen by no row
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    kpm[1, 3] = True

    def run(v):
        t = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        with fastformer.use_backend(backend):
            return attention(*t, key_padding_mask=kpm.to(device), is_causal=True).cpu()

    out, clean = run(v), run(v.nan_to_num(0.0, 0.0, 0.0))
    visible = (torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)) & ~kpm[:, None, None, :]
    bad = ~torch.isfinite(v)  # (B, H, Sk, D)
    sees_bad = (visible.float() @ bad.float()) > 0  # (B, H, Sq, D): the row sees a bad key in that column
    may_be_bad = bad.any(2, keepdim=True) & visible.any(-1, keepdim=True)
    got_bad = ~torch.isfinite(out)
    assert sees_bad.sum() > 100 and (may_be_bad & ~sees_bad).sum() > 100, "the probe must have both kinds"
    assert got_bad[sees_bad].all(), f"{(~got_bad[sees_bad]).sum().item()} elements that see a NaN / inf are finite"
    assert not (got_bad & ~may_be_bad).any(), f"non-finite at {(got_bad & ~may_be_bad).nonzero()[:5].tolist()}"
    assert (out[:, :, :Sq - Sk] == 0).all(), "rows with no visible key must be 0"
    assert torch.equal(out[~got_bad], clean[~got_bad])
