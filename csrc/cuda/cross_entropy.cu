// Fused label-smoothed cross-entropy for CUDA, shared by cross_entropy_fwd and the chunked
// linear_cross_entropy ops (see cross_entropy.cpp, linear_cross_entropy.cpp):
//   * a one-block kernel counts the rows whose target is not ignore_index (the mean's divisor,
//     read on the device: no host synchronisation); with torch's class weights w it also sums
//     w[target] over those rows (then the mean's divisor) and w itself (for the smoothing term);
//   * the row kernel (one block per row) sweeps the row once with an online log-sum-exp (max,
//     sum of exp, sum of logits; fp32 for 16-bit logits), writes the row's loss and, when asked,
//     sweeps it again with the final lse to write the gradient (which may alias the logits);
//     where V % 8 == 0 (and the pointers are aligned) a thread moves 8 classes as one vector;
//     a NaN or +inf logit, or a row of only -inf logits, has no finite log-sum-exp: its loss and
//     gradient are NaN, as F.cross_entropy's (the logits' sum tells, as in the CPU kernel);
//   * a one-block kernel sums the per-row losses in a fixed order (fp64), for mean and sum.
#include "common.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int kMaxWarps = 32;
constexpr int kReduceThreads = 256;

// Eight classes moved as one aligned vector (16 bytes for 16-bit logits, 2 x 16 for fp32).
template <typename T>
struct alignas(sizeof(T) * 8) Pack8 {
  T v[8];
};

// Adds v to the online state (m = running max, s = sum of exp(x - m)). A NaN passes both tests:
// the logits' sum flags its row.
FF_DEVICE void lse_add(float& m, float& s, float v) {
  if (v > m) {
    s = s * expf(m - v) + 1.0f;
    m = v;
  } else if (v > -INFINITY) {
    s += expf(v - m);
  }
}

// The gradient of class c: (exp(x - lse) - eps / V) * sc, minus (1 - eps) * sc at the target;
// sc == 0 (an ignored row) gives exactly 0 whatever x is.
FF_DEVICE float class_grad(float x, int64_t c, int64_t t, float lse, float sc, float smooth,
                           float hit) {
  if (sc == 0.0f) return 0.0f;
  const float g = expf(x - lse) * sc - smooth;
  return c == t ? g - hit : g;
}

// (m, s) <- the log-sum-exp state of both: s * e^m is the sum of exp over both parts.
FF_DEVICE void lse_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty (or only -inf): s stays 0
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

// (m, s, sx, swx) over the warp's 32 lanes (butterfly), in every lane: the log-sum-exp states
// merged, the logits' sums (plain and class-weighted) added.
FF_DEVICE void warp_lse_sum(float& m, float& s, float& sx, float& swx) {
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, k);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, k);
    sx += __shfl_xor_sync(0xffffffffu, sx, k);
    swx += __shfl_xor_sync(0xffffffffu, swx, k);
    lse_merge(m, s, m2, s2);
  }
}

// The row's gradient scale for the mean: 1 / the divisor (the count, or with class weights
// weight_stats[0] = the rows' sum of w[target]); 0 when no row counts; NaN when rows count but
// their weights sum to 0 (torch's).
FF_DEVICE float mean_scale(const int64_t* mean_count, const float* weight_stats) {
  const int64_t cnt = *mean_count;
  if (cnt == 0) return 0.0f;
  if (weight_stats == nullptr) return 1.0f / static_cast<float>(cnt);
  return weight_stats[0] != 0.0f ? 1.0f / weight_stats[0] : NAN;
}

// One row per block (grid-stride over rows). loss_rows[i] = lse - (1 - eps) x_t - eps mean(x)
// (0 for ignored rows, nan for a target outside [0, V) that is not ignore_index; such a target
// is never used as an address). grad (nullptr: none) = (softmax - (1 - eps) onehot - eps / V)
// * scale_i, scale_i = row_scale[i], else 1 / *mean_count (0 when no row counts), else scale;
// ignored rows get 0. With class weights w (class_weight, weight_stats = (the mean's weighted
// divisor, sum(w))): loss_rows[i] = (1 - eps) w[t] (lse - x_t) + eps / V (sum(w) lse - sum_c w_c
// x_c), grad = (((1 - eps) w[t] + eps sum(w) / V) softmax - (1 - eps) w[t] onehot - eps / V w)
// * scale_i.
template <typename T>
__global__ void _cross_entropy_fwd(const T* logits,                  // (n, V)
                                   const int64_t* __restrict__ target,  // (n,)
                                   T* grad,                          // (n, V), nullptr, or logits
                                   float* __restrict__ loss_rows,    // (n,) out
                                   int64_t n,                        // rows
                                   int64_t V,                        // classes
                                   float eps,                        // label smoothing
                                   int64_t ignore_index,             // target value to skip
                                   const float* __restrict__ row_scale,   // (n,) or nullptr
                                   const int64_t* __restrict__ mean_count,  // () or nullptr
                                   float scale,                      // scale without the above
                                   const float* __restrict__ class_weight,  // (V,) or nullptr
                                   const float* __restrict__ weight_stats,  // (2,) with class_weight
                                   bool vec) {                       // rows move as Pack8
  __shared__ float red_m[kMaxWarps], red_s[kMaxWarps], red_x[kMaxWarps], red_wx[kMaxWarps];
  __shared__ float row_stats[2];  // lse, sum of logits
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  const float inv_v = 1.0f / static_cast<float>(V);
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* x = logits + row * V;
    const int64_t t = target[row];
    const bool valid = t != ignore_index;
    const bool in_range = t >= 0 && t < V;
    // x_t is read before the barriers below, so before any thread overwrites the row.
    const float x_t = (tid == 0 && valid && in_range) ? ff_to_float(x[t]) : 0.0f;

    // w[t], and the softmax's share of the gradient (1 without class weights)
    const float w_t = (class_weight != nullptr && valid && in_range) ? class_weight[t] : 1.0f;
    const float p_mass = class_weight != nullptr ? (1.0f - eps) * w_t + eps * weight_stats[1] * inv_v : 1.0f;

    // Sweep 1: online max / sum of exp, and the sum of the logits (and with class weights
    // sum_c w_c x_c).
    float m = -INFINITY, s = 0.0f, sx = 0.0f, swx = 0.0f;
    const int64_t c8 = 8 * static_cast<int64_t>(tid), step8 = 8 * static_cast<int64_t>(blockDim.x);
    if (vec) {  // V % 8 == 0: thread tid takes the packs at 8 tid, 8 (tid + blockDim.x), ...
      for (int64_t c = c8; c < V; c += step8) {
        const Pack8<T> pk = *reinterpret_cast<const Pack8<T>*>(x + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float v = ff_to_float(pk.v[j]);
          sx += v;
          if (class_weight != nullptr) swx += class_weight[c + j] * v;
          lse_add(m, s, v);
        }
      }
    } else {
      for (int64_t c = tid; c < V; c += blockDim.x) {
        const float v = ff_to_float(x[c]);
        sx += v;
        if (class_weight != nullptr) swx += class_weight[c] * v;
        lse_add(m, s, v);
      }
    }
    warp_lse_sum(m, s, sx, swx);
    if (lane == 0) {
      red_m[warp] = m;
      red_s[warp] = s;
      red_x[warp] = sx;
      red_wx[warp] = swx;
    }
    __syncthreads();
    if (warp == 0) {
      m = lane < nwarps ? red_m[lane] : -INFINITY;
      s = lane < nwarps ? red_s[lane] : 0.0f;
      sx = lane < nwarps ? red_x[lane] : 0.0f;
      swx = lane < nwarps ? red_wx[lane] : 0.0f;
      warp_lse_sum(m, s, sx, swx);
      if (lane == 0) {
        const bool no_lse = sx != sx || sx == INFINITY || m == -INFINITY;
        const float lse = no_lse ? NAN : m + logf(s);
        row_stats[0] = lse;
        row_stats[1] = sx;
        float loss = 0.0f;
        if (valid && class_weight != nullptr) {
          loss = in_range ? (1.0f - eps) * w_t * (lse - x_t) : NAN;
          if (eps > 0.0f) loss += eps * inv_v * (weight_stats[1] * lse - swx);
        } else if (valid) {
          loss = in_range ? lse - (1.0f - eps) * x_t : NAN;
          if (eps > 0.0f) loss -= eps * sx * inv_v;
        }
        loss_rows[row] = loss;
      }
    }
    __syncthreads();

    // Sweep 2: the gradient with the final lse.
    if (grad != nullptr) {
      const float lse = row_stats[0];
      float sc = 0.0f;
      if (valid) {
        if (row_scale != nullptr) {
          sc = row_scale[row];
        } else if (mean_count != nullptr) {
          sc = mean_scale(mean_count, class_weight != nullptr ? weight_stats : nullptr);
        } else {
          sc = scale;
        }
        if (!in_range) sc = NAN;
      }
      const float smooth = eps * inv_v * sc, hit = (1.0f - eps) * w_t * sc, psc = p_mass * sc;
      const float* cw = class_weight;
      T* g = grad + row * V;
      if (vec) {
        for (int64_t c = c8; c < V; c += step8) {
          Pack8<T> pk = *reinterpret_cast<const Pack8<T>*>(x + c);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float sm = cw != nullptr ? smooth * cw[c + j] : smooth;
            const float gv = class_grad(ff_to_float(pk.v[j]), c + j, t, lse, psc, sm, hit);
            pk.v[j] = ff_from_float<T>(gv);
          }
          *reinterpret_cast<Pack8<T>*>(g + c) = pk;
        }
      } else {
        for (int64_t c = tid; c < V; c += blockDim.x) {
          const float sm = cw != nullptr ? smooth * cw[c] : smooth;
          g[c] = ff_from_float<T>(class_grad(ff_to_float(x[c]), c, t, lse, psc, sm, hit));
        }
      }
    }
    __syncthreads();  // row_stats and red_* are reused by the next row
  }
}

// v summed over the warp's 32 lanes (butterfly), in every lane.
FF_DEVICE void warp_add(float& v) {
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
}

// Class probabilities probs (n, V) fp32 as the target (torch's soft targets), one row per block:
// with q = ((1 - eps) probs + eps / V) * w (w = class_weight, 1 when null), Q = sum q and
// S = sum q x, loss_rows[i] = (Q lse - S) * loss_scale and grad (nullptr: none) =
// (Q softmax - q) * scale_i (row_scale[i] when given: linear_cross_entropy's backward of reduction
// none; else scale). A NaN or +inf logit, or only -inf logits: NaN, as the reference.
template <typename T>
__global__ void _soft_cross_entropy_fwd(const T* logits,                        // (n, V)
                                        const float* __restrict__ probs,        // (n, V)
                                        T* grad,                                // (n, V), nullptr, or logits
                                        float* __restrict__ loss_rows,          // (n,) out
                                        int64_t n, int64_t V, float eps,
                                        float scale, float loss_scale,
                                        const float* __restrict__ class_weight,  // (V,) or nullptr
                                        const float* __restrict__ row_scale) {   // (n,) or nullptr
  __shared__ float red_m[kMaxWarps], red_s[kMaxWarps], red_x[kMaxWarps], red_q[kMaxWarps], red_qx[kMaxWarps];
  __shared__ float row_stats[2];  // lse, Q
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  const float off = eps / static_cast<float>(V);
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* x = logits + row * V;
    const float* p = probs + row * V;
    float m = -INFINITY, s = 0.0f, sx = 0.0f, sq = 0.0f, sqx = 0.0f;
    for (int64_t c = tid; c < V; c += blockDim.x) {
      const float v = ff_to_float(x[c]);
      float q = (1.0f - eps) * p[c] + off;
      if (class_weight != nullptr) q *= class_weight[c];
      sx += v;
      sq += q;
      sqx += q * v;
      lse_add(m, s, v);
    }
    warp_lse_sum(m, s, sq, sqx);
    warp_add(sx);
    if (lane == 0) {
      red_m[warp] = m;
      red_s[warp] = s;
      red_x[warp] = sx;
      red_q[warp] = sq;
      red_qx[warp] = sqx;
    }
    __syncthreads();
    if (warp == 0) {
      m = lane < nwarps ? red_m[lane] : -INFINITY;
      s = lane < nwarps ? red_s[lane] : 0.0f;
      sx = lane < nwarps ? red_x[lane] : 0.0f;
      sq = lane < nwarps ? red_q[lane] : 0.0f;
      sqx = lane < nwarps ? red_qx[lane] : 0.0f;
      warp_lse_sum(m, s, sq, sqx);
      warp_add(sx);
      if (lane == 0) {
        const bool no_lse = sx != sx || sx == INFINITY || m == -INFINITY;
        const float lse = no_lse ? NAN : m + logf(s);
        row_stats[0] = lse;
        row_stats[1] = sq;
        loss_rows[row] = (sq * lse - sqx) * loss_scale;
      }
    }
    __syncthreads();
    if (grad != nullptr) {
      const float lse = row_stats[0], Q = row_stats[1];
      const float sc = row_scale != nullptr ? row_scale[row] : scale;
      T* g = grad + row * V;
      for (int64_t c = tid; c < V; c += blockDim.x) {
        float q = (1.0f - eps) * p[c] + off;
        if (class_weight != nullptr) q *= class_weight[c];
        g[c] = ff_from_float<T>((expf(ff_to_float(x[c]) - lse) * Q - q) * sc);
      }
    }
    __syncthreads();  // row_stats and red_* are reused by the next row
  }
}

// *count = the number of rows whose target is not ignore_index (one block). With class_weight
// (V,): weight_stats[0] = the sum of class_weight[target] over those rows, weight_stats[1] = the
// sum of class_weight (fp64 partial sums in a fixed order: deterministic). A target outside
// [0, V) adds no weight (its row's loss is NaN anyway) and is never used as an address.
__global__ void _cross_entropy_count(const int64_t* __restrict__ target,  // (n,)
                                     int64_t n,                           // rows
                                     int64_t ignore_index,                // target value to skip
                                     int64_t* __restrict__ count,         // () out
                                     const float* __restrict__ class_weight,  // (V,) or nullptr
                                     int64_t V,                           // classes
                                     float* __restrict__ weight_stats) {  // (2,) out, with class_weight
  __shared__ int64_t part[kReduceThreads];
  __shared__ double wpart[2][kReduceThreads];
  int64_t c = 0;
  double wt = 0.0, ws = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t t = target[i];
    c += t != ignore_index ? 1 : 0;
    if (class_weight != nullptr && t != ignore_index && t >= 0 && t < V) wt += class_weight[t];
  }
  if (class_weight != nullptr) {
    for (int64_t k = threadIdx.x; k < V; k += blockDim.x) ws += class_weight[k];
  }
  part[threadIdx.x] = c;
  wpart[0][threadIdx.x] = wt;
  wpart[1][threadIdx.x] = ws;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (static_cast<int>(threadIdx.x) < k) {
      part[threadIdx.x] += part[threadIdx.x + k];
      wpart[0][threadIdx.x] += wpart[0][threadIdx.x + k];
      wpart[1][threadIdx.x] += wpart[1][threadIdx.x + k];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *count = part[0];
    if (class_weight != nullptr) {
      weight_stats[0] = static_cast<float>(wpart[0][0]);
      weight_stats[1] = static_cast<float>(wpart[1][0]);
    }
  }
}

// out = the sum of loss_rows (fp64, fixed order: deterministic), divided by *mean_count when
// given (0 / 0 = nan, as torch), or with mean_weight by *mean_weight (NaN when it is 0, as
// torch). One block.
template <typename T>
__global__ void _cross_entropy_reduce(const float* __restrict__ loss_rows,    // (n,)
                                      int64_t n,                              // rows
                                      const int64_t* __restrict__ mean_count,  // () or nullptr
                                      const float* __restrict__ mean_weight,   // () or nullptr
                                      T* __restrict__ out) {                  // () out
  __shared__ double part[kReduceThreads];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(loss_rows[i]);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (static_cast<int>(threadIdx.x) < k) part[threadIdx.x] += part[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double total = part[0];
    if (mean_count != nullptr && mean_weight != nullptr) {
      total = *mean_weight != 0.0f ? total / static_cast<double>(*mean_weight) : NAN;
    } else if (mean_count != nullptr) {
      total /= static_cast<double>(*mean_count);
    }
    out[0] = ff_from_float<T>(static_cast<float>(total));
  }
}

// Rows move as Pack8 where V % 8 == 0 and both pointers are aligned to 8 elements.
bool vector_ok(int64_t V, int64_t elem, const void* logits, const void* grad) {
  const uintptr_t align = static_cast<uintptr_t>(8 * elem);
  return V % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % align == 0 &&
         reinterpret_cast<uintptr_t>(grad) % align == 0;  // grad nullptr: aligned
}

// Threads per row: about 16 classes per thread, a power of two in [32, 512].
int row_threads(int64_t V) {
  int threads = 32;
  while (threads < 512 && static_cast<int64_t>(threads) * 16 < V) threads *= 2;
  return threads;
}

template <typename T>
void fwd(const void* logits, const int64_t* target, void* grad, float* loss_rows, int64_t n,
         int64_t V, float eps, int64_t ignore_index, const float* row_scale,
         const int64_t* mean_count, float scale, const float* class_weight,
         const float* weight_stats, void* stream) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
  FF_LAUNCH(_cross_entropy_fwd<T>, dim3(grid), dim3(row_threads(V)), 0, stream,
            static_cast<const T*>(logits), target, static_cast<T*>(grad), loss_rows, n, V, eps,
            ignore_index, row_scale, mean_count, scale, class_weight, weight_stats,
            vector_ok(V, sizeof(T), logits, grad));
}

template <typename T>
void soft_fwd(const void* logits, const float* probs, void* grad, float* loss_rows, int64_t n, int64_t V,
              float eps, float scale, float loss_scale, const float* class_weight, const float* row_scale,
              void* stream) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
  FF_LAUNCH(_soft_cross_entropy_fwd<T>, dim3(grid), dim3(row_threads(V)), 0, stream,
            static_cast<const T*>(logits), probs, static_cast<T*>(grad), loss_rows, n, V, eps, scale,
            loss_scale, class_weight, row_scale);
}

template <typename T>
void reduce(const float* loss_rows, int64_t n, const int64_t* mean_count, const float* mean_weight,
            void* out, void* stream) {
  FF_LAUNCH(_cross_entropy_reduce<T>, dim3(1), dim3(kReduceThreads), 0, stream, loss_rows, n,
            mean_count, mean_weight, static_cast<T*>(out));
}

}  // namespace

const char* launch_cross_entropy_count_valid(const int64_t* target, int64_t n, int64_t ignore_index,
                                             int64_t* count, const float* class_weight, int64_t V,
                                             float* weight_stats, void* stream) {
  FF_LAUNCH(_cross_entropy_count, dim3(1), dim3(kReduceThreads), 0, stream, target, n, ignore_index,
            count, class_weight, V, weight_stats);
  return ff_last_error();
}

const char* launch_cross_entropy_fwd(const void* logits, const int64_t* target, void* grad,
                                     float* loss_rows, int64_t n, int64_t V, int dtype,
                                     double label_smoothing, int64_t ignore_index,
                                     const float* row_scale, const int64_t* mean_count,
                                     double scale, const float* class_weight,
                                     const float* weight_stats, void* stream) {
  if (n == 0) return nullptr;
  const float eps = static_cast<float>(label_smoothing), sc = static_cast<float>(scale);
  FF_DISPATCH_DTYPE(dtype, T, fwd<T>(logits, target, grad, loss_rows, n, V, eps, ignore_index,
                                     row_scale, mean_count, sc, class_weight, weight_stats, stream));
  return ff_last_error();
}

const char* launch_soft_cross_entropy_fwd(const void* logits, const float* probs, void* grad,
                                          float* loss_rows, int64_t n, int64_t V, int dtype,
                                          double label_smoothing, double scale, double loss_scale,
                                          const float* class_weight, const float* row_scale, void* stream) {
  if (n == 0) return nullptr;
  const float eps = static_cast<float>(label_smoothing);
  FF_DISPATCH_DTYPE(dtype, T, soft_fwd<T>(logits, probs, grad, loss_rows, n, V, eps, static_cast<float>(scale),
                                          static_cast<float>(loss_scale), class_weight, row_scale, stream));
  return ff_last_error();
}

const char* launch_cross_entropy_reduce(const float* loss_rows, int64_t n,
                                        const int64_t* mean_count, const float* mean_weight,
                                        void* out, int dtype, void* stream) {
  FF_DISPATCH_DTYPE(dtype, T, reduce<T>(loss_rows, n, mean_count, mean_weight, out, stream));
  return ff_last_error();
}
