// Attention's fused row kernels for CUDA; the four products run as batched GEMMs in ATen
// (csrc/cuda/attention.cpp). Every kernel takes one row of an (B, H, Sq, Sk) fp32 matrix per
// block, row r = (b H + h) Sq + i (the query), Sk columns (the keys), rows Sk apart.
//
//   forward           s = q k^T (fp32)  ->  attention_softmax_fwd: scale + key padding + additive
//                     mask + bottom-right causal, softmax (fp32, online max / sum per thread, then
//                     a block reduction), lse, Philox v2 dropout  ->  p_d (may overwrite s)
//   backward, first   s = q k^T again   ->  attention_probs_bwd: P = exp(masked s - lse) (no
//                     max / sum pass), kept fp32 over s, and P_d = dropout(P) for dV = P_d^T dO
//   backward, second  dp = dO v^T (fp32) ->  attention_softmax_bwd: delta = rowsum(dO * out),
//                     dS = scale P (dp Z - delta) (may overwrite dp) for dQ = dS k, dK = dS^T q
//
// Masks, exactly as fastformer/ops/reference.py: key j is hidden from query i when key j is
// padded, when the additive mask is -inf (whatever the score, NaN included), or, causal, when
// j > i + Sk - Sq. A row's visibility comes from the masks alone: a row with no visible key gets
// P = 0, lse = +inf and so dS = 0; a visible row with a NaN or +inf score (or whose visible scores
// are all -inf) is NaN throughout, lse NaN.
//
// Dropout (Philox v2, philox.cuh): the probabilities are rows of C = Sk columns, one per query;
// each group of 8 columns gets its single Philox call from one lane, and warp shuffles hand its
// keep bits to the lanes that own its columns (coalesced, see for_row_columns). Kept values are
// scaled by 1 / (1 - p): Z = keep / (1 - p).
#include "common.cuh"
#include "philox.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kMaxThreads = 256;

// The masks of one launch. kpm: (B, Sk) bool, True = padded, or null. am: fp32 additive mask read
// through (broadcast, 0 where size 1) strides, or null. causal: key j visible to query i iff
// j <= i + shift, shift = Sk - Sq.
struct AttnMasks {
  const bool* kpm;
  const float* am;
  int64_t am_sb, am_sh, am_sq, am_sk;
  int causal;
  int64_t shift;
};

// The masks of row (b, h, i): padded-key row, additive-mask row, the last visible causal key.
struct RowMasks {
  const bool* kpm;
  const float* am;
  int64_t am_sk;
  int64_t last;  // causal: keys past it are hidden (INT64_MAX when not causal)
};

FF_DEVICE RowMasks row_masks(const AttnMasks& mk, int64_t b, int64_t h, int64_t i, int64_t Sk) {
  RowMasks r;
  r.kpm = mk.kpm != nullptr ? mk.kpm + b * Sk : nullptr;
  r.am = mk.am != nullptr ? mk.am + b * mk.am_sb + h * mk.am_sh + i * mk.am_sq : nullptr;
  r.am_sk = mk.am_sk;
  r.last = mk.causal ? i + mk.shift : INT64_MAX;
  return r;
}

// The scaled and masked score of key j: -inf when a mask hides it (visible = false), else
// scale s + am (NaN and inf pass through).
FF_DEVICE float masked_score(const float* srow, int64_t j, float scale, const RowMasks& r,
                             bool& visible) {
  visible = false;
  if (j > r.last) return -INFINITY;
  if (r.kpm != nullptr && r.kpm[j]) return -INFINITY;
  float x = srow[j] * scale;
  if (r.am != nullptr) {
    const float a = r.am[j * r.am_sk];
    if (a == -INFINITY) return -INFINITY;
    x += a;
  }
  visible = true;
  return x;
}

// Online softmax state of part of a row: running max m (over the finite-or-+inf visible scores)
// and sum l of exp(x - m) (a NaN score makes l NaN for good); v = 1 once a key is visible.
struct MaxSum {
  float m, l, v;
};

FF_DEVICE void max_sum_add(MaxSum& s, float x) {
  if (x == -INFINITY) return;  // contributes exp(-inf - m) = 0
  if (x > s.m) {
    s.l = s.l * expf(s.m - x) + 1.0f;  // m = -inf at first: l = 0 * 0 + 1
    s.m = x;
  } else {
    s.l += expf(x - s.m);  // x NaN: l NaN
  }
}

// l rescaled from max mi to the combined max m >= mi (l is 0 or NaN while mi = -inf).
FF_DEVICE float rescale(float l, float mi, float m) { return mi == m ? l : l * expf(mi - m); }

FF_DEVICE MaxSum max_sum_merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  MaxSum r;
  r.m = m;
  r.l = rescale(a.l, a.m, m) + rescale(b.l, b.m, m);
  r.v = fmaxf(a.v, b.v);
  return r;
}

// The states of the warp's 32 lanes merged (butterfly), in every lane.
FF_DEVICE MaxSum warp_max_sum(MaxSum s) {
#pragma unroll
  for (int mask = kFfWarpSize / 2; mask > 0; mask >>= 1) {
    MaxSum o;
    o.m = __shfl_xor_sync(kFfFullMask, s.m, mask);
    o.l = __shfl_xor_sync(kFfFullMask, s.l, mask);
    o.v = __shfl_xor_sync(kFfFullMask, s.v, mask);
    s = max_sum_merge(s, o);
  }
  return s;
}

// The state of the whole row, in every thread (blockDim.x a multiple of 32, every thread calls).
// red: __shared__ scratch of 3 * 32 floats.
FF_DEVICE MaxSum block_max_sum(MaxSum s, float* red) {
  s = warp_max_sum(s);
  const int lane = threadIdx.x % kFfWarpSize, warp = threadIdx.x / kFfWarpSize;
  const int warps = blockDim.x / kFfWarpSize;
  __syncthreads();  // the previous row's readers are done with red
  if (lane == 0) {
    red[warp] = s.m;
    red[kFfWarpSize + warp] = s.l;
    red[2 * kFfWarpSize + warp] = s.v;
  }
  __syncthreads();
  MaxSum w;
  w.m = lane < warps ? red[lane] : -INFINITY;
  w.l = lane < warps ? red[kFfWarpSize + lane] : 0.0f;
  w.v = lane < warps ? red[2 * kFfWarpSize + lane] : 0.0f;
  return warp_max_sum(w);
}

// The keep mask of the 8 columns of group g of row `row` (bit c: column 8 g + c kept).
FF_DEVICE uint32_t group_keep(uint64_t seed, uint64_t offset, int64_t row, int64_t Sk, int64_t g,
                              uint32_t threshold) {
  return ff_dropout_keep8(seed, ff_dropout_counter(offset, row, Sk, g), threshold);
}

constexpr int kChunk = kFfWarpSize * kFfDropoutGroup;  // columns a warp takes at a time: 32 groups

// Calls f(j, kept) for the columns j of row `row` that this thread owns, coalesced: warp w of the
// block takes chunks w, w + warps, ... of 256 columns (32 groups of 8), and lane l columns
// l, l + 32, ..., l + 224 of a chunk. With dropout, lane l makes the one Philox call of the chunk's
// group l and the keep bits reach the lanes that own its columns by shuffles (the loop is uniform
// across the warp: every lane takes part in every shuffle). Without dropout, kept is always true.
template <typename F>
FF_DEVICE void for_row_columns(int64_t row, int64_t Sk, bool dropout, uint32_t threshold,
                               uint64_t seed, uint64_t offset, F&& f) {
  const int lane = threadIdx.x % kFfWarpSize, warp = threadIdx.x / kFfWarpSize;
  const int warps = blockDim.x / kFfWarpSize;
  const int64_t G = ff_dropout_groups(Sk), chunks = (Sk + kChunk - 1) / kChunk;
  for (int64_t chunk = warp; chunk < chunks; chunk += warps) {
    const int64_t j0 = chunk * kChunk;
    if (dropout) {
      const int64_t g = chunk * kFfWarpSize + lane;  // the group whose Philox call this lane makes
      const uint32_t keep = g < G ? group_keep(seed, offset, row, Sk, g, threshold) : 0u;
#pragma unroll
      for (int m = 0; m < kFfDropoutGroup; ++m) {
        const int c = lane + kFfWarpSize * m;  // column within the chunk, in group c / 8
        const uint32_t bits = __shfl_sync(kFfFullMask, keep, c / kFfDropoutGroup);
        if (j0 + c < Sk) f(j0 + c, ((bits >> (c % kFfDropoutGroup)) & 1u) != 0u);
      }
    } else {
#pragma unroll
      for (int m = 0; m < kFfDropoutGroup; ++m) {
        const int c = lane + kFfWarpSize * m;
        if (j0 + c < Sk) f(j0 + c, true);
      }
    }
  }
}

// prob's marker of a key hidden by the masks: -0.0f, which exp never gives. The softmax backward
// makes dS exactly 0 there even in a NaN row (the reference's masked_fill passes no gradient to a
// hidden score), while P itself is NaN at every key of a NaN row, as in the reference.
FF_DEVICE float hidden_prob() { return -0.0f; }
FF_DEVICE bool is_hidden_prob(float p) { return __float_as_uint(p) == 0x80000000u; }

// Writes P = exp(x - lse) of the masked scores of row `row`: prob (fp32, may alias s: each
// element is read and written by the same thread) holds P at visible keys and hidden_prob() at
// hidden ones; dropped (in T, when not null) P Z. lse = +inf (no visible key) gives P = 0.
// Every thread of the block calls it (for_row_columns shuffles).
template <typename T>
FF_DEVICE void write_row_probs(const float* srow, float* prob, T* dropped, int64_t row, int64_t Sk,
                               float scale, const RowMasks& rm, float lse, uint32_t threshold,
                               float keep_scale, uint64_t seed, uint64_t offset) {
  const bool none_visible = lse == INFINITY;
  const bool dropout = dropped != nullptr && threshold != 0u;
  for_row_columns(row, Sk, dropout, threshold, seed, offset, [&](int64_t j, bool kept) {
    float p = 0.0f;
    bool visible = false;
    if (!none_visible) p = expf(masked_score(srow, j, scale, rm, visible) - lse);  // hidden: 0, or NaN if lse is
    if (prob != nullptr) prob[j] = visible ? p : hidden_prob();
    if (dropped != nullptr) dropped[j] = ff_from_float<T>(kept ? p * keep_scale : 0.0f);
  });
}

// Forward: p (rows, Sk) in T (may alias s when T is float) = dropout(softmax(scale s + masks)),
// lse (rows,) fp32.
template <typename T>
__global__ void attention_softmax_fwd(const float* s,       // (rows, Sk) q k^T, unscaled
                                      T* p,                  // (rows, Sk) out: dropped probabilities
                                      float* lse,            // (rows,) out: log-sum-exp, +inf if none visible
                                      int64_t rows, int64_t H, int64_t Sq, int64_t Sk, float scale,
                                      AttnMasks mk, uint32_t threshold, float keep_scale,
                                      uint64_t seed, uint64_t offset) {
  __shared__ float red[3 * kFfWarpSize];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % Sq, bh = row / Sq, h = bh % H, b = bh / H;
    const float* srow = s + row * Sk;
    const RowMasks rm = row_masks(mk, b, h, i, Sk);
    MaxSum st{-INFINITY, 0.0f, 0.0f};
    for (int64_t j = threadIdx.x; j < Sk; j += blockDim.x) {
      bool visible;
      const float x = masked_score(srow, j, scale, rm, visible);
      if (visible) st.v = 1.0f;
      max_sum_add(st, x);
    }
    const MaxSum tot = block_max_sum(st, red);
    float row_lse = INFINITY;
    if (tot.v > 0.0f) {
      // every visible score -inf, or one +inf: the reference's exp(s - max) is NaN there
      const float l = (tot.m == INFINITY || tot.m == -INFINITY) ? NAN : tot.l;
      row_lse = tot.m + logf(l);
    }
    if (threadIdx.x == 0) lse[row] = row_lse;
    // p may alias s: every element is read and written by the same thread below, and the
    // reductions above (with their barriers) are done reading s
    T* prow = p + row * Sk;
    write_row_probs<T>(srow, nullptr, prow, row, Sk, scale, rm, row_lse, threshold, keep_scale, seed,
                       offset);
  }
}

// Backward, first kernel: prob (rows, Sk) fp32 over s = P = exp(masked scale s - lse) (hidden
// keys: hidden_prob()), and, when dropped is not null, dropped (rows, Sk) in T = P Z.
template <typename T>
__global__ void attention_probs_bwd(float* s,              // (rows, Sk) in: q k^T, out: P
                                    T* dropped,            // (rows, Sk) out: P Z, or null
                                    const float* lse,      // (rows,) the forward's
                                    int64_t rows, int64_t H, int64_t Sq, int64_t Sk, float scale,
                                    AttnMasks mk, uint32_t threshold, float keep_scale,
                                    uint64_t seed, uint64_t offset) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % Sq, bh = row / Sq, h = bh % H, b = bh / H;
    float* srow = s + row * Sk;
    const RowMasks rm = row_masks(mk, b, h, i, Sk);
    write_row_probs<T>(srow, srow, dropped != nullptr ? dropped + row * Sk : nullptr, row, Sk, scale,
                       rm, lse[row], threshold, keep_scale, seed, offset);
  }
}

// Backward, second kernel: ds (rows, Sk) in T (may alias dp when T is float) = scale P (dp Z - delta),
// 0 at hidden keys, with delta = sum over d of dout * out (row (b, h, i) of each, D columns, read
// through strides).
template <typename T>
__global__ void attention_softmax_bwd(const float* prob,   // (rows, Sk) P, undropped
                                      const float* dp,     // (rows, Sk) dO v^T
                                      T* ds,               // (rows, Sk) out
                                      const T* dout, int64_t do_sb, int64_t do_sh, int64_t do_ss,
                                      const T* out, int64_t o_sb, int64_t o_sh, int64_t o_ss,
                                      int64_t rows, int64_t H, int64_t Sq, int64_t Sk, int64_t D,
                                      float scale, uint32_t threshold, float keep_scale,
                                      uint64_t seed, uint64_t offset) {
  __shared__ float red[kFfWarpSize];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % Sq, bh = row / Sq, h = bh % H, b = bh / H;
    const T* gr = dout + b * do_sb + h * do_sh + i * do_ss;
    const T* orow = out + b * o_sb + h * o_sh + i * o_ss;
    float part = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) part += ff_to_float(gr[d]) * ff_to_float(orow[d]);
    const float delta = ff_block_sum(part, red);
    const float* prow = prob + row * Sk;
    const float* dprow = dp + row * Sk;
    T* dsrow = ds + row * Sk;  // may alias dprow: each element is read and written by one thread
    // threshold 0 keeps every element (kept is then always true), still scaled by 1 / (1 - p)
    for_row_columns(row, Sk, threshold != 0u, threshold, seed, offset, [&](int64_t j, bool kept) {
      const float z = kept ? keep_scale : 0.0f;
      const float pj = prow[j];
      dsrow[j] = ff_from_float<T>(is_hidden_prob(pj) ? 0.0f : scale * pj * (dprow[j] * z - delta));
    });
  }
}

// Threads per row block: a warp per chunk of 256 keys, 1 .. 8 warps.
int row_threads(int64_t Sk) {
  int64_t t = (Sk + kChunk - 1) / kChunk * kFfWarpSize;
  if (t < kFfWarpSize) t = kFfWarpSize;
  if (t > kMaxThreads) t = kMaxThreads;
  return static_cast<int>(t);
}

// What every row launch shares: one block a row, the dropout threshold and 1 / (1 - p).
struct RowLaunch {
  int64_t rows;
  uint32_t threshold;
  float keep_scale;
  dim3 grid, block;
  RowLaunch(int64_t B, int64_t H, int64_t Sq, int64_t Sk, double dropout_p)
      : rows(B * H * Sq),
        threshold(ff_dropout_threshold(dropout_p)),
        keep_scale(static_cast<float>(1.0 / (1.0 - dropout_p))),
        grid(ff_grid_blocks(rows, 1)),
        block(row_threads(Sk)) {}
};

// The launch of attention_softmax_fwd and attention_probs_bwd, which take the same arguments:
// pick(static_cast<T*>(nullptr)) is the kernel for element type T; S and L are the two kernels'
// types of s and lse (read or written).
template <typename Pick, typename S, typename L>
const char* launch_masked_rows(Pick pick, S* s, void* out, L* lse, int64_t B, int64_t H, int64_t Sq,
                               int64_t Sk, int dtype, double scale, const bool* kpm, const float* am,
                               int64_t am_sb, int64_t am_sh, int64_t am_sq, int64_t am_sk,
                               int causal, double dropout_p, uint64_t seed, uint64_t offset,
                               void* stream) {
  if (B * H * Sq == 0 || Sk == 0) return nullptr;
  const AttnMasks mk{kpm, am, am_sb, am_sh, am_sq, am_sk, causal, Sk - Sq};
  const RowLaunch rl(B, H, Sq, Sk, dropout_p);
  FF_DISPATCH_DTYPE(dtype, T, {
    auto* kernel = pick(static_cast<T*>(nullptr));
    FF_LAUNCH(kernel, rl.grid, rl.block, 0, stream, s, static_cast<T*>(out), lse, rl.rows, H, Sq,
              Sk, static_cast<float>(scale), mk, rl.threshold, rl.keep_scale, seed, offset);
  });
  return ff_last_error();
}

}  // namespace

const char* launch_attention_softmax_fwd(const float* s, void* p, float* lse, int64_t B, int64_t H,
                                         int64_t Sq, int64_t Sk, int dtype, double scale,
                                         const bool* kpm, const float* am, int64_t am_sb,
                                         int64_t am_sh, int64_t am_sq, int64_t am_sk, int causal,
                                         double dropout_p, uint64_t seed, uint64_t offset,
                                         void* stream) {
  const auto pick = [](auto* t) { return &attention_softmax_fwd<std::remove_pointer_t<decltype(t)>>; };
  return launch_masked_rows(pick, s, p, lse, B, H, Sq, Sk, dtype, scale, kpm, am, am_sb, am_sh, am_sq,
                            am_sk, causal, dropout_p, seed, offset, stream);
}

const char* launch_attention_probs_bwd(float* s, void* dropped, const float* lse, int64_t B,
                                       int64_t H, int64_t Sq, int64_t Sk, int dtype, double scale,
                                       const bool* kpm, const float* am, int64_t am_sb,
                                       int64_t am_sh, int64_t am_sq, int64_t am_sk, int causal,
                                       double dropout_p, uint64_t seed, uint64_t offset,
                                       void* stream) {
  const auto pick = [](auto* t) { return &attention_probs_bwd<std::remove_pointer_t<decltype(t)>>; };
  return launch_masked_rows(pick, s, dropped, lse, B, H, Sq, Sk, dtype, scale, kpm, am, am_sb, am_sh,
                            am_sq, am_sk, causal, dropout_p, seed, offset, stream);
}

const char* launch_attention_softmax_bwd(const float* prob, const float* dp, void* ds,
                                         const void* dout, int64_t do_sb, int64_t do_sh,
                                         int64_t do_ss, const void* out, int64_t o_sb,
                                         int64_t o_sh, int64_t o_ss, int64_t B, int64_t H,
                                         int64_t Sq, int64_t Sk, int64_t D, int dtype, double scale,
                                         double dropout_p, uint64_t seed, uint64_t offset,
                                         void* stream) {
  if (B * H * Sq == 0 || Sk == 0) return nullptr;
  const RowLaunch rl(B, H, Sq, Sk, dropout_p);
  FF_DISPATCH_DTYPE(dtype, T, {
    auto* kernel = &attention_softmax_bwd<T>;
    FF_LAUNCH(kernel, rl.grid, rl.block, 0, stream, prob, dp, static_cast<T*>(ds),
              static_cast<const T*>(dout), do_sb, do_sh, do_ss, static_cast<const T*>(out), o_sb,
              o_sh, o_ss, rl.rows, H, Sq, Sk, D, static_cast<float>(scale), rl.threshold,
              rl.keep_scale, seed, offset);
  });
  return ff_last_error();
}
