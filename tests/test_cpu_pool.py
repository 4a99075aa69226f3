"""The CPU buffer pool (csrc/cpu/large_buffers.h, fastformer.cpu_pool): large kernel outputs come
from it, a freed block is reused by the next request of its size, reused (dirty) blocks still give
the reference's values, the profiler sees the allocations, and FASTFORMER_CPU_POOL_MB caps it."""
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer import cpu_pool
from fastformer.jobs.bench.timing import peak_memory_bytes
from fastformer.ops import reference

pytestmark = pytest.mark.skipif(not fastformer.backends.availability("cpu", "cpu"),
                                reason="the C++ extension is not built")

MiB = 2**20


def _ce_grad(x, t, **kwargs):
    x = x.detach().requires_grad_(True)
    with fastformer.use_backend("cpu"):
        loss = fastformer.ops.cross_entropy(x, t, **kwargs)
    loss.backward()
    return loss.detach(), x.grad


def _inputs(N, V, seed):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(N, V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100  # ignored rows: zero-filled, so a dirty block must not show through
    return x, t


def test_large_gradient_comes_from_the_pool_and_its_block_is_reused():
    N, V = 1024, 2048  # an 8 MiB fp32 gradient
    x, t = _inputs(N, V, 0)
    cpu_pool.empty_cache()
    before = cpu_pool.stats()
    _, grad = _ce_grad(x, t)
    during = cpu_pool.stats()
    assert during["misses"] == before["misses"] + 1
    assert during["in_use_bytes"] >= before["in_use_bytes"] + N * V * 4
    ptr = grad.data_ptr()
    del grad
    freed = cpu_pool.stats()
    assert freed["in_use_bytes"] == before["in_use_bytes"]
    assert freed["cached_bytes"] == 8 * MiB  # kept for reuse (a multiple of 2 MiB)
    _, grad = _ce_grad(x, t)
    again = cpu_pool.stats()
    assert (again["hits"], again["misses"]) == (freed["hits"] + 1, freed["misses"])
    assert grad.data_ptr() == ptr and again["cached_bytes"] == 0
    assert cpu_pool.empty_cache() == 0  # the block is in use, nothing to give back
    del grad
    assert cpu_pool.empty_cache() == 8 * MiB and cpu_pool.stats()["cached_bytes"] == 0


@pytest.mark.parametrize("N, V", [(1024, 2048), (700, 1503)])  # 8 MiB; 4 MiB with a ragged row tail
def test_reused_dirty_block_gives_the_reference_gradient(N, V):
    cpu_pool.empty_cache()
    for seed in (1, 2):  # the second call writes into the block the first one dirtied
        x, t = _inputs(N, V, seed)
        loss, grad = _ce_grad(x, t, label_smoothing=0.1)
        ref_x = x.double().requires_grad_(True)
        ref = reference.cross_entropy(ref_x, t, label_smoothing=0.1)
        ref.backward()
        torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad.double(), ref_x.grad, atol=2e-7, rtol=1e-4)
        assert (grad[::7] == 0).all()
        del grad
    assert cpu_pool.stats()["hits"] >= 1


def test_linear_cross_entropy_scratch_is_pooled_and_zeroed_on_reuse():
    N, D, V = 256, 160, 8000  # the (V, D) weight-gradient accumulator is 5 MB
    g = torch.Generator().manual_seed(3)
    cpu_pool.empty_cache()
    for _ in range(2):
        h = torch.randn(N, D, generator=g, requires_grad=True)
        w = (torch.randn(V, D, generator=g) / D ** 0.5).requires_grad_(True)
        b = torch.randn(V, generator=g, requires_grad=True)
        t = torch.randint(0, V, (N,), generator=g)
        with fastformer.use_backend("cpu"):
            fastformer.ops.linear_cross_entropy(h, w, t, linear_bias=b, label_smoothing=0.1).backward()
        refs = [a.detach().double().requires_grad_(True) for a in (h, w, b)]
        reference.linear_cross_entropy(refs[0], refs[1], t, linear_bias=refs[2], label_smoothing=0.1).backward()
        for got, ref in zip((h.grad, w.grad, b.grad), refs):
            torch.testing.assert_close(got.double(), ref.grad, atol=1e-6, rtol=1e-4)
    assert cpu_pool.stats()["in_use_bytes"] >= V * D * 4  # w.grad is the fp32 accumulator itself
    del h, w, b
    stats = cpu_pool.stats()
    assert stats["hits"] >= 1 and stats["in_use_bytes"] == 0


def test_small_outputs_and_no_grad_losses_leave_the_pool_alone():
    before = cpu_pool.stats()
    _ce_grad(*_inputs(64, 100, 4))  # 25 KB: torch's allocator
    x, t = _inputs(1024, 2048, 5)
    x.requires_grad_(True)
    with torch.no_grad(), fastformer.use_backend("cpu"):
        loss = fastformer.ops.cross_entropy(x, t)  # no gradient is written, none allocated
    after = cpu_pool.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    torch.testing.assert_close(loss.double(), reference.cross_entropy(x.double(), t), atol=1e-5, rtol=1e-5)


def test_profiler_sees_pool_allocations():
    x, t = _inputs(1024, 2048, 6)
    x.requires_grad_(True)

    def step():
        with fastformer.use_backend("cpu"):
            fastformer.ops.cross_entropy(x, t).backward()
        x.grad = None

    step()  # the block is now kept: the measured call reuses it, and must still count it
    peak = peak_memory_bytes(step, torch.device("cpu"))
    assert peak is not None and peak >= 1024 * 2048 * 4


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


_CE_TWICE = """
import torch, fastformer
from fastformer import cpu_pool
x = torch.randn(1024, 2048, requires_grad=True); t = torch.randint(0, 2048, (1024,))
for _ in range(2):
    with fastformer.use_backend("cpu"):
        fastformer.ops.cross_entropy(x, t).backward()
    x.grad = None
s = cpu_pool.stats()
print(s["cap_bytes"], s["cached_bytes"], s["hits"], s["misses"])
"""


def test_cap_zero_keeps_nothing():
    proc = _run(_CE_TWICE, FASTFORMER_CPU_POOL_MB="0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0", "0", "2"]


@pytest.mark.parametrize("value", ["lots", "-5", "1.5"])
def test_bad_cap_is_a_clear_error(value):
    proc = _run(_CE_TWICE, FASTFORMER_CPU_POOL_MB=value)
    assert proc.returncode != 0
    assert "FASTFORMER_CPU_POOL_MB must be a whole number of MiB >= 0" in proc.stderr and f"'{value}'" in proc.stderr


def test_a_kept_block_serves_a_smaller_request_if_it_is_at_most_a_quarter_larger():
    cpu_pool.empty_cache()
    _, grad = _ce_grad(*_inputs(1280, 2048, 7))  # 10 MiB
    del grad
    before = cpu_pool.stats()
    _, grad = _ce_grad(*_inputs(1024, 2048, 8))  # 8 MiB: the 10 MiB block fits
    during = cpu_pool.stats()
    assert (during["hits"], during["misses"]) == (before["hits"] + 1, before["misses"])
    assert during["in_use_bytes"] == 10 * MiB and during["cached_bytes"] == 0
    del grad
    _, grad = _ce_grad(*_inputs(768, 2048, 9))  # 6 MiB: the 10 MiB block is too large
    after = cpu_pool.stats()
    assert after["misses"] == during["misses"] + 1 and after["cached_bytes"] == 10 * MiB
    del grad
    cpu_pool.empty_cache()


_EVICT = """
import torch, fastformer
from fastformer import cpu_pool

def grad_of(n):  # an (n, 2048) fp32 cross-entropy gradient, freed on return
    x = torch.randn(n, 2048, requires_grad=True)
    with fastformer.use_backend("cpu"):
        fastformer.ops.cross_entropy(x, torch.randint(0, 2048, (n,))).backward()

grad_of(1024)  # 8 MiB kept
grad_of(768)   # 6 MiB: 8 + 6 > the 12 MiB cap, so the 8 MiB block (kept longest) is freed
s = cpu_pool.stats()
print(s["cached_bytes"] // 2**20, s["misses"], s["hits"])
grad_of(1024)  # no 8 MiB block any more: a new one, and the 6 MiB one goes to make room
s = cpu_pool.stats()
print(s["cached_bytes"] // 2**20, s["misses"], s["hits"])
"""


def test_cap_frees_the_blocks_kept_longest_first():
    proc = _run(_EVICT, FASTFORMER_CPU_POOL_MB="12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["6", "2", "0", "8", "3", "0"]
