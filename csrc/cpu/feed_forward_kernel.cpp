// The position-wise feed-forward block linear(dropout(act(linear(x, w1, b1))), w2, b2) for CPU.
//
// The GEMMs of forward and backward go to ATen's BLAS (oneDNN / MKL, see matmul_nt); everything
// between them is one vectorised parallel pass each way:
//   forward:  pre = x w1^T (+ b1 where oneDNN runs the GEMM), then ONE pass a = dropout(act(pre
//             + b1)) (adding b1 where the GEMM did not), then out = a w2^T + b2.
//   backward: da = dout w2, then ONE pass over (saved, da) writing dpre = da * keep * scale *
//             act'(pre) over da in place, summing db1 (columns of dpre) and db2 (columns of dout)
//             per block of rows on the way; then dw2 = dout^T a, dw1 = dpre^T x, dx = dpre w1.
// The gated form (w3 given) runs the same way with [g | u] = x [w1; w3]^T (one GEMM, N x 2F), one
// pass h = dropout(act(g + b1) * (u + b3)), and backward's pass writing [dg | du] (N, 2F) from
// dh = dout w2; forward keeps [g | u] for every activation.
// What forward keeps (N, F) depends on the activation:
//   relu: a itself (written over pre). a > 0 exactly where the element was kept and pre > 0, so
//         act'(pre) * keep = (a > 0) and the backward needs neither pre nor the dropout mask.
//   gelu / silu: pre; the backward regenerates the mask and recomputes a for dw2.
//
// This file is the pass between the GEMMs, compiled once per ISA level into fastformer::<level>
// (isa.h); feed_forward.cpp checks the arguments, runs the GEMMs and calls the chosen level.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "dropout_scales.h"
#include "feed_forward.h"
#include "philox.h"
#include "vec_io.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

// gelu_tanh's tanh argument sqrt(2 / pi) (p + 0.044715 p^3), as F.gelu(approximate="tanh").
constexpr double kGeluTanhBeta = 0.7978845608028654, kGeluTanhKappa = 0.044715;
template <typename A>
inline Vectorized<A> gelu_tanh_inner(const Vectorized<A>& p) {
  using V = Vectorized<A>;
  return V(static_cast<A>(kGeluTanhBeta)) * at::vec::fmadd(V(static_cast<A>(kGeluTanhKappa)) * p * p, p, p);
}

template <typename A>
inline Vectorized<A> activate(const Vectorized<A>& p, Activation act) {
  using V = Vectorized<A>;
  if (act == Activation::kRelu) return at::vec::clamp_min(p, V(A(0)));
  // silu: p sigmoid(p) = p / (1 + exp(-p)) (exp(-p) = inf below about -88 in fp32: -0, not NaN)
  if (act == Activation::kSilu) return p * (V(A(1)) / (V(A(1)) + p.neg().exp()));
  const V half(A(0.5));
  if (act == Activation::kGeluTanh) return half * p * (V(A(1)) + gelu_tanh_inner(p).tanh());
  // exact gelu: 0.5 p (1 + erf(p / sqrt(2)))
  return p * (half + half * (p * V(static_cast<A>(M_SQRT1_2))).erf());
}

// d act / d p. relu: 1 where p > 0 (F.relu's convention at 0); gelu: Phi(p) + p phi(p);
// silu: s (1 + p (1 - s)) with s = sigmoid(p) (torch's silu_backward); gelu_tanh: the exact
// derivative of the tanh form, 0.5 (1 + t) + 0.5 p (1 - t^2) beta (1 + 3 kappa p^2), t its tanh
// (torch's GeluBackward with approximate="tanh").
template <typename A>
inline Vectorized<A> activate_grad(const Vectorized<A>& p, Activation act) {
  using V = Vectorized<A>;
  if (act == Activation::kRelu) return V::blendv(V(A(0)), V(A(1)), p > V(A(0)));
  if (act == Activation::kSilu) {
    const V one(A(1));
    const V s = one / (one + p.neg().exp());
    return s * at::vec::fmadd(p, one - s, one);
  }
  const V half(A(0.5));
  if (act == Activation::kGeluTanh) {
    const V one(A(1));
    const V t = gelu_tanh_inner(p).tanh();
    const V dinner = V(static_cast<A>(kGeluTanhBeta)) *
                     at::vec::fmadd(V(static_cast<A>(3 * kGeluTanhKappa)) * p, p, one);
    return at::vec::fmadd(half * p * (one - t * t), dinner, half * (one + t));
  }
  const V cdf = half + half * (p * V(static_cast<A>(M_SQRT1_2))).erf();
  const V pdf = (p * p * V(A(-0.5))).exp() * V(static_cast<A>(0.3989422804014327));  // 1/sqrt(2 pi)
  return at::vec::fmadd(p, pdf, cdf);
}

// a = dropout(act(pre + bias)) over the flat (N * F) element range, in chunks that may span rows:
// the dropout factors of element e are those of column e % F of row e / F. bias (F,): nullptr when
// the GEMM added it; else pre + bias is also written back into pre when a is another buffer (the
// backward of gelu / silu reads it).
template <typename T>
void act_dropout_fwd(T* pre, const T* bias, T* a, int64_t N, int64_t F, Activation act,
                     double dropout_p, uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  constexpr int64_t kChunk = 2048;  // elements per dropout-factor buffer (8 KiB of fp32)
  const int64_t total = N * F;
  const DropoutParams dp = dropout_params(dropout_p);
  const bool write_pre = bias != nullptr && a != pre;
  at::parallel_for(0, total, 8 * kChunk, [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? kChunk : 0]);
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t len = std::min(kChunk, end - c0);
      for (int64_t e = c0; keep && e < c0 + len;) {  // the chunk's pieces of rows
        const int64_t row = e / F, col = e % F, n = std::min(F - col, c0 + len - e);
        dropout.fill(keep + (e - c0), col, n, dropout_row_counter(offset, row, F));
        e += n;
      }
      for (int64_t e = c0; e < c0 + len;) {  // the same pieces: the bias goes by column
        const int64_t col = e % F, n = std::min(F - col, c0 + len - e);
        T* const p = pre + e;
        T* const out = a + e;
        const A* const k = keep ? keep + (e - c0) : nullptr;
        vec_loop<W>(n, [&](int64_t j, int64_t m) {
          V v = load(p + j, m);
          if (bias) {
            v = v + load(bias + col + j, m);
            if (write_pre) store(p + j, v, m);
          }
          v = activate(v, act);
          if (k) v = v * V::loadu(k + j, m);
          store(out + j, v, m);
        });
        e += n;
      }
    }
  });
}

// The gated form's forward over rows: pre (N, 2F) rows [g | u]; h = dropout(act(g + bg) * (u + bu))
// (N, F); bias (2F,) = [bg | bu], nullptr when the GEMM added it, else pre + bias is written back
// into pre (the backward reads it). The dropout factors of h's (row, col) are the plain form's.
template <typename T>
void glu_dropout_fwd(T* pre, const T* bias, T* h, int64_t N, int64_t F, Activation act,
                     double dropout_p, uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const DropoutParams dp = dropout_params(dropout_p);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop ? F : 0]);
    A* const keep = dp.drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t row = begin; row < end; ++row) {
      if (keep) dropout.fill(keep, 0, F, dropout_row_counter(offset, row, F));
      T* const g = pre + row * 2 * F;
      T* const u = g + F;
      T* const out = h + row * F;
      vec_loop<W>(F, [&](int64_t j, int64_t m) {
        V gv = load(g + j, m), uv = load(u + j, m);
        if (bias) {
          gv = gv + load(bias + j, m);
          uv = uv + load(bias + F + j, m);
          store(g + j, gv, m);
          store(u + j, uv, m);
        }
        V v = activate(gv, act) * uv;
        if (keep) v = v * V::loadu(keep + j, m);
        store(out + j, v, m);
      });
    }
  });
}

// sum[0, n) += x[0, n) (a bias gradient's column sums, one row at a time).
template <typename T>
inline void add_to_sum(acc_t<T>* sum, const T* x, int64_t n) {
  using V = AccVec<T>;
  vec_loop<V::size()>(n, [&](int64_t j, int64_t m) {
    (V::loadu(sum + j, m) + load(x + j, m)).store(sum + j, m);
  });
}

// One row of the backward pass: a = dropout(act(pre)) and dpre = da * keep * act'(pre) written over
// da; db1_sum += dpre, db2_sum += dout (each when not nullptr). keep: nullptr without dropout.
template <typename T>
inline void act_dropout_bwd_row(const T* pr, T* dr, T* ar, const acc_t<T>* keep, const T* gr,
                                acc_t<T>* db1_sum, acc_t<T>* db2_sum, int64_t F, int64_t E,
                                Activation act) {
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  vec_loop<W>(F, [&](int64_t j, int64_t n) {
    const V p = load(pr + j, n);
    V av = activate(p, act);
    V d = load(dr + j, n) * activate_grad(p, act);
    if (keep) {
      const V f = V::loadu(keep + j, n);
      av = av * f;
      d = d * f;
    }
    store(ar + j, av, n);
    store(dr + j, d, n);
    if (db1_sum) (V::loadu(db1_sum + j, n) + d).store(db1_sum + j, n);
  });
  if (db2_sum) add_to_sum(db2_sum, gr, E);
}

// One row of the gated backward pass: pr [g | u] (2F), dhr the gradient of h (F); writes
// dr [dg | du] (2F) = [dh keep u act'(g) | dh keep act(g)] and hr = keep act(g) u (F, for dw2);
// db1_sum (2F) += dr, db2_sum += dout (each when not nullptr).
template <typename T>
inline void glu_dropout_bwd_row(const T* pr, const T* dhr, T* dr, T* hr, const acc_t<T>* keep,
                                const T* gr, acc_t<T>* db1_sum, acc_t<T>* db2_sum, int64_t F,
                                int64_t E, Activation act) {
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  vec_loop<W>(F, [&](int64_t j, int64_t n) {
    const V g = load(pr + j, n), u = load(pr + F + j, n);
    const V ag = activate(g, act);
    V dh = load(dhr + j, n);
    V hv = ag * u;
    if (keep) {
      const V f = V::loadu(keep + j, n);
      hv = hv * f;
      dh = dh * f;
    }
    const V dg = dh * u * activate_grad(g, act), du = dh * ag;
    store(hr + j, hv, n);
    store(dr + j, dg, n);
    store(dr + F + j, du, n);
    if (db1_sum) {
      (V::loadu(db1_sum + j, n) + dg).store(db1_sum + j, n);
      (V::loadu(db1_sum + F + j, n) + du).store(db1_sum + F + j, n);
    }
  });
  if (db2_sum) add_to_sum(db2_sum, gr, E);
}

// One row of relu's backward pass from the kept a: dpre = da * scale where a > 0, else 0, written
// over da; db1_sum / db2_sum as act_dropout_bwd_row. scale: 1 / (1 - p), 1 without dropout.
template <typename T>
inline void relu_dropout_bwd_row(const T* ar, T* dr, const T* gr, acc_t<T> scale, acc_t<T>* db1_sum,
                                 acc_t<T>* db2_sum, int64_t F, int64_t E) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const V zero(A(0)), s(scale);
  vec_loop<W>(F, [&](int64_t j, int64_t n) {
    const V d = V::blendv(zero, load(dr + j, n) * s, load(ar + j, n) > zero);
    store(dr + j, d, n);
    if (db1_sum) (V::loadu(db1_sum + j, n) + d).store(db1_sum + j, n);
  });
  if (db2_sum) add_to_sum(db2_sum, gr, E);
}

// The backward's one pass over rows (see act_dropout_bwd_row, relu_dropout_bwd_row); saved: a for
// relu (a is then not written), else pre; db1 / db2 (nullptr: not wanted) are summed per block of
// rows, then the blocks' sums added in block order. Gated (glu_dropout_bwd_row; dh may be nullptr
// only with no rows):
// saved is pre (N, 2F), dh (N, F) the gradient of h, da_dpre the (N, 2F) dpre written, a h, db1 (2F,).
template <typename T>
void act_dropout_bwd(const T* saved, T* da_dpre, const T* dout, T* a, T* db1, T* db2, int64_t N,
                     int64_t F, int64_t E, Activation act, double dropout_p, uint64_t seed,
                     uint64_t offset, bool gated = false, const T* dh = nullptr) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const DropoutParams dp = dropout_params(dropout_p);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
  const int64_t nblocks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  const int64_t rows_per_block = (N + nblocks - 1) / nblocks;
  const int64_t F1 = db1 ? (gated ? 2 * F : F) : 0, E2 = db2 ? E : 0;
  std::unique_ptr<A[]> partial_buf(new A[nblocks * (F1 + E2)]());  // per block: db1 (F1), db2 (E2)
  A* const partial = partial_buf.get();
  const bool relu = act == Activation::kRelu && !gated;  // saved holds a: no mask, no recomputation
  at::parallel_for(0, nblocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::unique_ptr<A[]> keep_buf(new A[dp.drop && !relu ? F : 0]);
    A* const keep = dp.drop && !relu ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, dp.threshold, static_cast<A>(dp.scale));
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* const db1_sum = F1 ? partial + block * (F1 + E2) : nullptr;
      A* const db2_sum = E2 ? partial + block * (F1 + E2) + F1 : nullptr;
      const int64_t row_end = std::min(N, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        if (relu) {
          relu_dropout_bwd_row<T>(saved + row * F, da_dpre + row * F, dout + row * E,
                                  dp.drop ? static_cast<A>(dp.scale) : A(1), db1_sum, db2_sum, F, E);
          continue;
        }
        if (keep) dropout.fill(keep, 0, F, dropout_row_counter(offset, row, F));
        if (gated) {
          glu_dropout_bwd_row<T>(saved + row * 2 * F, dh + row * F, da_dpre + row * 2 * F, a + row * F, keep,
                                 dout + row * E, db1_sum, db2_sum, F, E, act);
          continue;
        }
        act_dropout_bwd_row<T>(saved + row * F, da_dpre + row * F, a + row * F, keep, dout + row * E,
                               db1_sum, db2_sum, F, E, act);
      }
    }
  });
  auto reduce = [&](T* out, int64_t len, int64_t at) {
    vec_loop<W>(len, [&](int64_t j, int64_t n) {
      V s(A(0));
      for (int64_t block = 0; block < nblocks; ++block) {
        s = s + V::loadu(partial + block * (F1 + E2) + at + j, n);
      }
      store(out + j, s, n);
    });
  };
  if (F1) reduce(db1, F1, 0);
  if (E2) reduce(db2, E2, F1);
}

}  // namespace

void glu_dropout_fwd_kernel(at::Tensor& pre, const at::Tensor& bias, at::Tensor& h, Activation act,
                            double dropout_p, uint64_t seed, uint64_t offset) {
  const int64_t N = h.size(0), F = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, pre.scalar_type(), "feed_forward_fwd", [&] {
    glu_dropout_fwd<scalar_t>(pre.data_ptr<scalar_t>(),
                              bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                              h.data_ptr<scalar_t>(), N, F, act, dropout_p, seed, offset);
  });
}

void glu_dropout_bwd_kernel(const at::Tensor& pre, const at::Tensor& dh, at::Tensor& dpre,
                            const at::Tensor& dout, at::Tensor& h, at::Tensor& db1, at::Tensor& db2,
                            Activation act, double dropout_p, uint64_t seed, uint64_t offset) {
  const int64_t N = dh.size(0), F = dh.size(1), E = dout.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, pre.scalar_type(), "feed_forward_bwd", [&] {
    act_dropout_bwd<scalar_t>(pre.data_ptr<scalar_t>(), dpre.data_ptr<scalar_t>(),
                              dout.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(),
                              db1.numel() > 0 ? db1.data_ptr<scalar_t>() : nullptr,
                              db2.numel() > 0 ? db2.data_ptr<scalar_t>() : nullptr, N, F, E, act,
                              dropout_p, seed, offset, /*gated=*/true, dh.data_ptr<scalar_t>());
  });
}

void act_dropout_fwd_kernel(at::Tensor& pre, const at::Tensor& bias, at::Tensor& a, Activation act,
                            double dropout_p, uint64_t seed, uint64_t offset) {
  const int64_t N = pre.size(0), F = pre.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, pre.scalar_type(), "feed_forward_fwd", [&] {
    act_dropout_fwd<scalar_t>(pre.data_ptr<scalar_t>(),
                              bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                              a.data_ptr<scalar_t>(), N, F, act, dropout_p, seed, offset);
  });
}

void act_dropout_bwd_kernel(const at::Tensor& saved, at::Tensor& dpre, const at::Tensor& dout,
                            at::Tensor& a, at::Tensor& db1, at::Tensor& db2, Activation act,
                            double dropout_p, uint64_t seed, uint64_t offset) {
  const int64_t N = saved.size(0), F = saved.size(1), E = dout.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, saved.scalar_type(), "feed_forward_bwd", [&] {
    act_dropout_bwd<scalar_t>(saved.data_ptr<scalar_t>(), dpre.data_ptr<scalar_t>(),
                              dout.data_ptr<scalar_t>(), a.defined() ? a.data_ptr<scalar_t>() : nullptr,
                              db1.numel() > 0 ? db1.data_ptr<scalar_t>() : nullptr,
                              db2.numel() > 0 ? db2.data_ptr<scalar_t>() : nullptr, N, F, E, act,
                              dropout_p, seed, offset);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
