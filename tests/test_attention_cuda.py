"""attention on the cuda backend, beyond the shared matrix of tests/test_attention.py: rows of
2100 keys (many key tiles) with head dim 256, fp16, dropout equal to the cpu backend's for the same
seed and offset, NaN in a later key tile, empty sizes, the glue's checks, the memory claim (nothing
of size Sq x Sk is allocated), and the same under the SIMT harness's reversed and warp_ahead
thread schedules.
Without a GPU these run on the SIMT harness (tests/simt)."""
import math

import pytest
import torch

import fastformer
from fastformer import backends, philox
from fastformer.ops import attention, reference
from test_attention import check_bwd_glue
from utils import (assert_close, assert_close_lowp, device_for, kernel_backends, other_simt_schedules_test,
                   peak_allocated)

CUDA = kernel_backends("cuda")
CPU_OK = backends.availability("cpu", "cpu")

# fp32 (atol, rtol): outputs, then gradients (sums over up to 2100 keys)
TOL = {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)}


def _grads(fn, qkv, dout):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _op(backend, masks, p=0.0, seed=1234):
    def fn(q, k, v):
        torch.manual_seed(seed)  # the Function draws (seed, offset) from torch's generator
        with fastformer.use_backend(backend):
            return attention(q, k, v, dropout_p=p, **masks)
    return fn


def _ref(masks, p=0.0, seed=1234):
    torch.manual_seed(seed)
    rng = philox.next_seed() if p > 0 else None  # the pair the kernel's Function drew

    def fn(q, k, v):
        return reference.attention(q, k, v, dropout_p=p, rng=rng, **masks)
    return fn


def _check(got, want, equal_nan=False):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        atol, rtol = TOL["out" if name == "out" else "grad"]
        if equal_nan:
            assert torch.equal(g.isnan(), w.isnan()), f"{name}: NaN at {int(g.isnan().sum())} places, " \
                                                      f"the reference at {int(w.isnan().sum())}"
            torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{name}: {m}")
        else:
            assert_close(name, g, w, atol=atol, rtol=rtol)


def _wide(device, D=256, Sq=3, Sk=2100, seed=0):
    """Rows of Sk = 2100 keys: 132 key tiles of 16 (D = 256) or 33 of 64 (D <= 64), the last one partial."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, S, D, generator=gen) for S in (Sq, Sk, Sk))
    dout = torch.randn(1, 2, Sq, D, generator=gen)
    kpm = torch.zeros(1, Sk, dtype=torch.bool)
    kpm[0, 700:900] = True
    am = torch.randn(1, 1, Sq, Sk, generator=gen)
    am[..., 1:, 5:40] = float("-inf")
    masks = dict(key_padding_mask=kpm.to(device), attn_mask=am.to(device), is_causal=True)
    return [t.to(device) for t in (q, k, v, dout)], masks


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("backend", CUDA)
def test_wide_rows_head_dim_256(backend, p):
    (q, k, v, dout), masks = _wide(device_for(backend))
    got = _grads(_op(backend, masks, p), (q, k, v), dout)
    assert all(torch.isfinite(t).all() for t in got)
    _check(got, _grads(_ref(masks, p), (q, k, v), dout))


@pytest.mark.parametrize("backend", CUDA)
def test_wide_rows_nan_in_a_later_tile(backend):
    """A NaN key in the 24th of 33 key tiles poisons every row that sees it, as in the reference (dV NaN at
    every key of those rows, hidden ones too; dK only at the keys they see); one hidden by the
    padding changes nothing."""
    (q, k, v, dout), masks = _wide(device_for(backend), D=40)
    k = k.clone()
    k[0, 0, 1500, 3] = float("nan")  # visible to every query of head (0, 0)
    k[0, 1, 800, 0] = float("nan")  # a padded key of head (0, 1)
    got = _grads(_op(backend, masks), (q, k, v), dout)
    want = _grads(_ref(masks), (q, k, v), dout)
    assert want[0][0, 0].isnan().all() and not want[0][0, 1].isnan().any()
    _check(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", CUDA)
def test_low_precision_head_dim_256_and_fp16(backend, dtype):
    """fp16 and bf16 (fp32 scores, softmax and accumulation) by FlashAttention's rule: at most twice
    the error of the reference computed in that precision."""
    (q, k, v, dout), masks = _wide(device_for(backend), Sq=33, Sk=203)
    qkv = [t.to(dtype) for t in (q, k, v)]
    got = _grads(_op(backend, masks, 0.2), qkv, dout.to(dtype))
    lowp = _grads(_ref(masks, 0.2), qkv, dout.to(dtype))
    fp32 = _grads(_ref(masks, 0.2), [t.float() for t in qkv], dout.to(dtype).float())
    for name, g, lp, r in zip(("out", "dq", "dk", "dv"), got, lowp, fp32):
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}"
        assert_close_lowp(name, g, r, lp, factor=2.0)


@pytest.mark.skipif(not CPU_OK, reason=f"needs the cpu backend too: {CPU_OK.reason}")
@pytest.mark.parametrize("backend", CUDA)
def test_dropout_equals_the_cpu_backend(backend):
    """The same seed and offset drop the same probabilities in the cpu and the cuda kernels: the
    outputs and every gradient agree at p = 0.3 (Sq != Sk, an offset whose low word wraps)."""
    gen = torch.Generator().manual_seed(8)
    B, H, Sq, Sk, D = 2, 2, 37, 203, 59
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for S in (Sq, Sk, Sk))
    dout = torch.randn(B, H, Sq, D, generator=gen)
    kpm = torch.rand(B, Sk, generator=gen) < 0.2
    am = torch.randn(B, 1, Sq, Sk, generator=gen).expand(B, H, Sq, Sk)
    seed, offset = 2**40 + 3, 2**32 - 1000
    results = {}
    for name in ("cpu", backend):
        dev = device_for(name)
        kern = backends.Kernels(name)
        args = [t.to(dev) for t in (q, k, v)]
        m = (kpm.to(dev), am.to(dev), True, 1.0 / math.sqrt(D), 0.3, philox.pack(seed, offset))
        out, lse = kern.attention_fwd(*args, *m)
        grads = kern.attention_bwd(dout.to(dev), *args, out, lse, *m)
        results[name] = [t.cpu() for t in (out, lse, *grads)]
    for name, c, g in zip(("out", "lse", "dq", "dk", "dv"), results["cpu"], results[backend]):
        atol, rtol = TOL["out" if name in ("out", "lse") else "grad"]
        assert_close(name, g, c, atol=atol, rtol=rtol)
    # dropout really acted: the result differs from the undropped one
    dev = device_for(backend)
    out0, _ = backends.Kernels(backend).attention_fwd(q.to(dev), k.to(dev), v.to(dev), kpm.to(dev), am.to(dev),
                                                      True, 1.0 / math.sqrt(D), 0.0,
                                                      philox.pack(seed, offset))
    assert (out0.cpu() - results[backend][0]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", CUDA)
def test_empty_sizes(backend):
    device = device_for(backend)
    kern = backends.Kernels(backend)
    q, k = torch.randn(2, 3, 5, 16, device=device), torch.randn(2, 3, 0, 16, device=device)
    out, lse = kern.attention_fwd(q, k, k, None, None, False, 0.25, 0.1, philox.pack(1, 0))  # no keys at all
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all() and lse.shape == (2, 3, 5)
    dq, dk, dv, _ = kern.attention_bwd(torch.randn_like(q), q, k, k, out, lse, None, None, False, 0.25, 0.1, philox.pack(1, 0))
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == k.shape
    q0 = torch.randn(0, 3, 5, 16, device=device, requires_grad=True)
    with fastformer.use_backend(backend):
        out0 = attention(q0, q0, q0)
    out0.sum().backward()
    assert out0.shape == (0, 3, 5, 16) and q0.grad.shape == q0.shape


@pytest.mark.parametrize("backend", CUDA)
def test_glue_checks_name_the_argument(backend):
    device = device_for(backend)
    fwd, bwd = backends.Kernels(backend).attention_fwd, backends.Kernels(backend).attention_bwd

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device).to(dtype)
    q, k, v = r(2, 3, 5, 8), r(2, 3, 7, 8), r(2, 3, 7, 8)
    kpm, am = torch.zeros(2, 7, dtype=torch.bool, device=device), r(2, 3, 5, 7)
    fwd_cases = [
        ((q[0], k, v, None, None), "q must be 4-D"),
        ((q.long(), k.long(), v.long(), None, None), "q must be float32, float16 or bfloat16"),
        ((q.double(), k.double(), v.double(), None, None), "q must be float32, float16 or bfloat16"),
        ((q, k.half(), v, None, None), "k has dtype Half but q has dtype Float"),
        ((q, r(2, 4, 7, 8), v, None, None), r"k has 4 heads, which must divide q's 3 heads"),
        ((q, k, r(2, 3, 6, 8), None, None), "v must have k's shape"),
        ((r(2, 3, 5, 16)[..., ::2], k, v, None, None), "q must have a contiguous last dimension"),
        ((*(r(1, 1, 2, 300) for _ in range(3)), None, None), r"head dim D must be in \[1, 256\]"),
        ((q, k, v, kpm.float(), None), "key_padding_mask must be bool"),
        ((q, k, v, kpm[:, :6], None), r"key_padding_mask must have shape \(B, Sk\)"),
        ((q, k, v, None, am.double()), "attn_mask must be float32"),
        ((q, k, v, None, am[0]), "attn_mask must be a 4-D view"),
        ((q, k, v, None, r(2, 3, 4, 7)), "attn_mask of shape .* does not broadcast"),
    ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            fwd(*args, False, 0.5, 0.0, philox.no_dropout())
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        fwd(q, k, v, None, None, False, 0.5, 1.0, philox.no_dropout())
    with pytest.raises(RuntimeError, match=r"philox seed philox\[0\] must be >= 0"):
        fwd(q, k, v, None, None, False, 0.5, 0.1, torch.tensor([-1, 0], device="cpu"))
    with pytest.raises(RuntimeError, match=r"philox offset philox\[1\] must be >= 0"):
        fwd(q, k, v, None, None, False, 0.5, 0.1, torch.tensor([1, -1], device="cpu"))
    with pytest.raises(RuntimeError, match="philox must be int64"):
        fwd(q, k, v, None, None, False, 0.5, 0.1, philox.pack(1, 0).to(torch.int32))
    with pytest.raises(RuntimeError, match="scale must be finite"):
        fwd(q, k, v, None, None, False, float("nan"), 0.0, philox.no_dropout())
    out, lse = fwd(q, k, v, None, None, False, 0.5, 0.0, philox.no_dropout())
    check_bwd_glue(bwd, q, k, v, out, lse, torch.float16, philox.no_dropout())


@pytest.mark.parametrize("backend", CUDA)
def test_no_sq_by_sk_buffer(backend):
    """Forward and backward allocate nothing of size Sq x Sk per head, with every mask kind and
    dropout (an attn_mask view that is not contiguous is read in place, never copied): on the
    harness the largest allocation the profiler sees, on a GPU the peak memory above the inputs."""
    device = device_for(backend)
    B, H, S, D = 1, 1, 1024, 16
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=gen).to(device) for _ in range(4))
    kpm = (torch.rand(B, S, generator=gen) < 0.1).to(device)
    am = torch.randn(S, S, generator=gen).to(device).t().expand(B, H, S, S)  # a transposed view
    square = S * S * 4  # one fp32 Sq x Sk matrix of one head: 4 MiB, 64x the size of q
    # what may exist at once: out, dq, dk, dv (64 KiB each), lse and delta (4 KiB each)
    kern = backends.Kernels(backend)
    args = (kpm, am, True, D ** -0.5, 0.1, philox.pack(3, 0))

    def run():
        out, lse = kern.attention_fwd(q, k, v, *args)
        return kern.attention_bwd(dout, q, k, v, out, lse, *args)

    grads, peak = peak_allocated(run, device)
    assert 0 < peak < square / 4, f"{peak} bytes allocated at once; an Sq x Sk fp32 matrix is {square}"
    assert grads[3].shape == (0,)  # no rel_bias: its gradient is empty
    assert all(torch.isfinite(g).all() and g.abs().amax() > 0 for g in grads[:3])


# The subsets re-run per schedule: reverse the tests of this file and part of the shared matrix;
# warp_ahead (each of the kernels' 8 warps alone to its next __syncthreads) a smaller part, the
# many-tile, head-dim 256 and dropout tests, to keep its time in check.
SCHEDULE_SUBSETS = {
    "reverse": "cuda and not thread_schedule and not glue_checks and not bf16 and not statistics"
               " and (not fp32 or d111 or 203x203)",
    "warp_ahead": "cuda and not thread_schedule and not glue_checks and not bf16 and not statistics"
                  " and not fp32 and not (no_visible_key and 0.2)",
}


test_other_thread_schedule = other_simt_schedules_test(
    ("test_attention_cuda.py", "test_attention.py"), SCHEDULE_SUBSETS,
    "The same kernels with the harness's threads run last to first (FF_SIMT_SCHEDULE=reverse), which "
    "shows the other half of a missing barrier within a warp's reach, or warp by warp (warp_ahead), which "
    "shows one between warps: in a fresh process on the already built harness.")
