// Large output tensors of the CPU kernels, from a pool that keeps freed blocks for reuse.
//
// glibc gives freed memory back to the kernel -- every block above its mmap threshold (32 MiB at
// most), and the heap's free top once it passes the trim threshold (a few MiB) -- so the next
// output of that size is page-faulted in again, 4 KiB at a time; on a VM that can cost more than
// the kernel's own pass over it (attention's forward + backward in the base training step ran
// 7.3 ms with fresh pages, 4.3 ms with reused ones). empty_large() takes tensors of at least
// kPoolMinBytes from a pool of 2 MiB-aligned blocks marked for transparent huge pages (madvise
// MADV_HUGEPAGE: a first touch faults in 2 MiB, not 4 KiB). A block freed by its last tensor is
// kept (under a cap: the blocks kept longest make room) and handed to the next request it fits
// (if it is at most a quarter larger than the request's size rounded up to 2 MiB), already
// mapped. Smaller tensors come from torch's CPU allocator as usual.
//
// The pool is the CPU twin of a GPU caching allocator: every allocation and free is reported to
// the torch profiler (so profile_memory and the benchmarks' peak memory see it), the blocks it
// keeps free count as reserved, and fastformer.cpu_pool.empty_cache() returns them to the system.
// FASTFORMER_CPU_POOL_MB (read once, at the first allocation) caps the bytes kept free, freeing
// the blocks kept longest first; 0 keeps none (each block is freed at once, still on huge pages).
#pragma once
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>

namespace fastformer {

// Tensors of at least this many bytes come from the pool.
constexpr size_t kPoolMinBytes = size_t{1} << 20;

// at::empty(sizes, options) (contiguous, CPU); from the pool when it holds >= kPoolMinBytes.
at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options);

// at::empty_like(t) for a contiguous CPU tensor t, from the pool when large.
at::Tensor empty_large_like(const at::Tensor& t);

struct PoolStats {
  int64_t in_use_bytes;   // held by live tensors
  int64_t cached_bytes;   // freed by their tensors, kept for reuse
  int64_t cap_bytes;      // the most kept free
  int64_t hits;           // requests served from kept blocks
  int64_t misses;         // requests that mapped a new block
};

PoolStats pool_stats();

// Frees every kept block; returns the bytes given back.
int64_t pool_empty_cache();

}  // namespace fastformer
