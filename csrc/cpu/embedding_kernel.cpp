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

template <typename T>
void embedding_fwd_rows(const int64_t* ids, const T* weight, const int64_t* positions,
                        const T* positional, T* out, int64_t N, int64_t D, double scale,
                        double dropout_p, uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const DropoutParams dp = dropout_params(dropout_p);
  const V vscale(static_cast<A>(scale));
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / D), [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? D : 0]);  // dropout factors of one row
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t i = begin; i < end; ++i) {
      const T* wr = weight + ids[i] * D;
      const T* pr = positional ? positional + positions[i] * D : nullptr;
      T* o = out + i * D;
      if (keep) dropout.fill(keep, 0, D, dropout_row_counter(offset, i, D));
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
  const DropoutParams dp = dropout_params(dropout_p);
  const V vscale(static_cast<A>(scale));
  // about 16K elements of the table a task (most of its rows are zeros when K is a vocabulary)
  at::parallel_for(0, K, std::max<int64_t>(1, 16384 / D), [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? D : 0]);
    std::unique_ptr<A[]> sum_buf(new A[D]);  // the row's sum
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    A* const sum = sum_buf.get();
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
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
        if (keep) dropout.fill(keep, 0, D, dropout_row_counter(offset, i, D));
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
