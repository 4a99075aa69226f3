// Row primitives of the CPU attention kernels (attention_kernel_fwd.cpp,
// attention_kernel_bwd.cpp): scaling and masking a row of scores, the softmax's exponentials and
// reductions (several rows' together), the softmax backward of a row, and the conversions between
// a tensor's rows and the fp32 / fp64 tiles the products take. n is a multiple of kPad unless
// said otherwise.
#pragma once  // per-ISA sources only: attention_schedule.h checks
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "attention_problem.h"

namespace fastformer {
namespace CPU_CAPABILITY {
// Internal linkage, as when all of this was one file: each per-ISA source keeps its own copy.
namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// Softmax rows whose statistics are computed together: one vector of them.
template <typename T>
constexpr int64_t kRowGroup = Vec<T>::size();

template <typename T>
constexpr T neg_inf() { return -std::numeric_limits<T>::infinity(); }

template <typename T>
Vec<T> vexp(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();  // ~20 ulp, exp(-inf) = 0
  } else {
    return x.exp();
  }
}

// x[0, n) *= a, any n.
template <typename T>
void scale_row(T* x, int64_t n, T a) {
  const Vec<T> va(a);
  int64_t c = 0;
  for (; c + Vec<T>::size() <= n; c += Vec<T>::size()) (Vec<T>::loadu(x + c) * va).store(x + c);
  for (; c < n; ++c) x[c] *= a;
}

// s[c] += a[c * stride] for c < n (any n); a is fp32.
// s += a, except that a -inf in the mask hides the key whatever its score: s = -inf there, also
// where the score is NaN (as the reference's masked_fill; NaN + -inf would be NaN).
template <typename T>
inline T add_mask(T s, float a) {
  return a == neg_inf<float>() ? neg_inf<T>() : s + static_cast<T>(a);
}

template <typename T>
void add_mask_row(T* s, const float* a, int64_t stride, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (stride == 1) {
      const Vec<float> hidden(neg_inf<float>());
      int64_t c = 0;
      for (; c + Vec<float>::size() <= n; c += Vec<float>::size()) {
        const Vec<float> av = Vec<float>::loadu(a + c);
        Vec<float>::blendv(Vec<float>::loadu(s + c) + av, hidden, av == hidden).store(s + c);
      }
      for (; c < n; ++c) s[c] = add_mask(s[c], a[c]);
      return;
    }
  }
  if (stride == 0) {
    for (int64_t c = 0; c < n; ++c) s[c] = add_mask(s[c], a[0]);
  } else {
    for (int64_t c = 0; c < n; ++c) s[c] = add_mask(s[c], a[c * stride]);
  }
}

// The relative position bias of columns [c, c + V) of a row (RelRow): one load inside the
// window, one value broadcast past either end, lane by lane only where a vector straddles an end.
template <typename T>
Vec<T> rel_bias_at(const RelRow<T>& rel, int64_t c) {
  constexpr int64_t V = Vec<T>::size();
  const int64_t d = rel.d0 + c;
  if (d >= 0 && d + V - 1 <= rel.last) return Vec<T>::loadu(rel.bias + d);
  if (d + V - 1 <= 0) return Vec<T>(rel.bias[0]);
  if (d >= rel.last) return Vec<T>(rel.bias[rel.last]);
  alignas(64) T x[V];
  for (int64_t k = 0; k < V; ++k) x[k] = rel.bias[std::clamp<int64_t>(d + k, 0, rel.last)];
  return Vec<T>::loadu(x);
}

// s[0, n) += the row's relative position bias (any n).
template <typename T>
void add_rel_row(T* s, const RelRow<T>& rel, int64_t n) {
  int64_t c = 0;
  for (; c + Vec<T>::size() <= n; c += Vec<T>::size()) {
    (Vec<T>::loadu(s + c) + rel_bias_at(rel, c)).store(s + c);
  }
  for (; c < n; ++c) s[c] += rel.bias[std::clamp<int64_t>(rel.d0 + c, 0, rel.last)];
}

// One task's partial gradient of the relative position bias (2R + 1 sums, a slot no other task
// writes): the scores' gradients added by clamped distance, the columns past either end of the
// window summed lane-wise in lo / hi and folded in by flush(), all in a fixed order.
template <typename T>
struct RelGrad {
  static constexpr int64_t V = Vec<T>::size();
  T* part;
  int64_t last;  // 2R
  Vec<T> lo = Vec<T>(T(0)), hi = Vec<T>(T(0));

  // u: the gradients of count <= V consecutive columns, the first at unclamped index d.
  void add(int64_t d, const Vec<T>& u, int64_t count) {
    if (count == V) {
      if (d >= 0 && d + V - 1 <= last) {
        (Vec<T>::loadu(part + d) + u).store(part + d);
        return;
      }
      if (d + V - 1 <= 0) {
        lo = lo + u;
        return;
      }
      if (d >= last) {
        hi = hi + u;
        return;
      }
    }
    alignas(64) T x[V];
    u.store(x);
    for (int64_t k = 0; k < count; ++k) part[std::clamp<int64_t>(d + k, 0, last)] += x[k];
  }
  void flush() {
    const auto add = [](Vec<T> x, Vec<T> y) { return x + y; };
    part[0] += at::vec::vec_reduce_all<T>(add, lo);
    part[last] += at::vec::vec_reduce_all<T>(add, hi);
    lo = hi = Vec<T>(T(0));
  }
};

// s[0, n) = scale * s + relative position bias + masks for query i against keys j0 .. j0 + n - 1
// (causal: key j visible iff j <= i + shift), and the padding s[n, n_pad) = -inf.
template <typename T>
void scale_mask_row(const Masks& mk, const RelRow<T>& rel, T scale, int64_t b, int64_t h, int64_t i,
                    int64_t shift, int64_t j0, int64_t n, int64_t n_pad, T* s) {
  scale_row(s, n, scale);
  if (rel.bias != nullptr) add_rel_row(s, rel, n);  // before the masks: their -inf wins over any bias
  if (mk.key_bias != nullptr) add_mask_row(s, mk.key_bias + b * mk.Sk + j0, 1, n);
  if (mk.am != nullptr) {
    add_mask_row(s, mk.am + b * mk.am_sb + h * mk.am_sh + i * mk.am_sq + j0 * mk.am_sk, mk.am_sk, n);
  }
  if (mk.causal) {
    const int64_t first_hidden = std::max<int64_t>(0, i + shift - j0 + 1);
    for (int64_t c = first_hidden; c < n; ++c) s[c] = neg_inf<T>();
  }
  for (int64_t c = n; c < n_pad; ++c) s[c] = neg_inf<T>();
}

// s[0, n_pad) = f(scale * s + relative position bias + masks) for query i against keys j0 .. j0 +
// n - 1, f(-inf) where a mask hides the key and in the padding [n, n_pad): scale_mask_row and the
// next pass over the row (forward: the row max, backward: exp(s - lse)) in one sweep, the causal
// mask and the padding as whole vectors. Without an attn_mask (fp32: also with key padding) only;
// see fusable().
template <typename T, typename F>
void scale_mask_map_row(const Masks& mk, const RelRow<T>& rel, T scale, int64_t b, int64_t i,
                        int64_t shift, int64_t j0, int64_t n, int64_t n_pad, T* s, const F& f) {
  constexpr int64_t V = Vec<T>::size();
  const Vec<T> vs(scale), hidden(neg_inf<T>());
  // columns [visible, n_pad) are hidden: causal, then padding
  const int64_t visible = mk.causal ? std::clamp<int64_t>(i + shift - j0 + 1, 0, n) : n;
  const float* kb = mk.key_bias != nullptr ? mk.key_bias + b * mk.Sk + j0 : nullptr;
  // the sweep compiled with and without the bias, chosen once a row
  auto sweep = [&](auto with_rel) {
    auto score = [&](int64_t c, int64_t count) {
      Vec<T> x = Vec<T>::loadu(s + c) * vs;
      if constexpr (decltype(with_rel)::value) x = x + rel_bias_at(rel, c);
      if constexpr (std::is_same_v<T, float>) {
        if (kb != nullptr) {  // as add_mask_row: -inf hides the key even where the score is NaN
          const Vec<float> a = Vec<float>::loadu(kb + c, count);
          x = Vec<float>::blendv(x + a, hidden, a == hidden);
        }
      }
      return x;
    };
    int64_t c = 0;
    for (; c + V <= visible; c += V) f(score(c, V)).store(s + c);
    if (c < visible) {
      f(Vec<T>::set(hidden, score(c, visible - c), visible - c)).store(s + c);
      c += V;
    }
    return c;
  };
  int64_t c = rel.bias != nullptr ? sweep(std::true_type{}) : sweep(std::false_type{});
  if (c < n_pad) {
    const Vec<T> tail = f(hidden);
    for (; c < n_pad; c += V) tail.store(s + c);
  }
}

// Whether scale_mask_map_row takes these masks.
template <typename T>
bool fusable(const Masks& mk) {
  return mk.am == nullptr && (std::is_same_v<T, float> || mk.key_bias == nullptr);
}

// Lane r of the result = op over the lanes of v[r], r < Vec<T>::size(): the horizontal reductions
// of a group of rows (row maxima, row sums) done together. fp32 / AVX-512: a 16 x 16
// transpose-and-reduce, 15 ops on pairs of shuffles instead of 16 reductions of 4 dependent steps.
template <typename T, typename Op>
Vec<T> reduce_rows(const Vec<T>* v, const Op& op) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    __m512 a[8], b[4], c[2];
    for (int k = 0; k < 8; ++k) {  // rows 2k, 2k + 1 interleaved, 8 partials each
      a[k] = op(Vec<T>(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1])),
                Vec<T>(_mm512_unpackhi_ps(v[2 * k], v[2 * k + 1])));
    }
    for (int k = 0; k < 4; ++k) {  // rows 4k .. 4k + 3 in order within each 128-bit lane
      const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
      b[k] = op(Vec<T>(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y))),
                Vec<T>(_mm512_castpd_ps(_mm512_unpackhi_pd(x, y))));
    }
    for (int k = 0; k < 2; ++k) {  // 128-bit lanes: rows 8k .. 8k + 7, 2 partials each
      c[k] = op(Vec<T>(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88)),
                Vec<T>(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xdd)));
    }
    return op(Vec<T>(_mm512_shuffle_f32x4(c[0], c[1], 0x88)), Vec<T>(_mm512_shuffle_f32x4(c[0], c[1], 0xdd)));
  }
#endif
  constexpr int64_t n = Vec<T>::size();
  alignas(64) T out[n];
  for (int64_t r = 0; r < n; ++r) out[r] = at::vec::vec_reduce_all<T>(op, v[r]);
  return Vec<T>::loadu(out);
}

template <typename T>
Vec<T> max_op(const Vec<T>& x, const Vec<T>& y) { return at::vec::maximum(x, y); }  // NaN wins

template <typename T>
Vec<T> add_op(const Vec<T>& x, const Vec<T>& y) { return x + y; }

template <typename T>
constexpr T nan_of() { return std::numeric_limits<T>::quiet_NaN(); }

// A softmax row that is NaN (a NaN or +inf score): NaN in its n columns, 0 in the padding up to
// npad (the padding takes part in padded GEMMs, where 0 * NaN would spread to other rows).
template <typename T>
void poison_row(T* s, int64_t n, int64_t npad) {
  std::fill(s, s + n, nan_of<T>());
  std::fill(s + n, s + npad, T(0));
}

// s = exp(s - m); returns the row sum.
template <typename T>
T exp_sub_sum(T* s, int64_t n, T m) {
  const Vec<T> vm(m);
  Vec<T> sum(T(0));
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    const Vec<T> e = vexp(Vec<T>::loadu(s + c) - vm);
    e.store(s + c);
    sum = sum + e;
  }
  return at::vec::vec_reduce_all<T>([](Vec<T> x, Vec<T> y) { return x + y; }, sum);
}

// s = exp(s - m) (times keep, when given); returns the lane-wise partial sums of exp(s - m)
// (before dropout), for reduce_rows.
template <typename T>
Vec<T> exp_sub_partial(T* s, int64_t n, T m, const T* keep) {
  const Vec<T> vm(m);
  Vec<T> sum(T(0));
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    const Vec<T> e = vexp(Vec<T>::loadu(s + c) - vm);
    sum = sum + e;
    (keep != nullptr ? e * Vec<T>::loadu(keep + c) : e).store(s + c);
  }
  return sum;
}

// s = exp(s - m) without the sum (backward's P = exp(S - lse)).
template <typename T>
void exp_sub(T* s, int64_t n, T m) {
  const Vec<T> vm(m);
  for (int64_t c = 0; c < n; c += Vec<T>::size()) vexp(Vec<T>::loadu(s + c) - vm).store(s + c);
}

template <typename T>
void mul_row(T* x, const T* y, int64_t n) {
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    (Vec<T>::loadu(x + c) * Vec<T>::loadu(y + c)).store(x + c);
  }
}

// dst = x * y
template <typename T>
void mul_into(T* dst, const T* x, const T* y, int64_t n) {
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    (Vec<T>::loadu(x + c) * Vec<T>::loadu(y + c)).store(dst + c);
  }
}

// dp = scale * p * (dp z - delta): the softmax backward of one row, times the score scale, with
// the dropout multipliers z when given.
template <typename T>
void softmax_bwd_row(T* dp, const T* p, const T* z, int64_t n, T delta, T scale) {
  const Vec<T> vd(delta), vs(scale);
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    Vec<T> d = Vec<T>::loadu(dp + c);
    if (z != nullptr) d = d * Vec<T>::loadu(z + c);
    (Vec<T>::loadu(p + c) * vs * (d - vd)).store(dp + c);
  }
}

// softmax_bwd_row that also adds each column's u = p (dp z - delta), the gradient of its score
// (after the scale, so not times it), to the bias gradient g, the row's columns [0, n) from
// unclamped index d0 on (RelRow); the padding [n, npad) is left out (a NaN row's is not 0).
template <typename T>
void softmax_bwd_rel_row(T* dp, const T* p, const T* z, int64_t n, int64_t npad, T delta, T scale,
                         int64_t d0, RelGrad<T>& g) {
  constexpr int64_t V = Vec<T>::size();
  const Vec<T> vd(delta), vs(scale);
  for (int64_t c = 0; c < npad; c += V) {
    Vec<T> d = Vec<T>::loadu(dp + c);
    if (z != nullptr) d = d * Vec<T>::loadu(z + c);
    const Vec<T> u = Vec<T>::loadu(p + c) * (d - vd);
    if (c < n) g.add(d0 + c, u, std::min(V, n - c));
    (u * vs).store(dp + c);
  }
}

// dst[0, n) = src converted (any n).
template <typename S, typename D>
void convert_row(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst[0, n) = src * f, converted (any n); src is scratch and may be overwritten.
template <typename T, typename D>
void store_scaled_row(T* src, T f, D* dst, int64_t n) {
  if constexpr (std::is_same_v<T, D>) {
    const Vec<T> vf(f);
    int64_t c = 0;
    for (; c + Vec<T>::size() <= n; c += Vec<T>::size()) (Vec<T>::loadu(src + c) * vf).store(dst + c);
    for (; c < n; ++c) dst[c] = src[c] * f;
  } else {
    scale_row(src, n, f);
    at::vec::convert(src, dst, n);
  }
}

// Rows [s0, s0 + n) of one head of a q / k / v / dout operand as GEMM-ready acc_t rows: the
// tensor's own memory for fp32 and fp64 (also rows ld > D apart: a copy to contiguous rows was
// measured slower, the GEMMs read strided rows well); a converted fp32 copy for bf16, kept while
// the rows asked for lie within the last rows converted (a task can convert a whole head up front).
template <typename scalar_t>
class OperandTile {
 public:
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kLowp = !std::is_same_v<scalar_t, acc_t>;

  OperandTile(int64_t max_rows, int64_t D) : D_(D) {
    if constexpr (kLowp) buf_.resize(max_rows * D);
  }
  // Returns the rows and sets ld to their leading dimension.
  const acc_t* get(const Rows<scalar_t>& src, int64_t b, int64_t h, int64_t s0, int64_t n, int64_t& ld) {
    if constexpr (!kLowp) {
      ld = src.ld;
      return src.row(b, h, s0);
    } else {
      if (b != b_ || h != h_ || s0 < s0_ || s0 + n > s0_ + n_) {
        if (static_cast<int64_t>(buf_.size()) < n * D_) buf_.resize(n * D_);
        for (int64_t r = 0; r < n; ++r) convert_row(src.row(b, h, s0 + r), buf_.data() + r * D_, D_);
        b_ = b;
        h_ = h;
        s0_ = s0;
        n_ = n;
      }
      ld = D_;
      return buf_.data() + (s0 - s0_) * D_;
    }
  }

 private:
  int64_t D_;
  int64_t b_ = -1, h_ = -1, s0_ = -1, n_ = -1;
  std::vector<acc_t> buf_;
};

// Rows [s0, s0 + n) of head (b, h) of dst = acc (n, D) (leading dimension D), converted.
template <typename acc_t, typename scalar_t>
void store_rows(const acc_t* acc, const Rows<scalar_t>& dst, int64_t b, int64_t h, int64_t s0,
                int64_t n, int64_t D) {
  for (int64_t r = 0; r < n; ++r) convert_row(acc + r * D, dst.row(b, h, s0 + r), D);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fastformer
