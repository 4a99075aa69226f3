// Attention for CUDA, both ops: `attention` (padded (B, H, S, D) heads, key padding, attn_mask)
// and `attention_varlen` (packed rows through cu_seqlens) run the same fused kernels,
// FlashAttention-2's algorithm in plain FMA (SIMT) arithmetic with fp32 accumulation. Tensor-core
// mma.sync is a later step: it replaces the dot-product loops over a row group's head-dim slice
// below and keeps the tiles, the masks and the softmax steps. The glue is csrc/cuda/attention.cpp
// and csrc/cuda/attention_varlen.cpp; the definitions fastformer/ops/reference.py::attention and
// ::attention_varlen.
//
//   forward   attention_fwd: a block owns (sequence b, head h, a tile of kRows queries); it streams
//             the sequence's keys in tiles of kTile rows (K and V through shared memory), takes a
//             tile's scores in register chunks of at most 32 keys, each an online-softmax step in
//             fp32 (running max m and sum l per row, the output accumulator rescaled); writes
//             out = acc / l and only lse = m + log(l) per row.
//   backward  attention_bwd_dq: a block owns (b, h, a tile of kRows queries); first delta =
//               rowsum(dO * O) of its rows (fp32, kept in registers and written for the next
//               kernel), then it streams K and V tiles: dS = P (dP Z - delta), dQ += scale dS K;
//             attention_bwd_dkdv: a block owns (b, h, a tile of kRows keys), keeps k, v, dk, dv rows
//               in registers and streams the queries that can see its keys in tiles of kTile rows
//               (Q, dO, lse, delta through shared memory): P = exp(scale s + mask - lse),
//               dV += (P Z)^T dO, dK += scale dS^T Q.
//             Every gradient element has one owner thread: no atomics, deterministic. Nothing of
//             size Sq x Sk exists anywhere: only out and lse (forward) and delta (backward).
//
// Problems (Params): row i of sequence b, head h of an operand (q, k, v, out, dout, the gradients,
// lse and delta) is element b batch + (start_b + i) row + h head (+ d along the head dim, unit
// stride) with the operand's FfRows strides. The padded op has start_b = 0 and lengths Lq = Sq,
// Lk = Sk (max_seqlen = Sq, Sk); varlen has batch = 0 and reads start_b and the lengths from
// cu_seqlens on the device only, each sequence's [start, end) clamped to [0, total) and its length
// to max_seqlen, so any values are memory-safe. A block whose tile starts past its sequence's
// length exits at once.
//
// Thread layout (all kernels, kThreads = 256 a block): a row the block owns (a query, or a key in
// attention_bwd_dkdv) is handled by kTpr = kD / 16 consecutive lanes ("a row group", inside one
// warp); lane g of the group owns the head-dim columns d = g + kTpr c, c < 16, of that row's
// registers. A dot product with a shared-memory row is 16 FMAs a lane and a butterfly over the
// group (__shfl_xor_sync), which leaves the full value in every lane of the group; the group's
// lanes then read shared memory at kTpr consecutive addresses (conflict-free, broadcast across
// groups).
//
// Head dims are compile-time buckets kD = 64, 128, 256 (D <= kD: columns d >= D are zeros in
// registers and shared memory, never stored). Tiles: kRows = 4096 / kD rows a block (64, 32, 16),
// kTile = 4096 / kD streamed rows (64, 32, 16): two fp32 tiles of kTile x kD take 32 KiB of static
// shared memory in every bucket (under the 48 KiB a block gets without opt-in on sm_80 / sm_90).
//
// Masks, exactly as the reference: key j of a sequence is hidden from its query i when j >= Lk,
// when causal and j > i + Lk - Lq (bottom-right), when key_padding_mask (B, Sk) marks it, or when
// the additive attn_mask (fp32, read through broadcast strides; a bool mask arrives as -inf / 0) is
// -inf there, whatever the score (NaN included); otherwise its score is scale q.k + attn_mask. Key
// tiles that no query of a block sees causally are skipped, in every kernel. A row's visibility
// comes from the masks alone: a row with no visible key gives out 0, lse +inf and zero gradients;
// a NaN score makes its row NaN (lse NaN), and so does a row whose visible scores are all -inf or
// one +inf. Hidden keys get dS = 0 exactly and P = 0, except in a NaN row, where P (for dV) is NaN
// at every key as the reference's is, within the (query tile, key tile) pairs a block visits.
//
// Relative position bias (T5's by distance, FfAttentionArgs::rel_bias): a kRel template flag, so
// the kernels without one are those above, unchanged. A visible key j of query i adds
// rel_bias[h, clamp(j - pos_i, -R, R) + R], pos_i = i + Lk - Lq + rel_shift, after the attn_mask; each
// tile's bias is a window of its distances in shared memory. attention_bwd_dq sums its gradient
// (dS by distance bin) per block into a scratch row, which the glue sums over blocks with torch.
//
// Dropout (attention's v3, philox.cuh and fastformer/philox.py), the padded op's counters on
// (B, H, max_seqlen_q, max_seqlen_k): 16 x 32 tiles of head-row b H + h, 32 Philox calls a tile,
// one byte a probability, kept iff the byte >= T8 = round(256 p), kept values scaled by
// 256 / (256 - T8). Every kernel computes the keep bits of its current (queries x keys) tile into
// shared memory first (ff_attn_dropout_keep_tile: a quad's 4 calls decide two rows of a 16 x 32
// tile, spread over the block's threads); key tiles start at multiples of 8.
#include "common.cuh"
#include "philox.cuh"

#include <cmath>
#include <cstdint>

namespace {

constexpr int kThreads = 256;

template <int kD>
struct Tile {
  static_assert(kD == 64 || kD == 128 || kD == 256, "head-dim buckets are 64, 128, 256");
  static constexpr int kTpr = kD / 16;                 // lanes a row: 4, 8, 16
  static constexpr int kSlice = kD / kTpr;             // head-dim columns a lane: 16
  static constexpr int kRows = kThreads / kTpr;        // rows a block owns: 64, 32, 16
  static constexpr int kTile = 4096 / kD;              // streamed rows a tile: 64, 32, 16
  static constexpr int kGroups = kTile / kFfDropoutGroup;
  static_assert(kRows % kFfDropoutGroup == 0 && kTile % kFfDropoutGroup == 0,
                "key tiles start at multiples of the dropout group");
};

// What every kernel of a launch shares (built by the launchers from FfAttentionArgs).
struct Params {
  const void* q;
  const void* k;
  const void* v;
  FfRows q_s, k_s, v_s;
  const int32_t* cu_q;  // varlen: sequence b's rows from cu_q[b]; null for the padded op
  const int32_t* cu_k;
  int64_t H, D, total_q, total_k, max_q, max_k;
  const bool* kpm;  // (B, max_k) contiguous, True = padded key, or null
  const float* am;  // additive, (b, h, i, j) at b am_sb + h am_sh + i am_sq + j am_sk, or null
  int64_t am_sb, am_sh, am_sq, am_sk;
  int causal;
  int dropout;  // dropout_p > 0: kept values are scaled by keep_scale, the others are 0
  float scale, keep_scale;
  uint32_t threshold;
  uint64_t seed, offset;
  const int64_t* philox;  // device (seed, offset), read by fill_keep instead, or null
  int64_t kv_group;  // query head h reads k/v head h / kv_group (grouped-query attention)
  const float* rel;   // relative position bias (H, 2 rel_R + 1) by distance, or null (kRel kernels)
  int64_t rel_R, rel_shift;
};

// A sequence's rows: [start, start + len).
struct Seq {
  int64_t start, len;
};

// Sequence b of a varlen operand (cu not null), clamped to the tensor's rows and to max_seqlen;
// every sequence of the padded op is rows [0, max_len).
FF_DEVICE Seq seq_of(const int32_t* cu, int64_t b, int64_t total, int64_t max_len) {
  if (cu == nullptr) return {0, max_len};
  int64_t s = cu[b], e = cu[b + 1];
  s = s < 0 ? 0 : (s > total ? total : s);
  e = e < s ? s : (e > total ? total : e);
  const int64_t len = e - s;
  return {s, len > max_len ? max_len : len};
}

// The element offset of row 0 of sequence s (batch b), head h, in an operand laid out as r.
FF_DEVICE int64_t row0(const FfRows& r, int64_t b, int64_t h, const Seq& s) {
  return b * r.batch + s.start * r.row + h * r.head;
}

// The padded op's masks of (batch b, head h): its key_padding_mask row and attn_mask plane (both
// null for varlen, or when not given).
struct Masks {
  const bool* kpm;
  const float* am;
  int64_t am_sq, am_sk;
};

FF_DEVICE Masks masks_of(const Params& p, int64_t b, int64_t h) {
  return {p.kpm != nullptr ? p.kpm + b * p.max_k : nullptr,
          p.am != nullptr ? p.am + b * p.am_sb + h * p.am_sh : nullptr, p.am_sq, p.am_sk};
}

FF_DEVICE bool key_padded(const Masks& m, int64_t j) { return m.kpm != nullptr && m.kpm[j]; }

// x += attn_mask[i, j]; false where the mask is -inf: that hides the key whatever x is.
FF_DEVICE bool add_attn_mask(const Masks& m, int64_t i, int64_t j, float& x) {
  if (m.am == nullptr) return true;
  const float a = m.am[i * m.am_sq + j * m.am_sk];
  x += a;
  return a != -INFINITY;
}

// The sum of v over a row group of kTpr lanes, in every lane of the group (the same bits).
template <int kTpr>
FF_DEVICE float group_sum(float v) {
#pragma unroll
  for (int m = kTpr / 2; m > 0; m >>= 1) v += __shfl_xor_sync(kFfFullMask, v, m);
  return v;
}

// dst[r kD + c] (fp32, shared) = row first + r, column c of the sequence's rows at base (row
// stride `stride`, unit column stride), 0 for r >= valid or c >= D. Every thread calls it.
template <typename T, int kD, int kR>
FF_DEVICE void load_tile(float* dst, const T* base, int64_t stride, int64_t first, int64_t valid,
                         int64_t D) {
  for (int e = threadIdx.x; e < kR * kD; e += kThreads) {
    const int r = e / kD, c = e % kD;
    float x = 0.0f;
    if (r < valid && c < D) x = ff_to_float(base[(first + r) * stride + c]);
    dst[e] = x;
  }
}

// keep[i (kCols / 8) + g], bit t: key k0 + 8 g + t is kept for query q0 + i of sequence b, head h
// (0 for a query or key group outside the sequence). k0 is a multiple of 8. Every thread calls it.
template <int kRowsQ, int kCols>
FF_DEVICE void fill_keep(uint8_t* keep, const Params& p, int64_t b, int64_t h, int64_t q0,
                         int64_t q_len, int64_t k0, int64_t k_len) {
  ff_attn_dropout_keep_tile<kRowsQ, kCols, kThreads>(keep, p.seed, p.offset, p.philox, p.threshold, b, h, p.H,
                                                     p.max_q, p.max_k, q0, q_len, k0, k_len);
}

// The block's (tile, head, sequence) from the flat blockIdx.x = tile + tiles (h + H b).
struct BlockIdx {
  int64_t tile, h, b;
};

FF_DEVICE BlockIdx block_idx(int64_t tiles, int64_t H) {
  const int64_t x = blockIdx.x, bh = x / tiles;
  return {x % tiles, bh % H, bh / H};
}

// One past the last key that a query in [0, q_last] can see (causal), or Lk; may be <= 0.
FF_DEVICE int64_t key_end(const Params& p, int64_t q_last, int64_t Lq, int64_t Lk) {
  if (!p.causal) return Lk;
  const int64_t e = q_last + (Lk - Lq) + 1;
  return e < Lk ? e : Lk;
}

// ------------------------------------------------------------------ relative position bias
// (the kRel kernels only: the kernels without it are compiled without any of this)
//
// Query i of a sequence is at position i + off, off = Lk - Lq + rel_shift; key j at j. The pairs
// (a, b) of a tile (a: one of kA rows, b: one of kB columns, one query-side and one key-side)
// lie on kA + kB - 1 diagonals t = b - a + kA - 1, and the distance of a pair is d0 + t, where d0 is
// the tile's: the bias of the whole tile is a window of kA + kB - 1 values, staged in shared
// memory with the tile.

// Head h's bias (2R + 1 values at relh) at distance d, clamped to [-R, R].
FF_DEVICE float rel_at(const float* relh, int64_t R, int64_t d) {
  return relh[(d < -R ? -R : (d > R ? R : d)) + R];
}

// win[t] = the bias at distance d0 + t, t < kA + kB - 1. Every thread calls it.
template <int kA, int kB>
FF_DEVICE void fill_rel_window(float* win, const float* relh, int64_t R, int64_t d0) {
  for (int t = threadIdx.x; t < kA + kB - 1; t += kThreads) win[t] = rel_at(relh, R, d0 + t);
}

// ------------------------------------------------------------------ forward

template <typename T, int kD, bool kRel>
__global__ void __launch_bounds__(kThreads)
attention_fwd(Params p, T* __restrict__ out, FfRows out_s, float* __restrict__ lse, FfRows lse_s,
              int64_t tiles) {
  using C = Tile<kD>;
  constexpr int kTpr = C::kTpr, kSlice = C::kSlice, BM = C::kRows, BN = C::kTile;
  constexpr int kChunk = BN < 32 ? BN : 32;  // scores held in registers at once
  __shared__ __align__(16) float ks[BN * kD];
  __shared__ __align__(16) float vs[BN * kD];
  __shared__ uint8_t keep_s[BM * C::kGroups];
  __shared__ float rel_s[kRel ? BM + BN - 1 : 1];  // the key tile's bias window (query grp, key j)

  const BlockIdx bi = block_idx(tiles, p.H);
  const Seq sq = seq_of(p.cu_q, bi.b, p.total_q, p.max_q);
  const Seq sk = seq_of(p.cu_k, bi.b, p.total_k, p.max_k);
  const int64_t m0 = bi.tile * BM;
  if (m0 >= sq.len) return;  // the whole block: no barrier is left waiting
  const int grp = threadIdx.x / kTpr, g = threadIdx.x % kTpr;
  const int64_t qi = m0 + grp, shift = sk.len - sq.len;
  const bool row_valid = qi < sq.len;
  const Masks mk = masks_of(p, bi.b, bi.h);

  const T* qp = static_cast<const T*>(p.q) + row0(p.q_s, bi.b, bi.h, sq);
  const T* kp = static_cast<const T*>(p.k) + row0(p.k_s, bi.b, bi.h / p.kv_group, sk);
  const T* vp = static_cast<const T*>(p.v) + row0(p.v_s, bi.b, bi.h / p.kv_group, sk);
  float qr[kSlice], acc[kSlice];
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    qr[c] = row_valid && d < p.D ? ff_to_float(qp[qi * p.q_s.row + d]) : 0.0f;
    acc[c] = 0.0f;
  }
  const int64_t q_last = (m0 + BM < sq.len ? m0 + BM : sq.len) - 1;
  const int64_t n_end = key_end(p, q_last, sq.len, sk.len);  // block-uniform
  const int64_t row_last = p.causal ? qi + shift : sk.len - 1;
  const float* relh = kRel ? p.rel + bi.h * (2 * p.rel_R + 1) : nullptr;
  float m = -INFINITY, l = 0.0f;
  bool sees = false;  // a key visible by the masks (whatever its score)

  for (int64_t n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();  // the previous tile's readers are done
    load_tile<T, kD, BN>(ks, kp, p.k_s.row, n0, sk.len - n0, p.D);
    load_tile<T, kD, BN>(vs, vp, p.v_s.row, n0, sk.len - n0, p.D);
    if (p.dropout) fill_keep<BM, BN>(keep_s, p, bi.b, bi.h, m0, sq.len, n0, sk.len);
    if constexpr (kRel) {  // pair (grp, j) at diagonal j - grp + BM - 1
      fill_rel_window<BM, BN>(rel_s, relh, p.rel_R, n0 - m0 - shift - p.rel_shift - (BM - 1));
    }
    __syncthreads();

    // the tile's keys in chunks of kChunk scores (registers), each an online-softmax step
#pragma unroll
    for (int j0 = 0; j0 < BN; j0 += kChunk) {
      float s[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        float a = 0.0f;
#pragma unroll
        for (int c = 0; c < kSlice; ++c) a = fmaf(qr[c], ks[(j0 + j) * kD + g + kTpr * c], a);
        s[j] = group_sum<kTpr>(a);
      }
      // hidden keys -inf (a visible -inf score is 0 as well; a row of only those is NaN below)
      float mt = -INFINITY;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const int64_t key = n0 + j0 + j;
        float x = s[j] * p.scale;
        bool vis = row_valid && key < sk.len && key <= row_last && !key_padded(mk, key);
        vis = vis && add_attn_mask(mk, qi, key, x);
        if constexpr (kRel) x += rel_s[j0 + j - grp + BM - 1];
        sees = sees || vis;
        s[j] = vis ? x : -INFINITY;
        mt = fmaxf(mt, s[j]);  // ignores NaN: a NaN score reaches l and acc through exp below
      }
      const float mn = fmaxf(m, mt);
      const float alpha = m == mn ? 1.0f : expf(m - mn);  // m = -inf before the first visible key: 0
      l *= alpha;
#pragma unroll
      for (int c = 0; c < kSlice; ++c) acc[c] *= alpha;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - mn);
        l += e;
        float z = 1.0f;
        if (p.dropout) {
          const int jj = j0 + j;
          const uint32_t bits = keep_s[grp * C::kGroups + jj / kFfDropoutGroup];
          z = (bits >> (jj % kFfDropoutGroup)) & 1u ? p.keep_scale : 0.0f;
        }
        s[j] = e * z;
      }
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
#pragma unroll
        for (int c = 0; c < kSlice; ++c) acc[c] = fmaf(s[j], vs[(j0 + j) * kD + g + kTpr * c], acc[c]);
      }
      m = mn;
    }
  }

  if (!row_valid) return;  // no barrier follows
  float row_lse = INFINITY, inv = 0.0f;
  if (sees) {
    // every visible score -inf: the reference's exp(s - max) is NaN there
    row_lse = m == -INFINITY ? NAN : m + logf(l);
    inv = m == -INFINITY ? NAN : 1.0f / l;
  }
  T* orow = out + row0(out_s, bi.b, bi.h, sq) + qi * out_s.row;
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    if (d < p.D) orow[d] = ff_from_float<T>(sees ? acc[c] * inv : 0.0f);
  }
  if (g == 0) lse[row0(lse_s, bi.b, bi.h, sq) + qi * lse_s.row] = row_lse;
}

// ------------------------------------------------------------------ backward

// dQ of a tile of kRows queries, over the key tiles they see; first the rows' delta, which it
// writes for attention_bwd_dkdv (launched after it).
//
// With a rel_bias (kRel) it also sums dS by distance bin into its row of w.drel_partial (zeroed
// first, by every block, so that blocks past their sequence leave zeros): the bins 0 and 2R (the
// distances clamped to -R and R, most of a long row's keys) in two registers a row, summed over
// the rows at the end; the bins inside, (-R, R), which a row reaches at most once each (one key a
// distance), as diagonals of each key tile: a warp's rows add their dS of diagonal u into its own
// shared slot (one row a slot at a time, __syncwarp between keys), then a thread a tile diagonal
// adds the warps' slots in warp order to the block's row (global memory, the block's alone). A
// fixed order everywhere, no atomics: deterministic.
template <typename T, int kD, bool kRel>
__global__ void __launch_bounds__(kThreads)
attention_bwd_dq(Params p, FfAttentionGrads w, int64_t tiles) {
  using C = Tile<kD>;
  constexpr int kTpr = C::kTpr, kSlice = C::kSlice, BM = C::kRows, BN = C::kTile;
  constexpr int kWarpRows = 32 / kTpr, kWarps = kThreads / 32;
  constexpr int kDiag = BN + kWarpRows - 1;  // a warp's diagonals of a key tile
  __shared__ __align__(16) float ks[BN * kD];
  __shared__ __align__(16) float vs[BN * kD];
  __shared__ uint8_t keep_s[BM * C::kGroups];
  __shared__ float rel_s[kRel ? BM + BN - 1 : 1];     // the key tile's bias window
  __shared__ float diag_s[kRel ? kWarps * kDiag : 1];  // the warps' dS sums by diagonal
  __shared__ float tail_s[kRel ? 2 * BM : 1];          // the rows' dS of bins 0 and 2R

  const BlockIdx bi = block_idx(tiles, p.H);
  const Seq sq = seq_of(p.cu_q, bi.b, p.total_q, p.max_q);
  const Seq sk = seq_of(p.cu_k, bi.b, p.total_k, p.max_k);
  const int64_t m0 = bi.tile * BM;
  // (B, H, tiles, bins): blockIdx.x = tile + tiles (h + H b) is the block's row
  float* drel_row = kRel ? w.drel_partial + static_cast<int64_t>(blockIdx.x) * w.drel_bins : nullptr;
  if constexpr (kRel) {
    for (int64_t e = threadIdx.x; e < w.drel_bins; e += kThreads) drel_row[e] = 0.0f;
  }
  if (m0 >= sq.len) return;
  const int grp = threadIdx.x / kTpr, g = threadIdx.x % kTpr;
  const int64_t qi = m0 + grp, shift = sk.len - sq.len;
  const bool row_valid = qi < sq.len;
  const Masks mk = masks_of(p, bi.b, bi.h);

  const T* qp = static_cast<const T*>(p.q) + row0(p.q_s, bi.b, bi.h, sq) + qi * p.q_s.row;
  const T* dop = static_cast<const T*>(w.dout) + row0(w.dout_s, bi.b, bi.h, sq) + qi * w.dout_s.row;
  const T* op = static_cast<const T*>(w.out) + row0(w.out_s, bi.b, bi.h, sq) + qi * w.out_s.row;
  const T* kp = static_cast<const T*>(p.k) + row0(p.k_s, bi.b, bi.h / p.kv_group, sk);
  const T* vp = static_cast<const T*>(p.v) + row0(p.v_s, bi.b, bi.h / p.kv_group, sk);
  float qr[kSlice], dor[kSlice], dq[kSlice];
  float part = 0.0f;
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    const bool in = row_valid && d < p.D;
    qr[c] = in ? ff_to_float(qp[d]) : 0.0f;
    dor[c] = in ? ff_to_float(dop[d]) : 0.0f;
    part = fmaf(dor[c], in ? ff_to_float(op[d]) : 0.0f, part);
    dq[c] = 0.0f;
  }
  const float row_delta = group_sum<kTpr>(part);  // rowsum(dO * O), fp32
  const int64_t stat = row0(w.stat_s, bi.b, bi.h, sq) + qi * w.stat_s.row;
  if (row_valid && g == 0) w.delta[stat] = row_delta;
  const float row_lse = row_valid ? w.lse[stat] : INFINITY;
  const int64_t q_last = (m0 + BM < sq.len ? m0 + BM : sq.len) - 1;
  const int64_t n_end = key_end(p, q_last, sq.len, sk.len);
  const int64_t row_last = p.causal ? qi + shift : sk.len - 1;
  const int64_t R = p.rel_R;
  const float* relh = kRel ? p.rel + bi.h * (2 * R + 1) : nullptr;
  [[maybe_unused]] const int warp = threadIdx.x / 32, wr = grp % kWarpRows;  // the row's warp, its row there
  [[maybe_unused]] float lo_tail = 0.0f, hi_tail = 0.0f;  // dS at distances <= -R (bin 0), >= R (bin 2R)

  for (int64_t n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();
    load_tile<T, kD, BN>(ks, kp, p.k_s.row, n0, sk.len - n0, p.D);
    load_tile<T, kD, BN>(vs, vp, p.v_s.row, n0, sk.len - n0, p.D);
    if (p.dropout) fill_keep<BM, BN>(keep_s, p, bi.b, bi.h, m0, sq.len, n0, sk.len);
    // pair (grp, j) at diagonal j - grp + BM - 1, distance d0 + that
    [[maybe_unused]] const int64_t d0 = kRel ? n0 - m0 - shift - p.rel_shift - (BM - 1) : 0;
    // block-uniform: some diagonal of the tile inside (-R, R), which the diagonal sums then take
    [[maybe_unused]] const bool band = kRel && d0 + (BM + BN - 2) > -R && d0 < R;
    if constexpr (kRel) {
      fill_rel_window<BM, BN>(rel_s, relh, R, d0);
      if (band) {
        for (int e = threadIdx.x; e < kWarps * kDiag; e += kThreads) diag_s[e] = 0.0f;
      }
    }
    __syncthreads();

#pragma unroll 2
    for (int j = 0; j < BN; ++j) {
      float a = 0.0f, b = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlice; ++c) {
        a = fmaf(qr[c], ks[j * kD + g + kTpr * c], a);
        b = fmaf(dor[c], vs[j * kD + g + kTpr * c], b);
      }
      a = group_sum<kTpr>(a);
      b = group_sum<kTpr>(b);
      const int64_t key = n0 + j;
      float x = a * p.scale;
      bool vis = row_valid && key < sk.len && key <= row_last && !key_padded(mk, key);
      vis = vis && add_attn_mask(mk, qi, key, x);
      if constexpr (kRel) x += rel_s[j - grp + BM - 1];
      float ds = 0.0f;  // hidden keys: exactly 0, also in a NaN row
      if (vis) {
        const float pr = expf(x - row_lse);
        float z = 1.0f;
        if (p.dropout) {
          const uint32_t bits = keep_s[grp * C::kGroups + j / kFfDropoutGroup];
          z = (bits >> (j % kFfDropoutGroup)) & 1u ? p.keep_scale : 0.0f;
        }
        ds = pr * (b * z - row_delta);
      }
      if constexpr (kRel) {
        const int64_t d = d0 + (j - grp + BM - 1);
        if (d <= -R) {
          lo_tail += ds;
        } else if (d >= R) {
          hi_tail += ds;
        } else if (g == 0) {  // the warp's row wr + 1 adds to this slot at key j + 1
          diag_s[warp * kDiag + j - wr + kWarpRows - 1] += ds;
        }
        if (band) __syncwarp();
      }
#pragma unroll
      for (int c = 0; c < kSlice; ++c) dq[c] = fmaf(ds, ks[j * kD + g + kTpr * c], dq[c]);
    }
    if constexpr (kRel) {
      if (band) {
        __syncthreads();  // every warp's diagonals are in
        for (int t = threadIdx.x; t < BM + BN - 1; t += kThreads) {
          const int64_t d = d0 + t;
          if (d <= -R || d >= R) continue;  // the tails' bins: in registers
          float sum = 0.0f;
          for (int wp = 0; wp < kWarps; ++wp) {
            const int u = t - BM + kWarpRows * (wp + 1);  // diagonal t in warp wp's slots
            if (u >= 0 && u < kDiag) sum += diag_s[wp * kDiag + u];
          }
          // a bin no visible pair reaches (the window's padding) has sum 0 and may lie outside
          const int64_t c = d + R - w.drel_lo;
          if (c >= 0 && c < w.drel_bins) drel_row[c] += sum;
        }
      }
    }
  }

  if constexpr (kRel) {
    if (g == 0) {
      tail_s[grp] = lo_tail;
      tail_s[BM + grp] = hi_tail;
    }
    __syncthreads();  // also orders the last tile's additions before these
    if (threadIdx.x == 0) {
      float lo = 0.0f, hi = 0.0f;
      for (int r = 0; r < BM; ++r) {
        lo += tail_s[r];
        hi += tail_s[BM + r];
      }
      // bins 0 and 2R (the same bin when R = 0); outside the row only when no pair reaches it
      const int64_t c0 = -w.drel_lo, c1 = 2 * R - w.drel_lo;
      if (c0 >= 0 && c0 < w.drel_bins) drel_row[c0] += lo;
      if (c1 >= 0 && c1 < w.drel_bins) drel_row[c1] += hi;
    }
  }
  if (!row_valid) return;
  T* dqrow = static_cast<T*>(w.dq) + row0(w.dq_s, bi.b, bi.h, sq) + qi * w.dq_s.row;
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    if (d < p.D) dqrow[d] = ff_from_float<T>(dq[c] * p.scale);
  }
}

// dK and dV of a tile of kRows keys, over the query tiles that see them.
template <typename T, int kD, bool kRel>
__global__ void __launch_bounds__(kThreads)
attention_bwd_dkdv(Params p, FfAttentionGrads w, int64_t tiles) {
  using C = Tile<kD>;
  constexpr int kTpr = C::kTpr, kSlice = C::kSlice, BN = C::kRows, BM = C::kTile;
  constexpr int kG = BN / kFfDropoutGroup;
  __shared__ __align__(16) float qs[BM * kD];
  __shared__ __align__(16) float dos[BM * kD];
  __shared__ float lse_s[BM], delta_s[BM];
  __shared__ uint8_t keep_s[BM * kG];
  __shared__ float rel_s[kRel ? BM + BN - 1 : 1];  // the query tile's bias window (query i, key grp)

  const BlockIdx bi = block_idx(tiles, p.H);
  const Seq sq = seq_of(p.cu_q, bi.b, p.total_q, p.max_q);
  const Seq sk = seq_of(p.cu_k, bi.b, p.total_k, p.max_k);
  const int64_t n0 = bi.tile * BN;
  if (n0 >= sk.len) return;
  const int grp = threadIdx.x / kTpr, g = threadIdx.x % kTpr;
  const int64_t kj = n0 + grp, shift = sk.len - sq.len;
  const bool key_valid = kj < sk.len;
  const Masks mk = masks_of(p, bi.b, bi.h);
  const bool key_open = key_valid && !key_padded(mk, kj);  // visible to some query, masks aside

  const T* kp = static_cast<const T*>(p.k) + row0(p.k_s, bi.b, bi.h / p.kv_group, sk) + kj * p.k_s.row;
  const T* vp = static_cast<const T*>(p.v) + row0(p.v_s, bi.b, bi.h / p.kv_group, sk) + kj * p.v_s.row;
  const T* qp = static_cast<const T*>(p.q) + row0(p.q_s, bi.b, bi.h, sq);
  const T* dop = static_cast<const T*>(w.dout) + row0(w.dout_s, bi.b, bi.h, sq);
  const float* lsep = w.lse + row0(w.stat_s, bi.b, bi.h, sq);
  const float* deltap = w.delta + row0(w.stat_s, bi.b, bi.h, sq);
  float kr[kSlice], vr[kSlice], dk[kSlice], dv[kSlice];
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    const bool in = key_valid && d < p.D;
    kr[c] = in ? ff_to_float(kp[d]) : 0.0f;
    vr[c] = in ? ff_to_float(vp[d]) : 0.0f;
    dk[c] = 0.0f;
    dv[c] = 0.0f;
  }
  // causal: query i sees key n0 iff i >= n0 - shift; earlier queries see none of the tile
  int64_t i_begin = p.causal ? n0 - shift : 0;
  if (i_begin < 0) i_begin = 0;
  const float* relh = kRel ? p.rel + bi.h * (2 * p.rel_R + 1) : nullptr;

  for (int64_t i0 = i_begin; i0 < sq.len; i0 += BM) {
    __syncthreads();
    load_tile<T, kD, BM>(qs, qp, p.q_s.row, i0, sq.len - i0, p.D);
    load_tile<T, kD, BM>(dos, dop, w.dout_s.row, i0, sq.len - i0, p.D);
    for (int t = threadIdx.x; t < BM; t += kThreads) {
      const bool in = i0 + t < sq.len;
      lse_s[t] = in ? lsep[(i0 + t) * w.stat_s.row] : INFINITY;
      delta_s[t] = in ? deltap[(i0 + t) * w.stat_s.row] : 0.0f;
    }
    if (p.dropout) fill_keep<BM, BN>(keep_s, p, bi.b, bi.h, i0, sq.len, n0, sk.len);
    if constexpr (kRel) {  // pair (i, grp) at diagonal grp - i + BM - 1
      fill_rel_window<BM, BN>(rel_s, relh, p.rel_R, n0 - i0 - shift - p.rel_shift - (BM - 1));
    }
    __syncthreads();

#pragma unroll 2
    for (int i = 0; i < BM; ++i) {
      float a = 0.0f, b = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlice; ++c) {
        a = fmaf(kr[c], qs[i * kD + g + kTpr * c], a);
        b = fmaf(vr[c], dos[i * kD + g + kTpr * c], b);
      }
      a = group_sum<kTpr>(a);
      b = group_sum<kTpr>(b);
      const int64_t qi = i0 + i;
      float x = a * p.scale;
      bool vis = key_open && qi < sq.len && (!p.causal || kj <= qi + shift);
      vis = vis && add_attn_mask(mk, qi, kj, x);
      if constexpr (kRel) x += rel_s[grp - i + BM - 1];
      const float row_lse = lse_s[i];
      // hidden: P = 0, or NaN in a NaN row (lse NaN) as the reference's; dS = 0 either way
      float pd = row_lse != row_lse ? row_lse : 0.0f, ds = 0.0f;
      if (vis) {
        const float pr = expf(x - row_lse);  // lse +inf (no visible key): 0
        float z = 1.0f;
        if (p.dropout) {
          const uint32_t bits = keep_s[i * kG + grp / kFfDropoutGroup];
          z = (bits >> (grp % kFfDropoutGroup)) & 1u ? p.keep_scale : 0.0f;
        }
        pd = pr * z;
        ds = pr * (b * z - delta_s[i]);
      }
#pragma unroll
      for (int c = 0; c < kSlice; ++c) {
        dv[c] = fmaf(pd, dos[i * kD + g + kTpr * c], dv[c]);
        dk[c] = fmaf(ds, qs[i * kD + g + kTpr * c], dk[c]);
      }
    }
  }

  if (!key_valid) return;
  T* dkrow = static_cast<T*>(w.dk) + row0(w.dk_s, bi.b, bi.h, sk) + kj * w.dk_s.row;
  T* dvrow = static_cast<T*>(w.dv) + row0(w.dv_s, bi.b, bi.h, sk) + kj * w.dv_s.row;
#pragma unroll
  for (int c = 0; c < kSlice; ++c) {
    const int d = g + kTpr * c;
    if (d < p.D) {
      dkrow[d] = ff_from_float<T>(dk[c] * p.scale);
      dvrow[d] = ff_from_float<T>(dv[c]);
    }
  }
}

// ------------------------------------------------------------------ launchers

Params make_params(const FfAttentionArgs& a) {
  Params p;
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.q_s = a.q_s;
  p.k_s = a.k_s;
  p.v_s = a.v_s;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.H = a.H;
  p.D = a.D;
  p.total_q = a.total_q;
  p.total_k = a.total_k;
  p.max_q = a.max_seqlen_q;
  p.max_k = a.max_seqlen_k;
  p.kpm = a.key_padding_mask;
  p.am = a.attn_mask;
  p.am_sb = a.am_sb;
  p.am_sh = a.am_sh;
  p.am_sq = a.am_sq;
  p.am_sk = a.am_sk;
  p.causal = a.causal ? 1 : 0;
  p.threshold = ff_attn_dropout_threshold(a.dropout_p);
  p.dropout = p.threshold != 0u ? 1 : 0;  // p < 1 / 512 drops nothing (v3's 8-bit threshold)
  p.scale = static_cast<float>(a.scale);
  p.keep_scale = ff_attn_dropout_scale(a.dropout_p);
  p.seed = a.seed;
  p.offset = a.offset;
  p.philox = p.dropout ? a.philox : nullptr;
  p.kv_group = a.kv_group;
  p.rel = a.rel_bias;
  p.rel_R = a.rel_R;
  p.rel_shift = a.rel_shift;
  return p;
}

// Blocks of a launch over `rows_per_seq` rows of each (sequence, head) in tiles of `tile` rows;
// 0 for nothing to do, -1 when the grid would be too large.
int64_t grid_blocks(const FfAttentionArgs& a, int64_t rows_per_seq, int64_t tile, int64_t* tiles) {
  *tiles = (rows_per_seq + tile - 1) / tile;
  if (*tiles == 0 || a.B == 0 || a.H == 0) return 0;
  const int64_t limit = (int64_t{1} << 31) - 1;
  if (*tiles > limit / a.B || *tiles * a.B > limit / a.H) return -1;
  return *tiles * a.B * a.H;
}

constexpr const char* kTooManyBlocks =
    "attention: ceil(sequence length / tile) * B * H blocks exceed the grid's 2^31 - 1";

template <int kD>
const char* launch_fwd(const FfAttentionArgs& a, void* out, FfRows out_s, float* lse, FfRows lse_s,
                       void* stream) {
  int64_t tiles;
  const int64_t blocks = grid_blocks(a, a.max_seqlen_q, Tile<kD>::kRows, &tiles);
  if (blocks == 0) return nullptr;
  if (blocks < 0) return kTooManyBlocks;
  const Params p = make_params(a);
  FF_DISPATCH_DTYPE(a.dtype, T, {
    auto* kernel = p.rel != nullptr ? &attention_fwd<T, kD, true> : &attention_fwd<T, kD, false>;
    FF_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p,
              static_cast<T*>(out), out_s, lse, lse_s, tiles);
  });
  return ff_last_error();
}

// dQ (and delta) first, then dK / dV, which read delta.
template <int kD>
const char* launch_bwd(const FfAttentionArgs& a, const FfAttentionGrads& w, void* stream) {
  const Params p = make_params(a);
  int64_t tiles;
  int64_t blocks = grid_blocks(a, a.max_seqlen_q, Tile<kD>::kRows, &tiles);
  if (blocks < 0) return kTooManyBlocks;
  if (blocks > 0) {
    FF_DISPATCH_DTYPE(a.dtype, T, {
      auto* kernel = p.rel != nullptr ? &attention_bwd_dq<T, kD, true> : &attention_bwd_dq<T, kD, false>;
      FF_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p, w, tiles);
    });
    if (const char* err = ff_last_error()) return err;
  }
  blocks = grid_blocks(a, a.max_seqlen_k, Tile<kD>::kRows, &tiles);
  if (blocks < 0) return kTooManyBlocks;
  if (blocks > 0) {
    FF_DISPATCH_DTYPE(a.dtype, T, {
      auto* kernel = p.rel != nullptr ? &attention_bwd_dkdv<T, kD, true> : &attention_bwd_dkdv<T, kD, false>;
      FF_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p, w, tiles);
    });
  }
  return ff_last_error();
}

// The head-dim bucket of D (1 .. 256).
int bucket(int64_t D) { return D <= 64 ? 64 : (D <= 128 ? 128 : 256); }

constexpr const char* kBadHeadDim = "attention: head dim must be in [1, 256]";

// What a call with a rel_bias needs besides (nullptr when fine).
const char* rel_why_not(const FfAttentionArgs& a) {
  if (a.rel_bias == nullptr) return nullptr;
  if (a.rel_R < 0) return "attention: rel_bias needs R >= 0";
  return nullptr;
}

}  // namespace

const char* launch_attention_fwd(const FfAttentionArgs& a, void* out, FfRows out_s, float* lse,
                                 FfRows lse_s, void* stream) {
  if (a.D < 1 || a.D > 256) return kBadHeadDim;
  if (const char* why = rel_why_not(a)) return why;
  switch (bucket(a.D)) {
    case 64: return launch_fwd<64>(a, out, out_s, lse, lse_s, stream);
    case 128: return launch_fwd<128>(a, out, out_s, lse, lse_s, stream);
    default: return launch_fwd<256>(a, out, out_s, lse, lse_s, stream);
  }
}

const char* launch_attention_bwd(const FfAttentionArgs& a, const FfAttentionGrads& w, void* stream) {
  if (a.D < 1 || a.D > 256) return kBadHeadDim;
  if (const char* why = rel_why_not(a)) return why;
  if (a.rel_bias != nullptr && (w.drel_partial == nullptr || w.drel_bins < 1)) {
    return "attention: a backward with rel_bias needs drel_partial (attention_bwd_rel_parts rows)";
  }
  switch (bucket(a.D)) {
    case 64: return launch_bwd<64>(a, w, stream);
    case 128: return launch_bwd<128>(a, w, stream);
    default: return launch_bwd<256>(a, w, stream);
  }
}

int64_t attention_bwd_rel_parts(int64_t max_seqlen_q, int64_t D) {
  int64_t rows = Tile<256>::kRows;
  if (D <= 64) rows = Tile<64>::kRows;
  else if (D <= 128) rows = Tile<128>::kRows;
  return (max_seqlen_q + rows - 1) / rows;
}
