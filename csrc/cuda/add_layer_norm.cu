// Fused dropout + residual add + LayerNorm on (N, C) rows for CUDA, forward and backward (the
// contract of csrc/cpu/add_layer_norm.cpp; launchers declared in launchers.h).
//
// Work split: a row is cut into units of 8 consecutive columns, one Philox v2 dropout group each
// (one Philox call per unit, its 8 keep bits used directly). A row belongs to one warp when
// C <= 1024 (4 rows a block of 128 threads, warp shuffles only) and to one block otherwise
// (128..512 threads, block reductions through 32 floats of shared memory); lane / thread t takes
// units t, t + P, t + 2P, ... (P = 32 or blockDim.x), so every thread reads back only what it
// wrote itself. A unit is two 128-bit loads (float) or one (fp16 / bf16) when C % 8 == 0 and every
// pointer is 16-byte aligned, eight scalar loads with bounds checks otherwise.
//
// Forward: h = residual + dropout(x) is formed in fp32, rounded to T and stored; mean and the
// variance (two passes, fp32) come from the stored h re-read by the same thread (L1 / L2), then
// y = (h - mean) * rstd * weight + bias. RMSNorm (rms): mean taken (and written) as 0, and
// (h * rstd) rounded to T before the weight multiply (T5's cast); its backward drops the mean(g) term.
// Backward: pass 1 the row sums of g = dy * weight and g * xhat, pass 2 dx (and dresidual).
// dweight / dbias: the grid is sized from the SM count (add_layer_norm_bwd_parts: enough blocks to
// fill every SM, no more, since each block costs one partial row); every thread keeps the fp32
// sums of dy * xhat and dy for its own columns in registers over all its rows. At the end a block
// writes ONE row of partial (blocks, 2, C) (warp-per-row blocks first add their warps' sums in
// shared memory, in warp order); a second kernel reduces the partial rows per column tile as a
// tree (add_layer_norm_partial_sum_kernel). Fixed orders throughout: deterministic, no atomics.
// The bits depend on the grid, so on the device's SM count: the same on the same GPU model.
//
// Expected HBM bandwidth of the backward (H100 SXM, ~3.35 TB/s): per row it must move
// C * sizeof(T) * (2 reads dy, h [+ dh] + 1 write dx [+ dresidual]) + 8 bytes (mean, rstd); the
// second pass re-reads h, dy and weight from L1 / L2 (a warp's or block's row is 2-16 KB, and 4
// warps x 4 blocks an SM keep well under the 256 KB L1). The dweight / dbias partials add
// 2 * (blocks x 2C x 4) bytes (write, then read), e.g. N = 16384, C = 1024, bf16, post-LN with a
// residual and dropout: 16384 x 8 KB = 134 MB of rows against 528 x 8 KB = 4.3 MB of partials
// (written and read: +6%). A row-streaming kernel with 128-bit loads and ~16 warps an SM in flight
// reaches ~85-90% of peak on an H100, so expect ~75-80% of 3.35 TB/s end to end (~50 us for that
// example), the rest being the partials, the tail of the last wave and the two launches.
#include "common.cuh"
#include "philox.cuh"

#include <algorithm>
#include <cstring>

namespace {

constexpr int kUnit = 8;                 // columns per unit (= one Philox group)
constexpr int64_t kWarpRowMaxC = 1024;   // warp-per-row up to this hidden size
constexpr int kWarpRowThreads = 128;     // 4 rows per block in warp-per-row mode
constexpr int kRegUnits = 4;             // units a backward thread keeps dweight / dbias sums of in registers
constexpr int kBwdThreadsPerSm = 512;    // resident backward threads an SM is given: 16 warps (with
                                         // 128-bit loads enough bytes in flight to cover HBM latency),
                                         // as many as 128 registers a thread allow (64K an SM)
constexpr int kSumCols = 32;             // partial-sum kernel: columns a block owns (one warp wide) ...
constexpr int kSumLanes = 16;            // ... and the lanes that split the parts of each column
static_assert(kRegUnits * kFfWarpSize * kUnit >= kWarpRowMaxC,
              "a warp-per-row thread must hold all its columns' dweight / dbias sums in registers");

// The 8 values of unit columns [c, c + 8) as fp32 (0 past C).
template <typename T, bool kVec>
FF_DEVICE void load8(const T* __restrict__ p, int64_t c, int64_t C, float (&v)[kUnit]) {
  if (kVec) {
    alignas(16) T raw[kUnit];
    const uint4* q = reinterpret_cast<const uint4*>(p + c);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(T) * kUnit / 16); ++k) {
      const uint4 bits = q[k];
      memcpy(reinterpret_cast<char*>(raw) + 16 * k, &bits, 16);
    }
#pragma unroll
    for (int j = 0; j < kUnit; ++j) v[j] = ff_to_float(raw[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) v[j] = c + j < C ? ff_to_float(p[c + j]) : 0.0f;
  }
}

// Stores columns [c, min(c + 8, C)) of v rounded to T.
template <typename T, bool kVec>
FF_DEVICE void store8(T* __restrict__ p, int64_t c, int64_t C, const float (&v)[kUnit]) {
  if (kVec) {
    alignas(16) T raw[kUnit];
#pragma unroll
    for (int j = 0; j < kUnit; ++j) raw[j] = ff_from_float<T>(v[j]);
    uint4* q = reinterpret_cast<uint4*>(p + c);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(T) * kUnit / 16); ++k) {
      uint4 bits;
      memcpy(&bits, reinterpret_cast<const char*>(raw) + 16 * k, 16);
      q[k] = bits;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      if (c + j < C) p[c + j] = ff_from_float<T>(v[j]);
    }
  }
}

// The row sum of v over the row's threads (a warp, or the whole block).
template <bool kWarpRow>
FF_DEVICE float row_sum(float v, float* red) {
  return kWarpRow ? ff_warp_sum(v) : ff_block_sum(v, red);
}

// Where a thread sits: the first row of its row group ("part"), the row stride, its index within
// the row's threads and their number.
struct RowSplit {
  int64_t part, parts;
  int t, P;
};

template <bool kWarpRow>
FF_DEVICE RowSplit row_split() {
  RowSplit s;
  if (kWarpRow) {
    const int warps = blockDim.x / kFfWarpSize;
    s.part = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / kFfWarpSize;
    s.parts = static_cast<int64_t>(gridDim.x) * warps;
    s.t = threadIdx.x % kFfWarpSize;
    s.P = kFfWarpSize;
  } else {
    s.part = blockIdx.x;
    s.parts = gridDim.x;
    s.t = threadIdx.x;
    s.P = blockDim.x;
  }
  return s;
}

template <typename T, bool kVec, bool kWarpRow>
__global__ void add_layer_norm_fwd_kernel(const T* __restrict__ x,         // (N, C)
                                          const T* __restrict__ residual,  // (N, C) or null
                                          const T* __restrict__ weight,    // (C,)
                                          const T* __restrict__ bias,      // (C,)
                                          T* __restrict__ y,               // (N, C) out
                                          T* __restrict__ h,               // (N, C) out
                                          float* __restrict__ mean,        // (N,) out
                                          float* __restrict__ rstd,        // (N,) out
                                          int64_t N, int64_t C, float eps,
                                          bool drop,           // dropout_p > 0
                                          uint32_t threshold,  // Philox v2 T (0: keep all)
                                          float scale,         // 1 / (1 - p)
                                          uint64_t seed, uint64_t offset,
                                          const int64_t* __restrict__ philox,  // device (seed, offset) or null
                                          bool rms) {  // RMSNorm
  __shared__ float red[kFfWarpSize];
  if (drop) ff_philox_resolve(philox, seed, offset);
  const RowSplit s = row_split<kWarpRow>();
  const int64_t G = ff_dropout_groups(C);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t row = s.part; row < N; row += s.parts) {
    const int64_t base = row * C;
    // h = residual + dropout(x), rounded to T as stored; the statistics see the stored h
    float sum = 0.0f;
    for (int64_t u = s.t; u < G; u += s.P) {
      const int64_t c = u * kUnit;
      float v[kUnit];
      load8<T, kVec>(x + base, c, C, v);
      if (drop) {
        const uint32_t keep = ff_dropout_keep8(seed, offset + static_cast<uint64_t>(row * G + u), threshold);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[j] = ((keep >> j) & 1u) ? v[j] * scale : 0.0f;
      }
      if (residual != nullptr) {
        float r[kUnit];
        load8<T, kVec>(residual + base, c, C, r);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[j] += r[j];
      }
#pragma unroll
      for (int j = 0; j < kUnit; ++j) v[j] = ff_to_float(ff_from_float<T>(v[j]));
      store8<T, kVec>(h + base, c, C, v);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) sum += v[j];  // 0 past C
    }
    float mu = row_sum<kWarpRow>(sum, red) * inv_c;  // (every thread reduces: a block-wide barrier)
    if (rms) mu = 0.0f;
    float sq = 0.0f;
    for (int64_t u = s.t; u < G; u += s.P) {
      const int64_t c = u * kUnit;
      float v[kUnit];
      load8<T, kVec>(h + base, c, C, v);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        const float d = c + j < C ? v[j] - mu : 0.0f;
        sq += d * d;
      }
    }
    const float rs = rsqrtf(row_sum<kWarpRow>(sq, red) * inv_c + eps);
    for (int64_t u = s.t; u < G; u += s.P) {
      const int64_t c = u * kUnit;
      float v[kUnit], w[kUnit], b[kUnit];
      load8<T, kVec>(h + base, c, C, v);
      load8<T, kVec>(weight, c, C, w);
      load8<T, kVec>(bias, c, C, b);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        float xn = (v[j] - mu) * rs;
        if (rms) xn = ff_to_float(ff_from_float<T>(xn));  // T5's cast; a no-op for float
        v[j] = fmaf(xn, w[j], b[j]);
      }
      store8<T, kVec>(y + base, c, C, v);
    }
    if (s.t == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// One unit of pass 1: adds dy * xhat and dy into (pw, pb) and the unit's share of the two row sums.
template <typename T, bool kVec>
FF_DEVICE void bwd_unit_pass1(const T* __restrict__ dy, const T* __restrict__ h,
                              const T* __restrict__ weight, int64_t c, int64_t C, float mu,
                              float rs, float (&pw)[kUnit], float (&pb)[kUnit], float& sum_g,
                              float& sum_gx) {
  float hv[kUnit], g[kUnit], w[kUnit];
  load8<T, kVec>(h, c, C, hv);
  load8<T, kVec>(dy, c, C, g);
  load8<T, kVec>(weight, c, C, w);
#pragma unroll
  for (int j = 0; j < kUnit; ++j) {
    const float xhat = (hv[j] - mu) * rs;  // dy is 0 past C: nothing is added there
    pw[j] = fmaf(g[j], xhat, pw[j]);
    pb[j] += g[j];
    const float gw = g[j] * w[j];
    sum_g += gw;
    sum_gx = fmaf(gw, xhat, sum_gx);
  }
}

// Block rows launch up to 512 threads, so at most 128 registers a thread (their 64 fp32 sums fit
// without spills). Warp rows launch 128: at least 3 blocks an SM (<= 170 registers) lets the
// scalar path keep its sums unspilled too (~170 registers: 3 of the grid's 4 blocks an SM resident,
// a short second wave; that path serves only C % 8 != 0 or unaligned rows); the 128-bit path needs
// <= 128, so all 4 blocks (kBwdThreadsPerSm) stay resident there.
template <typename T, bool kVec, bool kWarpRow>
__global__ void __launch_bounds__(kWarpRow ? kWarpRowThreads : 512, kWarpRow ? 3 : 1)
    add_layer_norm_bwd_kernel(const T* __restrict__ dy,      // (N, C)
                                          const T* __restrict__ dh,      // (N, C) or null
                                          const T* __restrict__ h,       // (N, C)
                                          const T* __restrict__ weight,  // (C,)
                                          const float* __restrict__ mean,  // (N,)
                                          const float* __restrict__ rstd,  // (N,)
                                          T* __restrict__ dx,            // (N, C) out
                                          T* __restrict__ dresidual,     // (N, C) out or null
                                          float* __restrict__ partial,   // (gridDim.x, 2, C) out
                                          int64_t N, int64_t C, bool drop, uint32_t threshold,
                                          float scale, uint64_t seed, uint64_t offset,
                                          const int64_t* __restrict__ philox,  // device (seed, offset) or null
                                          bool rms) {  // RMSNorm: no mean(g) term
  __shared__ float red[kFfWarpSize];
  if (drop) ff_philox_resolve(philox, seed, offset);
  const RowSplit s = row_split<kWarpRow>();
  const int64_t G = ff_dropout_groups(C);
  const float inv_c = 1.0f / static_cast<float>(C);
  float* dw_part = partial + static_cast<int64_t>(blockIdx.x) * 2 * C;  // this block's dweight row,
  float* db_part = dw_part + C;                                          // then its dbias row
  // This thread's units t + k P (k < kRegUnits) keep their sums in registers. Units past
  // kRegUnits * P exist only for block rows with C > kRegUnits * 8 * 512 (16384): their sums go
  // straight to the block's partial row, which only this thread touches at those columns.
  float acc_w[kRegUnits][kUnit], acc_b[kRegUnits][kUnit];
#pragma unroll
  for (int k = 0; k < kRegUnits; ++k) {
#pragma unroll
    for (int j = 0; j < kUnit; ++j) acc_w[k][j] = acc_b[k][j] = 0.0f;
  }
  if constexpr (!kWarpRow) {
    const float zero[kUnit] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t u = s.t + static_cast<int64_t>(kRegUnits) * s.P; u < G; u += s.P) {
      store8<float, kVec>(dw_part, u * kUnit, C, zero);
      store8<float, kVec>(db_part, u * kUnit, C, zero);
    }
  }
  for (int64_t row = s.part; row < N; row += s.parts) {
    const int64_t base = row * C;
    const float mu = mean[row], rs = rstd[row];
    // pass 1: the two row sums, and this row's share of dweight / dbias (own columns only)
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int k = 0; k < kRegUnits; ++k) {
      const int64_t u = s.t + static_cast<int64_t>(k) * s.P;
      if (u < G) {
        bwd_unit_pass1<T, kVec>(dy + base, h + base, weight, u * kUnit, C, mu, rs, acc_w[k],
                                acc_b[k], sum_g, sum_gx);
      }
    }
    if constexpr (!kWarpRow) {
      for (int64_t u = s.t + static_cast<int64_t>(kRegUnits) * s.P; u < G; u += s.P) {
        const int64_t c = u * kUnit;
        float pw[kUnit], pb[kUnit];
        load8<float, kVec>(dw_part, c, C, pw);
        load8<float, kVec>(db_part, c, C, pb);
        bwd_unit_pass1<T, kVec>(dy + base, h + base, weight, c, C, mu, rs, pw, pb, sum_g, sum_gx);
        store8<float, kVec>(dw_part, c, C, pw);
        store8<float, kVec>(db_part, c, C, pb);
      }
    }
    float c1 = row_sum<kWarpRow>(sum_g, red) * inv_c;  // (every thread reduces: a block-wide barrier)
    if (rms) c1 = 0.0f;
    const float c2 = row_sum<kWarpRow>(sum_gx, red) * inv_c;
    // pass 2: dh_total = rstd * (g - c1 - xhat * c2) [+ dh]; dx = dh_total * keep * scale
    for (int64_t u = s.t; u < G; u += s.P) {
      const int64_t c = u * kUnit;
      float hv[kUnit], g[kUnit], w[kUnit], extra[kUnit];
      load8<T, kVec>(h + base, c, C, hv);
      load8<T, kVec>(dy + base, c, C, g);
      load8<T, kVec>(weight, c, C, w);
      if (dh != nullptr) load8<T, kVec>(dh + base, c, C, extra);
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        const float xhat = (hv[j] - mu) * rs;
        g[j] = (g[j] * w[j] - c1 - xhat * c2) * rs;
        if (dh != nullptr) g[j] += extra[j];
      }
      if (dresidual != nullptr) store8<T, kVec>(dresidual + base, c, C, g);
      if (drop) {
        const uint32_t keep = ff_dropout_keep8(seed, offset + static_cast<uint64_t>(row * G + u), threshold);
#pragma unroll
        for (int j = 0; j < kUnit; ++j) g[j] = ((keep >> j) & 1u) ? g[j] * scale : 0.0f;
      }
      store8<T, kVec>(dx + base, c, C, g);
    }
  }
  if constexpr (kWarpRow) {
    // The block's warps add their sums into one (2, C) row of shared memory, warp 0 first, then
    // the block writes it out (coalesced). C <= kWarpRowMaxC, so at most 8 KB.
    __shared__ float block_sum[2 * kWarpRowMaxC];
    const int warp = threadIdx.x / kFfWarpSize, warps = blockDim.x / kFfWarpSize;
    for (int w = 0; w < warps; ++w) {
      if (warp == w) {
#pragma unroll
        for (int k = 0; k < kRegUnits; ++k) {
          const int64_t c0 = (s.t + static_cast<int64_t>(k) * s.P) * kUnit;
#pragma unroll
          for (int j = 0; j < kUnit; ++j) {
            const int64_t c = c0 + j;
            if (c < C) {
              block_sum[c] = w == 0 ? acc_w[k][j] : block_sum[c] + acc_w[k][j];
              block_sum[C + c] = w == 0 ? acc_b[k][j] : block_sum[C + c] + acc_b[k][j];
            }
          }
        }
      }
      __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) dw_part[i] = block_sum[i];
  } else {
    // A block-per-row thread owns its columns in the block's row: it writes them itself.
#pragma unroll
    for (int k = 0; k < kRegUnits; ++k) {
      const int64_t u = s.t + static_cast<int64_t>(k) * s.P;
      if (u < G) {
        store8<float, kVec>(dw_part, u * kUnit, C, acc_w[k]);
        store8<float, kVec>(db_part, u * kUnit, C, acc_b[k]);
      }
    }
  }
}

// dweight[c] / dbias[c] = the sum over parts of partial[part][0][c] / partial[part][1][c]. A
// block (kSumCols, kSumLanes) owns kSumCols columns of one of the two rows (blockIdx.y: 0 dweight,
// 1 dbias); lane y adds parts y, y + kSumLanes, ... of its column in order (a warp reads 32
// consecutive floats of one part: coalesced), then the lanes are added as a tree in shared
// memory. Fixed order: the same bits every run.
template <typename T>
__global__ void add_layer_norm_partial_sum_kernel(const float* __restrict__ partial,  // (parts, 2, C)
                                                  T* __restrict__ dweight, T* __restrict__ dbias,
                                                  int64_t parts, int64_t C) {
  __shared__ float tile[kSumLanes][kSumCols + 1];
  const int x = threadIdx.x, y = threadIdx.y;
  const int which = blockIdx.y;
  T* __restrict__ out = which == 0 ? dweight : dbias;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kSumCols; c0 < C;
       c0 += static_cast<int64_t>(gridDim.x) * kSumCols) {  // uniform in the block: barriers are safe
    const int64_t c = c0 + x;
    float sum = 0.0f;
    if (c < C) {
      const float* p = partial + which * C + c;
#pragma unroll 4
      for (int64_t part = y; part < parts; part += kSumLanes) sum += p[part * 2 * C];
    }
    tile[y][x] = sum;
#pragma unroll
    for (int half = kSumLanes / 2; half > 0; half /= 2) {
      __syncthreads();
      if (y < half) tile[y][x] += tile[y + half][x];
    }
    if (y == 0 && c < C) out[c] = ff_from_float<T>(tile[0][x]);
    __syncthreads();  // the next tile's writes wait for the last step's reads
  }
}

// ---- launch geometry (shared by the forward, the backward and add_layer_norm_bwd_parts)
bool warp_rows(int64_t C) { return C <= kWarpRowMaxC; }

int row_threads(int64_t C) {
  if (warp_rows(C)) return kWarpRowThreads;
  const int64_t units = ff_dropout_groups(C);
  const int64_t t = (units + kFfWarpSize - 1) / kFfWarpSize * kFfWarpSize;
  return static_cast<int>(t < 128 ? 128 : (t > 512 ? 512 : t));
}

int64_t rows_per_block(int64_t C) {
  return warp_rows(C) ? kWarpRowThreads / kFfWarpSize : 1;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, bool kVec, bool kWarpRow>
void fwd(const void* x, const void* res, const void* w, const void* b, void* y, void* h,
         float* mean, float* rstd, int64_t N, int64_t C, float eps, uint32_t threshold,
         float scale, uint64_t seed, uint64_t offset, const int64_t* philox, void* stream, bool rms) {
  auto* kernel = &add_layer_norm_fwd_kernel<T, kVec, kWarpRow>;
  const bool drop = scale != 1.0f || threshold != 0u;
  FF_LAUNCH(kernel, dim3(ff_grid_blocks(N, rows_per_block(C))), dim3(row_threads(C)), 0, stream,
            static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
            static_cast<const T*>(b), static_cast<T*>(y), static_cast<T*>(h), mean, rstd, N, C,
            eps, drop, threshold, scale, seed, offset, philox, rms);
}

template <typename T, bool kVec, bool kWarpRow>
void bwd(const void* dy, const void* dh, const void* h, const void* w, const float* mean,
         const float* rstd, void* dx, void* dres, float* partial, int64_t parts, int64_t N,
         int64_t C, uint32_t threshold, float scale, uint64_t seed, uint64_t offset,
         const int64_t* philox, void* stream, bool rms) {
  auto* kernel = &add_layer_norm_bwd_kernel<T, kVec, kWarpRow>;
  const bool drop = scale != 1.0f || threshold != 0u;
  FF_LAUNCH(kernel, dim3(static_cast<unsigned>(parts)), dim3(row_threads(C)),
            0, stream, static_cast<const T*>(dy), static_cast<const T*>(dh),
            static_cast<const T*>(h), static_cast<const T*>(w), mean, rstd, static_cast<T*>(dx),
            static_cast<T*>(dres), partial, N, C, drop, threshold, scale, seed, offset, philox, rms);
}

}  // namespace

const char* launch_add_layer_norm_fwd(const void* x, const void* residual, const void* weight,
                                      const void* bias, void* y, void* h, float* mean, float* rstd,
                                      int64_t N, int64_t C, int dtype, double eps,
                                      double dropout_p, uint64_t seed, uint64_t offset,
                                      const int64_t* philox, void* stream, bool rms_norm) {
  if (N <= 0 || C <= 0) return nullptr;
  const uint32_t threshold = ff_dropout_threshold(dropout_p);
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const bool vec = C % kUnit == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) &&
                   aligned16(bias) && aligned16(y) && aligned16(h);
  const float e = static_cast<float>(eps);
  FF_DISPATCH_DTYPE(dtype, T, {
    if (vec && warp_rows(C)) {
      fwd<T, true, true>(x, residual, weight, bias, y, h, mean, rstd, N, C, e, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else if (vec) {
      fwd<T, true, false>(x, residual, weight, bias, y, h, mean, rstd, N, C, e, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else if (warp_rows(C)) {
      fwd<T, false, true>(x, residual, weight, bias, y, h, mean, rstd, N, C, e, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else {
      fwd<T, false, false>(x, residual, weight, bias, y, h, mean, rstd, N, C, e, threshold, scale, seed, offset, philox, stream, rms_norm);
    }
  });
  return ff_last_error();
}

// The current device's SM count (the SIMT harness models one). 1 if it cannot be read, which a
// device with live tensors never does; the sticky error is cleared so no launch reports it.
int device_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1) {
    (void)cudaGetLastError();
    return 1;
  }
  return sms;
}

// The backward's blocks (= partial rows): one wave of kBwdThreadsPerSm threads an SM (4 blocks of
// 128 threads for warp rows, 1-4 blocks for block rows), fewer when there are fewer rows. More
// blocks would not run sooner, only add partial rows to write and reduce.
int64_t add_layer_norm_bwd_parts(int64_t N, int64_t C) {
  const int64_t rpb = rows_per_block(C);
  const int64_t per_sm = std::max<int64_t>(1, kBwdThreadsPerSm / row_threads(C));
  const int64_t blocks = std::min<int64_t>((N + rpb - 1) / rpb, device_sm_count() * per_sm);
  return std::max<int64_t>(1, blocks);
}

const char* launch_add_layer_norm_bwd(const void* dy, const void* dh, const void* h,
                                      const void* weight, const float* mean, const float* rstd,
                                      void* dx, void* dresidual, void* dweight, void* dbias,
                                      float* partial, int64_t parts, int64_t N, int64_t C,
                                      int dtype, double dropout_p, uint64_t seed, uint64_t offset,
                                      const int64_t* philox, void* stream, bool rms_norm) {
  if (C <= 0) return nullptr;
  if (parts != add_layer_norm_bwd_parts(N, C)) {
    return "launch_add_layer_norm_bwd: parts must be add_layer_norm_bwd_parts(N, C)";
  }
  const uint32_t threshold = ff_dropout_threshold(dropout_p);
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const bool vec = C % kUnit == 0 && aligned16(dy) && aligned16(dh) && aligned16(h) &&
                   aligned16(weight) && aligned16(dx) && aligned16(dresidual) && aligned16(partial);
  FF_DISPATCH_DTYPE(dtype, T, {
    if (vec && warp_rows(C)) {
      bwd<T, true, true>(dy, dh, h, weight, mean, rstd, dx, dresidual, partial, parts, N, C, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else if (vec) {
      bwd<T, true, false>(dy, dh, h, weight, mean, rstd, dx, dresidual, partial, parts, N, C, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else if (warp_rows(C)) {
      bwd<T, false, true>(dy, dh, h, weight, mean, rstd, dx, dresidual, partial, parts, N, C, threshold, scale, seed, offset, philox, stream, rms_norm);
    } else {
      bwd<T, false, false>(dy, dh, h, weight, mean, rstd, dx, dresidual, partial, parts, N, C, threshold, scale, seed, offset, philox, stream, rms_norm);
    }
    if (const char* err = ff_last_error()) return err;
    auto* sum = &add_layer_norm_partial_sum_kernel<T>;
    FF_LAUNCH(sum, dim3(ff_grid_blocks(C, kSumCols), 2), dim3(kSumCols, kSumLanes), 0, stream,
              static_cast<const float*>(partial), static_cast<T*>(dweight), static_cast<T*>(dbias),
              parts, C);
  });
  return ff_last_error();
}
