"""add_layer_norm: the reference against torch, then every kernel backend against the reference
(forward and every gradient), dropout exactness and statistics, gradcheck, opcheck, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import add_layer_norm, reference
from utils import (
    OUTSIDE_OTHER_SIMT_SCHEDULES, assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends,
    num_threads, rerun_under_simt_schedule)

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
CPU_CUDA = kernel_backends("cpu", "cuda")  # cuda: a GPU, or the SIMT harness on CPU tensors
CUDA = kernel_backends("cuda")

# Shapes (..., C): hidden sizes 64, 1023, 256, 7; row counts 1, odd, round; leading dims.
SHAPES = [(1, 64), (7, 1023), (203, 256), (5, 7), (3, 7, 256), (1, 1, 1023), (64, 256)]
# The Triton interpreter is slow: a subset keeps its part of this file short.
TRITON_SHAPES = [(5, 7), (3, 7, 256), (1, 1, 1023)]
# cuda: warp-per-row (C <= 1024) and block-per-row kernels, 128-bit (C % 8 == 0) and scalar paths.
CUDA_SHAPES = [(1, 64), (7, 1023), (2, 4096), (5, 7), (3, 1500)]

# fp32 tolerances per backend: (atol, rtol) for outputs and for gradients.
FP32_TOL = {
    "cpu": {"out": (2e-5, 1e-5), "grad": (1e-4, 1e-5)},
    "triton": {"out": (2e-5, 1e-5), "grad": (1e-4, 1e-5)},
    "cuda": {"out": (2e-5, 1e-5), "grad": (1e-4, 1e-5)},
}
# bf16: FlashAttention's rule, kernel error <= LOWP_FACTOR x the bf16 reference's error (+ atol).
# Triton's interpreter (no GPU) converts fp32 -> bf16 by truncation, not round-to-nearest as the
# hardware does: up to a whole bf16 ulp instead of half, so it gets twice the factor there.
LOWP_FACTOR = {"cpu": 2.0, "triton": 2.0 if torch.cuda.is_available() else 4.0, "cuda": 2.0}

# name: (has residual, weight, bias, prenorm, which outputs get a gradient, dropout_p)
CONFIGS = {
    "post": (True, True, True, False, "y", 0.0),
    "post_dropout": (True, True, True, False, "y", 0.3),
    "no_residual_dropout": (False, True, True, False, "y", 0.2),
    "no_affine": (True, False, False, False, "y", 0.0),
    "weight_only_dropout": (True, True, False, False, "y", 0.1),
    "prenorm_grad_y_only": (True, True, True, True, "y", 0.1),
    "prenorm_grad_both": (True, True, True, True, "yh", 0.0),
    "prenorm_grad_both_dropout": (True, True, True, True, "yh", 0.25),
    "prenorm_grad_h_only_dropout": (True, True, True, True, "h", 0.2),
}
INPUT_NAMES = ("x", "residual", "weight", "bias")


def _shapes(backend):
    return {"triton": TRITON_SHAPES, "cuda": CUDA_SHAPES}.get(backend, SHAPES)


def _cases():
    for backend in BACKENDS:
        for shape in _shapes(backend.values[0]):
            for config in CONFIGS:
                yield pytest.param(backend.values[0], shape, config, marks=backend.marks,
                                   id=f"{backend.id}-{'x'.join(map(str, shape))}-{config}")


def _make_inputs(shape, config, device):
    has_res, has_w, has_b, _, _, _ = CONFIGS[config]
    C = shape[-1]
    x = torch.randn(shape, device=device)
    residual = torch.randn(shape, device=device) if has_res else None
    weight = 1.0 + 0.5 * torch.randn(C, device=device) if has_w else None
    bias = 0.5 * torch.randn(C, device=device) if has_b else None
    return x, residual, weight, bias


def _run_case(backend, shape, config, dtype, inputs):
    """(kernel, reference in dtype, reference in fp32) outputs and gradients, same dropout mask."""
    _, _, _, prenorm, grad_of, p = CONFIGS[config]
    device = inputs[0].device
    gy = torch.randn(shape, device=device) if "y" in grad_of else None
    gh = torch.randn(shape, device=device) if "h" in grad_of else None
    upstream = (gy, gh) if prenorm else (gy,)
    torch.manual_seed(1234)
    rng = philox.next_seed()

    def kernel(x, r, w, b):
        torch.manual_seed(1234)  # the Function draws the same (seed, offset) as rng
        with fastformer.use_backend(backend):
            return add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm)

    def ref(x, r, w, b):
        return reference.add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm, rng=rng)

    cast = [None if t is None else t.to(dtype) for t in inputs]
    up_cast = [None if g is None else g.to(dtype) for g in upstream]
    out = forward_backward(kernel, cast, up_cast, INPUT_NAMES)
    ref_lowp = forward_backward(ref, cast, up_cast, INPUT_NAMES)
    ref_fp32 = forward_backward(ref, [None if t is None else t.float() for t in cast],
                                [None if g is None else g.float() for g in up_cast], INPUT_NAMES)
    return out, ref_lowp, ref_fp32


# ---------------------------------------------------------------- the reference against torch


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", [(5, 7), (3, 7, 256), (2, 1023)])
def test_reference_matches_torch_layer_norm(shape, p):
    C = shape[-1]
    inputs = (torch.randn(shape), torch.randn(shape), 1 + torch.randn(C), torch.randn(C))
    upstream = (torch.randn(shape),)
    rng = (987, 3)

    def torch_version(x, r, w, b):
        if p > 0:  # the shared Philox mask, applied by hand
            x = x * philox.keep_mask(x.shape, p, *rng).to(x.dtype) / (1 - p)
        return F.layer_norm(r + x, (C,), w, b, 1e-5)

    def ref(x, r, w, b):
        return reference.add_layer_norm(x, r, w, b, 1e-5, p, rng=rng)

    (y_ref,), g_ref = forward_backward(ref, inputs, upstream, INPUT_NAMES)
    (y_torch,), g_torch = forward_backward(torch_version, inputs, upstream, INPUT_NAMES)
    assert_close("y", y_ref, y_torch, atol=1e-5, rtol=1e-5)
    for name in INPUT_NAMES:
        assert_close(f"d{name}", g_ref[name], g_torch[name], atol=1e-4, rtol=1e-5)


def test_reference_prenorm_and_no_residual_no_affine():
    x, r = torch.randn(4, 33), torch.randn(4, 33)
    y, h = reference.add_layer_norm(x, r, None, None, 1e-5, prenorm=True)
    assert_close("h", h, x + r, atol=0, rtol=0)
    assert_close("y", y, F.layer_norm(x + r, (33,), eps=1e-5), atol=1e-5, rtol=1e-5)
    assert_close("y (no residual)", reference.add_layer_norm(x, None, None, None),
                 F.layer_norm(x, (33,), eps=1e-5), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- kernels against the reference


@pytest.mark.parametrize("backend,shape,config", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, shape, config):
    inputs = _make_inputs(shape, config, device_for(backend))
    (outs, grads), _, (ref_outs, ref_grads) = _run_case(backend, shape, config, torch.float32, inputs)
    atol, rtol = FP32_TOL[backend]["out"]
    for name, o, r in zip(("y", "h"), outs, ref_outs):
        assert_close(name, o, r, atol=atol, rtol=rtol)
    atol, rtol = FP32_TOL[backend]["grad"]
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend,shape,config", list(_cases()))
def test_bf16_forward_and_every_gradient(backend, shape, config):
    inputs = _make_inputs(shape, config, device_for(backend))
    (outs, grads), (lp_outs, lp_grads), (ref_outs, ref_grads) = _run_case(
        backend, shape, config, torch.bfloat16, inputs)
    factor = LOWP_FACTOR[backend]
    for name, o, lp, r in zip(("y", "h"), outs, lp_outs, ref_outs):
        assert o.dtype == torch.bfloat16
        assert_close_lowp(name, o, r, lp, factor=factor)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert grads[name].dtype == torch.bfloat16
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name], factor=factor)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_exactly_the_reference_mask(backend):
    """Same (seed, offset) as the reference: identical h (no rounding in x * scale + 0)."""
    device = device_for(backend)
    x = torch.randn(6, 300, device=device)
    w, b = torch.ones(300, device=device), torch.zeros(300, device=device)
    kern = backends.Kernels(backend)
    for seed, offset in ((5, 0), (2**40 + 3, 17)):
        _, h, _, _ = kern.add_layer_norm_fwd(x, None, w, b, 1e-5, 0.4, philox.pack(seed, offset))
        _, h_ref = reference.add_layer_norm(x, None, None, None, 1e-5, 0.4, prenorm=True,
                                            rng=(seed, offset))
        assert torch.equal(h, h_ref)


# ---------------------------------------------------------------- dropout statistics


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_statistics_and_backward_mask(backend, p):
    device = device_for(backend)
    N, C = (64, 257) if backend == "triton" else (256, 1000)
    kern = backends.Kernels(backend)
    x = torch.ones(N, C, device=device)
    w, b = torch.ones(C, device=device), torch.zeros(C, device=device)
    _, h, mean, rstd = kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(11, 0))
    kept = h != 0
    n = kept.numel()
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), f"keep rate {rate} for p={p}"
    assert torch.equal(h[kept], torch.full_like(h[kept], 1.0 / (1.0 - p)))
    assert torch.equal(kept, philox.keep_mask((N, C), p, 11, 0, device=device))
    # same seed: same mask; another seed or offset: another mask
    assert torch.equal(kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(11, 0))[1], h)
    assert not torch.equal(kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(12, 0))[1] != 0, kept)
    assert not torch.equal(kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(11, 1))[1] != 0, kept)
    # backward regenerates the same mask: with dy = 0 and dh = 1, dx is exactly keep * scale
    dx, dres, dw, db = kern.add_layer_norm_bwd(torch.zeros_like(h), torch.ones_like(h), h, w, mean,
                                               rstd, p, philox.pack(11, 0), True)
    assert torch.equal(dx, h)
    assert torch.equal(dres, torch.ones_like(h))


@pytest.mark.parametrize("config", ["prenorm_grad_both_dropout", "post"])
@pytest.mark.parametrize("shape", [(7, 1023), (2, 4096)])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_fp16_forward_and_every_gradient(backend, shape, config):
    """fp16 (a CUDA-only dtype): the same FlashAttention-style rule as bf16."""
    inputs = _make_inputs(shape, config, device_for(backend))
    (outs, grads), (lp_outs, lp_grads), (ref_outs, ref_grads) = _run_case(
        backend, shape, config, torch.float16, inputs)
    for name, o, lp, r in zip(("y", "h"), outs, lp_outs, ref_outs):
        assert o.dtype == torch.float16
        assert_close_lowp(name, o, r, lp, factor=LOWP_FACTOR[backend])
    for name in ref_grads:
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name],
                          factor=LOWP_FACTOR[backend])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [64, 4096])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_vector_and_scalar_paths_agree_bit_for_bit(backend, C, dtype):
    """Rows whose start is not 16-byte aligned take the scalar path; same per-thread arithmetic,
    so every output equals the 128-bit path's exactly."""
    device, N = device_for(backend), 5
    kern = backends.Kernels(backend)

    def misaligned(t):  # the same values one element into a larger buffer: contiguous, unaligned
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        buf[1:] = t.reshape(-1)
        return buf[1:].view(t.shape)

    x, r = torch.randn(N, C, device=device, dtype=dtype), torch.randn(N, C, device=device, dtype=dtype)
    w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    fwd = [kern.add_layer_norm_fwd(*a, 1e-5, 0.3, philox.pack(5, 7)) for a in ((x, r, w, b), tuple(misaligned(t) for t in (x, r, w, b)))]
    for got, want in zip(fwd[1], fwd[0]):
        assert torch.equal(got, want)
    _, h, mean, rstd = fwd[0]
    bwd = [kern.add_layer_norm_bwd(dy_, dh_, h_, w_, mean, rstd, 0.3, philox.pack(5, 7), True)
           for dy_, dh_, h_, w_ in ((dy, dh, h, w), tuple(misaligned(t) for t in (dy, dh, h, w)))]
    for got, want in zip(bwd[1], bwd[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_counters_past_32_bits(backend):
    """Group counters offset + r * G + g whose low word wraps use the high word as philox.py defines."""
    device = device_for(backend)
    x = torch.ones(3, 50, device=device)
    w, b = torch.ones(50, device=device), torch.zeros(50, device=device)
    offset = 2**32 - 10  # 7 counters a row: the wrap falls inside the second row
    _, h, _, _ = backends.Kernels(backend).add_layer_norm_fwd(x, None, w, b, 1e-5, 0.5, philox.pack(9, offset))
    assert torch.equal(h != 0, philox.keep_mask((3, 50), 0.5, 9, offset, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("C", [1, 7, 8, 9, 63, 64, 65, 1023, 1032])
@pytest.mark.parametrize("backend", CPU_CUDA)
def test_dropout_mask_is_the_reference_mask_for_odd_rows(backend, C, dtype):
    """Rows of any length C (the group counter restarts each row), offsets whose low word wraps
    mid-tensor, thresholds at both ends: forward h and backward dx are exactly keep * scale."""
    if backend == "cuda" and dtype == torch.float64:
        pytest.skip("the cuda backend has no float64 kernels")
    N = 37
    kern = backends.Kernels(backend)
    device = device_for(backend)
    x = torch.ones(N, C, dtype=dtype, device=device)
    w, b = torch.ones(C, dtype=dtype, device=device), torch.zeros(C, dtype=dtype, device=device)
    G = (C + 7) // 8
    for p, seed, offset in ((0.1, 3, 0), (0.5, 2**40 + 9, 2**32 - N * G // 2), (0.9, 2**62 - 1, 2**32 - 1),
                            (1e-6, 4, 5), (0.999995, 4, 5)):  # T = 0 keeps all, T = 65536 none
        _, h, mean, rstd = kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(seed, offset))
        keep = philox.keep_mask((N, C), p, seed, offset, device=device)
        assert torch.equal(h != 0, keep), f"forward mask, p={p} offset={offset}"
        assert torch.equal(h[keep], torch.full_like(h[keep], 1 / (1 - p)))
        dx, _, _, _ = kern.add_layer_norm_bwd(torch.zeros_like(h), torch.ones_like(h), h, w, mean, rstd,
                                              p, philox.pack(seed, offset), True)
        assert torch.equal(dx, h), f"backward mask, p={p} offset={offset}"


# The backward's grid comes from the SM count: the SIMT harness models one, which these tests set.
HARNESS_SM_COUNT = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="sets the SIMT harness's modelled SM count (a GPU has its own)")


@pytest.fixture
def sm_count():
    """set(n): the harness's modelled SM count for the rest of the test (restored after it)."""
    ops = torch.ops.fastformer_simt_selftest
    previous = ops.set_sm_count(0)  # 0 reads it
    yield ops.set_sm_count
    ops.set_sm_count(previous)


@HARNESS_SM_COUNT
@pytest.mark.parametrize("N,C", [(203, 256), (67, 1023), (37, 1500), (9, 4096)])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_backward_grid_from_the_sm_count(backend, N, C, sm_count):
    """1 SM (4 warp-row blocks or 1-2 block-row blocks: a warp or block takes many rows, its
    dweight / dbias sums kept in registers across them), 3 SMs, 132 (an H100: more blocks than
    rows, some with none): the partial rows reduce to dweight / dbias within fp32 rounding of the
    exact sums; dx and dresidual are per-row work, the same bits whatever the grid; a second run
    on the same grid gives the same bits (no atomics)."""
    device = device_for(backend)
    kern = backends.Kernels(backend)
    g = torch.Generator().manual_seed(N * 131 + C)
    x, r, dy, dh = (torch.randn(N, C, generator=g).to(device) for _ in range(4))
    w, b = (torch.randn(C, generator=g).to(device) for _ in range(2))
    _, h, mean, rstd = kern.add_layer_norm_fwd(x, r, w, b, 1e-5, 0.2, philox.pack(3, 5))
    xhat = (h.double() - mean.double()[:, None]) * rstd.double()[:, None]
    want_dw, want_db = (dy.double() * xhat).sum(0).float(), dy.double().sum(0).float()
    got = {}
    for sms in (1, 3, 132):
        sm_count(sms)
        got[sms] = kern.add_layer_norm_bwd(dy, dh, h, w, mean, rstd, 0.2, philox.pack(3, 5), True)
        _, _, dw, db = got[sms]
        assert_close(f"dweight ({sms} SMs)", dw, want_dw, *FP32_TOL[backend]["grad"])
        assert_close(f"dbias ({sms} SMs)", db, want_db, *FP32_TOL[backend]["grad"])
    for sms in (3, 132):
        for name, a, c in zip(("dx", "dresidual"), got[sms][:2], got[1][:2]):
            assert torch.equal(a, c), f"{name} differs between 1 and {sms} SMs"
    again = kern.add_layer_norm_bwd(dy, dh, h, w, mean, rstd, 0.2, philox.pack(3, 5), True)
    for name, a, c in zip(("dx", "dresidual", "dweight", "dbias"), again, got[132]):
        assert torch.equal(a, c), f"{name} differs between two runs"


@HARNESS_SM_COUNT
@pytest.mark.parametrize("C", [16400, 16411])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_backward_columns_past_the_register_sums(backend, C, sm_count):
    """Past 16384 columns (4 units of 8 a thread, 512 threads) a block-row thread's further
    columns accumulate dweight / dbias in the block's partial row instead of registers: 128-bit
    (16400) and scalar (16411) paths, every output and gradient against the reference, 1 SM so
    one block takes every row."""
    sm_count(1)
    shape = (3, C)
    inputs = _make_inputs(shape, "post_dropout", device_for(backend))
    (outs, grads), _, (ref_outs, ref_grads) = _run_case(backend, shape, "post_dropout", torch.float32, inputs)
    for name, o, r in zip(("y", "h"), outs, ref_outs):
        assert_close(name, o, r, *FP32_TOL[backend]["out"])
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@OUTSIDE_OTHER_SIMT_SCHEDULES
@pytest.mark.parametrize("schedule", ["reverse", "warp_ahead"])
@pytest.mark.parametrize("backend", CUDA)
def test_cuda_other_thread_schedule(backend, schedule):
    """The backward's block sums (warps added in shared memory) and the partial-sum kernel's tree
    with the harness's threads run last to first (FF_SIMT_SCHEDULE=reverse), which shows the other
    half of a missing barrier within a warp's reach, or warp by warp to each __syncthreads
    (warp_ahead), which shows one between warps: the grid, register-overflow, fp32 dropout and
    128-bit / scalar tests of this file in a fresh process on the already built harness."""
    rerun_under_simt_schedule(schedule, ("test_add_layer_norm.py",),
                              "cuda and (sm_count or register_sums or (fp32 and (post_dropout or prenorm_grad_both))"
                              " or vector_and_scalar)")


@pytest.mark.parametrize("C", [1, 7, 8, 9, 65])
@pytest.mark.parametrize("backend", kernel_backends("triton"))
def test_triton_dropout_rows_of_any_width(backend, C):
    """Rows narrower than a Philox group (C < 8, BLOCK_C rounded up to 8) and rows ending
    mid-group: forward h and the backward's regenerated mask are philox.keep_mask's."""
    device = device_for(backend)
    N, p, seed, offset = 5, 0.5, 2**35 + 1, 2**32 - 3 * ((C + 7) // 8)  # the low word wraps at row 3
    x = torch.ones(N, C, device=device)
    w, b = torch.ones(C, device=device), torch.zeros(C, device=device)
    kern = backends.Kernels(backend)
    _, h, mean, rstd = kern.add_layer_norm_fwd(x, None, w, b, 1e-5, p, philox.pack(seed, offset))
    keep = philox.keep_mask((N, C), p, seed, offset, device=device)
    assert torch.equal(h, keep.float() * 2.0)
    dx, _, _, _ = kern.add_layer_norm_bwd(torch.zeros_like(h), torch.ones_like(h), h, w, mean, rstd,
                                          p, philox.pack(seed, offset), True)
    assert torch.equal(dx, keep.float() * 2.0)


def test_functional_op_draws_seed_from_torch_generator():
    """torch.manual_seed makes the op repeatable; the reference with the recovered rng agrees."""
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    torch.manual_seed(3)
    y1 = add_layer_norm(x, r, None, None, dropout_p=0.5)
    torch.manual_seed(3)
    y2 = add_layer_norm(x, r, None, None, dropout_p=0.5)
    torch.manual_seed(3)
    rng = philox.next_seed()
    assert torch.equal(y1, y2)
    assert_close("y", y1, reference.add_layer_norm(x, r, None, None, dropout_p=0.5, rng=rng),
                 atol=2e-5, rtol=1e-5)
    assert not torch.equal(add_layer_norm(x, r, None, None, dropout_p=0.5), y1)


# ---------------------------------------------------------------- gradcheck, opcheck, edge cases


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, p, has_residual, prenorm):
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    x, w, b = make(3, 2, 7), make(7), make(7)
    r = make(3, 2, 7) if has_residual else None

    def fn(x, r, w, b):
        torch.manual_seed(42)  # the same dropout mask on every evaluation
        with fastformer.use_backend(backend):
            return add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm)

    assert torch.autograd.gradcheck(fn, (x, r, w, b), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_opcheck(backend, dtype):
    """Both overloads of each op: the plain one and .x_bias (the producing linear layer's bias)."""
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    x, r = torch.randn(5, 37, dtype=dtype), torch.randn(5, 37, dtype=dtype)
    w, b, xb = (torch.randn(37, dtype=dtype) for _ in range(3))
    for overload, extra in (("default", ()), ("x_bias", (xb,))):
        fwd, bwd = getattr(ops.add_layer_norm_fwd, overload), getattr(ops.add_layer_norm_bwd, overload)
        for residual, p in ((r, 0.2), (None, 0.0), (r, 0.0)):
            torch.library.opcheck(fwd, (x, residual, w, b, 1e-5, p, philox.pack(7, 3), *extra))
            _, h, mean, rstd = fwd(x, residual, w, b, 1e-5, p, philox.pack(7, 3), *extra)
            for dh in (None, torch.randn_like(x)):
                args = (torch.randn_like(x), dh, h, w, mean, rstd, p, philox.pack(7, 3), residual is not None)
                torch.library.opcheck(bwd, args)


@pytest.mark.parametrize("backend", CPU_CUDA)
def test_backward_returns_empty_dresidual_unless_it_differs_from_dx(backend):
    kern = backends.Kernels(backend)
    d = device_for(backend)
    x, r = torch.randn(4, 9, device=d), torch.randn(4, 9, device=d)
    w, b = torch.randn(9, device=d), torch.randn(9, device=d)
    dy = torch.randn(4, 9, device=d)
    for p, has_res, separate in ((0.0, True, False), (0.3, False, False), (0.3, True, True)):
        _, h, mean, rstd = kern.add_layer_norm_fwd(x, r if has_res else None, w, b, 1e-5, p, philox.pack(1, 0))
        dx, dres, _, _ = kern.add_layer_norm_bwd(dy, None, h, w, mean, rstd, p, philox.pack(1, 0), has_res)
        assert dres.numel() == (dx.numel() if separate else 0)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_any_thread_count(backend, threads):
    """Rows split over 1 or 3 threads (per-thread dweight / dbias partial sums) give the same answer."""
    with num_threads(threads):
        shape, config = (203, 256), "prenorm_grad_both_dropout"
        inputs = _make_inputs(shape, config, "cpu")
        (outs, grads), _, (ref_outs, ref_grads) = _run_case(backend, shape, config, torch.float32,
                                                            inputs)
    for name, o, r in zip(("y", "h"), outs, ref_outs):
        assert_close(name, o, r, *FP32_TOL[backend]["out"])
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], *FP32_TOL[backend]["grad"])


@pytest.mark.parametrize("backend", CPU_CUDA)
def test_zero_rows(backend):
    d = device_for(backend)
    x = torch.randn(0, 16, device=d, requires_grad=True)
    w = torch.randn(16, device=d, requires_grad=True)
    with fastformer.use_backend(backend):
        y = add_layer_norm(x, None, w, None, dropout_p=0.1)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16, device=d))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_clear_errors(backend):
    device = device_for(backend)
    x, r = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match="residual must have shape"):
            add_layer_norm(x, torch.randn(4, 9, device=device), w, None)
        with pytest.raises(ValueError, match="weight must have shape"):
            add_layer_norm(x, r, torch.randn(7, device=device), None)
        with pytest.raises(ValueError, match="bias must have 1 dimensions"):
            add_layer_norm(x, r, w, torch.randn(1, 8, device=device))
        with pytest.raises(TypeError, match="residual has dtype"):
            add_layer_norm(x, r.to(torch.bfloat16), w, None)
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            add_layer_norm(x.long(), None, None, None)
        for p in (1.0, -0.1, 1.5):
            with pytest.raises(ValueError, match="dropout_p must be a number in"):
                add_layer_norm(x, r, w, None, dropout_p=p)
        with pytest.raises(ValueError, match="eps must be a positive number"):
            add_layer_norm(x, r, w, None, eps=0.0)


@pytest.mark.parametrize("backend", CPU_CUDA)
def test_kernel_checks_name_the_argument(backend):
    kern = backends.Kernels(backend)
    torch.set_default_device(device_for(backend))
    try:
        _kernel_checks(kern)
    finally:
        torch.set_default_device(None)


def _kernel_checks(kern):
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    Z = philox.pack(0, 0)  # (seed, offset) of the calls without dropout
    _, h, mean, rstd = kern.add_layer_norm_fwd(x, None, w, b, 1e-5, 0.0, Z)
    fwd_cases = [
        ((torch.randn(32), None, w, b, 1e-5, 0.0, Z), "x must be 2-D"),
        ((x.long(), None, w, b, 1e-5, 0.0, Z), "x must be float32, float(64|16) or bfloat16"),
        ((torch.randn(8, 4).t(), None, w, b, 1e-5, 0.0, Z), "x must be contiguous"),
        ((x, torch.randn(4, 7), w, b, 1e-5, 0.0, Z), "residual must have the shape of x"),
        ((x, x.double(), w, b, 1e-5, 0.0, Z), "residual must have the dtype of x"),
        ((x, None, torch.randn(7), b, 1e-5, 0.0, Z), r"weight must have shape \(8,\)"),
        ((x, None, w, b.double(), 1e-5, 0.0, Z), "bias must have the dtype of x"),
        ((x, None, w, b, 0.0, 0.0, Z), "eps must be > 0"),
        ((x, None, w, b, 1e-5, 1.0, Z), r"dropout_p must be in \[0, 1\)"),
        ((x, None, w, b, 1e-5, 0.1, torch.tensor([-1, 0], device="cpu")), r"the philox seed philox\[0\] must be >= 0"),
        ((x, None, w, b, 1e-5, 0.1, torch.zeros(2, dtype=torch.int32, device="cpu")), "philox must be int64"),
    ]
    for args, message in fwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.add_layer_norm_fwd(*args)
    bwd_cases = [
        ((torch.randn(4, 7), None, h, w, mean, rstd, 0.0, Z, False), "dy must have the shape of h"),
        ((x, torch.randn(3, 8), h, w, mean, rstd, 0.0, Z, False), "dh must have the shape of h"),
        ((x, None, h, w, mean.double(), rstd, 0.0, Z, False), "mean must be float32"),
        ((x, None, h, w, mean, rstd[:3], 0.0, Z, False), r"rstd must have shape \(4,\)"),
        ((x, None, h, w, mean, rstd, -0.5, Z, False), r"dropout_p must be in \[0, 1\)"),
    ]
    for args, message in bwd_cases:
        with pytest.raises(RuntimeError, match=message):
            kern.add_layer_norm_bwd(*args)
