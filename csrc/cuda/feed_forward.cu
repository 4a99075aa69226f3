// The feed-forward block's elementwise kernels for CUDA (the GEMMs run in ATen, see
// feed_forward.cpp):
//   forward:  pre += b1 in place, a = dropout(act(pre))                        (one pass over (N, F))
//   gated:    pre (N, 2F) = [g | u] += [b1 | b3] in place, h = dropout(act(g) u), and backward's
//             one pass from (pre, dh) to dpre (N, 2F) and h (_feed_forward_glu_*)
//   backward: a = dropout(act(pre)), dpre = da * keep * scale * act'(pre) over da in place, and
//             db1's per-part column sums of dpre, in the same pass; a second small kernel adds
//             the parts in a fixed order (deterministic, no atomics)
// and the two-stage column sum that gives db2 (and the chunked linear cross-entropy's dbias).
//
// Dropout is Philox v2 (philox.cuh): the (N, F) activations are rows of C = F columns; one thread
// owns one group of 8 columns of a row, makes that group's single Philox call and uses its eight
// 16-bit values. Blocks are (32, 8) threads: x walks 32 groups (256 contiguous columns, so a warp
// reads 256 contiguous elements of a row), y walks rows. Where F % 8 == 0 and every pointer is
// aligned to 8 elements, a group moves as one vector (16 bytes for 16-bit types, 2 x 16 for fp32).
#include "common.cuh"
#include "philox.cuh"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kActRelu = 0;  // the activation codes of launchers.h (1: gelu)
constexpr int kActSilu = 2;
constexpr int kActGeluTanh = 3;
constexpr float kGeluTanhBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluTanhKappa = 0.044715f;
constexpr int kTileGroups = 32;  // blockDim.x: groups of 8 columns per block
constexpr int kTileRows = 8;     // blockDim.y: rows in flight per block
constexpr int kTileCols = kTileGroups * kFfDropoutGroup;  // 256 columns per block
constexpr int kFinalThreads = 256;
// The two elementwise kernels are memory-bound: at most 64 registers (4 blocks of 256 an SM).
constexpr int kMinBlocksPerSm = 4;

// Eight elements moved as one aligned vector.
template <typename T>
struct alignas(sizeof(T) * 8) Pack8 {
  T v[8];
};

// v[0 .. cnt) = p[0 .. cnt) as fp32 (vec: cnt is 8 and p is aligned to 8 elements).
template <typename T>
FF_DEVICE void load8(const T* p, int cnt, bool vec, float (&v)[8]) {
  if (vec) {
    const Pack8<T> pk = *reinterpret_cast<const Pack8<T>*>(p);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = ff_to_float(pk.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = j < cnt ? ff_to_float(p[j]) : 0.0f;
  }
}

// p[0 .. cnt) = v[0 .. cnt) rounded to T.
template <typename T>
FF_DEVICE void store8(T* p, int cnt, bool vec, const float (&v)[8]) {
  if (vec) {
    Pack8<T> pk;
#pragma unroll
    for (int j = 0; j < 8; ++j) pk.v[j] = ff_from_float<T>(v[j]);
    *reinterpret_cast<Pack8<T>*>(p) = pk;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) p[j] = ff_from_float<T>(v[j]);
    }
  }
}

// sigmoid(p) = 1 / (1 + exp(-p)); 0 where exp(-p) overflows (p below about -88), not NaN.
FF_DEVICE float ff_sigmoid(float p) { return 1.0f / (1.0f + expf(-p)); }

// sigmoid(sign 2z), z = sqrt(2 / pi) (p + 0.044715 p^3): gelu_tanh's 0.5 (1 + tanh(z)) for sign 1
// and 0.5 (1 - tanh(z)) for sign -1, each to fp32's relative precision (1 +- tanhf(z) by
// subtraction would lose it where tanh nears -+1); 0 or 1 where expf overflows, never NaN.
FF_DEVICE float gelu_tanh_s(float p, float sign) {
  const float z = kGeluTanhBeta * fmaf(kGeluTanhKappa * p * p, p, p);
  return 1.0f / (1.0f + expf(-2.0f * sign * z));
}

// relu keeps a NaN (as F.relu); gelu is the exact erf form; silu is p sigmoid(p); gelu_tanh the
// tanh approximation (F.gelu(approximate="tanh")).
FF_DEVICE float activate(float p, int act) {
  if (act == kActRelu) return p < 0.0f ? 0.0f : p;
  if (act == kActSilu) return p * ff_sigmoid(p);
  if (act == kActGeluTanh) return p * gelu_tanh_s(p, 1.0f);
  return 0.5f * p * (1.0f + erff(p * 0.70710678118654752f));
}

// d act / d p: relu 1 where p > 0 (0 at exactly 0 and for NaN, F.relu's rule); gelu Phi(p) + p phi(p);
// silu s (1 + p (1 - s)) with s = sigmoid(p) (torch's silu_backward).
FF_DEVICE float activate_grad(float p, int act) {
  if (act == kActRelu) return p > 0.0f ? 1.0f : 0.0f;
  if (act == kActSilu) {
    const float s = ff_sigmoid(p);
    return s * fmaf(p, 1.0f - s, 1.0f);
  }
  if (act == kActGeluTanh) {
    // the tanh form's own derivative 0.5 (1 + t) + 0.5 p (1 - t^2) z', t = tanh(z), written
    // s + 2 p s (1 - s) z' with s = 0.5 (1 + t) (1 - t^2 = 4 s (1 - s))
    const float s = gelu_tanh_s(p, 1.0f);
    const float dz = kGeluTanhBeta * fmaf(3.0f * kGeluTanhKappa * p, p, 1.0f);
    return fmaf(2.0f * p * s * gelu_tanh_s(p, -1.0f), dz, s);
  }
  const float cdf = 0.5f * (1.0f + erff(p * 0.70710678118654752f));
  const float pdf = expf(-0.5f * p * p) * 0.39894228040143268f;  // 1 / sqrt(2 pi)
  return fmaf(p, pdf, cdf);
}

// The dropout multipliers of the 8 columns of group g of row r: scale if kept, else 0 (a dropped
// NaN stays NaN, as x * 0 in the reference).
FF_DEVICE void dropout_factors(uint64_t seed, uint64_t offset, int64_t r, int64_t F, int64_t g,
                               uint32_t threshold, float scale, float (&f)[8]) {
  const uint32_t keep = ff_dropout_keep8(seed, ff_dropout_counter(offset, r, F, g), threshold);
#pragma unroll
  for (int j = 0; j < 8; ++j) f[j] = ((keep >> j) & 1u) ? scale : 0.0f;
}

// What both elementwise kernels take besides their tensors and sizes.
struct ActDropout {
  int act;             // 0 relu, 1 gelu, 2 silu, 3 gelu_tanh
  uint32_t threshold;  // Philox v2 16-bit threshold
  float scale;         // 1 / (1 - p)
  uint64_t seed;       // Philox key
  uint64_t offset;     // first Philox counter
  const int64_t* philox;  // device (seed, offset) read by the kernels instead, or null
  bool vec;            // 8-element vector access
};

// Forward. Block (32, 8), grid (ceil(G / 32), row blocks): thread (x, y) handles group
// 32 blockIdx.x + x of rows 8 blockIdx.y + y, + 8 gridDim.y, ...
// pre (N, F) gets b1 added in place (rounded to T: the activation sees exactly the saved pre,
// as backward will); a (N, F) = dropout(act(pre)).
template <typename T>
__global__ void __launch_bounds__(kTileGroups * kTileRows, kMinBlocksPerSm)
_feed_forward_act_fwd(T* __restrict__ pre,        // (N, F) in: x w1^T, out: + b1
                      const T* __restrict__ b1,   // (F,) or nullptr
                      T* __restrict__ a,          // (N, F) out
                      int64_t N,                  // rows
                      int64_t F,                  // columns (dropout row length C)
                      ActDropout ad) {
  const int act = ad.act;
  const bool vec = ad.vec;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kTileGroups + threadIdx.x;
  const int64_t c0 = g * kFfDropoutGroup;
  if (c0 >= F) return;  // no barrier in this kernel
  uint64_t seed = ad.seed, offset = ad.offset;
  ff_philox_resolve(ad.philox, seed, offset);
  const int cnt = static_cast<int>(F - c0 < 8 ? F - c0 : 8);
  float bias[8];
  if (b1 != nullptr) {
    load8(b1 + c0, cnt, vec, bias);
  }
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * kTileRows + threadIdx.y; r < N;
       r += static_cast<int64_t>(gridDim.y) * kTileRows) {
    const int64_t at = r * F + c0;
    float v[8], f[8];
    load8(pre + at, cnt, vec, v);
    if (b1 != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = ff_to_float(ff_from_float<T>(v[j] + bias[j]));
      store8(pre + at, cnt, vec, v);
    }
    dropout_factors(seed, offset, r, F, g, ad.threshold, ad.scale, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = activate(v[j], act) * f[j];
    store8(a + at, cnt, vec, v);
  }
}

// Backward. Block (32, 8), grid (ceil(G / 32), parts): the block walks rows [r0, r1) of its part,
// thread (x, y) rows r0 + y, r0 + y + 8, ... of group 32 blockIdx.x + x, writing
// a = dropout(act(pre)) (dw2 needs it) and dpre = da * keep * scale * act'(pre) over da; with
// partial (db1 wanted), the part's column sums of dpre (fp32, fixed order) go to
// partial[part, c].
template <typename T>
__global__ void __launch_bounds__(kTileGroups * kTileRows, kMinBlocksPerSm)
_feed_forward_act_bwd(const T* __restrict__ pre,   // (N, F) saved pre-activation
                      T* __restrict__ dpre,        // (N, F) in: da, out: dpre
                      T* __restrict__ a,           // (N, F) out
                      float* __restrict__ partial,  // (parts, F) or nullptr
                      int64_t N,                   // rows
                      int64_t F,                   // columns
                      int64_t rows_per_part,       // rows of one part
                      ActDropout ad) {
  const int act = ad.act;
  const bool vec = ad.vec;
  __shared__ float sums[kTileRows][kTileCols + 1];  // per row lane: the 256 columns' sums
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kTileGroups + threadIdx.x;
  const int64_t c0 = g * kFfDropoutGroup;
  const int cnt = c0 < F ? static_cast<int>(F - c0 < 8 ? F - c0 : 8) : 0;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < N ? r0 + rows_per_part : N;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (cnt > 0) {
    uint64_t seed = ad.seed, offset = ad.offset;
    ff_philox_resolve(ad.philox, seed, offset);
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kTileRows) {
      const int64_t at = r * F + c0;
      float p[8], d[8], f[8], out[8];
      load8(pre + at, cnt, vec, p);
      load8(dpre + at, cnt, vec, d);
      dropout_factors(seed, offset, r, F, g, ad.threshold, ad.scale, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        out[j] = activate(p[j], act) * f[j];
        d[j] = d[j] * activate_grad(p[j], act) * f[j];
      }
      store8(a + at, cnt, vec, out);
      store8(dpre + at, cnt, vec, d);
      if (partial != nullptr) {
        // the sums see the stored (rounded) dpre, as a column sum of the dpre tensor would
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += ff_to_float(ff_from_float<T>(d[j]));
      }
    }
  }
  if (partial == nullptr) return;  // uniform over the grid: no thread waits at the barrier below
#pragma unroll
  for (int j = 0; j < 8; ++j) sums[threadIdx.y][threadIdx.x * 8 + j] = acc[j];
  __syncthreads();
  // thread t of the 256 sums column t of the tile over the 8 row lanes, in order
  const int t = threadIdx.y * kTileGroups + threadIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileCols + t;
  if (c < F) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kTileRows; ++k) s += sums[k][t];
    partial[static_cast<int64_t>(blockIdx.y) * F + c] = s;
  }
}

// The gated form's forward. Block and grid as _feed_forward_act_fwd; pre (N, 2F) rows [g | u]
// (x [w1; w3]^T) get b1 / b3 added in place (rounded: the saved pre), h (N, F) = dropout(act(g) u).
template <typename T>
__global__ void __launch_bounds__(kTileGroups * kTileRows, kMinBlocksPerSm)
_feed_forward_glu_fwd(T* __restrict__ pre,        // (N, 2F) in: x [w1; w3]^T, out: + [b1 | b3]
                      const T* __restrict__ b1,   // (F,) or nullptr
                      const T* __restrict__ b3,   // (F,) or nullptr
                      T* __restrict__ h,          // (N, F) out
                      int64_t N,                  // rows
                      int64_t F,                  // columns of h (dropout row length C)
                      ActDropout ad) {
  const int act = ad.act;
  const bool vec = ad.vec;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kTileGroups + threadIdx.x;
  const int64_t c0 = g * kFfDropoutGroup;
  if (c0 >= F) return;  // no barrier in this kernel
  uint64_t seed = ad.seed, offset = ad.offset;
  ff_philox_resolve(ad.philox, seed, offset);
  const int cnt = static_cast<int>(F - c0 < 8 ? F - c0 : 8);
  float bias1[8], bias3[8];
  if (b1 != nullptr) load8(b1 + c0, cnt, vec, bias1);
  if (b3 != nullptr) load8(b3 + c0, cnt, vec, bias3);
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * kTileRows + threadIdx.y; r < N;
       r += static_cast<int64_t>(gridDim.y) * kTileRows) {
    T* const gp = pre + r * 2 * F + c0;
    T* const up = gp + F;
    float gv[8], uv[8], f[8];
    load8(gp, cnt, vec, gv);
    load8(up, cnt, vec, uv);
    if (b1 != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) gv[j] = ff_to_float(ff_from_float<T>(gv[j] + bias1[j]));
      store8(gp, cnt, vec, gv);
    }
    if (b3 != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j) uv[j] = ff_to_float(ff_from_float<T>(uv[j] + bias3[j]));
      store8(up, cnt, vec, uv);
    }
    dropout_factors(seed, offset, r, F, g, ad.threshold, ad.scale, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) gv[j] = activate(gv[j], act) * uv[j] * f[j];
    store8(h + r * F + c0, cnt, vec, gv);
  }
}

// The gated form's backward. Block and grid as the forward: from pre (N, 2F) [g | u] and dh (N, F)
// (dout w2) it writes dpre (N, 2F) = [dh keep u act'(g) | dh keep act(g)] and h (N, F) =
// dropout(act(g) u) (dw2 needs it). The bias gradients are column sums of dpre (the glue's).
template <typename T>
__global__ void __launch_bounds__(kTileGroups * kTileRows, kMinBlocksPerSm)
_feed_forward_glu_bwd(const T* __restrict__ pre,  // (N, 2F)
                      const T* __restrict__ dh,   // (N, F)
                      T* __restrict__ dpre,       // (N, 2F) out
                      T* __restrict__ h,          // (N, F) out
                      int64_t N,                  // rows
                      int64_t F,                  // columns of h
                      ActDropout ad) {
  const int act = ad.act;
  const bool vec = ad.vec;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kTileGroups + threadIdx.x;
  const int64_t c0 = g * kFfDropoutGroup;
  if (c0 >= F) return;  // no barrier in this kernel
  uint64_t seed = ad.seed, offset = ad.offset;
  ff_philox_resolve(ad.philox, seed, offset);
  const int cnt = static_cast<int>(F - c0 < 8 ? F - c0 : 8);
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * kTileRows + threadIdx.y; r < N;
       r += static_cast<int64_t>(gridDim.y) * kTileRows) {
    const int64_t at2 = r * 2 * F + c0, at = r * F + c0;
    float gv[8], uv[8], d[8], f[8], hv[8], dg[8], du[8];
    load8(pre + at2, cnt, vec, gv);
    load8(pre + at2 + F, cnt, vec, uv);
    load8(dh + at, cnt, vec, d);
    dropout_factors(seed, offset, r, F, g, ad.threshold, ad.scale, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = activate(gv[j], act), df = d[j] * f[j];
      hv[j] = a * uv[j] * f[j];
      dg[j] = df * uv[j] * activate_grad(gv[j], act);
      du[j] = df * a;
    }
    store8(h + at, cnt, vec, hv);
    store8(dpre + at2, cnt, vec, dg);
    store8(dpre + at2 + F, cnt, vec, du);
  }
}

// Stage 1 of the column sum: block (32, 8) sums columns [32 bx, 32 bx + 32) over the rows of
// part by (rows_per_part of them) in a fixed order, one fp32 partial per (part, column).
template <typename T>
__global__ void _colsum_partial(const T* __restrict__ x,        // (rows, cols)
                                int64_t rows,                   // rows
                                int64_t cols,                   // columns
                                int64_t rows_per_part,          // rows summed by one part
                                float* __restrict__ partial) {  // (parts, cols) out
  __shared__ float tile[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  float acc = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += ff_to_float(x[r * cols + c]);
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

// Stage 2: out[c] (+)= sum over parts of partial[part, c], parts in order, in fp32, rounded once
// to out's type To (the cast to the dtype folded in here: no separate .to() launch).
template <typename To>
__global__ void _colsum_final(const float* __restrict__ partial,  // (parts, cols)
                              int64_t parts,                      // number of partial rows
                              int64_t cols,                       // columns
                              To* __restrict__ out,               // (cols,)
                              int accumulate) {                   // 1: add into out
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t p = 0; p < parts; ++p) s += partial[p * cols + c];
  out[c] = ff_from_float<To>(accumulate ? ff_to_float(out[c]) + s : s);
}

// Vector access: F a multiple of 8 and every pointer aligned to 8 elements.
bool vector_ok(int64_t F, int64_t elem, const void* p0, const void* p1, const void* p2) {
  const uintptr_t align = static_cast<uintptr_t>(8 * elem);
  auto ok = [align](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % align == 0; };
  return F % 8 == 0 && ok(p0) && ok(p1) && ok(p2);
}

unsigned tiles_for(int64_t F) {
  return static_cast<unsigned>((ff_dropout_groups(F) + kTileGroups - 1) / kTileGroups);
}

// The kernels' ActDropout for these arguments (vec: set per dtype, vector_ok).
ActDropout act_dropout(int activation, double dropout_p, uint64_t seed, uint64_t offset,
                       const int64_t* philox) {
  return {activation, ff_dropout_threshold(dropout_p), static_cast<float>(1.0 / (1.0 - dropout_p)), seed,
          offset, philox, false};
}

// Rows per part of the backward / colsum stage 1 for `parts` parts.
int64_t rows_per_part(int64_t rows, int64_t parts) { return (rows + parts - 1) / parts; }

}  // namespace

int64_t colsum_num_parts(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>((rows + 127) / 128, 256));
}

const char* launch_feed_forward_act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream) {
  if (N == 0 || F == 0) return nullptr;
  ActDropout ad = act_dropout(activation, dropout_p, seed, offset, philox);
  const int64_t row_blocks = std::min<int64_t>((N + kTileRows - 1) / kTileRows, 65535);
  const dim3 grid(tiles_for(F), static_cast<unsigned>(row_blocks)), block(kTileGroups, kTileRows);
  FF_DISPATCH_DTYPE(dtype, T, {
    ad.vec = vector_ok(F, sizeof(T), pre, b1, a);
    FF_LAUNCH(_feed_forward_act_fwd<T>, grid, block, 0, stream, static_cast<T*>(pre),
              static_cast<const T*>(b1), static_cast<T*>(a), N, F, ad);
  });
  return ff_last_error();
}

const char* launch_feed_forward_glu_fwd(void* pre, const void* b1, const void* b3, void* h, int64_t N,
                                        int64_t F, int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream) {
  if (N == 0 || F == 0) return nullptr;
  ActDropout ad = act_dropout(activation, dropout_p, seed, offset, philox);
  const int64_t row_blocks = std::min<int64_t>((N + kTileRows - 1) / kTileRows, 65535);
  const dim3 grid(tiles_for(F), static_cast<unsigned>(row_blocks)), block(kTileGroups, kTileRows);
  FF_DISPATCH_DTYPE(dtype, T, {
    ad.vec = vector_ok(F, sizeof(T), pre, b1, h) && vector_ok(F, sizeof(T), b3, nullptr, nullptr);
    FF_LAUNCH(_feed_forward_glu_fwd<T>, grid, block, 0, stream, static_cast<T*>(pre), static_cast<const T*>(b1),
              static_cast<const T*>(b3), static_cast<T*>(h), N, F, ad);
  });
  return ff_last_error();
}

const char* launch_feed_forward_glu_bwd(const void* pre, const void* dh, void* dpre, void* h, int64_t N,
                                        int64_t F, int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream) {
  if (N == 0 || F == 0) return nullptr;
  ActDropout ad = act_dropout(activation, dropout_p, seed, offset, philox);
  const int64_t row_blocks = std::min<int64_t>((N + kTileRows - 1) / kTileRows, 65535);
  const dim3 grid(tiles_for(F), static_cast<unsigned>(row_blocks)), block(kTileGroups, kTileRows);
  FF_DISPATCH_DTYPE(dtype, T, {
    ad.vec = vector_ok(F, sizeof(T), pre, dh, dpre) && vector_ok(F, sizeof(T), h, nullptr, nullptr);
    FF_LAUNCH(_feed_forward_glu_bwd<T>, grid, block, 0, stream, static_cast<const T*>(pre),
              static_cast<const T*>(dh), static_cast<T*>(dpre), static_cast<T*>(h), N, F, ad);
  });
  return ff_last_error();
}

const char* launch_feed_forward_act_bwd(const void* pre, void* dpre, void* a, float* db1_partial,
                                        int64_t parts, void* db1, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream) {
  if (F == 0) return nullptr;
  if (N > 0) {
    ActDropout ad = act_dropout(activation, dropout_p, seed, offset, philox);
    const dim3 grid(tiles_for(F), static_cast<unsigned>(parts)), block(kTileGroups, kTileRows);
    FF_DISPATCH_DTYPE(dtype, T, {
      ad.vec = vector_ok(F, sizeof(T), pre, dpre, a);
      FF_LAUNCH(_feed_forward_act_bwd<T>, grid, block, 0, stream, static_cast<const T*>(pre),
                static_cast<T*>(dpre), static_cast<T*>(a), db1 != nullptr ? db1_partial : nullptr,
                N, F, rows_per_part(N, parts), ad);
    });
  }
  if (db1 != nullptr) {  // N == 0: zero parts, stage 2 alone writes zeros
    FF_DISPATCH_DTYPE(dtype, T, {
      FF_LAUNCH(_colsum_final<T>, dim3(ff_grid_blocks(F, kFinalThreads)), dim3(kFinalThreads), 0, stream,
                static_cast<const float*>(db1_partial), N > 0 ? parts : int64_t{0}, F, static_cast<T*>(db1), 0);
    });
  }
  return ff_last_error();
}

const char* launch_colsum(const void* x, int64_t rows, int64_t cols, int dtype, float* partial,
                          int64_t parts, void* out, int out_dtype, int accumulate, void* stream) {
  if (cols == 0) return nullptr;
  if (rows == 0 || parts <= 0) {
    if (accumulate) return nullptr;
    parts = 0;  // stage 2 alone writes zeros
  } else {
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(parts));
    FF_DISPATCH_DTYPE(dtype, T, {
      FF_LAUNCH(_colsum_partial<T>, grid, dim3(32, 8), 0, stream, static_cast<const T*>(x), rows,
                cols, rows_per_part(rows, parts), partial);
    });
  }
  FF_DISPATCH_DTYPE(out_dtype, To, {
    FF_LAUNCH(_colsum_final<To>, dim3(ff_grid_blocks(cols, kFinalThreads)), dim3(kFinalThreads), 0, stream,
              static_cast<const float*>(partial), parts, cols, static_cast<To*>(out), accumulate);
  });
  return ff_last_error();
}
