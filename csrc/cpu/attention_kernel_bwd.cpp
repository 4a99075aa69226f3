// The backward of the CPU attention kernels: fastformer::attention_bwd and attention_varlen_bwd
// (one Problem for both, attention_problem.h), compiled once per ISA level (isa.h).
//
// Backward recomputes P = exp(S - lse) tile by tile and regenerates the dropout mask from
// (seed, offset): with Z the dropout multipliers (0 or 256 / (256 - T8), attention's dropout v3,
// philox.h; each tile's bits made once for its dQ, dK and dV) and delta = rowsum(dO * O),
//   dV += (P Z)^T dO,  dP = (dO V^T) Z,  dS = scale P (dP - delta),  dQ += dS K,  dK += dS^T Q.
// Two race-free schedules, chosen per sequence:
//   * one task per (sequence, head) computing dQ, dK and dV together (five products per tile),
//     when the head is a small share of the whole call's work; a head of one tile (fp32 / fp64)
//     has each product write its gradient rows in place (backward_single_tile), and the task
//     computes its rows' delta itself unless some head is split (then row_dots runs first);
//   * otherwise two passes: dK and dV per (sequence, head, key block), then dQ per
//     (sequence, head, query block), recomputing S and dP in each (seven products per tile). The
//     dropout bits are made once, in pass 1, which keeps them for pass 2 in a bit map of the
//     split heads (HeadKeep: about Lq Lk / 8 bytes a head; the two passes' key blocks differ
//     after leading padded keys, so the map is per score, not per tile).
// Tiles wholly hidden by the causal mask or by key padding (leading / trailing padded keys)
// are skipped. Threads take tasks one at a time from a shared counter, heaviest first
// (TaskList, parallel_tasks), so sequences of different lengths do not leave a thread waiting
// for another.
// A relative position bias's gradient (dS summed by clamped distance, without floating-point
// atomics) is collected per (sequence, head, key block) in a slot of its own, by the one task
// that computes that key block's dS with dK (never the dQ pass, which recomputes it), and the
// slots are summed in a fixed order at the end: the same bits whatever the schedule or the
// thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "attention_gemm.h"
#include "attention_problem.h"
#include "attention_rows.h"
#include "attention_schedule.h"
#include "attention_transpose.h"
#include "dropout_scales.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

template <typename scalar_t>
struct BwdData {
  using acc_t = at::opmath_type<scalar_t>;
  Rows<scalar_t> dout;
  Rows<acc_t> lse;      // Problem::stat_rows (fp32, fp64 under fp64 inputs)
  Rows<acc_t> delta;    // Problem::stat_rows: rowsum(dout * out)
  Rows<scalar_t> dq, dk, dv;  // the gradients, each row written once
  Rows<scalar_t> out;         // the forward's output (for delta)
};

// A split head's dropout keep bits (AttentionDropout::save's map, ld words a query row): pass 1
// makes each tile's and saves them (load = false), pass 2 reads them (load = true). data nullptr:
// the tile makes its own.
struct HeadKeep {
  uint32_t* data = nullptr;
  int64_t ld = 0;
  bool load = false;
};

// Where a tile's gradient rows go: ld apart; accumulate adds to them, else the tile's product is
// the first and only one and overwrites them.
template <typename acc_t>
struct GradRows {
  acc_t* data;
  int64_t ld;
};

// Per-thread scratch of the backward pass.
template <typename scalar_t>
struct BwdScratch {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<acc_t> S, dP, keep, PZ;  // (kBlockQ, kBlockK) tiles; keep / PZ only with dropout
  std::vector<acc_t> KT, VT;           // (D, kBlockK): K_j^T, V_j^T
  std::vector<acc_t> T;                // (kBlockK, kBlockQ): (P Z)^T, then dS^T
  std::vector<acc_t> dq, dk, dv;       // accumulators of the rows a task owns (leading dim D)
  std::vector<acc_t> x, y;             // bf16: a dout and an out row converted (head_deltas)
  OperandTile<scalar_t> q, k, v, dout;
  AttentionDropout<acc_t> drop;        // the keep bits of the tile at hand (dropout only)
  BwdScratch(const Problem<scalar_t>& p, int64_t dq_rows, int64_t dkv_rows)
      : BwdScratch(p.dropout.drop, p.D, dq_rows, dkv_rows, p.dropout_tiles(static_cast<acc_t>(p.dropout.scale))) {}
  BwdScratch(bool dropout, int64_t D, int64_t dq_rows, int64_t dkv_rows, AttentionDropout<acc_t> tiles)
      : S(kBlockQ * kBlockK),
        dP(kBlockQ * kBlockK),
        keep(dropout ? kBlockQ * kBlockK : 0),
        PZ(dropout ? kBlockQ * kBlockK : 0),
        KT(D * kBlockK),
        VT(D * kBlockK),
        T(kBlockK * kBlockQ),
        dq(dq_rows * D),
        dk(dkv_rows * D),
        dv(dkv_rows * D),
        x(std::is_same_v<scalar_t, acc_t> ? 0 : D),
        y(std::is_same_v<scalar_t, acc_t> ? 0 : D),
        q(kBlockQ, D),
        k(kBlockK, D),
        v(kBlockK, D),
        dout(kBlockQ, D),
        drop(std::move(tiles)) {}

  // K_j, V_j (nk, D) of the k/v head query head (b, h) reads and their transposes into KT, VT.
  void load_keys(const Problem<scalar_t>& p, int64_t b, int64_t h, int64_t j0, int64_t nk,
                 const acc_t*& Kj, int64_t& ldk) {
    int64_t ldv;
    Kj = k.get(p.k, b, p.kv_head(h), j0, nk, ldk);
    const acc_t* Vj = v.get(p.v, b, p.kv_head(h), j0, nk, ldv);
    attn::transpose(Kj, ldk, nk, p.D, KT.data(), kBlockK);
    attn::transpose(Vj, ldv, nk, p.D, VT.data(), kBlockK);
  }
};

// One (query block, key block) tile of the backward pass: queries i0 .. i0 + mq - 1 against keys
// j0 .. j0 + nk - 1 of head (b, h), with w.KT / w.VT holding K_j^T / V_j^T. Adds (accumulate) or
// writes dS K_j to dq (mq, D) when given, and (P Z)^T dO_i, dS^T Q_i to dv, dk (nk, D) when given;
// adds the tile's dS by distance to drel (2R + 1, a task's slot) when given. keep: where the
// dropout bits are saved or read, if anywhere.
template <typename scalar_t>
void backward_tile(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                   int64_t b, int64_t h, int64_t i0, int64_t mq, int64_t j0, int64_t nk,
                   const at::opmath_type<scalar_t>* Kj, int64_t ldk, GradRows<at::opmath_type<scalar_t>> dq,
                   GradRows<at::opmath_type<scalar_t>> dk, GradRows<at::opmath_type<scalar_t>> dv,
                   at::opmath_type<scalar_t>* drel, bool accumulate = true, HeadKeep keep = {}) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D, npad = round_up(nk, kPad), shift = p.shift(b);
  const acc_t* lse = g.lse.row(b, h, i0);
  const acc_t* delta = g.delta.row(b, h, i0);
  const bool dropout = p.dropout.drop;
  int64_t ldq, lddo;
  const acc_t* Qi = w.q.get(p.q, b, h, i0, mq, ldq);            // (mq, D)
  const acc_t* dOi = w.dout.get(g.dout, b, h, i0, mq, lddo);    // (mq, D)

  if (dropout) {  // before the product: the multipliers' stores are done when the rows read them
    if (keep.load) {
      w.drop.load(keep.data, keep.ld, i0, j0);
    } else {
      w.drop.block(b * p.H + h, i0, mq, j0, nk);  // once per tile: dK, dV and dQ of a tile share it
      if (keep.data != nullptr) w.drop.save(keep.data, keep.ld, mq);
    }
    for (int64_t r = 0; r < mq; ++r) w.drop.row(r, nk, npad, w.keep.data() + r * kBlockK);
  }
  // P (mq, nk) = exp(scale * Q_i K_j^T + mask - lse)
  attn::matmul(mq, npad, D, Qi, ldq, w.KT.data(), kBlockK, w.S.data(), kBlockK, false);
  const bool fused = fusable<acc_t>(p.mask);
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t i = i0 + r;
    acc_t* s = w.S.data() + r * kBlockK;
    const acc_t row_lse = lse[r];
    const RelRow<acc_t> rel = p.rel_row(b, h, i, j0);
    if (row_lse == std::numeric_limits<acc_t>::infinity()) {
      std::fill(s, s + npad, acc_t(0));  // no visible key
    } else if (std::isnan(row_lse)) {
      poison_row(s, nk, npad);  // the forward's row was NaN: so are its gradients
    } else if (fused) {
      const Vec<acc_t> vlse(row_lse);
      scale_mask_map_row(p.mask, rel, p.scale, b, i, shift, j0, nk, npad, s,
                         [&](const Vec<acc_t>& x) { return vexp(x - vlse); });
    } else {
      scale_mask_row(p.mask, rel, p.scale, b, h, i, shift, j0, nk, npad, s);
      exp_sub(s, npad, row_lse);
    }
    if (dropout) mul_into(w.PZ.data() + r * kBlockK, s, w.keep.data() + r * kBlockK, npad);
  }

  if (dv.data != nullptr) {
    // dV_j (nk, D) += (P Z)^T (nk, mq) dO_i (mq, D)
    attn::transpose(dropout ? w.PZ.data() : w.S.data(), kBlockK, mq, nk, w.T.data(), kBlockQ);
    attn::matmul(nk, D, mq, w.T.data(), kBlockQ, dOi, lddo, dv.data, dv.ld, accumulate);
  }

  // dP (mq, nk) = dO_i V_j^T, then dS = scale * P (dP Z - delta) in place (and P (dP Z - delta)
  // by distance into drel)
  attn::matmul(mq, npad, D, dOi, lddo, w.VT.data(), kBlockK, w.dP.data(), kBlockK, false);
  RelGrad<acc_t> rel_grad{drel, 2 * p.rel_R};
  for (int64_t r = 0; r < mq; ++r) {
    acc_t* dp = w.dP.data() + r * kBlockK;
    if (npad > nk) std::fill(dp + nk, dp + npad, acc_t(0));
    const acc_t* z = dropout ? w.keep.data() + r * kBlockK : nullptr;
    if (drel != nullptr) {
      softmax_bwd_rel_row(dp, w.S.data() + r * kBlockK, z, nk, npad, delta[r], p.scale,
                          p.rel_row(b, h, i0 + r, j0).d0, rel_grad);
    } else {
      softmax_bwd_row(dp, w.S.data() + r * kBlockK, z, npad, delta[r], p.scale);
    }
  }
  if (drel != nullptr) rel_grad.flush();

  if (dq.data != nullptr) {
    // dQ_i (mq, D) += dS (mq, nk) K_j (nk, D)
    attn::matmul(mq, D, nk, w.dP.data(), kBlockK, Kj, ldk, dq.data, dq.ld, accumulate);
  }
  if (dk.data != nullptr) {
    // dK_j (nk, D) += dS^T (nk, mq) Q_i (mq, D)
    attn::transpose(w.dP.data(), kBlockK, mq, nk, w.T.data(), kBlockQ);
    attn::matmul(nk, D, mq, w.T.data(), kBlockQ, Qi, ldq, dk.data, dk.ld, accumulate);
  }
}

// delta[b, h, i] = sum_d dout[b, h, i, d] * out[b, h, i, d]
template <typename scalar_t>
void row_dots(const Problem<scalar_t>& p, const Rows<scalar_t>& dout, const Rows<scalar_t>& out,
              const Rows<at::opmath_type<scalar_t>>& delta) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kLowp = !std::is_same_v<scalar_t, acc_t>;
  const int64_t D = p.D;
  at::parallel_for(0, p.total_q() * p.H, grain_for(D), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> x(kLowp ? D : 0), y(kLowp ? D : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % p.H;
      const auto [b, i] = p.locate_q(row / p.H);
      const acc_t* a;
      const acc_t* c;
      if constexpr (kLowp) {
        convert_row(dout.row(b, h, i), x.data(), D);
        convert_row(out.row(b, h, i), y.data(), D);
        a = x.data();
        c = y.data();
      } else {
        a = dout.row(b, h, i);
        c = out.row(b, h, i);
      }
      *delta.row(b, h, i) = at::vec::map2_reduce_all<acc_t>(
          [](Vec<acc_t> u, Vec<acc_t> t) { return u * t; },
          [](Vec<acc_t> u, Vec<acc_t> t) { return u + t; }, a, c, D);
    }
  });
}

// delta of head (b, h)'s query rows [0, lq): row_dots for one head, run by the task that reads
// them next, while its dout rows are in cache (x, y: D scratch each, for bf16).
template <typename scalar_t>
void head_deltas(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, int64_t b, int64_t h, int64_t lq,
                 at::opmath_type<scalar_t>* x, at::opmath_type<scalar_t>* y) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D;
  acc_t* delta = g.delta.row(b, h, 0);
  for (int64_t i = 0; i < lq; ++i) {
    const acc_t* a;
    const acc_t* c;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      convert_row(g.dout.row(b, h, i), x, D);
      convert_row(g.out.row(b, h, i), y, D);
      a = x;
      c = y;
    } else {
      a = g.dout.row(b, h, i);
      c = g.out.row(b, h, i);
    }
    delta[i] = at::vec::map2_reduce_all<acc_t>([](Vec<acc_t> u, Vec<acc_t> t) { return u * t; },
                                               [](Vec<acc_t> u, Vec<acc_t> t) { return u + t; }, a, c, D);
  }
}

// Rows [s0, s1) of head (b, h) of a gradient set to 0 (rows no tile writes: keys nobody sees).
template <typename scalar_t>
void zero_rows(const Rows<scalar_t>& dst, int64_t b, int64_t h, int64_t s0, int64_t s1, int64_t D) {
  for (int64_t s = s0; s < s1; ++s) std::fill(dst.row(b, h, s), dst.row(b, h, s) + D, scalar_t(0));
}

// A whole head of one tile (Lq <= kBlockQ, Lk <= kBlockK; fp32 / fp64): each product of the tile
// is the only one into its gradient rows, so it writes them in place, without an accumulator to
// zero first and copy out after. drel: the slot of the head's one key block, or nullptr.
template <typename scalar_t>
void backward_single_tile(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                          int64_t b, int64_t h, at::opmath_type<scalar_t>* drel) {
  static_assert(std::is_same_v<scalar_t, at::opmath_type<scalar_t>>);
  const int64_t D = p.D, lq = p.Lq(b), lk = p.Lk(b);
  const auto [kbegin, kend] = p.key_span(b, lq);
  if (lq == 0 || kbegin >= kend) {  // no key visible to any query: every gradient is 0
    zero_rows(g.dq, b, h, 0, lq, D);
    zero_rows(g.dk, b, h, 0, lk, D);
    zero_rows(g.dv, b, h, 0, lk, D);
    return;
  }
  zero_rows(g.dk, b, h, 0, kbegin, D);
  zero_rows(g.dk, b, h, kend, lk, D);
  zero_rows(g.dv, b, h, 0, kbegin, D);
  zero_rows(g.dv, b, h, kend, lk, D);
  const scalar_t* Kj;
  int64_t ldk;
  w.load_keys(p, b, h, kbegin, kend - kbegin, Kj, ldk);
  backward_tile(p, g, w, b, h, 0, lq, kbegin, kend - kbegin, Kj, ldk, {g.dq.row(b, h, 0), g.dq.ld},
                {g.dk.row(b, h, kbegin), g.dk.ld}, {g.dv.row(b, h, kbegin), g.dv.ld}, drel, /*accumulate=*/false);
}

// dK, dV rows [jb, jb + nb) of head (b, h): accumulated over every query block that sees them
// (into w.dk / w.dv) and stored; dq, when given, collects dS K for the whole head; drel, when
// given (the key block's slot), dS by distance; keep, when given, the head's map to save the
// dropout bits in. The same tiles in the same order whether a whole-head task or a key-block task
// runs it (and backward_single_tile's one tile is its one).
template <typename scalar_t>
void backward_key_block(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                        int64_t b, int64_t h, int64_t jb, int64_t nb, at::opmath_type<scalar_t>* dq,
                        at::opmath_type<scalar_t>* drel, HeadKeep keep = {}) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D;
  std::fill(w.dk.begin(), w.dk.begin() + nb * D, acc_t(0));
  std::fill(w.dv.begin(), w.dv.begin() + nb * D, acc_t(0));
  const int64_t lq = p.Lq(b);
  const auto [kbegin, kend] = p.key_span(b, lq);
  const int64_t j0 = std::max(jb, kbegin), j1 = std::min(jb + nb, kend);  // keys anyone sees
  if (j0 < j1) {
    const acc_t* Kj;
    int64_t ldk;
    w.load_keys(p, b, h, j0, j1 - j0, Kj, ldk);
    for (int64_t i0 = p.query_begin(b, j0) / kBlockQ * kBlockQ; i0 < lq; i0 += kBlockQ) {
      const int64_t mq = std::min(kBlockQ, lq - i0);
      backward_tile(p, g, w, b, h, i0, mq, j0, j1 - j0, Kj, ldk, {dq != nullptr ? dq + i0 * D : nullptr, D},
                    {w.dk.data() + (j0 - jb) * D, D}, {w.dv.data() + (j0 - jb) * D, D}, drel, true, keep);
    }
  }
  store_rows(w.dk.data(), g.dk, b, h, jb, nb, D);
  store_rows(w.dv.data(), g.dv, b, h, jb, nb, D);
}

// drel: rel_bias's gradient (H, 2R + 1) when p has a bias, else nullptr.
template <typename scalar_t>
void attention_bwd_kernel(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, at::opmath_type<scalar_t>* drel) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D, threads = at::get_num_threads();

  // The bias gradient's slots, (H, key blocks of all sequences, 2R + 1): sequence b's key block kb
  // of head h is slot h * key_blocks + block0[b] + kb, written by one task only (zeros where no
  // key is seen).
  const bool rel = drel != nullptr;
  const int64_t W = 2 * p.rel_R + 1;
  std::vector<int64_t> block0(p.B + 1, 0);
  for (int64_t b = 0; b < p.B; ++b) block0[b + 1] = block0[b] + (rel ? ceil_div(p.Lk(b), kBlockK) : 0);
  const int64_t key_blocks = block0[p.B];
  std::vector<acc_t> slots(rel ? p.H * key_blocks * W : 0, acc_t(0));
  auto slot = [&](int64_t b, int64_t h, int64_t kb) {
    return rel ? slots.data() + (h * key_blocks + block0[b] + kb) * W : nullptr;
  };

  // A head's score-tile work per sequence; the whole call's is H times their sum.
  std::vector<int64_t> head_work(p.B, 0);
  int64_t total = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t i0 = 0; i0 < p.Lq(b); i0 += kBlockQ) {
      head_work[b] += p.tile_area(b, i0, std::min(kBlockQ, p.Lq(b) - i0));
    }
    total += p.H * head_work[b];
  }
  // A head of more than one tile is split into key and query blocks (two passes, seven products
  // a tile instead of five) when as one task it would be over a quarter of a thread's share:
  // then the one-task-per-head schedule cannot balance (for equal sequences: fewer than
  // 4 x threads heads, as for the padded op).
  auto split = [&](int64_t b) {
    return threads > 1 && (p.Lq(b) > kBlockQ || p.Lk(b) > kBlockK) && 4 * threads * head_work[b] > total;
  };
  TaskList pass1(p.H), pass2(p.H);  // pass 1: whole heads and key blocks; pass 2: query blocks
  int64_t whole_rows = 0;           // the longest whole head's queries (its dq accumulator)
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t lq = p.Lq(b), lk = p.Lk(b);
    if (!split(b)) {
      pass1.add(b, TaskList::kWholeHead, 5 * head_work[b]);
      whole_rows = std::max(whole_rows, lq);
      continue;
    }
    const auto [kbegin, kend] = p.key_span(b, lq);
    for (int64_t jb = 0, kb = 0; jb < lk; jb += kBlockK, ++kb) {
      const int64_t nk = std::max<int64_t>(0, std::min(jb + kBlockK, kend) - std::max(jb, kbegin));
      pass1.add(b, kb, 4 * (lq - p.query_begin(b, jb)) * nk * D);
    }
    for (int64_t i0 = 0, qb = 0; i0 < lq; i0 += kBlockQ, ++qb) {
      pass2.add(b, qb, 3 * p.tile_area(b, i0, std::min(kBlockQ, lq - i0)));
    }
  }
  pass1.sort();
  pass2.sort();
  // The split heads' dropout keep bits, pass 1 to pass 2: sequence b's head h at
  // keep_bits + keep0[b] + h Lq(b) keep_ld[b]; zeros where pass 1 makes no tile (hidden keys,
  // whose P is 0 in pass 2 too)
  std::vector<int64_t> keep0(p.B, 0), keep_ld(p.B, 0);
  int64_t keep_words = 0;
  for (int64_t b = 0; p.dropout.drop && b < p.B; ++b) {
    if (!split(b)) continue;
    keep0[b] = keep_words;
    keep_ld[b] = ceil_div(p.Lk(b), kAttnDropCols) + 1;  // + the zero word AttentionDropout::row reads
    keep_words += p.H * p.Lq(b) * keep_ld[b];
  }
  std::vector<uint32_t> keep_bits(keep_words, 0u);
  auto head_keep = [&](int64_t b, int64_t h, bool load) {
    return keep_words == 0 ? HeadKeep{}
                           : HeadKeep{keep_bits.data() + keep0[b] + h * p.Lq(b) * keep_ld[b], keep_ld[b], load};
  };
  // delta: up front when split heads need it (their key-block tasks read every query row's),
  // else by each whole-head task for its own rows
  const bool head_delta = pass2.size() == 0;
  if (!head_delta) row_dots(p, g.dout, g.out, g.delta);

  // Pass 1: each whole-head task owns its dQ, dK, dV rows, each key-block task its dK, dV rows.
  parallel_tasks(pass1.size(), pass1.work(), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(p, whole_rows, kBlockK);
    for (int64_t task; tasks.pop(task);) {
      int64_t h;
      const TaskList::Item& it = pass1.item(task, h);
      const int64_t b = it.b, lq = p.Lq(b), lk = p.Lk(b);
      if (it.block != TaskList::kWholeHead) {
        const int64_t jb = it.block * kBlockK;
        backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, lk - jb), nullptr, slot(b, h, it.block),
                           head_keep(b, h, false));
        continue;
      }
      if (head_delta) head_deltas(p, g, b, h, lq, w.x.data(), w.y.data());
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        if (lq <= kBlockQ && lk <= kBlockK) {
          backward_single_tile(p, g, w, b, h, slot(b, h, 0));
          continue;
        }
      }
      // key blocks in turn, dQ accumulated over the whole head
      int64_t ld;
      w.q.get(p.q, b, h, 0, lq, ld);  // bf16: convert the head's q and dout once
      w.dout.get(g.dout, b, h, 0, lq, ld);
      std::fill(w.dq.begin(), w.dq.begin() + lq * D, acc_t(0));
      for (int64_t jb = 0; jb < lk; jb += kBlockK) {
        backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, lk - jb), w.dq.data(), slot(b, h, jb / kBlockK));
      }
      store_rows(w.dq.data(), g.dq, b, h, 0, lq, D);
    }
  });
  // Pass 2: dQ of the split heads, each (sequence, head, query block) task owning its rows.
  parallel_tasks(pass2.size(), pass2.work(), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(p, kBlockQ, 0);
    for (int64_t task; tasks.pop(task);) {
      int64_t h;
      const TaskList::Item& it = pass2.item(task, h);
      const int64_t b = it.b, i0 = it.block * kBlockQ, mq = std::min(kBlockQ, p.Lq(b) - i0);
      const auto [kbegin, kend] = p.key_span(b, i0 + mq);
      std::fill(w.dq.begin(), w.dq.end(), acc_t(0));
      for (int64_t j0 = kbegin; j0 < kend; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, kend - j0);
        const acc_t* Kj;
        int64_t ldk;
        w.load_keys(p, b, h, j0, nk, Kj, ldk);
        backward_tile(p, g, w, b, h, i0, mq, j0, nk, Kj, ldk, {w.dq.data(), D}, {nullptr, D}, {nullptr, D},
                      nullptr, true, head_keep(b, h, true));  // (pass 1 took this dS's share of drel)
      }
      store_rows(w.dq.data(), g.dq, b, h, i0, mq, D);
    }
  });
  // drel[h] = the sum of head h's slots, in slot order
  if (rel) {
    for (int64_t h = 0; h < p.H; ++h) {
      acc_t* dst = drel + h * W;
      std::fill(dst, dst + W, acc_t(0));
      for (int64_t n = 0; n < key_blocks; ++n) {
        const acc_t* src = slots.data() + (h * key_blocks + n) * W;
        for (int64_t c = 0; c < W; ++c) dst[c] += src[c];
      }
    }
  }
}

}  // namespace

void attention_bwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& dout,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const Masks& mask,
                        const RelBias& rel, double scale, double dropout_p, uint64_t seed,
                        uint64_t offset, at::Tensor& delta, at::Tensor& dq, at::Tensor& dk,
                        at::Tensor& dv, at::Tensor& drel) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_problem<scalar_t>(dims, q, k, v, mask, rel, scale, dropout_p, seed, offset);
    BwdData<scalar_t> g{rows_of<scalar_t>(dout), p.stat_rows(lse.data_ptr<at::opmath_type<scalar_t>>()),
                        p.stat_rows(delta.data_ptr<acc_t>()), rows_of<scalar_t>(dq),
                        rows_of<scalar_t>(dk), rows_of<scalar_t>(dv), rows_of<scalar_t>(out)};
    attention_bwd_kernel<scalar_t>(p, g, rel.data != nullptr ? drel.data_ptr<acc_t>() : nullptr);
  });
}

void attention_varlen_bwd_impl(const Varlen& lens, const at::Tensor& dout, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, bool causal, const RelBias& rel, double scale,
                               double dropout_p, uint64_t seed, uint64_t offset, at::Tensor& delta,
                               at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& drel) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_varlen_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_varlen_problem<scalar_t>(lens, q, k, v, causal, rel, scale, dropout_p, seed, offset);
    BwdData<scalar_t> g{packed_rows_of<scalar_t>(dout, lens.cu_q), p.stat_rows(lse.data_ptr<at::opmath_type<scalar_t>>()),
                        p.stat_rows(delta.data_ptr<acc_t>()), packed_rows_of<scalar_t>(dq, lens.cu_q),
                        packed_rows_of<scalar_t>(dk, lens.cu_k), packed_rows_of<scalar_t>(dv, lens.cu_k),
                        packed_rows_of<scalar_t>(out, lens.cu_q)};
    attention_bwd_kernel<scalar_t>(p, g, rel.data != nullptr ? drel.data_ptr<acc_t>() : nullptr);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
