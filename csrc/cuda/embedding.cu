// The fused input embedding for CUDA, forward and backward (the contract of csrc/cpu/embedding.cpp;
// launchers declared in launchers.h).
//
// Forward: a warp per id (4 a block of 128 threads); lane t takes the units of 8 columns t, t + 32,
// ... of its row, one Philox v2 dropout group each (one call per unit, its 8 keep bits used
// directly): out = (weight[id] * scale + positional[pos]) * keep * (1 / (1 - p)) in fp32, rounded once.
// Backward, deterministic (as torch's own CUDA embedding backward: sorted ids and segment sums, no
// atomics): the glue sorts the keys stably and finds each sorted position's segment end; the warp
// of a sorted position that starts a segment sums the segment's rows of grad * keep * (1 / (1 - p))
// in that order (increasing id position, the CPU kernel's order too), unit by unit in fp32
// registers, scales, and writes its key's row of the zero-filled table once. Every other warp
// returns at once. Rows of any width, scalar loads with bounds checks (the op moves N x D elements
// once; its cost is the gather, not the instruction count).
#include "common.cuh"
#include "philox.cuh"

namespace {

constexpr int kUnit = 8;          // columns per unit (= one Philox group)
constexpr int kThreads = 128;     // 4 warps, one id (or one sorted position) each

template <typename T>
__global__ void embedding_fwd_kernel(const int64_t* __restrict__ ids, const T* __restrict__ weight,
                                     const int64_t* __restrict__ positions, const T* __restrict__ positional,
                                     T* __restrict__ out, int64_t N, int64_t D, float scale,
                                     uint32_t threshold, float drop_scale, uint64_t seed, uint64_t offset,
                                     const int64_t* __restrict__ philox) {  // device (seed, offset) or null
  const int lane = threadIdx.x % kFfWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / kFfWarpSize) + threadIdx.x / kFfWarpSize;
  if (row >= N) return;
  ff_philox_resolve(philox, seed, offset);
  const T* wr = weight + ids[row] * D;
  const T* pr = positional != nullptr ? positional + positions[row] * D : nullptr;
  T* o = out + row * D;
  const int64_t units = ff_dropout_groups(D);
  for (int64_t u = lane; u < units; u += kFfWarpSize) {
    // threshold 0 (p = 0, or p below 2^-17) keeps all eight without a Philox call; they are still
    // scaled by 1 / (1 - p), as the reference scales them
    const uint32_t keep = ff_dropout_keep8(seed, ff_dropout_counter(offset, row, D, u), threshold);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      const int64_t c = u * kUnit + j;
      if (c < D) {
        float v = ff_to_float(wr[c]) * scale;
        if (pr != nullptr) v += ff_to_float(pr[c]);
        o[c] = ff_from_float<T>((keep >> j) & 1u ? v * drop_scale : 0.0f);
      }
    }
  }
}

template <typename T>
__global__ void embedding_bwd_kernel(const T* __restrict__ grad, const int64_t* __restrict__ keys,
                                     const int64_t* __restrict__ order, const int64_t* __restrict__ ends,
                                     T* __restrict__ table, int64_t N, int64_t D, int64_t skip_row, float scale,
                                     uint32_t threshold, float drop_scale, uint64_t seed, uint64_t offset,
                                     const int64_t* __restrict__ philox) {  // device (seed, offset) or null
  const int lane = threadIdx.x % kFfWarpSize;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / kFfWarpSize) + threadIdx.x / kFfWarpSize;
  if (r >= N) return;
  const int64_t key = keys[r];
  if ((r > 0 && keys[r - 1] == key) || key == skip_row) return;  // not a segment's start, or padding
  const int64_t end = ends[r];
  ff_philox_resolve(philox, seed, offset);
  const int64_t units = ff_dropout_groups(D);
  for (int64_t u = lane; u < units; u += kFfWarpSize) {
    float acc[kUnit];
#pragma unroll
    for (int j = 0; j < kUnit; ++j) acc[j] = 0.0f;
    for (int64_t s = r; s < end; ++s) {
      const int64_t i = order[s];
      const uint32_t keep = ff_dropout_keep8(seed, ff_dropout_counter(offset, i, D, u), threshold);
      const T* g = grad + i * D;
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        const int64_t c = u * kUnit + j;
        if (c < D && ((keep >> j) & 1u)) acc[j] += ff_to_float(g[c]) * drop_scale;
      }
    }
    T* row = table + key * D;
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      const int64_t c = u * kUnit + j;
      if (c < D) row[c] = ff_from_float<T>(acc[j] * scale);
    }
  }
}

unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>((rows + kThreads / kFfWarpSize - 1) / (kThreads / kFfWarpSize));
}

}  // namespace

const char* launch_embedding_fwd(const int64_t* ids, const void* weight, const int64_t* positions,
                                 const void* positional, void* out, int64_t N, int64_t D, int dtype,
                                 double scale, double dropout_p, uint64_t seed, uint64_t offset,
                                 const int64_t* philox, void* stream) {
  if (N <= 0 || D <= 0) return nullptr;
  const uint32_t threshold = ff_dropout_threshold(dropout_p);
  const float drop_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const float s = static_cast<float>(scale);
  FF_DISPATCH_DTYPE(dtype, T, {
    auto* kernel = &embedding_fwd_kernel<T>;
    FF_LAUNCH(kernel, dim3(blocks_for(N)), dim3(kThreads), 0, stream, ids, static_cast<const T*>(weight),
              positions, static_cast<const T*>(positional), static_cast<T*>(out), N, D, s, threshold,
              drop_scale, seed, offset, philox);
  });
  return ff_last_error();
}

const char* launch_embedding_bwd(const void* grad, const int64_t* sorted_keys, const int64_t* order,
                                 const int64_t* ends, void* table, int64_t N, int64_t D, int64_t skip_row,
                                 int dtype, double scale, double dropout_p, uint64_t seed, uint64_t offset,
                                 const int64_t* philox, void* stream) {
  if (N <= 0 || D <= 0) return nullptr;
  const uint32_t threshold = ff_dropout_threshold(dropout_p);
  const float drop_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const float s = static_cast<float>(scale);
  FF_DISPATCH_DTYPE(dtype, T, {
    auto* kernel = &embedding_bwd_kernel<T>;
    FF_LAUNCH(kernel, dim3(blocks_for(N)), dim3(kThreads), 0, stream, static_cast<const T*>(grad), sorted_keys,
              order, ends, static_cast<T*>(table), N, D, skip_row, s, threshold, drop_scale, seed, offset, philox);
  });
  return ff_last_error();
}
