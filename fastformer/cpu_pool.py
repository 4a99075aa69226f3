"""The CPU buffer pool: where the C++ CPU kernels take their large outputs from.

A tensor of 1 MiB or more that a CPU kernel returns or uses as scratch (attention's output and
gradients, add_layer_norm's outputs, the feed-forward's activation, cross_entropy's ``(N, V)``
gradient, linear_cross_entropy's logits chunk and weight-gradient sum) comes from a pool of
2 MiB-aligned blocks marked for transparent huge pages. When the last tensor using a block is
freed the block is kept, up to a cap, and the next request of the same size reuses it, already
mapped. Without it glibc gives such memory back to the kernel (every block over 32 MiB, and the
heap's free top once it passes a few MiB), and the next call page-faults it in again, 4 KiB at a
time: on this project's VM that was 40% of attention's forward + backward time in the training
step, and 70% of cross_entropy's.

    >>> import fastformer.cpu_pool as pool
    >>> pool.stats()          # {'in_use_bytes': ..., 'cached_bytes': ..., 'cap_bytes': ..., 'hits': ..., 'misses': ...}
    >>> pool.empty_cache()    # frees the kept blocks, returns the bytes given back

``FASTFORMER_CPU_POOL_MB`` (read once, at the pool's first allocation; default 1024) caps the
memory kept free, freeing the blocks kept longest first to make room; ``0`` keeps nothing
(blocks are freed at once, still on huge pages). Allocations and frees are reported to the torch
profiler (``profile_memory=True``) like torch's own.
"""
import os
from typing import Dict

from . import _ext


def _module():
    # fastformer._C, or the private build FASTFORMER_EXT_LIBRARY loads instead (its pool is then
    # the one the kernels allocate from: only that library is loaded)
    ext = _ext.module()
    if ext is None:
        raise RuntimeError(_ext.load_error() or "the C++ extension fastformer._C could not be loaded")
    return ext


def stats() -> Dict[str, int]:
    """The pool's counters: ``in_use_bytes`` (held by live tensors), ``cached_bytes`` (kept free for
    reuse), ``cap_bytes`` (the most kept free), ``hits`` (requests served by a kept block) and
    ``misses`` (requests that allocated a new block)."""
    return dict(_module().cpu_pool_stats())


def empty_cache() -> int:
    """Free every block the pool keeps; returns the number of bytes given back to the system.
    Blocks held by live tensors are untouched (they return to the pool when freed)."""
    return int(_module().cpu_pool_empty_cache())
