"""The SIMT harness itself (tests/simt/): its own kernels (tests/simt/selftest.cu, written as the
csrc/cuda kernels are) against torch -- warp shuffles and ballots, a shared-memory transpose with
barriers, dynamic shared memory and integer atomics, detection of barriers and warp intrinsics that
only part of the threads reach, launch-configuration errors, fp16 / bf16 conversions bit for bit
against torch's, the modelled device's SM count and free memory."""
import time

import pytest
import torch

import fastformer
from fastformer import backends
from simt import plugin

pytestmark = pytest.mark.skipif(plugin.load_error() is not None, reason=str(plugin.load_error()))


def ops():
    return torch.ops.fastformer_simt_selftest


@pytest.mark.parametrize("threads", [32, 96])
def test_warp_shuffles_and_ballot(threads):
    x = torch.randn(7 * 32)  # 7 warps over blocks of 1 or 3 warps (grid-stride, a partial block)
    x[5] = 0.0
    xor_sum, down_sum, scan, ballot = ops().warp(x, threads)
    w = x.view(7, 32).double()
    want = w.sum(1, keepdim=True).expand(7, 32).reshape(-1)
    torch.testing.assert_close(xor_sum.double(), want, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(down_sum.double(), want, atol=1e-5, rtol=1e-6)
    # the butterfly gives every lane the same bits; down_sum is lane 0's, broadcast
    assert torch.equal(xor_sum.view(7, 32), xor_sum.view(7, 32)[:, :1].expand(7, 32))
    assert torch.equal(down_sum.view(7, 32), down_sum.view(7, 32)[:, :1].expand(7, 32))
    torch.testing.assert_close(scan.double(), w.cumsum(1).reshape(-1), atol=1e-5, rtol=1e-6)
    bits = (x.view(7, 32) > 0).long() << torch.arange(32)
    want_ballot = bits.sum(1).to(torch.int64)  # as uint32 in int64
    got = ballot.view(7, 32).long() & 0xFFFFFFFF
    assert torch.equal(got, want_ballot[:, None].expand(7, 32))


@pytest.mark.parametrize("shape", [(1, 1), (33, 70), (64, 32)])
def test_shared_memory_transpose_with_barriers(shape):
    x = torch.randn(shape)
    assert torch.equal(ops().transpose(x), x.t())


def test_dynamic_shared_memory_and_integer_atomics():
    x = torch.randn(5 * 96)
    out, count = ops().reverse(x, 96)
    assert torch.equal(out, x.view(5, 96).flip(1).reshape(-1))
    assert count.item() == int((x > 0).sum())


@pytest.mark.parametrize("mode,message", [
    (0, r"__syncthreads reached by threads 0-31 but threads 32-63 have exited"),
    (1, r"warp 0: __shfl_xor_sync \(mask 0xffffffff\) reached by only part of the warp: "
        r"threads 16-31 named in its mask have exited"),
    (2, r"no thread can continue .* threads 0-15 wait at __shfl_xor_sync; threads 16-63 wait at "
        r"__syncthreads"),
    (3, r"lane 0 is at __shfl_xor_sync .* but lane 16 at __shfl_down_sync"),
    (4, r"__shfl_sync in thread 0 reads lane 16, which does not exist \(the block has 16 threads\)"),
])
def test_divergence_is_reported_not_hung(mode, message):
    with pytest.raises(RuntimeError, match=message):
        ops().broken(mode)
    # the harness recovers: the next launch runs, and a correct kernel reports nothing
    out = ops().broken(5)
    assert torch.equal(out[:32], torch.full((32,), float(sum(range(32)))))


def test_reverse_schedule_shows_the_other_half_of_a_race():
    """A read of another thread's shared-memory write without a barrier: first-to-last order reads
    the later threads' slots before they are written (0xFF poison, NaN), last-to-first after."""
    n = 64
    forward = ops().racy(n, False)
    backward = ops().racy(n, True)
    want = (torch.arange(n, dtype=torch.float32) + 1) % n + 1
    assert torch.isnan(forward[:-1]).all() and forward[-1] == want[-1]
    assert torch.equal(backward[:-1], want[:-1]) and torch.isnan(backward[-1])
    assert torch.equal(ops().racy(n, False).isnan(), forward.isnan())  # the default order is back


def test_bad_launch_configuration_is_cudas_error():
    with pytest.raises(RuntimeError, match=r"invalid configuration argument \(kernel transpose_kernel, grid \(0, 1, 1\)"):
        ops().transpose(torch.randn(4, 0))


def test_many_blocks_with_barriers_run_quickly():
    start = time.perf_counter()
    out = ops().many_blocks(1000)  # 1000 blocks of 128 threads, three barriers each
    took = time.perf_counter() - start
    assert torch.equal(out, torch.arange(1000, dtype=torch.int32) + 127)
    print(f"1000 blocks x 128 threads, 3 barriers: {took:.3f} s")


def _special_floats():
    f32 = torch.finfo(torch.float32)
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, float("inf"),
            float("-inf"), 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26, 3 * 2.0**-25,
            2.0**-149, f32.max, -f32.max, f32.tiny, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8, 3.3895e38, -3.3896e38]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("kind,dtype", [(0, torch.float16), (1, torch.bfloat16)])
def test_half_conversions_match_torch_bit_for_bit(kind, dtype):
    g = torch.Generator().manual_seed(0)
    # random bit patterns over every exponent (NaNs included), normal values, the edge cases
    raw = torch.randint(-2**31, 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([raw.view(torch.float32), torch.randn(10_000, generator=g) * 1e-6,
                   torch.randn(10_000, generator=g) * 1e4, _special_floats()])
    bits = ops().to_bits(x, kind)
    want = x.to(dtype).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(bits[~nan], want[~nan])
    assert torch.isnan(bits[nan].view(dtype)).all()
    # back: every one of the 65536 16-bit patterns, exactly (NaN stays NaN)
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    back = ops().from_bits(every, kind)
    want_back = every.view(dtype).float()
    same = (back == want_back) | (torch.isnan(back) & torch.isnan(want_back))
    assert same.all()
    assert torch.equal(torch.signbit(back[~torch.isnan(back)]), torch.signbit(want_back[~torch.isnan(want_back)]))


def test_backend_uses_the_harness_for_cpu_tensors_only_when_forced():
    assert backends.availability("cuda", "cpu").available
    assert not backends.availability("cuda", "meta").available
    cpu = torch.device("cpu")
    with fastformer.use_backend("cuda"):
        kernels = backends.select("add_layer_norm", cpu, torch.float32)
    assert kernels.add_layer_norm_fwd is getattr(torch.ops, plugin.NAMESPACE).add_layer_norm_fwd
    # auto never picks the harness, even where its priority list would name the cuda backend
    assert backends.resolve("add_layer_norm", cpu, torch.float32) != "cuda"
    assert "only emulated" in backends.BACKENDS["cuda"].why_not("add_layer_norm", "cpu", torch.float32, auto=True)
    if not torch.cuda.is_available():
        assert not backends.available_backends()["cuda"].available
        assert "no CUDA GPU" in backends.available_backends()["cuda"].reason


def test_modelled_device_sm_count_and_free_memory():
    """The modelled device: 4 SMs and no free memory (-1) unless a test sets them; each setter
    returns the previous value (set_sm_count(0) only reads); bad values are refused."""
    sms, free = ops().set_sm_count(0), ops().set_free_memory(-1)
    try:
        assert (sms, free) == (4, -1), "another test left the modelled device changed"
        assert ops().set_sm_count(132) == 4 and ops().set_sm_count(0) == 132
        assert ops().set_free_memory(1 << 30) == -1 and ops().set_free_memory(0) == 1 << 30
        with pytest.raises(RuntimeError, match=r"set_sm_count: n must be in \[0, 2\^20\], got -1"):
            ops().set_sm_count(-1)
        with pytest.raises(RuntimeError, match=r"set_free_memory: bytes must be >= -1"):
            ops().set_free_memory(-2)
    finally:
        ops().set_sm_count(sms)
        ops().set_free_memory(free)
