// Fused dropout + residual add + LayerNorm on (N, C) rows, forward and backward, for CPU.
//
// Forward, one row at a time (rows in parallel): h = residual + dropout(x [+ x_bias]) is formed
// in fp32 (fp64 for fp64) and stored, its mean and variance come from the stored row (still in
// L1), and y = (h - mean) * rstd * weight + bias is written: x and residual are read once, y and h
// written once. Backward regenerates the dropout mask from (seed, offset) and makes two sweeps of
// each row, the first for the two row sums LayerNorm's gradient needs, the second writing dx (and
// dresidual); dweight / dbias (and dx_bias, the column sums of dx) are summed per block of rows and
// the blocks' sums added at the end, so no two threads ever write one location.
//
// RMSNorm (rms_norm): the same passes with the mean taken as 0 (and written as 0, so the backward
// reads xhat = h * rstd as it is), xhat rounded to T before the weight multiply (T5's cast), and
// the gradient's mean(g) term dropped.
//
// Compiled once per ISA level into fastformer::<level> (isa.h); add_layer_norm.cpp checks the
// arguments and calls the chosen level.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <type_traits>

#include "add_layer_norm.h"
#include "dropout_scales.h"
#include "philox.h"
#include "vec_io.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

// Rows per parallel task: about 16K elements, at least one row.
int64_t row_grain(int64_t C) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)); }

// The parameter row as acc_t: the tensor's own memory when T is acc_t, else widened into buf.
template <typename T>
const acc_t<T>* widen_param(const T* p, int64_t C, std::unique_ptr<acc_t<T>[]>& buf) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return p;
  } else {
    buf.reset(new acc_t<T>[C]);
    for (int64_t j = 0; j < C; ++j) buf[j] = static_cast<acc_t<T>>(p[j]);
    return buf.get();
  }
}

// v rounded to T's precision and widened back (T5's cast of the normalised value); a no-op when T
// is the accumulation type.
template <typename T>
inline AccVec<T> round_to(const AccVec<T>& v) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float(at::vec::convert_from_float<T>(v, v)));
  }
}

// One row of the forward. keep: the row's dropout factors or nullptr; res, xb: nullptr without a
// residual, an x_bias. Every pointer and flag is a by-value argument, so the compiler keeps them in
// registers across the vector stores.
template <typename T>
inline void add_layer_norm_fwd_row(const T* xr, const T* rr, const acc_t<T>* xb,
                                   const acc_t<T>* keep, const acc_t<T>* w, const acc_t<T>* b,
                                   T* hr, T* yr, int64_t C, acc_t<T> eps, acc_t<T>* mean,
                                   acc_t<T>* rstd, bool rms) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  // h = residual + dropout(x + xb), rounded to T as stored; the statistics and y see the stored h
  V sum(A(0));
  vec_loop<W>(C, [&](int64_t j, int64_t n) {
    V v = load(xr + j, n);
    if (xb) v = v + V::loadu(xb + j, n);  // 0 past n
    if (keep) v = v * V::loadu(keep + j, n);
    if (rr) v = v + load(rr + j, n);
    v = store_rounded(hr + j, v, n);
    sum = sum + v;  // lanes past n are 0
  });
  const A mu = rms ? A(0) : hsum(sum) / static_cast<A>(C);
  const V vmu(mu);
  V sq(A(0));
  vec_loop<W>(C, [&](int64_t j, int64_t n) {
    V d = load(hr + j, n) - vmu;
    if (n < W) d = V::set(V(A(0)), d, n);
    sq = at::vec::fmadd(d, d, sq);
  });
  const A rs = static_cast<A>(1) / std::sqrt(hsum(sq) / static_cast<A>(C) + eps);
  const V vrs(rs);
  vec_loop<W>(C, [&](int64_t j, int64_t n) {
    V xhat = (load(hr + j, n) - vmu) * vrs;
    if (rms) xhat = round_to<T>(xhat);
    store(yr + j, at::vec::fmadd(xhat, V::loadu(w + j, n), V::loadu(b + j, n)), n);
  });
  *mean = mu;
  *rstd = rs;
}

template <typename T>
void add_layer_norm_fwd_rows(const T* x, const T* res, const T* weight, const T* bias,
                             const T* x_bias, T* y, T* h, acc_t<T>* mean, acc_t<T>* rstd, int64_t N,
                             int64_t C, double eps, double dropout_p, uint64_t seed,
                             uint64_t offset, bool rms) {
  using A = acc_t<T>;
  const DropoutParams dp = dropout_params(dropout_p);
  std::unique_ptr<A[]> wbuf, bbuf, xbbuf;
  const A* w = widen_param(weight, C, wbuf);
  const A* b = widen_param(bias, C, bbuf);
  const A* xb = x_bias ? widen_param(x_bias, C, xbbuf) : nullptr;
  at::parallel_for(0, N, row_grain(C), [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? C : 0]);  // dropout factors of one row
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t row = begin; row < end; ++row) {
      if (keep) dropout.fill(keep, 0, C, dropout_row_counter(offset, row, C));
      add_layer_norm_fwd_row<T>(x + row * C, res ? res + row * C : nullptr, xb, keep, w, b,
                                h + row * C, y + row * C, C, static_cast<A>(eps), mean + row,
                                rstd + row, rms);
    }
  });
}

// One row of the backward: dh_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dh] with
// g = dy * weight (RMSNorm: without the mean(g) term); dx = dh_total * keep, dresidual = dh_total; dw_sum += dy * xhat, db_sum += dy,
// dxb_sum (when not nullptr) += dx.
template <typename T>
inline void add_layer_norm_bwd_row(const T* hr, const T* dyr, const T* dhr, const acc_t<T>* keep,
                                   const acc_t<T>* w, acc_t<T> mu, acc_t<T> rs, T* dxr, T* drr,
                                   acc_t<T>* dw_sum, acc_t<T>* db_sum, acc_t<T>* dxb_sum,
                                   int64_t C, bool rms) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const V vmu(mu), vrs(rs);
  // sweep 1: the two row sums, and this row's share of dweight / dbias
  V sum_g(A(0)), sum_gx(A(0));
  vec_loop<W>(C, [&](int64_t j, int64_t n) {
    const V xhat = (load(hr + j, n) - vmu) * vrs;
    const V dyv = load(dyr + j, n);  // 0 past n, so g and the sums get nothing there
    const V g = dyv * V::loadu(w + j, n);
    sum_g = sum_g + g;
    sum_gx = at::vec::fmadd(g, xhat, sum_gx);
    at::vec::fmadd(dyv, xhat, V::loadu(dw_sum + j, n)).store(dw_sum + j, n);
    (V::loadu(db_sum + j, n) + dyv).store(db_sum + j, n);
  });
  const A inv_c = static_cast<A>(1) / static_cast<A>(C);
  const V c1(rms ? A(0) : hsum(sum_g) * inv_c), c2(hsum(sum_gx) * inv_c);
  // sweep 2: dx and dresidual
  vec_loop<W>(C, [&](int64_t j, int64_t n) {
    const V xhat = (load(hr + j, n) - vmu) * vrs;
    const V g = load(dyr + j, n) * V::loadu(w + j, n);
    V dht = (g - c1 - xhat * c2) * vrs;
    if (dhr) dht = dht + load(dhr + j, n);
    if (drr) store(drr + j, dht, n);
    const V dxv = keep ? dht * V::loadu(keep + j, n) : dht;
    store(dxr + j, dxv, n);
    if (dxb_sum) (V::loadu(dxb_sum + j, n) + dxv).store(dxb_sum + j, n);
  });
}

template <typename T>
void add_layer_norm_bwd_rows(const T* dy, const T* dh, const T* h, const T* weight,
                             const acc_t<T>* mean, const acc_t<T>* rstd, T* dx, T* dres, T* dweight,
                             T* dbias, T* dx_bias, int64_t N, int64_t C, double dropout_p,
                             uint64_t seed, uint64_t offset, bool rms) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const DropoutParams dp = dropout_params(dropout_p);
  std::unique_ptr<A[]> wbuf;
  const A* w = widen_param(weight, C, wbuf);
  // Contiguous blocks of rows, one per thread at most; each block sums its own dweight / dbias.
  const int64_t nblocks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (N + row_grain(C) - 1) / row_grain(C)));
  const int64_t rows_per_block = (N + nblocks - 1) / nblocks;
  const int64_t sums = dx_bias ? 3 : 2;  // dweight, dbias [, dx_bias]
  std::unique_ptr<A[]> partial_buf(new A[nblocks * sums * C]());  // (nblocks, sums, C)
  A* const partial = partial_buf.get();
  at::parallel_for(0, nblocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? C : 0]);  // dropout factors of one row
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* const dw_sum = partial + block * sums * C;
      const int64_t row_end = std::min(N, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        if (keep) dropout.fill(keep, 0, C, dropout_row_counter(offset, row, C));
        add_layer_norm_bwd_row<T>(h + row * C, dy + row * C, dh ? dh + row * C : nullptr, keep, w,
                                  mean[row], rstd[row],
                                  dx + row * C, dres ? dres + row * C : nullptr, dw_sum,
                                  dw_sum + C, dx_bias ? dw_sum + 2 * C : nullptr, C, rms);
      }
    }
  });
  // dweight / dbias [/ dx_bias]: add the blocks' sums, in block order (deterministic for a thread
  // count)
  T* const outs[3] = {dweight, dbias, dx_bias};
  for (int64_t s = 0; s < sums; ++s) {
    vec_loop<W>(C, [&](int64_t j, int64_t n) {
      V total(A(0));
      for (int64_t block = 0; block < nblocks; ++block)
        total = total + V::loadu(partial + (block * sums + s) * C + j, n);
      store(outs[s] + j, total, n);
    });
  }
}

}  // namespace

void add_layer_norm_fwd_kernel(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& x_bias, at::Tensor& y, void* h, void* mean,
                               void* rstd, double eps, double dropout_p, uint64_t seed,
                               uint64_t offset, bool rms_norm) {
  const int64_t N = x.size(0), C = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_layer_norm_fwd", [&] {
    add_layer_norm_fwd_rows<scalar_t>(
        x.data_ptr<scalar_t>(), residual.defined() ? residual.data_ptr<scalar_t>() : nullptr,
        weight.data_ptr<scalar_t>(), bias.data_ptr<scalar_t>(),
        x_bias.defined() ? x_bias.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(),
        static_cast<scalar_t*>(h), static_cast<acc_t<scalar_t>*>(mean), static_cast<acc_t<scalar_t>*>(rstd), N, C, eps,
        dropout_p, seed, offset, rms_norm);
  });
}

void add_layer_norm_bwd_kernel(const at::Tensor& dy, const at::Tensor& dh, const void* h,
                               const at::Tensor& weight, const void* mean,
                               const void* rstd, at::Tensor& dx, at::Tensor& dres,
                               at::Tensor& dweight, at::Tensor& dbias, at::Tensor& dx_bias,
                               double dropout_p, uint64_t seed, uint64_t offset, bool rms_norm) {
  const int64_t N = dy.size(0), C = dy.size(1);  // (h's: checked)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dy.scalar_type(), "add_layer_norm_bwd", [&] {
    add_layer_norm_bwd_rows<scalar_t>(
        dy.data_ptr<scalar_t>(), dh.defined() ? dh.data_ptr<scalar_t>() : nullptr,
        static_cast<const scalar_t*>(h), weight.data_ptr<scalar_t>(), static_cast<const acc_t<scalar_t>*>(mean),
        static_cast<const acc_t<scalar_t>*>(rstd), dx.data_ptr<scalar_t>(),
        dres.numel() > 0 ? dres.data_ptr<scalar_t>() : nullptr, dweight.data_ptr<scalar_t>(),
        dbias.data_ptr<scalar_t>(), dx_bias.defined() ? dx_bias.data_ptr<scalar_t>() : nullptr, N,
        C, dropout_p, seed, offset, rms_norm);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
