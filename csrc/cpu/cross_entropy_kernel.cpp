// Fused label-smoothed cross-entropy on CPU: log-softmax, smoothing, NLL and the gradient in
// one kernel. Math in fp32 for fp32 / bf16 logits (fp64 for fp64); at::vec vectorised,
// parallel over rows. This file is the row kernel (and the bf16 accumulation linear_cross_entropy
// uses), compiled once per ISA level into fastformer::<level> (isa.h); cross_entropy.cpp checks
// the arguments, reduces the rows' losses in a fixed order (deterministic) and registers the op.
#include "cross_entropy.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>

#include "vec_io.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

// exp with ~20 ulp in fp32 (a polynomial, about twice Sleef's u10 speed); full precision in fp64.
inline Vectorized<float> fast_exp(const Vectorized<float>& x) { return x.exp_u20(); }
inline Vectorized<double> fast_exp(const Vectorized<double>& x) { return x.exp(); }

template <typename A>
inline A hmax(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>(
      [](const Vectorized<A>& a, const Vectorized<A>& b) { return at::vec::maximum(a, b); }, v);
}

// Online max / sum-of-exp over blocks of vectors: the block max is taken first, the running
// sum is rescaled once per block when the max grows, so each element costs one exp.
template <typename A>
struct OnlineLse {
  using Vec = Vectorized<A>;
  A m = -std::numeric_limits<A>::infinity();
  Vec s = Vec(A(0));

  inline void absorb(const Vec* v, int count) {
    Vec bm = v[0];
    for (int u = 1; u < count; ++u) bm = at::vec::maximum(bm, v[u]);
    const A block_max = hmax<A>(bm);
    if (block_max > m) {
      s = s * Vec(std::exp(m - block_max));
      m = block_max;
    }
    if (m == -std::numeric_limits<A>::infinity()) return;  // only -inf so far: adds 0
    const Vec mv(m);
    for (int u = 0; u < count; ++u) s = s + fast_exp(v[u] - mv);
  }

  inline A lse() const { return m + std::log(hsum<A>(s)); }
};

// kWeight: class weights cw (V,) in the math type, w_sum their sum (see cross_entropy.h).
template <typename T, bool kBias, bool kWeight>
void cross_entropy_rows_impl(const T* logits, const T* bias, const acc_t<T>* cw, acc_t<T> w_sum, T* grad,
                             acc_t<T>* grad_colsum, int64_t n, int64_t V, const int64_t* target,
                             double label_smoothing, int64_t ignore_index, RowScale rs,
                             double* loss_rows) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  constexpr int64_t kW = Vec::size();
  constexpr int kUnroll = 8;
  const A eps = static_cast<A>(label_smoothing);
  const A inv_v = A(1) / static_cast<A>(V);
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / V);
  // count elements of x (+ bias) from column j in the math type, zero past count.
  auto row = [bias](const T* x, int64_t j, int64_t count) {
    if constexpr (kBias) return load(x + j, count) + load(bias + j, count);
    return load(x + j, count);
  };
  // the class weights from column j, zero past count (1 without weights: never read)
  auto wvec = [cw](int64_t j, int64_t count) {
    if constexpr (kWeight) return Vec::loadu(cw + j, count);
    return Vec(A(1));
  };

  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> exp_buf(new A[grad != nullptr ? V : 0]);  // exp(x - max) of one row
    A* const e = exp_buf.get();
    for (int64_t i = begin; i < end; ++i) {
      const T* x = logits + i * V;  // (V,)
      const int64_t t = target[i];
      const bool valid = t != ignore_index;
      T* g = grad != nullptr ? grad + i * V : nullptr;
      if (!valid) {  // an ignored row: loss 0 and zero gradient, whatever its logits
        loss_rows[i] = 0.0;
        if (g != nullptr) std::fill(g, g + V, T(0));
        continue;
      }
      const A x_t = static_cast<A>(x[t]) + (kBias ? static_cast<A>(bias[t]) : A(0));  // before g overwrites x
      const A sc = static_cast<A>(rs.row_scale ? rs.row_scale[i] : rs.scale);
      // w[t], and the softmax's share of the gradient: (1 - eps) w[t] + eps sum(w) / V (1 unweighted)
      const A w_t = kWeight ? cw[t] : A(1);
      const A p_mass = kWeight ? (A(1) - eps) * w_t + eps * w_sum * inv_v : A(1);

      // Pass 1: the row's max and sum of logits, and (without a gradient to write) its sum of exp,
      // online over blocks of kUnroll vectors. With a gradient, pass 2 takes the exps once, after
      // the max is known, and keeps them for pass 3: one exp per element either way.
      const bool with_grad = g != nullptr && sc != A(0);
      OnlineLse<A> stats;
      Vec vmax(neg_inf), sx(A(0)), swx(A(0));  // swx: sum_c w_c x_c (with weights)
      Vec v[kUnroll];
      int64_t j = 0;
      for (; j + kUnroll * kW <= V; j += kUnroll * kW) {
        for (int u = 0; u < kUnroll; ++u) {
          v[u] = row(x, j + u * kW, kW);
          sx = sx + v[u];
          if constexpr (kWeight) swx = at::vec::fmadd(v[u], wvec(j + u * kW, kW), swx);
          if (with_grad) vmax = at::vec::maximum(vmax, v[u]);
        }
        if (!with_grad) stats.absorb(v, kUnroll);
      }
      int count = 0;
      for (; j + kW <= V; j += kW, ++count) {
        v[count] = row(x, j, kW);
        sx = sx + v[count];
        if constexpr (kWeight) swx = at::vec::fmadd(v[count], wvec(j, kW), swx);
      }
      if (j < V) {  // the tail: zero-padded for the sum, -inf-padded for max / exp
        const Vec tail = row(x, j, V - j);
        sx = sx + tail;
        if constexpr (kWeight) swx = at::vec::fmadd(tail, wvec(j, V - j), swx);
        v[count++] = Vec::set(Vec(neg_inf), tail, V - j);
      }
      if (with_grad) {
        for (int u = 0; u < count; ++u) vmax = at::vec::maximum(vmax, v[u]);
        stats.m = hmax<A>(vmax);
      } else if (count > 0) {
        stats.absorb(v, count);
      }
      // A NaN or +inf logit (the logits' sum is then NaN or +inf) or a row of only -inf logits has
      // no finite log-sum-exp: the reference and F.cross_entropy give NaN, and so does the kernel.
      // The running max alone would skip a NaN (a comparison with NaN is false).
      const A sum_x = hsum<A>(sx);
      const bool no_lse = std::isnan(sum_x) || sum_x == -neg_inf || stats.m == neg_inf;
      if (with_grad && !no_lse) {  // Pass 2: e = exp(x - max) into the row buffer, and its sum
        const Vec mv(stats.m);
        Vec se(A(0));
        vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
          Vec ev = fast_exp(row(x, k, cnt) - mv);
          if (cnt < kW) ev = Vec::set(Vec(A(0)), ev, cnt);
          ev.store(e + k, cnt);
          se = se + ev;
        });
        stats.s = se;
      }
      const A lse = no_lse ? std::numeric_limits<A>::quiet_NaN() : stats.lse();
      A loss;
      if constexpr (kWeight) {  // (1 - eps) w[t] (lse - x_t) + eps / V (sum(w) lse - sum_c w_c x_c)
        loss = (A(1) - eps) * w_t * (lse - x_t);
        if (eps > A(0)) loss += eps * inv_v * (w_sum * lse - hsum<A>(swx));
      } else {
        loss = lse - (A(1) - eps) * x_t;
        if (eps > A(0)) loss -= eps * sum_x * inv_v;
      }
      loss_rows[i] = static_cast<double>(loss);

      // Pass 3: grad = (softmax - (1 - eps) onehot - eps / V) * scale, from the row buffer; with
      // weights (p_mass softmax - (1 - eps) w[t] onehot - eps / V w) * scale.
      if (g == nullptr) continue;
      if (sc == A(0)) {  // a zero row scale: zero gradient, whatever its logits
        std::fill(g, g + V, T(0));
        continue;
      }
      if (no_lse) {  // the whole row's gradient is NaN, as the reference's (fast_exp would clamp it)
        const A nan = std::numeric_limits<A>::quiet_NaN();
        std::fill(g, g + V, static_cast<T>(nan));
        if (grad_colsum != nullptr) {
          A* cs = grad_colsum + at::get_thread_num() * V;
          for (int64_t k = 0; k < V; ++k) cs[k] += nan;
        }
        continue;
      }
      const Vec p_v(p_mass * sc / hsum<A>(stats.s)), c_v(eps * inv_v * sc);  // softmax = e / sum(e)
      if (grad_colsum == nullptr) {
        vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
          store(g + k, at::vec::fmsub(Vec::loadu(e + k, cnt), p_v, kWeight ? c_v * wvec(k, cnt) : c_v), cnt);
        });
      } else {  // also add the row into this thread's column sums (the bias gradient)
        A* cs = grad_colsum + at::get_thread_num() * V;
        vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
          const Vec gv = at::vec::fmsub(Vec::loadu(e + k, cnt), p_v, kWeight ? c_v * wvec(k, cnt) : c_v);
          store(g + k, gv, cnt);
          (Vec::loadu(cs + k, cnt) + gv).store(cs + k, cnt);
        });
        cs[t] -= (A(1) - eps) * w_t * sc;
      }
      g[t] = static_cast<T>((std::exp(x_t - lse) * p_mass - eps * inv_v * (kWeight ? cw[t] : A(1)) -
                             (A(1) - eps) * w_t) * sc);
    }
  });
}

// Class probabilities q (n, V) in the math type as the target (torch's soft targets): with
// q' = (1 - eps) q + eps / V and w = cw (1 without class weights), loss_rows[i] = Q lse - S with
// Q = sum_c w_c q'_c, S = sum_c w_c q'_c x_c, and grad_i = (Q softmax - w q') * scale_i. Two sweeps
// over the row (the max, then exp / Q / S into the row buffer) and the gradient from the buffer.
template <typename T, bool kWeight>
void soft_cross_entropy_rows_impl(const T* logits, const acc_t<T>* probs, const acc_t<T>* cw, T* grad,
                                  int64_t n, int64_t V, double label_smoothing, RowScale rs,
                                  double* loss_rows) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  constexpr int64_t kW = Vec::size();
  const A eps = static_cast<A>(label_smoothing), on = A(1) - eps, off = eps / static_cast<A>(V);
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / V);
  // w q' of the classes from column k, zero past cnt
  auto wq = [&](const A* q, int64_t k, int64_t cnt) {
    Vec v = Vec::loadu(q + k, cnt) * Vec(on) + Vec(off);
    if constexpr (kWeight) v = v * Vec::loadu(cw + k, cnt);
    return cnt < kW ? Vec::set(Vec(A(0)), v, cnt) : v;
  };

  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> exp_buf(new A[V]);  // exp(x - max) of one row
    A* const e = exp_buf.get();
    for (int64_t i = begin; i < end; ++i) {
      const T* x = logits + i * V;  // (V,)
      const A* q = probs + i * V;   // (V,)
      Vec vmax(neg_inf), sx(A(0));
      vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
        const Vec v = load(x + k, cnt);  // zero-padded
        sx = sx + v;
        vmax = at::vec::maximum(vmax, cnt < kW ? Vec::set(Vec(neg_inf), v, cnt) : v);
      });
      const A m = hmax<A>(vmax), sum_x = hsum<A>(sx);
      // a NaN or +inf logit, or only -inf logits: no finite log-sum-exp (NaN, as the reference)
      const bool no_lse = std::isnan(sum_x) || sum_x == -neg_inf || m == neg_inf;
      const Vec mv(m);
      Vec se(A(0)), sq(A(0)), sqx(A(0));
      vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
        const Vec v = load(x + k, cnt);
        Vec ev = fast_exp(v - mv);
        if (cnt < kW) ev = Vec::set(Vec(A(0)), ev, cnt);
        ev.store(e + k, cnt);
        se = se + ev;
        const Vec w = wq(q, k, cnt);
        sq = sq + w;
        sqx = at::vec::fmadd(w, v, sqx);
      });
      const A nan = std::numeric_limits<A>::quiet_NaN();
      const A lse = no_lse ? nan : m + std::log(hsum<A>(se));
      const A Q = hsum<A>(sq);
      loss_rows[i] = static_cast<double>(Q * lse - hsum<A>(sqx));
      if (grad == nullptr) continue;
      T* g = grad + i * V;
      const A sc = static_cast<A>(rs.row_scale ? rs.row_scale[i] : rs.scale);
      if (no_lse) {
        std::fill(g, g + V, static_cast<T>(nan));
        continue;
      }
      const Vec p_v(Q * sc / hsum<A>(se)), sc_v(sc);
      vec_loop<kW>(V, [&](int64_t k, int64_t cnt) {
        store(g + k, at::vec::fmsub(Vec::loadu(e + k, cnt), p_v, wq(q, k, cnt) * sc_v), cnt);
      });
    }
  });
}

}  // namespace

void soft_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& class_weight, const at::Tensor& probs,
                             double label_smoothing, RowScale scale, const at::Tensor& grad, double* loss_rows) {
  const int64_t n = logits.size(0), V = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "soft_cross_entropy_rows", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    const A* q = probs.const_data_ptr<A>();
    scalar_t* g = grad.defined() ? grad.data_ptr<scalar_t>() : nullptr;
    if (class_weight.defined()) {
      soft_cross_entropy_rows_impl<scalar_t, true>(x, q, class_weight.const_data_ptr<A>(), g, n, V, label_smoothing,
                                                   scale, loss_rows);
    } else {
      soft_cross_entropy_rows_impl<scalar_t, false>(x, q, nullptr, g, n, V, label_smoothing, scale, loss_rows);
    }
  });
}

void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& bias, const at::Tensor& class_weight,
                        const int64_t* target, double label_smoothing, int64_t ignore_index,
                        RowScale scale, const at::Tensor& grad, double* loss_rows,
                        const at::Tensor& grad_colsum) {
  const int64_t n = logits.size(0), V = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "cross_entropy_rows", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* g = grad.defined() ? grad.data_ptr<scalar_t>() : nullptr;
    A* cs = (g != nullptr && grad_colsum.defined()) ? grad_colsum.data_ptr<A>() : nullptr;
    auto run = [&](auto has_bias, auto has_weight) {
      const A* cw = has_weight ? class_weight.const_data_ptr<A>() : nullptr;
      A w_sum = 0;
      if (cw != nullptr) {  // summed in a fixed order: once a call (a chunk), O(V)
        double s = 0.0;
        for (int64_t c = 0; c < V; ++c) s += static_cast<double>(cw[c]);
        w_sum = static_cast<A>(s);
      }
      cross_entropy_rows_impl<scalar_t, decltype(has_bias)::value, decltype(has_weight)::value>(
          x, b, cw, w_sum, g, cs, n, V, target, label_smoothing, ignore_index, scale, loss_rows);
    };
    using True = std::true_type;
    using False = std::false_type;
    if (class_weight.defined()) {
      b != nullptr ? run(True(), True()) : run(False(), True());
    } else {
      b != nullptr ? run(True(), False()) : run(False(), False());
    }
  });
}

// acc[i] += src[i] for n elements (the bf16 partial dweight into its fp32 accumulator).
void accumulate_bf16(const at::BFloat16* src, int64_t n, float* acc) {
  constexpr int64_t kW = Vectorized<float>::size();
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    vec_loop<kW>(end - begin, [&](int64_t k, int64_t cnt) {
      const int64_t i = begin + k;
      (Vectorized<float>::loadu(acc + i, cnt) + load(src + i, cnt)).store(acc + i, cnt);
    });
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
