// Test kernels of the tensor-core wrappers csrc/cuda/mma.cuh (tests/test_cuda_mma.py): each
// instruction on its own, from registers or rows the test chooses, then a small GEMM that uses them
// as the flash-attention kernel will (cp.async pipeline, ldmatrix, mma.sync), and the dynamic
// shared-memory opt-in. Written as the csrc/cuda kernels are, so the same file compiles with nvcc
// for sm_80 / sm_90 (tests/test_cuda_compile.py) and runs on the SIMT harness.
#include "../../csrc/cuda/common.cuh"
#include "../../csrc/cuda/mma.cuh"
#include "mma_selftest.h"

namespace {

constexpr int kTileWarps = 2;  // warps a block in the mma kernels: scratch and barriers per warp

template <int kKind>
__global__ void mma_fragments_kernel(const uint32_t* __restrict__ a, const uint32_t* __restrict__ b,
                                     const float* __restrict__ c, float* __restrict__ d,
                                     int64_t tiles) {
  const int lane = threadIdx.x % kFfWarpSize;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTileWarps + threadIdx.x / kFfWarpSize;
  if (tile >= tiles) return;  // the whole warp: the mma is warp-collective
  const int64_t at = tile * kFfWarpSize + lane;
  const uint32_t ra[4] = {a[at * 4], a[at * 4 + 1], a[at * 4 + 2], a[at * 4 + 3]};
  const uint32_t rb[2] = {b[at * 2], b[at * 2 + 1]};
  const float rc[4] = {c[at * 4], c[at * 4 + 1], c[at * 4 + 2], c[at * 4 + 3]};
  float rd[4];
  if (kKind == 0) ff_mma_m16n8k16<__nv_bfloat16>(rd, ra, rb, rc);
  if (kKind == 1) ff_mma_m16n8k16<__half>(rd, ra, rb, rc);
  if (kKind == 2) ff_mma_m16n8k8_tf32(rd, ra, rb, rc);
  for (int i = 0; i < 4; ++i) d[at * 4 + i] = rd[i];
}

__global__ void tf32_kernel(const float* __restrict__ x, uint32_t* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = ff_float_to_tf32(x[i]);
  }
}

template <int kNum, bool kTrans>
__global__ void ldmatrix_kernel(const uint16_t* __restrict__ tile, int64_t n,
                                const int32_t* __restrict__ offsets, uint32_t* __restrict__ out) {
  FF_DYNAMIC_SMEM(uint16_t, s);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s[i] = tile[i];
  __syncthreads();
  uint32_t r[kNum];
  ff_ldmatrix<kNum, kTrans>(r, s + offsets[threadIdx.x]);
  for (int i = 0; i < kNum; ++i) out[threadIdx.x * kNum + i] = r[i];
}

// Issues the cp.async of one 16-byte chunk: `cols` 16-bit elements from column col of row `row` of
// a (rows, cols) row-major matrix, zero-filled where the row or the columns run out.
template <typename T>
__device__ __forceinline__ void load_chunk(T* dst, const T* __restrict__ m, int64_t rows,
                                           int64_t cols, int64_t row, int64_t col) {
  const int64_t left = row < rows ? cols - col : 0;
  const int bytes = left <= 0 ? 0 : left >= 8 ? 16 : static_cast<int>(left) * 2;
  // an out-of-bounds chunk names the matrix's first element: src-size 0 reads nothing
  ff_cp_async_16_zfill(dst, bytes ? m + row * cols + col : m, bytes);
}

template <typename T, bool kBKMajor>
__global__ void gemm_kernel(const T* __restrict__ a, const T* __restrict__ b,
                            const float* __restrict__ c, float* __restrict__ d, int64_t M,
                            int64_t N, int64_t K, int mistake) {
  // a warp's two stages of a 16 x 16 A tile and a 16 x 16 B tile (n x k, or k x n when kBKMajor),
  // in dynamic shared memory as the flash kernel's (which the harness fills with 0xFF before every
  // block, so a tile read before its copy landed is NaN)
  FF_DYNAMIC_SMEM(T, smem_base);
  auto tile_at = [&](int warp_, int stage, int which) {
    return smem_base + ((warp_ * 2 + stage) * 2 + which) * 16 * 16;
  };
  const int warp = threadIdx.x / kFfWarpSize, lane = threadIdx.x % kFfWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int64_t tiles_n = (N + 15) / 16, tiles = (M + 15) / 16 * tiles_n;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTileWarps + warp;
  if (tile >= tiles) return;  // the whole warp: nothing below synchronises the block
  const int64_t m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 16;
  const int steps = static_cast<int>((K + 15) / 16);

  // Each lane copies one 16-byte chunk (8 elements) of each tile: row lane / 2, half lane % 2.
  const int row = lane / 2, half = lane % 2;
  auto load = [&](int stage, int64_t k0) {
    T* sa = tile_at(warp, stage, 0);
    T* sb = tile_at(warp, stage, 1);
    load_chunk(sa + row * 16 + half * 8, a, M, K, m0 + row, k0 + half * 8);
    if (kBKMajor) {
      load_chunk(sb + row * 16 + half * 8, b, K, N, k0 + row, n0 + half * 8);
    } else {
      load_chunk(sb + row * 16 + half * 8, b, N, K, n0 + row, k0 + half * 8);
    }
    ff_cp_async_commit();
  };

  // Two n8 accumulators from c, in the C fragment layout.
  float acc[2][4];
  for (int nt = 0; nt < 2; ++nt) {
    for (int i = 0; i < 4; ++i) {
      const int64_t r = m0 + g + 8 * (i / 2), col = n0 + 8 * nt + 2 * t + i % 2;
      acc[nt][i] = r < M && col < N ? c[r * N + col] : 0.0f;
    }
  }

  load(0, 0);
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) {
      load((s + 1) % 2, static_cast<int64_t>(s + 1) * 16);
    } else {
      ff_cp_async_commit();  // an empty group keeps "all but the newest group" meaning step s
    }
    if (mistake == 3) {
      ff_cp_async_wait<2>();  // too lax: step s's group may still be in flight
    } else {
      ff_cp_async_wait<1>();  // this lane's copies of step s have landed ...
    }
    __syncwarp();  // ... and every lane's
    const T* sa = tile_at(warp, s % 2, 0);
    const T* sb = tile_at(warp, s % 2, 1);
    // A: lanes 0-15 give rows 0-15 at column 0, lanes 16-31 the same rows at column 8, so the four
    // 8 x 8 matrices are A's fragment registers a[0] .. a[3].
    uint32_t af[4];
    ff_ldmatrix_x4(af, sa + (lane % 16) * 16 + (lane / 16) * 8);
    if (mistake == 2) {
      const uint32_t x = af[1];
      af[1] = af[2];
      af[2] = x;
    }
    // B: matrix i = lane / 8 covers n 8 (i / 2) .. + 7 and k 8 (i % 2) .. + 7, so bf[0], bf[1]
    // are the n8 tile 0's b[0], b[1] and bf[2], bf[3] the n8 tile 1's.
    const int i = lane / 8, r = lane % 8;
    uint32_t bf[4];
    const bool trans = kBKMajor != (mistake == 1);
    if (kBKMajor) {
      const T* p = sb + (8 * (i % 2) + r) * 16 + 8 * (i / 2);  // k rows, n contiguous
      if (trans) ff_ldmatrix_x4_trans(bf, p); else ff_ldmatrix_x4(bf, p);
    } else {
      const T* p = sb + (8 * (i / 2) + r) * 16 + 8 * (i % 2);  // n rows, k contiguous
      if (trans) ff_ldmatrix_x4_trans(bf, p); else ff_ldmatrix_x4(bf, p);
    }
    const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
    ff_mma_m16n8k16<T>(acc[0], af, b0);
    ff_mma_m16n8k16<T>(acc[1], af, b1);
    __syncwarp();  // every lane has read stage s % 2 before the next step refills it
  }

  for (int nt = 0; nt < 2; ++nt) {
    for (int q = 0; q < 4; ++q) {
      const int64_t r = m0 + g + 8 * (q / 2), col = n0 + 8 * nt + 2 * t + q % 2;
      if (r < M && col < N) d[r * N + col] = acc[nt][q];
    }
  }
}

__global__ void cp_async_kernel(const uint8_t* __restrict__ src, const int32_t* __restrict__ sizes,
                                uint8_t* __restrict__ mid, uint8_t* __restrict__ out) {
  FF_DYNAMIC_SMEM(uint8_t, s);
  const int64_t first = 2 * static_cast<int64_t>(threadIdx.x);
  for (int64_t chunk = first; chunk < first + 2; ++chunk) {
    if (sizes[chunk] == 16) {
      ff_cp_async_16(s + chunk * 16, src + chunk * 16);
    } else {
      ff_cp_async_16_zfill(s + chunk * 16, src + chunk * 16, sizes[chunk]);
    }
    ff_cp_async_commit();
  }
  ff_cp_async_wait<1>();  // group 0 (chunk first) has landed; group 1 may not have
  for (int i = 0; i < 32; ++i) mid[first * 16 + i] = s[first * 16 + i];
  ff_cp_async_wait<0>();
  for (int i = 0; i < 32; ++i) out[first * 16 + i] = s[first * 16 + i];
}

// A stage read across warps and then refilled by cp.async (as a double-buffered pipeline does):
// thread t copies 16-byte chunk t of tile 0 (src[0, 256)) into the stage, reads the first float
// of the other warp's chunk t ^ 32 (out[t]), refills its own chunk with tile 1 (src[256, 512)),
// and after the wait reads the other warp's chunk again (out[64 + t]). Without `barrier` between
// the read and the refill, a race on a GPU: the copy may land before the other warp has read.
__global__ void refill_kernel(const float* __restrict__ src, float* __restrict__ out, int barrier) {
  FF_DYNAMIC_SMEM(float, stage);
  const int t = threadIdx.x;
  ff_cp_async_16(stage + 4 * t, src + 4 * t);
  ff_cp_async_commit();
  ff_cp_async_wait<0>();
  __syncthreads();
  out[t] = stage[4 * (t ^ 32)];
  if (barrier) __syncthreads();  // every warp has read the stage before it is refilled
  ff_cp_async_16(stage + 4 * t, src + 256 + 4 * t);
  ff_cp_async_commit();
  __syncthreads();
  ff_cp_async_wait<0>();
  __syncthreads();
  out[64 + t] = stage[4 * (t ^ 32)];
}

template <int kWhich>
__global__ void big_smem_kernel(float* __restrict__ out, int64_t n) {
  FF_DYNAMIC_SMEM(float, s);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s[i] = static_cast<float>(i);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
}

// 0: ldmatrix with a row address that is not 16-byte aligned; 1: mma.sync in a block of 16
// threads; 2: half a warp at mma.sync, the other half at ldmatrix; 3: cp.async to an address that
// is not 16-byte aligned; 4: cp.async with src-size 17.
__global__ void mma_broken_kernel(int mode, const uint8_t* __restrict__ src) {
  __shared__ __align__(16) uint16_t s[8 * 8 * 4 + 8];
  const int lane = threadIdx.x % kFfWarpSize;
  for (int i = threadIdx.x; i < 8 * 8 * 4 + 8; i += blockDim.x) s[i] = 0;
  __syncthreads();
  uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float acc[4] = {0, 0, 0, 0};
  switch (mode) {
    case 0:
      ff_ldmatrix_x4(a, s + lane * 8 + (lane == 5 ? 4 : 0));
      break;
    case 1:
      ff_mma_m16n8k16<__half>(acc, a, b);
      break;
    case 2:
      if (lane < 16) ff_mma_m16n8k16<__half>(acc, a, b);
      else ff_ldmatrix_x4(a, s + lane * 8);
      break;
    case 3:
      ff_cp_async_16(s + 4, src);
      break;
    default:
      ff_cp_async_16_zfill(s, src, 17);
      break;
  }
  ff_cp_async_wait<0>();
}

}  // namespace

const char* launch_selftest_mma_fragments(const uint32_t* a, const uint32_t* b, const float* c,
                                          float* d, int64_t tiles, int kind, void* stream) {
  const dim3 grid(ff_grid_blocks(tiles, kTileWarps)), block(kTileWarps * kFfWarpSize);
  switch (kind) {
    case 0: FF_LAUNCH(mma_fragments_kernel<0>, grid, block, 0, stream, a, b, c, d, tiles); break;
    case 1: FF_LAUNCH(mma_fragments_kernel<1>, grid, block, 0, stream, a, b, c, d, tiles); break;
    case 2: FF_LAUNCH(mma_fragments_kernel<2>, grid, block, 0, stream, a, b, c, d, tiles); break;
    default: return "mma_fragments: kind must be 0 (bf16), 1 (f16) or 2 (tf32)";
  }
  return ff_last_error();
}

const char* launch_selftest_tf32(const float* x, uint32_t* out, int64_t n, void* stream) {
  FF_LAUNCH(tf32_kernel, dim3(ff_grid_blocks(n, 128)), dim3(128), 0, stream, x, out, n);
  return ff_last_error();
}

template <int kNum, bool kTrans>
const char* run_ldmatrix(const uint16_t* tile, int64_t n, const int32_t* offsets, int threads,
                         uint32_t* out, void* stream) {
  auto* ldmatrix = &ldmatrix_kernel<kNum, kTrans>;  // FF_LAUNCH would split <kNum, kTrans>
  FF_LAUNCH(ldmatrix, dim3(1), dim3(threads), static_cast<size_t>(n) * sizeof(uint16_t), stream,
            tile, n, offsets, out);
  return ff_last_error();
}

const char* launch_selftest_ldmatrix(const uint16_t* tile, int64_t n, const int32_t* offsets,
                                     int threads, int num, bool trans, uint32_t* out,
                                     void* stream) {
  switch (num * 2 + trans) {
    case 2: return run_ldmatrix<1, false>(tile, n, offsets, threads, out, stream);
    case 3: return run_ldmatrix<1, true>(tile, n, offsets, threads, out, stream);
    case 4: return run_ldmatrix<2, false>(tile, n, offsets, threads, out, stream);
    case 5: return run_ldmatrix<2, true>(tile, n, offsets, threads, out, stream);
    case 8: return run_ldmatrix<4, false>(tile, n, offsets, threads, out, stream);
    case 9: return run_ldmatrix<4, true>(tile, n, offsets, threads, out, stream);
    default: return "ldmatrix: num must be 1, 2 or 4";
  }
}

template <typename T>
const char* run_gemm(const void* a, const void* b, const float* c, float* d, int64_t M, int64_t N,
                     int64_t K, bool b_kmajor, int mistake, void* stream) {
  const int64_t tiles = (M + 15) / 16 * ((N + 15) / 16);
  auto* gemm = b_kmajor ? &gemm_kernel<T, true> : &gemm_kernel<T, false>;
  const size_t smem = kTileWarps * 2 * 2 * 16 * 16 * sizeof(T);
  FF_LAUNCH(gemm, dim3(ff_grid_blocks(tiles, kTileWarps)), dim3(kTileWarps * kFfWarpSize), smem,
            stream, static_cast<const T*>(a), static_cast<const T*>(b), c, d, M, N, K, mistake);
  return ff_last_error();
}

const char* launch_selftest_mma_gemm(const void* a, const void* b, const float* c, float* d,
                                     int64_t M, int64_t N, int64_t K, int dtype, bool b_kmajor,
                                     int mistake, void* stream) {
  if (K % 8 != 0 || (b_kmajor && N % 8 != 0)) return "mma_gemm: K (and N for b_kmajor) % 8 != 0";
  if (dtype == 1) return run_gemm<__half>(a, b, c, d, M, N, K, b_kmajor, mistake, stream);
  if (dtype == 2) return run_gemm<__nv_bfloat16>(a, b, c, d, M, N, K, b_kmajor, mistake, stream);
  return "mma_gemm: dtype must be 1 (float16) or 2 (bfloat16)";
}

const char* launch_selftest_cp_async(const uint8_t* src, const int32_t* sizes, int64_t chunks,
                                     uint8_t* mid, uint8_t* out, void* stream) {
  FF_LAUNCH(cp_async_kernel, dim3(1), dim3(static_cast<unsigned>(chunks / 2)),
            static_cast<size_t>(chunks) * 16, stream, src, sizes, mid, out);
  return ff_last_error();
}

const char* launch_selftest_big_smem(int which, int64_t bytes, int64_t opt_in, float* out,
                                     void* stream) {
  // two kernels, so that one can stay without opt-in (the attribute lasts for the process)
  auto* big_smem = which == 0 ? &big_smem_kernel<0> : &big_smem_kernel<1>;
  if (opt_in >= 0 && cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(opt_in)) != cudaSuccess) {
    return ff_last_error();
  }
  FF_LAUNCH(big_smem, dim3(1), dim3(256), static_cast<size_t>(bytes), stream, out, bytes / 4);
  return ff_last_error();
}

const char* launch_selftest_mma_broken(int mode, const uint8_t* src, void* stream) {
  FF_LAUNCH(mma_broken_kernel, dim3(1), dim3(mode == 1 ? 16 : 32), 0, stream, mode, src);
  return ff_last_error();
}

const char* launch_selftest_refill(const float* src, float* out, int schedule, bool barrier,
                                   void* stream) {
#ifdef FF_SIMT
  const ff_simt::ScopedSchedule scope(schedule);
#else
  (void)schedule;
#endif
  FF_LAUNCH(refill_kernel, dim3(1), dim3(64), 64 * 16, stream, src, out, barrier ? 1 : 0);
  return ff_last_error();
}
