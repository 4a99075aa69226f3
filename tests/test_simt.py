"""The SIMT harness itself (tests/simt/): its own kernels (tests/simt/selftest.cu, written as the
csrc/cuda kernels are) against torch -- warp shuffles and ballots, a shared-memory transpose with
barriers, dynamic shared memory and integer atomics, detection of barriers and warp intrinsics that
only part of the threads reach, launch-configuration errors, fp16 / bf16 conversions bit for bit
against torch's, the modelled device's SM count and free memory, and the thread schedules
(FF_SIMT_SCHEDULE): races without a barrier, within a warp and across warps (which only the
warp_ahead schedules show), each giving its fixed wrong answer under the schedule that exposes it."""
import os
import subprocess
import sys
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
    (6, r"a block spins on a flag that no earlier block set"),
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


FORWARD, REVERSE, WARP_AHEAD, WARP_AHEAD_REVERSE = range(4)  # ff_simt::Schedule
SCHEDULES = [FORWARD, REVERSE, WARP_AHEAD, WARP_AHEAD_REVERSE]
SCHEDULE_IDS = ["forward", "reverse", "warp_ahead", "warp_ahead_reverse"]


def test_warp_ahead_schedules_show_a_cross_warp_race():
    """Two warps store to shared memory, meet at __syncwarp (each its own), and read the other
    warp's values without __syncthreads. forward / reverse keep the warps in lockstep at the
    __syncwarp, so the race passes by luck there; warp_ahead runs warp 0 to its end before warp 1
    starts (warp 0 reads 0xFF poison, NaN), warp_ahead_reverse warp 1 first (warp 1 reads NaN:
    warp 0 writes, warp 1 reads, no barrier). With the barrier every schedule is right."""
    want = (torch.arange(64) ^ 32).float() + 1
    nan0 = torch.arange(64) < 32  # warp 0's lanes
    for schedule in (FORWARD, REVERSE):
        assert torch.equal(ops().cross_warp(schedule, False), want)  # the gap the warp_ahead ones close
    ahead, ahead_rev = ops().cross_warp(WARP_AHEAD, False), ops().cross_warp(WARP_AHEAD_REVERSE, False)
    assert torch.isnan(ahead[nan0]).all() and torch.equal(ahead[~nan0], want[~nan0])
    assert torch.isnan(ahead_rev[~nan0]).all() and torch.equal(ahead_rev[nan0], want[nan0])
    for schedule in SCHEDULES:
        assert torch.equal(ops().cross_warp(schedule, True), want), SCHEDULE_IDS[schedule]


def test_warp_ahead_schedules_land_cp_async_before_the_other_warps_run():
    """A stage read across warps and refilled by cp.async without a barrier in between: forward /
    reverse land the copies at their wait (after the other warp has read: right by luck); the
    warp_ahead schedules land them when their thread reaches __syncthreads, before the other warp
    runs, so the warp that runs second reads the refill (tile 1) instead of tile 0."""
    src = torch.arange(512, dtype=torch.float32)
    other = torch.arange(64) ^ 32
    want = torch.cat([4.0 * other, 256.0 + 4.0 * other])
    refilled = torch.cat([256.0 + 4.0 * other, 256.0 + 4.0 * other])
    first = torch.cat([torch.arange(64) < 32, torch.zeros(64, dtype=torch.bool)])  # warp 0's reads
    second = torch.cat([torch.arange(64) >= 32, torch.zeros(64, dtype=torch.bool)])
    for schedule in (FORWARD, REVERSE):
        assert torch.equal(ops().refill(src, schedule, False), want)
    ahead = ops().refill(src, WARP_AHEAD, False)  # warp 0 refills before warp 1 reads
    assert torch.equal(ahead, torch.where(second, refilled, want))
    ahead_rev = ops().refill(src, WARP_AHEAD_REVERSE, False)
    assert torch.equal(ahead_rev, torch.where(first, refilled, want))
    for schedule in SCHEDULES:
        assert torch.equal(ops().refill(src, schedule, True), want), SCHEDULE_IDS[schedule]


def test_racy_kernel_under_every_schedule():
    """The barrier-less neighbour read (no warp intrinsic in it) under each schedule: a warp's
    lanes run in thread order between intrinsics, so warp_ahead reads as forward does (every
    thread but the last before its neighbour writes) and warp_ahead_reverse as reverse does; the
    schedule in force before the call is back after it."""
    n = 64
    want = (torch.arange(n, dtype=torch.float32) + 1) % n + 1
    got = {s: ops().racy_under(n, s) for s in SCHEDULES}
    for s in (FORWARD, WARP_AHEAD):
        assert torch.isnan(got[s][:-1]).all() and got[s][-1] == want[-1], SCHEDULE_IDS[s]
    for s in (REVERSE, WARP_AHEAD_REVERSE):
        assert torch.equal(got[s][:-1], want[:-1]) and torch.isnan(got[s][-1]), SCHEDULE_IDS[s]
    with pytest.raises(RuntimeError, match=r"schedule must be 0 \(forward\)"):
        ops().racy_under(n, 4)


def test_schedule_from_the_environment():
    """FF_SIMT_SCHEDULE names the schedule of a fresh process's launches (schedule -1: the one in
    force); a name that is no schedule fails every launch instead of running forward silently."""
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "ops = torch.ops.fastformer_simt_selftest\n"
            "try:\n    out = ops.cross_warp(-1, False)\nexcept RuntimeError as e:\n    print(e)\n"
            "else:\n    print(''.join('n' if v != v else '.' for v in out.tolist()[::16]))")
    procs = {name: subprocess.Popen([sys.executable, "-c", code, plugin._state["path"]],
                                    env=dict(os.environ, FF_SIMT_SCHEDULE=name), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in ("forward", "warp_ahead", "warp_ahead_reverse", "warp-ahead")}
    got = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        got[name] = out.strip()
    # lanes 0, 16 of warp 0, then of warp 1: NaN where the warp ran before the other wrote
    assert got["forward"] == "...."
    assert got["warp_ahead"] == "nn.." and got["warp_ahead_reverse"] == "..nn"
    assert "FF_SIMT_SCHEDULE=warp-ahead names no schedule (forward, reverse, warp_ahead, " \
           "warp_ahead_reverse)" in got["warp-ahead"]


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


def test_header_leaves_the_standard_library_compiling(tmp_path):
    # libstdc++ writes __attribute__((__noinline__)) (<memory>); a __noinline__ macro in simt.h broke
    # the harness build with a newer g++ on the first GPU machine
    cxx = os.environ.get("CXX", "c++")
    src = tmp_path / "after_simt_h.cpp"
    src.write_text('#include "simt.h"\n#include <map>\n#include <memory>\n#include <mutex>\n#include <string>\n'
                   '#include <vector>\nint main() { return 0; }\n')
    header_dir = os.path.dirname(plugin.__file__)
    proc = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{header_dir}", str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
