// Included first by every csrc/cuda/*.cu: the CUDA headers (or, with -DFF_SIMT, the SIMT test
// harness tests/simt/simt.h that runs the same source as host C++ on CPU tensors), the launch and
// dynamic-shared-memory macros, and small device helpers every kernel file shares.
//
//   FF_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
//       kernel<<<grid, block, smem_bytes, (cudaStream_t)stream>>>(args...) under nvcc, the
//       harness's launch under FF_SIMT. grid / block are dim3; stream is the glue's void*.
//       A kernel name with several template arguments has commas the macro would split: take a
//       pointer first (`auto* k = &kern<A, B>; FF_LAUNCH(k, ...)`).
//   FF_DYNAMIC_SMEM(type, name);   declares `type* name`, the block's dynamic shared memory
//                                  (16-byte aligned).
//   FF_DEVICE                      __device__ __forceinline__
//   FF_HOST_DEVICE                 __host__ __device__ __forceinline__
//   FF_DISPATCH_DTYPE(dtype, T, ...)  runs the statements with T = float / __half /
//                                  __nv_bfloat16 for dtype code 0 / 1 / 2, and returns an error
//                                  string from the enclosing launcher for any other code.
//   ff_last_error()                nullptr, or the CUDA error string of the last launch (the
//                                  value every launcher returns).
#pragma once

#include <cstdint>

#ifdef FF_SIMT
#include "simt.h"
#define FF_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  ::ff_simt::launch(#kernel, kernel, grid, block, smem_bytes, stream, ##__VA_ARGS__)
#define FF_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::ff_simt::dynamic_smem())
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define FF_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__)
#define FF_DYNAMIC_SMEM(type, name)                                   \
  extern __shared__ __align__(16) unsigned char ff_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(ff_dynamic_smem_)
#endif

#include "launchers.h"  // the .cu defines what the glue declares: a mismatch fails to link

#define FF_DEVICE __device__ __forceinline__
#define FF_HOST_DEVICE __host__ __device__ __forceinline__

constexpr int kFfWarpSize = 32;
constexpr unsigned kFfFullMask = 0xffffffffu;

#define FF_DISPATCH_DTYPE(dtype, T, ...)                                      \
  switch (dtype) {                                                           \
    case 0: { using T = float; __VA_ARGS__; } break;                         \
    case 1: { using T = __half; __VA_ARGS__; } break;                        \
    case 2: { using T = __nv_bfloat16; __VA_ARGS__; } break;                 \
    default: return "unsupported dtype code (want 0 float32, 1 float16, 2 bfloat16)"; \
  }

inline const char* ff_last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// ---- element conversions (fp32 arithmetic, round to nearest even on the way back)
FF_DEVICE float ff_to_float(float v) { return v; }
FF_DEVICE float ff_to_float(__half v) { return __half2float(v); }
FF_DEVICE float ff_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
FF_DEVICE T ff_from_float(float v);
template <>
FF_DEVICE float ff_from_float<float>(float v) { return v; }
template <>
FF_DEVICE __half ff_from_float<__half>(float v) { return __float2half_rn(v); }
template <>
FF_DEVICE __nv_bfloat16 ff_from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- warp and block reductions (full warps, *_sync with the full mask)
// Every lane gets the same bits: the butterfly adds the same two values in every lane pair.
FF_DEVICE float ff_warp_sum(float v) {
#pragma unroll
  for (int m = kFfWarpSize / 2; m > 0; m >>= 1) v += __shfl_xor_sync(kFfFullMask, v, m);
  return v;
}

FF_DEVICE float ff_warp_max(float v) {
#pragma unroll
  for (int m = kFfWarpSize / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFfFullMask, v, m));
  return v;
}

// The sum of v over a 1-D block (blockDim.x a multiple of 32, every thread calls it), returned
// to every thread in the same fixed order. red: __shared__ scratch of at least 32 floats; the
// leading barrier lets consecutive calls reuse it.
FF_DEVICE float ff_block_sum(float v, float* red) {
  const int lane = threadIdx.x % kFfWarpSize, warp = threadIdx.x / kFfWarpSize;
  const int warps = blockDim.x / kFfWarpSize;
  v = ff_warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return ff_warp_sum(lane < warps ? red[lane] : 0.0f);
}

// Blocks for a grid-stride loop over `work` items with `threads` threads a block (1 .. 2^20).
inline unsigned ff_grid_blocks(int64_t work, int64_t threads) {
  int64_t blocks = (work + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > (int64_t{1} << 20)) blocks = int64_t{1} << 20;
  return static_cast<unsigned>(blocks);
}
