// The harness's own test kernels (tests/test_simt.py): written as csrc/cuda kernels are (common.cuh,
// FF_LAUNCH, *_sync intrinsics), so they also compile with nvcc.
#include "../../csrc/cuda/common.cuh"
#include "selftest.h"

namespace {

__global__ void warp_kernel(const float* __restrict__ x, float* __restrict__ xor_sum,
                            float* __restrict__ down_sum, float* __restrict__ scan,
                            int32_t* __restrict__ ballot, int64_t n) {
  const int lane = threadIdx.x % kFfWarpSize;
  const int64_t warps = n / kFfWarpSize;
  const int64_t per_block = blockDim.x / kFfWarpSize;
  for (int64_t w = blockIdx.x * per_block + threadIdx.x / kFfWarpSize; w < warps;
       w += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t i = w * kFfWarpSize + lane;
    const float v = x[i];
    xor_sum[i] = ff_warp_sum(v);
    float d = v;
    for (int off = kFfWarpSize / 2; off > 0; off >>= 1) d += __shfl_down_sync(kFfFullMask, d, off);
    down_sum[i] = __shfl_sync(kFfFullMask, d, 0);
    float s = v;
    for (int off = 1; off < kFfWarpSize; off <<= 1) {
      const float t = __shfl_up_sync(kFfFullMask, s, off);
      if (lane >= off) s += t;
    }
    scan[i] = s;
    ballot[i] = static_cast<int32_t>(__ballot_sync(kFfFullMask, v > 0.0f));
  }
}

__global__ void transpose_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t R,
                                 int64_t C) {
  __shared__ float tile[32][33];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32, c0 = static_cast<int64_t>(blockIdx.x) * 32;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[k][threadIdx.x] = x[r * C + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < R && c < C) out[c * R + r] = tile[threadIdx.x][k];
  }
}

__global__ void reverse_kernel(const float* __restrict__ x, float* __restrict__ out,
                               int32_t* __restrict__ count) {
  FF_DYNAMIC_SMEM(float, buf);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x;
  const float v = x[base + threadIdx.x];
  buf[threadIdx.x] = v;
  if (v > 0.0f) atomicAdd(count, 1);
  __syncthreads();
  out[base + threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

// 0: __syncthreads in half the threads, the rest exit; 1: a shuffle reached by half a warp, the
// other half exited; 2: half a warp at a shuffle, the other half at __syncthreads; 3: two halves of
// a warp at different intrinsics; 4: __shfl_sync reading a lane of a 16-thread block that does not
// exist; 5: a correct kernel (no error).
__global__ void broken_kernel(int mode, float* scratch) {
  const int t = threadIdx.x;
  float v = static_cast<float>(t);
  switch (mode) {
    case 0:
      if (t < 32) __syncthreads();
      break;
    case 1:
      if (t < 16) v = __shfl_xor_sync(kFfFullMask, v, 1);
      break;
    case 2:
      if (t < 16) v = __shfl_xor_sync(kFfFullMask, v, 1);
      else __syncthreads();
      break;
    case 3:
      if (t < 16) v = __shfl_xor_sync(kFfFullMask, v, 1);
      else v = __shfl_down_sync(kFfFullMask, v, 1);
      break;
    case 4:
      v = __shfl_sync(0x0000ffffu, v, t + 16 < 32 ? t + 16 : t, 32);
      break;
    case 6:  // a spin on a flag (scratch, zeros) that no earlier block set: stops, never hangs
#ifdef FF_SIMT
      if (t == 0) ff_simt::spin_until_at_least(reinterpret_cast<const int*>(scratch), 1);
#endif
      break;
    default:
      v = ff_warp_sum(v);
      __syncthreads();
      break;
  }
  scratch[t] = v;
}

template <int kKind>
__global__ void to_bits_kernel(const float* __restrict__ x, int16_t* __restrict__ bits, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const unsigned short u = kKind == 0 ? __half_as_ushort(__float2half_rn(x[i]))
                                        : __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    bits[i] = static_cast<int16_t>(u);
  }
}

template <int kKind>
__global__ void from_bits_kernel(const int16_t* __restrict__ bits, float* __restrict__ x, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const unsigned short u = static_cast<unsigned short>(bits[i]);
    x[i] = kKind == 0 ? __half2float(__ushort_as_half(u)) : __bfloat162float(__ushort_as_bfloat16(u));
  }
}

__global__ void many_blocks_kernel(int32_t* out) {
  __shared__ int32_t s[128];
  s[threadIdx.x] = static_cast<int32_t>(threadIdx.x);
  __syncthreads();
  const int32_t v = s[127 - threadIdx.x] + static_cast<int32_t>(blockIdx.x);
  __syncthreads();
  s[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

// Missing __syncthreads between the write and the read: a data race on a GPU.
__global__ void racy_kernel(float* out) {
  FF_DYNAMIC_SMEM(float, buf);
  buf[threadIdx.x] = static_cast<float>(threadIdx.x + 1);
  out[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

// Each warp stores its lanes' values, meets at __syncwarp (this warp only), then reads the other
// warp's: out[t] = t ^ 32 + 1 once both warps have stored. Without `barrier` a cross-warp race on
// a GPU; on the harness the __syncwarp keeps the two warps in lockstep under forward / reverse.
__global__ void cross_warp_kernel(float* out, int barrier) {
  FF_DYNAMIC_SMEM(float, buf);
  const int t = threadIdx.x;
  buf[t] = static_cast<float>(t + 1);
  __syncwarp();
  if (barrier) __syncthreads();
  out[t] = buf[t ^ 32];
}

// The float16 (kind 0) or bfloat16 (kind 1) instance of an elementwise kernel over n elements.
template <typename In, typename Out>
const char* launch_by_kind(int kind, void (*f16)(const In*, Out*, int64_t),
                           void (*bf16)(const In*, Out*, int64_t), const In* in, Out* out, int64_t n,
                           void* stream) {
  auto* kernel = kind == 0 ? f16 : bf16;
  FF_LAUNCH(kernel, dim3(ff_grid_blocks(n, 256)), dim3(256), 0, stream, in, out, n);
  return ff_last_error();
}

// launch() under the harness's schedule `schedule` (< 0: the one in force), the one before
// restored after; on a GPU just launch().
template <typename Launch>
const char* under_schedule(int schedule, const Launch& launch) {
#ifdef FF_SIMT
  const ff_simt::ScopedSchedule scope(schedule);
#else
  (void)schedule;
#endif
  return launch();
}

}  // namespace

const char* launch_selftest_warp(const float* x, float* xor_sum, float* down_sum, float* scan,
                                 int32_t* ballot, int64_t n, int threads, void* stream) {
  const int64_t warps = n / kFfWarpSize;
  FF_LAUNCH(warp_kernel, dim3(ff_grid_blocks(warps, threads / kFfWarpSize)), dim3(threads), 0,
            stream, x, xor_sum, down_sum, scan, ballot, n);
  return ff_last_error();
}

const char* launch_selftest_transpose(const float* x, float* out, int64_t R, int64_t C,
                                      void* stream) {
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>((R + 31) / 32));
  FF_LAUNCH(transpose_kernel, grid, dim3(32, 8), 0, stream, x, out, R, C);
  return ff_last_error();
}

const char* launch_selftest_reverse(const float* x, float* out, int32_t* count, int64_t n,
                                    int threads, void* stream) {
  FF_LAUNCH(reverse_kernel, dim3(static_cast<unsigned>(n / threads)), dim3(threads),
            threads * sizeof(float), stream, x, out, count);
  return ff_last_error();
}

const char* launch_selftest_broken(int mode, float* scratch, void* stream) {
  FF_LAUNCH(broken_kernel, dim3(1), dim3(mode == 4 ? 16 : 64), 0, stream, mode, scratch);
  return ff_last_error();
}

const char* launch_selftest_to_bits(const float* x, int16_t* bits, int64_t n, int kind,
                                    void* stream) {
  return launch_by_kind(kind, &to_bits_kernel<0>, &to_bits_kernel<1>, x, bits, n, stream);
}

const char* launch_selftest_from_bits(const int16_t* bits, float* x, int64_t n, int kind,
                                      void* stream) {
  return launch_by_kind(kind, &from_bits_kernel<0>, &from_bits_kernel<1>, bits, x, n, stream);
}

const char* launch_selftest_many_blocks(int32_t* out, int64_t blocks, void* stream) {
  FF_LAUNCH(many_blocks_kernel, dim3(static_cast<unsigned>(blocks)), dim3(128), 0, stream, out);
  return ff_last_error();
}

const char* launch_selftest_racy(float* out, int n, bool reverse, void* stream) {
  return launch_selftest_racy_under(out, n, reverse ? 1 : 0, stream);
}

const char* launch_selftest_racy_under(float* out, int n, int schedule, void* stream) {
  return under_schedule(schedule, [&] {
    FF_LAUNCH(racy_kernel, dim3(1), dim3(n), n * sizeof(float), stream, out);
    return ff_last_error();
  });
}

const char* launch_selftest_cross_warp(float* out, int schedule, bool barrier, void* stream) {
  return under_schedule(schedule, [&] {
    FF_LAUNCH(cross_warp_kernel, dim3(1), dim3(64), 64 * sizeof(float), stream, out,
              barrier ? 1 : 0);
    return ff_last_error();
  });
}
