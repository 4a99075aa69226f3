// The problem description shared by the CPU attention kernels (attention_kernel_fwd.cpp,
// attention_kernel_bwd.cpp), which implement fastformer::attention_fwd / attention_bwd and
// attention_varlen_fwd / attention_varlen_bwd (schemas in csrc/schemas.h).
//
// One problem description serves both ops: attention's (B, H, S, D) batch of equal-length rows
// and attention_varlen's packed sequences (total, H, D) with cu_seqlens (Problem::Lq / Lk per
// sequence, Rows addressing a sequence's rows through cu), so every tile, mask and dropout step
// is the same code for both.
//
// The tile products are plain row-major C (+)= A B (attention_gemm.h: oneDNN's brgemm ukernel
// through at::native::cpublas for fp32, MKL for fp64; neither takes a transposed operand); the
// transposed operands (K^T, V^T, (P Z)^T, dS^T) are built explicitly (attention_transpose.h).
//
// Dtypes: fp32, fp64 and bf16. bf16 operands are converted to fp32 tiles, so the products,
// softmax statistics and gradient accumulation are fp32.
//
// The kernels are the math, compiled once per ISA level into fastformer::<level> (isa.h);
// attention.cpp and attention_varlen.cpp check the arguments, prepare the masks and call the
// chosen level.
#pragma once  // per-ISA sources only: attention_schedule.h checks
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "attention.h"
#include "attention_schedule.h"
#include "dropout_scales.h"
#include "philox.h"

namespace fastformer {
namespace CPU_CAPABILITY {
// Internal linkage, as when all of this was one file: each per-ISA source keeps its own copy.
namespace {

constexpr int64_t kBlockQ = 64;    // query rows per tile
constexpr int64_t kBlockK = 128;   // keys per tile; a multiple of kPad
// Score rows are padded (with -inf) to whole vectors. The products whose N is the key count
// (Q K^T, dO V^T) run npad wide: columns [nk, npad) of K^T / V^T hold whatever an earlier tile
// left there, and what they give is overwritten before it is read (-inf, or 0 in dP). oneDNN's
// brgemm then sees a few N instead of every length (a ragged N was ~20-35% slower per product at
// attention's tile sizes on AMD EPYC / AVX2, ragged M and K not).
constexpr int64_t kPad = 16;

// An operand read through its strides: row s of head h of sequence b is D contiguous elements
// (one for lse / delta), rows ld apart (ld >= D, as the GEMMs need). Padded (B, H, S, D):
// sequence b starts at b * sb; packed (total, H, D): at row cu[b].
template <typename T>
struct Rows {
  T* data;
  int64_t sb, sh, ld;
  const int32_t* cu = nullptr;
  T* row(int64_t b, int64_t h, int64_t s) const {
    return data + (cu != nullptr ? (cu[b] + s) * ld : b * sb + s * ld) + h * sh;
  }
};

// A padded (B, H, S, D) tensor.
template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  const int64_t ld = t.size(2) <= 1 ? t.size(3) : t.stride(2);
  return Rows<T>{const_cast<T*>(t.data_ptr<T>()), t.stride(0), t.stride(1), ld};
}

// A packed (total, H, D) tensor whose sequences start at rows cu[b].
template <typename T>
Rows<T> packed_rows_of(const at::Tensor& t, const int32_t* cu) {
  const int64_t ld = t.size(0) <= 1 ? t.size(2) : t.stride(0);
  return Rows<T>{const_cast<T*>(t.data_ptr<T>()), 0, t.stride(1), ld, cu};
}

// One score row's window of the relative position bias (RelBias): column c (key j0 + c) adds
// bias[clamp(d0 + c, 0, last)], last = 2R, d0 = j0 - pos + R for the query at position pos. The
// distance grows by one per key, so the row reads consecutive values, clamped at both ends.
template <typename T>
struct RelRow {
  const T* bias = nullptr;  // the head's 2R + 1 values; nullptr: no bias
  int64_t d0 = 0, last = 0;
};

template <typename scalar_t>
struct Problem {
  using acc_t = at::opmath_type<scalar_t>;
  // Sq, Sk: every sequence's lengths (padded) or the longest (packed); either way the dropout
  // counters' grid (B, H, Sq, Sk).
  int64_t B, H, Sq, Sk, D;
  const int32_t* cu_q = nullptr;  // packed: sequence b's query rows [cu_q[b], cu_q[b + 1])
  const int32_t* cu_k = nullptr;  //          and key rows [cu_k[b], cu_k[b + 1])
  Rows<scalar_t> q, k, v;
  int64_t kv_group = 1;  // query heads per k/v head (grouped-query attention when > 1)
  Masks mask;
  acc_t scale;
  DropoutParams dropout;  // attention_dropout_params (v3)
  uint64_t seed, offset;
  const acc_t* rel = nullptr;  // the relative position bias (H, 2R + 1) (RelBias); nullptr: none
  int64_t rel_R = 0, rel_shift = 0;

  // The k/v head query head h reads.
  int64_t kv_head(int64_t h) const { return h / kv_group; }
  // Sequence b's query and key counts.
  int64_t Lq(int64_t b) const { return cu_q != nullptr ? int64_t{cu_q[b + 1]} - cu_q[b] : Sq; }
  int64_t Lk(int64_t b) const { return cu_k != nullptr ? int64_t{cu_k[b + 1]} - cu_k[b] : Sk; }
  // Causal (bottom-right): key j of sequence b is visible to its query i iff j <= i + shift(b).
  int64_t shift(int64_t b) const { return Lk(b) - Lq(b); }
  // The bias of query i of head h of sequence b against keys j0, ..: query i sits at position
  // i + shift(b) + rel_shift (no bias: a RelRow without one).
  RelRow<acc_t> rel_row(int64_t b, int64_t h, int64_t i, int64_t j0) const {
    if (rel == nullptr) return {};
    return {rel + h * (2 * rel_R + 1), j0 - (i + shift(b) + rel_shift) + rel_R, 2 * rel_R};
  }
  // The query rows of all sequences (the rows of out, lse, delta).
  int64_t total_q() const { return cu_q != nullptr ? int64_t{cu_q[B]} : B * Sq; }
  // (sequence, query) of query row t < total_q().
  std::pair<int64_t, int64_t> locate_q(int64_t t) const {
    if (cu_q == nullptr) return {t / Sq, t % Sq};
    const int64_t b = std::upper_bound(cu_q + 1, cu_q + B + 1, t) - (cu_q + 1);  // skips empty ones
    return {b, t - cu_q[b]};
  }
  // lse / delta rows: (B, H, Sq) contiguous, or (H, total_q) for packed sequences.
  template <typename T>
  Rows<T> stat_rows(T* data) const {
    if (cu_q != nullptr) return Rows<T>{data, 0, total_q(), 1, cu_q};
    return Rows<T>{data, H * Sq, Sq, 1};
  }

  // The keys [first, second) that queries [.., i_end) of sequence b can see at all: outside lie
  // only padded keys and, under causal, keys past the diagonal of query i_end - 1. Tiles there
  // are skipped (their P is 0).
  std::pair<int64_t, int64_t> key_span(int64_t b, int64_t i_end) const {
    const int64_t lk = Lk(b);
    int64_t lo = 0, hi = lk;
    if (mask.key_span != nullptr) {
      lo = mask.key_span[2 * b];
      hi = mask.key_span[2 * b + 1];
    }
    if (mask.causal) hi = std::min(hi, std::clamp<int64_t>(i_end + shift(b), 0, lk));
    return {lo, std::max(lo, hi)};
  }
  // The first query of sequence b that can see key j0.
  int64_t query_begin(int64_t b, int64_t j0) const {
    return mask.causal ? std::clamp<int64_t>(j0 - shift(b), 0, Lq(b)) : 0;
  }
  // Multiply-adds of one head's score tiles for queries [i0, i0 + mq) of sequence b (D each).
  int64_t tile_area(int64_t b, int64_t i0, int64_t mq) const {
    const auto [kbegin, kend] = key_span(b, i0 + mq);
    return mq * (kend - kbegin) * D;
  }
  // A thread's dropout multipliers (AttentionDropout, dropout_scales.h) of value or 0, for blocks
  // of up to kBlockQ queries and kBlockK keys; the tile grid is (B, H, Sq, Sk).
  template <typename A>
  AttentionDropout<A> dropout_tiles(A value) const {
    return AttentionDropout<A>(dropout, seed, offset, Sq, Sk, value, kBlockQ, kBlockK);
  }
};

// The problem of q, k, v read as Rows (rows_of or packed_rows_of).
template <typename scalar_t>
Problem<scalar_t> make_problem(const std::array<int64_t, 5>& dims, const Rows<scalar_t>& q,
                               const Rows<scalar_t>& k, const Rows<scalar_t>& v, const Masks& mask,
                               const RelBias& rel, double scale, double dropout_p, uint64_t seed,
                               uint64_t offset) {
  Problem<scalar_t> p;
  p.B = dims[0];
  p.H = dims[1];
  p.Sq = dims[2];
  p.Sk = dims[3];
  p.D = dims[4];
  p.cu_q = q.cu;
  p.cu_k = k.cu;
  p.q = q;
  p.k = k;
  p.v = v;
  p.mask = mask;
  p.scale = static_cast<at::opmath_type<scalar_t>>(scale);
  p.dropout = attention_dropout_params(dropout_p);  // v3: 8-bit threshold, 256 / (256 - T8)
  p.seed = seed;
  p.offset = offset;
  p.rel = static_cast<const at::opmath_type<scalar_t>*>(rel.data);  // stat_dtype(q): the math type
  p.rel_R = rel.R;
  p.rel_shift = rel.shift;
  return p;
}

// Padded (B, H, S, D) operands.
template <typename scalar_t>
Problem<scalar_t> make_problem(const std::array<int64_t, 5>& dims, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const Masks& mask,
                               const RelBias& rel, double scale, double dropout_p, uint64_t seed,
                               uint64_t offset) {
  auto p = make_problem<scalar_t>(dims, rows_of<scalar_t>(q), rows_of<scalar_t>(k), rows_of<scalar_t>(v),
                                  mask, rel, scale, dropout_p, seed, offset);
  p.kv_group = k.size(1) > 0 ? q.size(1) / k.size(1) : 1;  // checked: k's heads divide q's
  return p;
}

// Packed sequences: no masks but the per-sequence causal one.
template <typename scalar_t>
Problem<scalar_t> make_varlen_problem(const Varlen& lens, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, bool causal, const RelBias& rel,
                                      double scale, double dropout_p, uint64_t seed, uint64_t offset) {
  Masks mask;
  mask.causal = causal;
  auto p = make_problem<scalar_t>({lens.B, lens.H, lens.max_q, lens.max_k, lens.D},
                                  packed_rows_of<scalar_t>(q, lens.cu_q),
                                  packed_rows_of<scalar_t>(k, lens.cu_k),
                                  packed_rows_of<scalar_t>(v, lens.cu_k), mask, rel, scale, dropout_p,
                                  seed, offset);
  p.kv_group = k.size(1) > 0 ? q.size(1) / k.size(1) : 1;  // checked: k's heads divide q's
  return p;
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fastformer
