// The feed-forward block's elementwise passes for CUDA (the GEMMs run in ATen, see
// feed_forward.cpp):
//   forward:  pre += b1 in place, a = dropout(act(pre))            (one pass over (N, F))
//   backward: a = dropout(act(pre)), dpre = da * keep * scale * act'(pre) over da in place
// and the deterministic two-stage column sum that gives the bias gradients (also used by the
// chunked linear cross-entropy for dbias).
//
// Dropout is Philox v2: the (N, F) activations are rows of C = F columns; one thread owns one
// group of 8 columns of one row, draws that group's single Philox call and uses its 16-bit halves.
#include "common.cuh"
#include "philox.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

FF_DEVICE float to_float(float v) { return v; }
FF_DEVICE float to_float(__half v) { return __half2float(v); }
FF_DEVICE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> FF_DEVICE T from_float(float v);
template <> FF_DEVICE float from_float<float>(float v) { return v; }
template <> FF_DEVICE __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> FF_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Philox v2: the four words of group counter n.
FF_DEVICE void philox_words(uint64_t seed, uint64_t n, uint32_t w[4]) {
  const FfPhilox4 r = ff_philox4x32_10(seed, n);
  w[0] = r.w[0];
  w[1] = r.w[1];
  w[2] = r.w[2];
  w[3] = r.w[3];
}

// Philox v2: column j (0..7) of a group is kept iff its 16 bits u >= threshold.
FF_DEVICE bool dropout_keep(const uint32_t w[4], int j, uint32_t threshold) {
  const uint32_t u = (w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
  return u >= threshold;
}

// T = floor(p * 65536 + 0.5), at most 65536.
uint32_t dropout_threshold16(double p) {
  const double t = std::floor(p * 65536.0 + 0.5);
  return static_cast<uint32_t>(t < 0.0 ? 0.0 : (t > 65536.0 ? 65536.0 : t));
}

constexpr int kActRelu = 0;
constexpr int kThreads = 256;

FF_DEVICE float activate(float p, int act) {
  if (act == kActRelu) return fmaxf(p, 0.0f);
  return 0.5f * p * (1.0f + erff(p * 0.70710678118654752f));  // exact gelu
}

// d act / d p: relu 1 where p > 0 (0 at exactly 0, F.relu's rule); gelu Phi(p) + p phi(p).
FF_DEVICE float activate_grad(float p, int act) {
  if (act == kActRelu) return p > 0.0f ? 1.0f : 0.0f;
  const float cdf = 0.5f * (1.0f + erff(p * 0.70710678118654752f));
  const float pdf = expf(-0.5f * p * p) * 0.39894228040143268f;  // 1 / sqrt(2 pi)
  return fmaf(p, pdf, cdf);
}

// Grid-stride over the N * G groups of 8 columns (G = ceil(F / 8)); per group one Philox call.
// pre (N, F) gets b1 added in place when b1 is not null; a (N, F) = dropout(act(pre)).
template <typename T>
__global__ void _feed_forward_act_fwd(T* __restrict__ pre,        // (N, F) in: x w1^T, out: + b1
                                      const T* __restrict__ b1,   // (F,) or nullptr
                                      T* __restrict__ a,          // (N, F) out: dropout(act(pre))
                                      int64_t N,                  // rows
                                      int64_t F,                  // columns (dropout row length C)
                                      int act,                    // 0 relu, 1 gelu
                                      uint32_t threshold,         // Philox v2 16-bit threshold T
                                      float scale,                // 1 / (1 - p)
                                      uint64_t seed,              // Philox key
                                      uint64_t offset) {          // first Philox counter
  const int64_t G = (F + 7) / 8;
  const int64_t total = N * G;
  const bool drop = threshold > 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / G, g = idx - r * G;
    const int64_t c0 = g * 8;
    const int cnt = static_cast<int>(F - c0 < 8 ? F - c0 : 8);
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (drop) philox_words(seed, offset + static_cast<uint64_t>(idx), w);
    T* p = pre + r * F + c0;
    T* o = a + r * F + c0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        float v = to_float(p[j]);
        if (b1 != nullptr) {
          v += to_float(b1[c0 + j]);
          const T stored = from_float<T>(v);
          p[j] = stored;
          v = to_float(stored);  // the activation sees the saved pre exactly, as backward will
        }
        float y = activate(v, act);
        y = (drop && !dropout_keep(w, j, threshold)) ? 0.0f : y * scale;  // T = 0: all kept, scaled
        o[j] = from_float<T>(y);
      }
    }
  }
}

// a = dropout(act(pre)) (dw2 needs it) and dpre = da * keep * scale * act'(pre) written over da.
template <typename T>
__global__ void _feed_forward_act_bwd(const T* __restrict__ pre,  // (N, F) saved pre-activation
                                      T* __restrict__ dpre,       // (N, F) in: da, out: dpre
                                      T* __restrict__ a,          // (N, F) out: dropout(act(pre))
                                      int64_t N,                  // rows
                                      int64_t F,                  // columns
                                      int act,                    // 0 relu, 1 gelu
                                      uint32_t threshold,         // Philox v2 16-bit threshold T
                                      float scale,                // 1 / (1 - p)
                                      uint64_t seed,              // Philox key
                                      uint64_t offset) {          // first Philox counter
  const int64_t G = (F + 7) / 8;
  const int64_t total = N * G;
  const bool drop = threshold > 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / G, g = idx - r * G;
    const int64_t c0 = g * 8;
    const int cnt = static_cast<int>(F - c0 < 8 ? F - c0 : 8);
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (drop) philox_words(seed, offset + static_cast<uint64_t>(idx), w);
    const T* p = pre + r * F + c0;
    T* d = dpre + r * F + c0;
    T* o = a + r * F + c0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        const float v = to_float(p[j]);
        const float f = (drop && !dropout_keep(w, j, threshold)) ? 0.0f : scale;
        o[j] = from_float<T>(activate(v, act) * f);
        d[j] = from_float<T>(to_float(d[j]) * activate_grad(v, act) * f);
      }
    }
  }
}

// Stage 1 of the column sum: block (32, 8) sums columns [32 bx, 32 bx + 32) over the rows of
// part by (rows_per_part of them) in a fixed order, one fp32 partial per (part, column).
template <typename T>
__global__ void _colsum_partial(const T* __restrict__ x,     // (rows, cols)
                                int64_t rows,                // rows
                                int64_t cols,                // columns
                                int64_t rows_per_part,       // rows summed by one part
                                float* __restrict__ partial) {  // (parts, cols) out
  __shared__ float tile[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_float(x[r * cols + c]);
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += tile[k][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = s;
  }
}

// Stage 2: out[c] (+)= sum over parts of partial[part, c], parts in order.
__global__ void _colsum_final(const float* __restrict__ partial,  // (parts, cols)
                              int64_t parts,                      // number of partial rows
                              int64_t cols,                       // columns
                              float* __restrict__ out,            // (cols,) fp32
                              int accumulate) {                   // 1: add into out
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += partial[p * cols + c];
  out[c] = accumulate ? out[c] + s : s;
}

unsigned grid_for(int64_t work, int64_t threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 20)));
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename T>
void act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F, int act, uint32_t threshold,
             float scale, uint64_t seed, uint64_t offset, void* stream) {
  const int64_t groups = N * ((F + 7) / 8);
  FF_LAUNCH(_feed_forward_act_fwd<T>, dim3(grid_for(groups, kThreads)), dim3(kThreads), 0, stream,
            static_cast<T*>(pre), static_cast<const T*>(b1), static_cast<T*>(a), N, F, act, threshold,
            scale, seed, offset);
}

template <typename T>
void act_bwd(const void* pre, void* dpre, void* a, int64_t N, int64_t F, int act,
             uint32_t threshold, float scale, uint64_t seed, uint64_t offset, void* stream) {
  const int64_t groups = N * ((F + 7) / 8);
  FF_LAUNCH(_feed_forward_act_bwd<T>, dim3(grid_for(groups, kThreads)), dim3(kThreads), 0, stream,
            static_cast<const T*>(pre), static_cast<T*>(dpre), static_cast<T*>(a), N, F, act,
            threshold, scale, seed, offset);
}

template <typename T>
void colsum_partial(const void* x, int64_t rows, int64_t cols, int64_t parts, float* partial,
                    void* stream) {
  const int64_t rows_per_part = (rows + parts - 1) / parts;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(parts));
  FF_LAUNCH(_colsum_partial<T>, grid, dim3(32, 8), 0, stream, static_cast<const T*>(x), rows, cols,
            rows_per_part, partial);
}

}  // namespace

int64_t colsum_num_parts(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>((rows + 127) / 128, 256));
}

const char* launch_feed_forward_act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream) {
  if (N * F == 0) return nullptr;
  const uint32_t threshold = dropout_threshold16(dropout_p);
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  switch (dtype) {
    case 0: act_fwd<float>(pre, b1, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    case 1: act_fwd<__half>(pre, b1, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    case 2: act_fwd<__nv_bfloat16>(pre, b1, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    default: return "launch_feed_forward_act_fwd: dtype code must be 0, 1 or 2";
  }
  return last_error();
}

const char* launch_feed_forward_act_bwd(const void* pre, void* dpre, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream) {
  if (N * F == 0) return nullptr;
  const uint32_t threshold = dropout_threshold16(dropout_p);
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  switch (dtype) {
    case 0: act_bwd<float>(pre, dpre, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    case 1: act_bwd<__half>(pre, dpre, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    case 2: act_bwd<__nv_bfloat16>(pre, dpre, a, N, F, activation, threshold, scale, seed, offset, stream); break;
    default: return "launch_feed_forward_act_bwd: dtype code must be 0, 1 or 2";
  }
  return last_error();
}

const char* launch_colsum(const void* x, int64_t rows, int64_t cols, int dtype, float* partial,
                          int64_t parts, float* out, int accumulate, void* stream) {
  if (cols == 0) return nullptr;
  if (rows == 0 || parts <= 0) {
    if (accumulate) return nullptr;
    parts = 0;  // stage 2 alone writes zeros
  } else {
    switch (dtype) {
      case 0: colsum_partial<float>(x, rows, cols, parts, partial, stream); break;
      case 1: colsum_partial<__half>(x, rows, cols, parts, partial, stream); break;
      case 2: colsum_partial<__nv_bfloat16>(x, rows, cols, parts, partial, stream); break;
      default: return "launch_colsum: dtype code must be 0, 1 or 2";
    }
  }
  FF_LAUNCH(_colsum_final, dim3(grid_for(cols, kThreads)), dim3(kThreads), 0, stream,
            static_cast<const float*>(partial), parts, cols, out, accumulate);
  return last_error();
}
