"""attention_varlen on the cuda backend, beyond the shared matrix of tests/test_attention_varlen.py:
sequences spanning many query and key tiles in every head-dim bucket (D = 1, 40, 59, 64, 80, 111,
128, 129, 256; tiles of 64 / 32 / 16 rows), causal with Lq != Lk both ways, dropout, fp16 and bf16,
strided q / k / v views and gradients laid out like them, cu_seqlens out of range (the kernels
clamp them), determinism, the memory claim (nothing of size Lq x Lk is allocated), hypothesis over
lengths, and the same under the SIMT harness's reversed and warp_ahead thread schedules. Without a
GPU these run on the SIMT harness (tests/simt)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import fastformer
from fastformer import backends, philox
from fastformer.ops import attention_varlen, reference
from utils import (
    assert_close, assert_close_lowp, device_for, kernel_backends,
    other_simt_schedules_test, peak_allocated, skip_without_kernels)

CUDA = kernel_backends("cuda")
TOL = {"out": (2e-5, 1e-4), "grad": (1e-4, 1e-4)}  # fp32 (atol, rtol)


@pytest.fixture(autouse=True)
def _needs_the_kernels():
    skip_without_kernels("cuda", "attention_varlen")


def cu_seqlens(lengths, device="cpu"):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device=device)


def _inputs(H, D, lq, lk, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lq), H, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=gen) for _ in range(2))
    lengths = dict(cu_seqlens_q=cu_seqlens(lq, device), cu_seqlens_k=cu_seqlens(lk, device),
                   max_seqlen_q=max(lq, default=0), max_seqlen_k=max(lk, default=0))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], dout.to(device=device, dtype=dtype), lengths


def _grads(fn, qkv, dout):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    out = fn(*leaves)
    if not out.requires_grad:  # no query row at all (the reference then builds no graph)
        return (out.detach(), *(torch.zeros_like(t) for t in leaves))
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _kernel(qkv, dout, lengths, causal, p=0.0, seed=1234):
    def fn(q, k, v):
        torch.manual_seed(seed)  # the Function draws (seed, offset) from torch's generator
        with fastformer.use_backend("cuda"):
            return attention_varlen(q, k, v, **lengths, is_causal=causal, dropout_p=p)
    return _grads(fn, qkv, dout)


def _reference(qkv, dout, lengths, causal, p=0.0, seed=1234, dtype=torch.float32):
    torch.manual_seed(seed)
    rng = philox.next_seed() if p > 0 else None  # the pair the kernel's Function drew
    lengths = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in lengths.items()}
    return _grads(lambda q, k, v: reference.attention_varlen(q, k, v, **lengths, is_causal=causal, dropout_p=p,
                                                             rng=rng),
                  [t.detach().cpu().to(dtype) for t in qkv], dout.cpu().to(dtype))


def _check(got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        atol, rtol = TOL["out" if name == "out" else "grad"]
        assert_close(name, g.cpu(), w, atol=atol, rtol=rtol)


# (H, D, query lengths, key lengths): several tiles of 64 / 32 / 16 rows in each bucket, a partial
# last tile, an empty sequence, Lq > Lk and Lq < Lk.
HEAD_DIMS = {
    1: (2, [70, 0, 9], [65, 3, 0]),
    40: (2, [130, 5, 64], [67, 129, 64]),
    59: (1, [100, 33], [41, 150]),
    64: (1, [65, 64], [64, 1]),
    80: (2, [70, 3], [33, 90]),
    111: (1, [45, 97], [97, 20]),
    128: (1, [33, 40], [40, 33]),
    129: (1, [17, 40], [35, 18]),
    256: (2, [37, 16, 1], [20, 50, 17]),
}


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", sorted(HEAD_DIMS), ids=[f"d{d}" for d in sorted(HEAD_DIMS)])
@pytest.mark.parametrize("backend", CUDA)
def test_many_tiles_every_head_dim_bucket(backend, D, causal, p):
    H, lq, lk = HEAD_DIMS[D]
    qkv, dout, lengths = _inputs(H, D, lq, lk, device_for(backend), seed=D)
    got = _kernel(qkv, dout, lengths, causal, p)
    assert all(torch.isfinite(t).all() for t in got)
    _check(got, _reference(qkv, dout, lengths, causal, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [40, 111, 256], ids=["d40", "d111", "d256"])
@pytest.mark.parametrize("backend", CUDA)
def test_low_precision(backend, D, dtype):
    """fp16 / bf16 in, fp32 scores, softmax and accumulation: at most twice the error of the
    reference computed in that precision (FlashAttention's rule)."""
    H, lq, lk = HEAD_DIMS[D]
    qkv, dout, lengths = _inputs(H, D, lq, lk, device_for(backend), dtype=dtype, seed=3)
    got = _kernel(qkv, dout, lengths, True, 0.2)
    lowp = _reference(qkv, dout, lengths, True, 0.2, dtype=dtype)
    fp32 = _reference(qkv, dout, lengths, True, 0.2, dtype=torch.float32)
    for name, g, lp, r in zip(("out", "dq", "dk", "dv"), got, lowp, fp32):
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}"
        assert_close_lowp(name, g.cpu().float(), r, lp.float(), factor=2.0, atol=1e-3)


@pytest.mark.parametrize("backend", CUDA)
def test_strided_views_and_gradient_layout(backend):
    """q / k / v as views of one (total, 3, H, D) projection and a head-major q: read through their
    strides; the gradients come back laid out like empty_like of each input."""
    device = device_for(backend)
    H, D, lq, lk = 3, 48, [20, 37], [20, 37]
    gen = torch.Generator().manual_seed(5)
    qkv_packed = torch.randn(sum(lq), 3, H, D, generator=gen).to(device)
    q, k, v = qkv_packed.unbind(1)  # row stride 3 H D
    dout = torch.randn(sum(lq), H, D, generator=gen).to(device)
    lengths = dict(cu_seqlens_q=cu_seqlens(lq, device), cu_seqlens_k=cu_seqlens(lk, device),
                   max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    _check(_kernel((q, k, v), dout, lengths, True, 0.1), _reference((q, k, v), dout, lengths, True, 0.1))
    # the C++ op directly: a head-major q (strides (D, total D, 1)) gets a head-major dq
    qh = torch.randn(H, sum(lq), D, generator=gen).to(device).transpose(0, 1)
    kern = backends.Kernels("cuda")
    args = (*lengths.values(), True, D ** -0.5, 0.0, philox.pack(0, 0))
    out, lse = kern.attention_varlen_fwd(qh, k, v, *args)
    dq, dk, dv, _ = kern.attention_varlen_bwd(dout, qh, k, v, out, lse, *args)
    assert dq.stride() == torch.empty_like(qh).stride() and dk.stride() == torch.empty_like(k).stride()
    want = _reference((qh, k, v), dout, lengths, True)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
        atol, rtol = TOL["out" if name == "out" else "grad"]
        assert_close(name, g.cpu(), w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", CUDA)
def test_cu_seqlens_out_of_range_are_clamped(backend):
    """The glue never reads cu_seqlens on the host; the kernels clamp each sequence to [0, total)
    and to max_seqlen: values past the rows read nothing outside the tensors."""
    device = device_for(backend)
    H, D = 2, 24
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, H, D, generator=gen).to(device) for n in (5, 6, 6))
    kern = backends.Kernels("cuda")
    bad_q = torch.tensor([0, 3, 500], dtype=torch.int32, device=device)   # -> [0, 3), [3, 5)
    bad_k = torch.tensor([-7, 4, 1000], dtype=torch.int32, device=device)  # -> [0, 4), [4, 6)
    scale = D ** -0.5
    out, lse = kern.attention_varlen_fwd(q, k, v, bad_q, bad_k, 3, 4, False, scale, 0.0, philox.pack(0, 0))
    want = reference.attention_varlen(q.cpu(), k.cpu(), v.cpu(), cu_seqlens([3, 2]), cu_seqlens([4, 2]), 3, 4,
                                      scale=scale)
    assert_close("out", out.cpu(), want, atol=2e-5, rtol=1e-4)
    # a length above max_seqlen is cut to it: sequence 0 keeps its first 2 queries and 3 keys
    out, lse = kern.attention_varlen_fwd(q, k, v, cu_seqlens([5], device), cu_seqlens([6], device), 2, 3, False,
                                         scale, 0.0, philox.pack(0, 0))
    want = reference.attention_varlen(q[:2].cpu(), k[:3].cpu(), v[:3].cpu(), cu_seqlens([2]), cu_seqlens([3]), 2, 3,
                                      scale=scale)
    assert_close("out", out[:2].cpu(), want, atol=2e-5, rtol=1e-4)
    dq, dk, dv, _ = kern.attention_varlen_bwd(torch.ones_like(out), q, k, v, out, lse, bad_q, bad_k, 3, 4, False,
                                           scale, 0.0, philox.pack(0, 0))
    assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("backend", CUDA)
def test_backward_is_deterministic(backend):
    qkv, dout, lengths = _inputs(2, 64, [90, 31], [77, 100], device_for(backend), seed=11)
    first = _kernel(qkv, dout, lengths, True, 0.25)
    second = _kernel(qkv, dout, lengths, True, 0.25)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", CUDA)
def test_no_lq_by_lk_buffer(backend):
    """Forward and backward allocate nothing of size Lq x Lk per head: on the harness the largest
    allocation the profiler sees, on a GPU the peak memory above the inputs."""
    device = device_for(backend)
    L, H, D = 1024, 1, 16
    qkv, dout, lengths = _inputs(H, D, [L], [L], device)
    square = L * L * 4  # one fp32 Lq x Lk matrix of one head: 4 MiB, 64x the size of q
    # what may exist at once: out, dq, dk, dv (64 KiB each), lse and delta (4 KiB each)
    kern = backends.Kernels("cuda")
    args = (*lengths.values(), True, D ** -0.5, 0.1, philox.pack(3, 0))

    def run():
        out, lse = kern.attention_varlen_fwd(*qkv, *args)
        return kern.attention_varlen_bwd(dout, *qkv, out, lse, *args)

    _, peak = peak_allocated(run, device)
    assert 0 < peak < square / 4, f"{peak} bytes allocated at once; an Lq x Lk fp32 matrix is {square}"


@pytest.mark.parametrize("backend", CUDA)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_hypothesis_lengths(backend, data):
    B = data.draw(st.integers(1, 4))
    lq = data.draw(st.lists(st.integers(0, 70), min_size=B, max_size=B))
    lk = data.draw(st.lists(st.integers(0, 70), min_size=B, max_size=B))
    D = data.draw(st.sampled_from([3, 16, 64, 65, 100, 160]))
    causal, p = data.draw(st.booleans()), data.draw(st.sampled_from([0.0, 0.2]))
    qkv, dout, lengths = _inputs(2, D, lq, lk, device_for(backend))
    lengths["max_seqlen_q"] += data.draw(st.integers(0, 20))  # a bound above the longest is allowed
    lengths["max_seqlen_k"] += data.draw(st.integers(0, 20))  # (it changes the dropout counters)
    _check(_kernel(qkv, dout, lengths, causal, p), _reference(qkv, dout, lengths, causal, p))


# The subsets re-run per schedule: reverse the tile tests of this file and the shared varlen tests;
# warp_ahead (each of the kernels' warps alone to its next __syncthreads) fewer tile tests, fp16 /
# bf16 (the tensor-core forward and backward) and the dropout, lse and NaN tests, to keep its time
# in check.
SCHEDULE_SUBSETS = {
    "reverse": "(many_tiles and causal and (d40 or d111 or d256)) or (cuda and (fp32 or dropout or lse or nan))",
    "warp_ahead": "(many_tiles and causal and 0.3 and (d40 or d256)) or (low_precision and d40) or "
                  "(cuda and (dropout or lse or nan))",
}


test_other_thread_schedule = other_simt_schedules_test(
    ("test_attention_varlen_cuda.py", "test_attention_varlen.py"), SCHEDULE_SUBSETS,
    "The varlen kernels' subset under the harness's other schedules (as test_attention_cuda.py's "
    "test_other_thread_schedule): a missing barrier within a warp's reach or between warps fails it.")
