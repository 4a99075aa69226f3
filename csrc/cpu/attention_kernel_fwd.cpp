// The forward of the CPU attention kernels: fastformer::attention_fwd and attention_varlen_fwd
// (one Problem for both, attention_problem.h), compiled once per ISA level (isa.h).
//
// Forward, per (sequence, head, block of kBlockQ queries): S = Q K^T for one block of kBlockK keys
// at a time, scale and masks applied while the tile is hot, an online softmax (running max m and
// sum l per row), dropout on the probabilities from the shared Philox stream (attention's v3
// tiles, philox.h: each 16 x 32 tile's bits made once per query block), and O += P V. A
// relative position bias is added to each score row with the scale (a window of the head's bias
// by distance, RelRow).
// Only the per-row log-sum-exp lse = m + log(l) is kept for backward (+inf for a row with no
// visible key, so exp(s - lse) recomputes P = 0 there).
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

// out: rows of (b, h, i) as Rows (D each); lse: p.stat_rows.
template <typename scalar_t>
void attention_fwd_kernel(const Problem<scalar_t>& p, const Rows<scalar_t>& out,
                          const Rows<at::opmath_type<scalar_t>>& lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D;
  const bool dropout = p.dropout.drop;
  const acc_t keep_scale = static_cast<acc_t>(p.dropout.scale);
  const bool fused = fusable<acc_t>(p.mask);
  constexpr int64_t kGroup = kRowGroup<acc_t>;

  TaskList list(p.H);  // (sequence, query block): only the blocks a sequence has
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t i0 = 0, qb = 0; i0 < p.Lq(b); i0 += kBlockQ, ++qb) {
      list.add(b, qb, 2 * p.tile_area(b, i0, std::min(kBlockQ, p.Lq(b) - i0)));
    }
  }
  list.sort();
  parallel_tasks(list.size(), list.work(), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    std::vector<acc_t> S(kBlockQ * kBlockK), KT(D * kBlockK), acc(kBlockQ * D), m(kBlockQ), l(kBlockQ),
        keep(kGroup * kBlockK);  // a row group's dropout multipliers
    std::array<Vec<acc_t>, kGroup> part;  // a row group's lane-wise maxima, then sums
    AttentionDropout<acc_t> drop = p.dropout_tiles(acc_t(1));  // scaled at the end
    OperandTile<scalar_t> q_tile(kBlockQ, D), k_tile(kBlockK, D), v_tile(kBlockK, D);
    // online softmax: rescale what row r accumulated under its old max
    auto rescale = [&](int64_t r, acc_t m_new) {
      if (m[r] != m_new && m[r] != neg_inf<acc_t>()) {
        const acc_t alpha = std::exp(m[r] - m_new);
        l[r] *= alpha;
        scale_row(acc.data() + r * D, D, alpha);
      }
    };
    // Row r's step with every case checked (a group holding a NaN or +inf score), s scaled and
    // masked, tile_max its maximum.
    auto online_softmax_row = [&](int64_t r, acc_t* s, acc_t tile_max, int64_t npad, int64_t nk,
                                  const acc_t* z) {
      const acc_t m_new = std::isnan(m[r]) || std::isnan(tile_max) ? nan_of<acc_t>()
                                                                   : std::max(m[r], tile_max);
      if (m_new == neg_inf<acc_t>()) {
        std::fill(s, s + npad, acc_t(0));  // nothing visible yet: P = 0
        return;
      }
      if (std::isnan(m_new) || m_new == -neg_inf<acc_t>()) {
        // a NaN or +inf score: the reference's softmax row is NaN, so P, the output and the
        // lse are NaN too (vexp would clamp exp(NaN) to a finite number)
        poison_row(s, nk, npad);
        m[r] = l[r] = nan_of<acc_t>();
        return;
      }
      rescale(r, m_new);
      l[r] += exp_sub_sum(s, npad, m_new);
      m[r] = m_new;
      if (z != nullptr) mul_row(s, z, npad);
    };
    for (int64_t task; tasks.pop(task);) {
      int64_t h;
      const TaskList::Item& it = list.item(task, h);
      const int64_t b = it.b, i0 = it.block * kBlockQ, mq = std::min(kBlockQ, p.Lq(b) - i0);
      const int64_t shift = p.shift(b);
      std::fill(m.begin(), m.end(), neg_inf<acc_t>());
      std::fill(l.begin(), l.end(), acc_t(0));
      std::fill(acc.begin(), acc.begin() + mq * D, acc_t(0));
      int64_t ldq, ldk, ldv;
      const acc_t* Qi = q_tile.get(p.q, b, h, i0, mq, ldq);  // (mq, D)
      const auto [kbegin, kend] = p.key_span(b, i0 + mq);
      for (int64_t j0 = kbegin; j0 < kend; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, kend - j0), npad = round_up(nk, kPad);
        const acc_t* Kj = k_tile.get(p.k, b, p.kv_head(h), j0, nk, ldk);  // (nk, D)
        attn::transpose(Kj, ldk, nk, D, KT.data(), kBlockK);         // (D, nk)
        // S (mq, nk) = Q_i K_j^T, computed npad wide (see kPad)
        attn::matmul(mq, npad, D, Qi, ldq, KT.data(), kBlockK, S.data(), kBlockK, false);
        if (dropout) drop.block(b * p.H + h, i0, mq, j0, nk);  // the block's keep bits
        // the softmax rows in groups of kGroup, their maxima and sums reduced together
        for (int64_t g0 = 0; g0 < mq; g0 += kGroup) {
          const int64_t rows = std::min(kGroup, mq - g0);
          acc_t* s0 = S.data() + g0 * kBlockK;
          if (dropout) {  // first: the multipliers' stores are done when the rows read them
            for (int64_t r = 0; r < rows; ++r) {
              drop.row(g0 + r, nk, npad, keep.data() + r * kBlockK);
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            acc_t* s = s0 + r * kBlockK;
            const RelRow<acc_t> rel = p.rel_row(b, h, i0 + g0 + r, j0);
            if (fused) {
              Vec<acc_t> mx(neg_inf<acc_t>());
              scale_mask_map_row(p.mask, rel, p.scale, b, i0 + g0 + r, shift, j0, nk, npad, s,
                                 [&](const Vec<acc_t>& x) {
                                   mx = at::vec::maximum(mx, x);
                                   return x;
                                 });
              part[r] = mx;
            } else {
              scale_mask_row(p.mask, rel, p.scale, b, h, i0 + g0 + r, shift, j0, nk, npad, s);
              Vec<acc_t> mx(neg_inf<acc_t>());
              for (int64_t c = 0; c < npad; c += Vec<acc_t>::size()) {
                mx = at::vec::maximum(mx, Vec<acc_t>::loadu(s + c));
              }
              part[r] = mx;
            }
          }
          for (int64_t r = rows; r < kGroup; ++r) part[r] = Vec<acc_t>(neg_inf<acc_t>());
          alignas(64) acc_t tile_max[kGroup], m_new[kGroup];
          const Vec<acc_t> group_max = reduce_rows(part.data(), max_op<acc_t>);  // NaN: a NaN score
          group_max.store(tile_max);
          at::vec::maximum(group_max, Vec<acc_t>::loadu(m.data() + g0)).store(m_new);
          bool ordinary = true;  // no NaN or +inf score (now or in an earlier tile) in the group
          for (int64_t r = 0; r < rows; ++r) {
            ordinary &= !std::isnan(m_new[r]) && m_new[r] != -neg_inf<acc_t>();
          }
          if (!ordinary) {
            for (int64_t r = 0; r < rows; ++r) {
              online_softmax_row(g0 + r, s0 + r * kBlockK, tile_max[r], npad, nk,
                                 dropout ? keep.data() + r * kBlockK : nullptr);
            }
            continue;
          }
          for (int64_t r = 0; r < rows; ++r) {
            acc_t* s = s0 + r * kBlockK;
            const int64_t row = g0 + r;
            if (m_new[r] == neg_inf<acc_t>()) {
              std::fill(s, s + npad, acc_t(0));  // nothing visible yet: P = 0
              part[r] = Vec<acc_t>(acc_t(0));
              continue;
            }
            rescale(row, m_new[r]);
            part[r] = exp_sub_partial(s, npad, m_new[r], dropout ? keep.data() + r * kBlockK : nullptr);
            m[row] = m_new[r];
          }
          alignas(64) acc_t sum[kGroup];
          reduce_rows(part.data(), add_op<acc_t>).store(sum);
          for (int64_t r = 0; r < rows; ++r) l[g0 + r] += sum[r];
        }
        // acc (mq, D) += P (mq, nk) V_j (nk, D)
        const acc_t* Vj = v_tile.get(p.v, b, p.kv_head(h), j0, nk, ldv);
        attn::matmul(mq, D, nk, S.data(), kBlockK, Vj, ldv, acc.data(), D, true);
      }
      acc_t* lse_rows = lse.row(b, h, i0);  // fp64 under fp64 inputs: gradients to fp64 precision
      for (int64_t g0 = 0; g0 < mq; g0 += kGroup) {
        alignas(64) acc_t log_l[kGroup];  // a group's logs in one vector call
        Vec<acc_t>::loadu(l.data() + g0).log().store(log_l);
        for (int64_t r = g0; r < std::min(mq, g0 + kGroup); ++r) {
          scalar_t* o = out.row(b, h, i0 + r);
          if (l[r] == acc_t(0)) {  // no visible key: output 0, lse +inf
            std::fill(o, o + D, scalar_t(0));
            lse_rows[r] = std::numeric_limits<acc_t>::infinity();
          } else {
            store_scaled_row(acc.data() + r * D, keep_scale / l[r], o, D);
            lse_rows[r] = m[r] + log_l[r - g0];
          }
        }
      }
    }
  });
}

}  // namespace

void attention_fwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const Masks& mask, const RelBias& rel, double scale,
                        double dropout_p, uint64_t seed, uint64_t offset, at::Tensor& out, at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_fwd", [&] {
    const auto p = make_problem<scalar_t>(dims, q, k, v, mask, rel, scale, dropout_p, seed, offset);
    attention_fwd_kernel<scalar_t>(p, rows_of<scalar_t>(out), p.stat_rows(lse.data_ptr<at::opmath_type<scalar_t>>()));
  });
}

void attention_varlen_fwd_impl(const Varlen& lens, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, bool causal, const RelBias& rel, double scale,
                               double dropout_p, uint64_t seed, uint64_t offset, at::Tensor& out,
                               at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_varlen_fwd", [&] {
    const auto p = make_varlen_problem<scalar_t>(lens, q, k, v, causal, rel, scale, dropout_p, seed, offset);
    attention_fwd_kernel<scalar_t>(p, packed_rows_of<scalar_t>(out, lens.cu_q),
                                   p.stat_rows(lse.data_ptr<at::opmath_type<scalar_t>>()));
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
