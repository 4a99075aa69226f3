// The fused input embedding on CPU, forward and backward.
//
// Forward, one output row per id (rows in parallel): out = (weight[id] * scale + positional[pos])
// x keep / (1 - p), in acc_t and rounded once: the table rows are read once, the output written
// once, the dropout factors of the row made in an L1 buffer (dropout_scales.h).
//
// Backward: a table's gradient row k is the sum of the rows i with key k of grad x keep / (1 - p)
// (x scale for the weight). embedding.cpp sorts the keys (stable counting sort); here the table's
// rows are split among the threads, and each thread writes its rows once: zeros where no key
// falls (or at padding_idx), else the sum of the row's grad rows in increasing i, accumulated in
// an acc_t buffer that stays in L1. No atomics, no zero fill of the table before the scatter, and
// the same bits whatever the thread count.
//
// Compiled once per ISA level into fastformer::<level> (isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "dropout_scales.h"
#include "embedding.h"
#include "philox.h"
#include "vec_io.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

// Rows a task: about 16K elements (in backward, most of the table's rows are zeros when K is a
// vocabulary).
inline int64_t row_grain(int64_t D) { return std::max<int64_t>(1, 16384 / D); }

// One task's dropout of whole rows: row i's factors (keep / (1 - p), 0 where dropped) made from
// (seed, offset, i) into a buffer that stays in L1, so forward and backward make the same ones.
template <typename A>
class RowDropout {
 public:
  RowDropout(double dropout_p, uint64_t seed, uint64_t offset, int64_t D)
      : RowDropout(dropout_params(dropout_p), seed, offset, D) {}

  // Row i's factors, or nullptr without dropout.
  const A* row(int64_t i) const {
    if (keep_) scales_.fill(keep_, 0, D_, dropout_row_counter(offset_, i, D_));
    return keep_;
  }

 private:
  RowDropout(const DropoutParams& dp, uint64_t seed, uint64_t offset, int64_t D)
      : buf_(new A[dp.drop ? D : 0]), keep_(dp.drop ? buf_.get() : nullptr),
        scales_(seed, dp.threshold, static_cast<A>(dp.scale)), offset_(offset), D_(D) {}

  std::unique_ptr<A[]> buf_;
  A* const keep_;
  const DropoutScales<A> scales_;
  const uint64_t offset_;
  const int64_t D_;
};

template <typename T>
void embedding_fwd_rows(const int64_t* ids, const T* weight, const int64_t* positions,
                        const T* positional, T* out, int64_t N, int64_t D, double scale,
                        double dropout_p, uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const V vscale(static_cast<A>(scale));
  at::parallel_for(0, N, row_grain(D), [&](int64_t begin, int64_t end) {
    const RowDropout<A> dropout(dropout_p, seed, offset, D);
    for (int64_t i = begin; i < end; ++i) {
      const T* wr = weight + ids[i] * D;
      const T* pr = positional ? positional + positions[i] * D : nullptr;
      T* o = out + i * D;
      const A* keep = dropout.row(i);
      vec_loop<W>(D, [&](int64_t j, int64_t n) {
        V v = load(wr + j, n) * vscale;
        if (pr) v = v + load(pr + j, n);
        if (keep) v = v * V::loadu(keep + j, n);
        store(o + j, v, n);
      });
    }
  });
}

template <typename T>
void embedding_bwd_rows(const T* grad, const int64_t* order, const int64_t* starts, T* table,
                        int64_t K, int64_t D, int64_t skip_row, double scale, double dropout_p,
                        uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  at::parallel_for(0, K, row_grain(D), [&](int64_t begin, int64_t end) {
    const RowDropout<A> dropout(dropout_p, seed, offset, D);
    std::unique_ptr<A[]> sum_buf(new A[D]);  // the row's sum, scaled once when it is written
    A* const sum = sum_buf.get();
    const V vscale(static_cast<A>(scale));
    for (int64_t k = begin; k < end; ++k) {
      T* const row = table + k * D;
      const int64_t first = starts[k], last = starts[k + 1];
      if (first == last || k == skip_row) {
        std::memset(static_cast<void*>(row), 0, sizeof(T) * D);
        continue;
      }
      for (int64_t r = first; r < last; ++r) {
        const int64_t i = order[r];
        const T* g = grad + i * D;
        const A* keep = dropout.row(i);
        const bool init = r == first;
        vec_loop<W>(D, [&](int64_t j, int64_t n) {
          V v = load(g + j, n);
          if (keep) v = v * V::loadu(keep + j, n);
          if (!init) v = v + V::loadu(sum + j, n);
          v.store(sum + j, n);
        });
      }
      vec_loop<W>(D, [&](int64_t j, int64_t n) { store(row + j, V::loadu(sum + j, n) * vscale, n); });
    }
  });
}

}  // namespace

void embedding_fwd_kernel(const at::Tensor& ids, const at::Tensor& weight,
                          const at::Tensor& positional, const at::Tensor& positions,
                          at::Tensor& out, double scale, double dropout_p, uint64_t seed,
                          uint64_t offset) {
  const int64_t N = ids.size(0), D = weight.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, weight.scalar_type(), "embedding_fwd", [&] {
    embedding_fwd_rows<scalar_t>(
        ids.const_data_ptr<int64_t>(), weight.const_data_ptr<scalar_t>(),
        positional.defined() ? positions.const_data_ptr<int64_t>() : nullptr,
        positional.defined() ? positional.const_data_ptr<scalar_t>() : nullptr,
        out.data_ptr<scalar_t>(), N, D, scale, dropout_p, seed, offset);
  });
}

void embedding_bwd_kernel(const at::Tensor& grad, const int64_t* order, const int64_t* starts,
                          at::Tensor& table, int64_t skip_row, double scale, double dropout_p,
                          uint64_t seed, uint64_t offset) {
  const int64_t K = table.size(0), D = table.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, grad.scalar_type(), "embedding_bwd", [&] {
    embedding_bwd_rows<scalar_t>(grad.const_data_ptr<scalar_t>(), order, starts,
                                 table.data_ptr<scalar_t>(), K, D, skip_row, scale, dropout_p,
                                 seed, offset);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
