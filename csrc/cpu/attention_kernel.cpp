// Flash-style CPU attention: fastformer::attention_fwd and attention_bwd (schemas in csrc/ops.cpp).
//
// Forward, per (batch, head, block of kBlockQ queries): S = Q K^T for one block of kBlockK keys
// at a time, scale and masks applied while the tile is hot, an online softmax (running max m and
// sum l per row), dropout on the probabilities from the shared Philox stream, and O += P V.
// Only the per-row log-sum-exp lse = m + log(l) is kept for backward (+inf for a row with no
// visible key, so exp(s - lse) recomputes P = 0 there).
//
// Backward recomputes P = exp(S - lse) tile by tile and regenerates the dropout mask from
// (seed, offset): with Z the dropout multipliers (0 or 1 / (1 - p)) and delta = rowsum(dO * O),
//   dV += (P Z)^T dO,  dP = (dO V^T) Z,  dS = scale P (dP - delta),  dQ += dS K,  dK += dS^T Q.
// Two race-free schedules:
//   * one task per (batch, head) computing dQ, dK and dV together (five products per tile),
//     when there are enough heads to keep every thread busy;
//   * otherwise two passes: dK and dV per (batch, head, key block), then dQ per
//     (batch, head, query block), recomputing S and dP in each (seven products per tile).
// Tiles wholly hidden by the causal mask or by key padding (leading / trailing padded keys)
// are skipped. Threads take tasks one at a time from a shared counter (parallel_tasks), so
// rows of different lengths do not leave a thread waiting for another.
//
// The tile products are plain row-major C (+)= A B (attention_gemm.h: oneDNN's brgemm ukernel
// through at::native::cpublas for fp32, MKL for fp64); the transposed operands (K^T, V^T,
// (P Z)^T, dS^T) are built explicitly (attention_transpose.h).
//
// Dtypes: fp32, fp64 and bf16. bf16 operands are converted to fp32 tiles, so the products,
// softmax statistics and gradient accumulation are fp32.
//
// This file is the math, compiled once per ISA level into fastformer::<level> (isa.h);
// attention.cpp checks the arguments, prepares the masks and calls the chosen level.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <atomic>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "attention_gemm.h"
#include "attention_transpose.h"
#include "dropout_scales.h"
#include "philox.h"

namespace fastformer {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kBlockQ = 64;    // query rows per tile
constexpr int64_t kBlockK = 128;   // keys per tile; a multiple of kPad
constexpr int64_t kPad = 16;       // score rows are padded (with -inf) to whole vectors

template <typename T>
using Vec = at::vec::Vectorized<T>;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// at::parallel_for grain for tasks of about `work` multiply-adds each: a thread gets at least
// ~2^17 of them, so tiny problems (gradcheck sizes) run inline instead of waking threads.
int64_t grain_for(int64_t work) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, work));
}

// Tasks handed out one at a time from a shared counter (see parallel_tasks).
class TaskQueue {
 public:
  explicit TaskQueue(int64_t n) : n_(n) {}
  // The next task not yet taken by any thread; false when none is left.
  bool pop(int64_t& task) {
    task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < n_;
  }

 private:
  const int64_t n_;
  std::atomic<int64_t> next_{0};
};

// Runs fn(queue) on as many of at::parallel_for's threads as tasks [0, n) of `grain` tasks each
// keep busy (one thread, inline, for small problems); each thread sets up its scratch once and
// then pops tasks until none is left. at::parallel_for alone hands each thread one contiguous
// range of tasks, and under key padding (batch rows of different lengths) or a causal mask one
// range can hold much more work than another while the other threads wait at the barrier. Each
// task writes only its own rows, so which thread runs it does not change a bit of the result.
template <typename Fn>
void parallel_tasks(int64_t n, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = std::clamp<int64_t>(ceil_div(n, grain), 1, at::get_num_threads());
  TaskQueue queue(n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { fn(queue); });
}

template <typename T>
constexpr T neg_inf() { return -std::numeric_limits<T>::infinity(); }

// ---------------------------------------------------------------------------------------------
// Operands and masks
// ---------------------------------------------------------------------------------------------

// A (B, H, S, D) tensor read through its strides: row s of head (b, h) is D contiguous elements,
// rows ld apart (ld >= D, as the GEMMs need).
template <typename T>
struct Rows {
  T* data;
  int64_t sb, sh, ld;
  T* row(int64_t b, int64_t h, int64_t s) const { return data + b * sb + h * sh + s * ld; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  const int64_t ld = t.size(2) <= 1 ? t.size(3) : t.stride(2);
  return Rows<T>{const_cast<T*>(t.data_ptr<T>()), t.stride(0), t.stride(1), ld};
}

template <typename scalar_t>
struct Problem {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t B, H, Sq, Sk, D;
  Rows<scalar_t> q, k, v;
  Masks mask;
  acc_t scale;
  DropoutParams dropout;
  uint64_t seed, offset;

  // The keys [first, second) that queries [.., i_end) of batch b can see at all: outside lie only
  // padded keys and, under causal, keys past the diagonal of query i_end - 1. Tiles there are
  // skipped (their P is 0).
  std::pair<int64_t, int64_t> key_span(int64_t b, int64_t i_end) const {
    int64_t lo = 0, hi = Sk;
    if (mask.key_span != nullptr) {
      lo = mask.key_span[2 * b];
      hi = mask.key_span[2 * b + 1];
    }
    if (mask.causal) hi = std::min(hi, std::clamp<int64_t>(i_end + mask.shift, 0, Sk));
    return {lo, std::max(lo, hi)};
  }
  // The first query that can see key j0.
  int64_t query_begin(int64_t j0) const {
    return mask.causal ? std::clamp<int64_t>(j0 - mask.shift, 0, Sq) : 0;
  }
  // out[0, npad) = the dropout multipliers (drop's value or 0) of keys [j0, j0 + nk) of query
  // (b, h, i), then zeros: the probabilities (B, H, Sq, Sk) are rows of Sk, one per query, row-major.
  template <typename A>
  void dropout_row(const DropoutScales<A>& drop, int64_t b, int64_t h, int64_t i, int64_t j0,
                   int64_t nk, int64_t npad, A* out) const {
    drop.fill(out, j0, nk, dropout_row_counter(offset, (b * H + h) * Sq + i, Sk));
    std::fill(out + nk, out + npad, A(0));
  }
};

// ---------------------------------------------------------------------------------------------
// Row primitives (n a multiple of kPad unless said otherwise)
// ---------------------------------------------------------------------------------------------

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

// s[0, n) = scale * s + masks for query i against keys j0 .. j0 + n - 1, and the padding
// s[n, n_pad) = -inf.
template <typename T>
void scale_mask_row(const Masks& mk, T scale, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                    int64_t n_pad, T* s) {
  scale_row(s, n, scale);
  if (mk.key_bias != nullptr) add_mask_row(s, mk.key_bias + b * mk.Sk + j0, 1, n);
  if (mk.am != nullptr) {
    add_mask_row(s, mk.am + b * mk.am_sb + h * mk.am_sh + i * mk.am_sq + j0 * mk.am_sk, mk.am_sk, n);
  }
  if (mk.causal) {
    const int64_t first_hidden = std::max<int64_t>(0, i + mk.shift - j0 + 1);
    for (int64_t c = first_hidden; c < n; ++c) s[c] = neg_inf<T>();
  }
  for (int64_t c = n; c < n_pad; ++c) s[c] = neg_inf<T>();
}

template <typename T>
constexpr T nan_of() { return std::numeric_limits<T>::quiet_NaN(); }

// A softmax row that is NaN (a NaN or +inf score): NaN in its n columns, 0 in the padding up to
// npad (the padding takes part in padded GEMMs, where 0 * NaN would spread to other rows).
template <typename T>
void poison_row(T* s, int64_t n, int64_t npad) {
  std::fill(s, s + n, nan_of<T>());
  std::fill(s + n, s + npad, T(0));
}

template <typename T>
T row_max(const T* s, int64_t n) {
  Vec<T> m(neg_inf<T>());
  for (int64_t c = 0; c < n; c += Vec<T>::size()) m = at::vec::maximum(m, Vec<T>::loadu(s + c));
  return at::vec::vec_reduce_all<T>([](Vec<T> x, Vec<T> y) { return at::vec::maximum(x, y); }, m);
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

// dp = scale * p * (dp - delta): the softmax backward of one row, times the score scale.
template <typename T>
void softmax_bwd_row(T* dp, const T* p, int64_t n, T delta, T scale) {
  const Vec<T> vd(delta), vs(scale);
  for (int64_t c = 0; c < n; c += Vec<T>::size()) {
    (Vec<T>::loadu(p + c) * vs * (Vec<T>::loadu(dp + c) - vd)).store(dp + c);
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
// tensor's own memory for fp32 and fp64; a converted fp32 copy for bf16, kept while the rows
// asked for lie within the last rows converted (a task can convert a whole head up front).
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

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

template <typename scalar_t>
void attention_fwd_kernel(const Problem<scalar_t>& p, scalar_t* out, float* lse) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t nqb = ceil_div(p.Sq, kBlockQ), D = p.D;
  const bool dropout = p.dropout.drop;
  const acc_t keep_scale = static_cast<acc_t>(p.dropout.scale);

  const int64_t grain = grain_for(2 * std::min(kBlockQ, p.Sq) * p.Sk * D);
  parallel_tasks(p.B * p.H * nqb, grain, [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    std::vector<acc_t> S(kBlockQ * kBlockK), KT(D * kBlockK), acc(kBlockQ * D), m(kBlockQ), l(kBlockQ),
        keep(kBlockK);
    const DropoutScales<acc_t> drop(p.seed, p.dropout.threshold, acc_t(1));  // scaled at the end
    OperandTile<scalar_t> q_tile(kBlockQ, D), k_tile(kBlockK, D), v_tile(kBlockK, D);
    for (int64_t task; tasks.pop(task);) {
      const int64_t qb = task % nqb, h = (task / nqb) % p.H, b = task / (nqb * p.H);
      const int64_t i0 = qb * kBlockQ, mq = std::min(kBlockQ, p.Sq - i0);
      std::fill(m.begin(), m.end(), neg_inf<acc_t>());
      std::fill(l.begin(), l.end(), acc_t(0));
      std::fill(acc.begin(), acc.begin() + mq * D, acc_t(0));
      int64_t ldq, ldk, ldv;
      const acc_t* Qi = q_tile.get(p.q, b, h, i0, mq, ldq);  // (mq, D)
      const auto [kbegin, kend] = p.key_span(b, i0 + mq);
      for (int64_t j0 = kbegin; j0 < kend; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, kend - j0), npad = round_up(nk, kPad);
        const acc_t* Kj = k_tile.get(p.k, b, h, j0, nk, ldk);  // (nk, D)
        attn::transpose(Kj, ldk, nk, D, KT.data(), kBlockK);         // (D, nk)
        // S (mq, nk) = Q_i K_j^T
        attn::matmul(mq, nk, D, Qi, ldq, KT.data(), kBlockK, S.data(), kBlockK, false);
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t i = i0 + r;
          acc_t* s = S.data() + r * kBlockK;
          scale_mask_row(p.mask, p.scale, b, h, i, j0, nk, npad, s);
          const acc_t tile_max = row_max(s, npad);  // NaN if a score is NaN
          const acc_t m_new = std::isnan(m[r]) || std::isnan(tile_max) ? nan_of<acc_t>()
                                                                       : std::max(m[r], tile_max);
          if (m_new == neg_inf<acc_t>()) {
            std::fill(s, s + npad, acc_t(0));  // nothing visible yet: P = 0
            continue;
          }
          if (std::isnan(m_new) || m_new == -neg_inf<acc_t>()) {
            // a NaN or +inf score: the reference's softmax row is NaN, so P, the output and the
            // lse are NaN too (vexp would clamp exp(NaN) to a finite number)
            poison_row(s, nk, npad);
            m[r] = l[r] = nan_of<acc_t>();
            continue;
          }
          // online softmax: rescale what was accumulated under the old max
          if (m[r] != m_new && m[r] != neg_inf<acc_t>()) {
            const acc_t alpha = std::exp(m[r] - m_new);
            l[r] *= alpha;
            scale_row(acc.data() + r * D, D, alpha);
          }
          l[r] += exp_sub_sum(s, npad, m_new);
          m[r] = m_new;
          if (dropout) {
            p.dropout_row(drop, b, h, i, j0, nk, npad, keep.data());
            mul_row(s, keep.data(), npad);
          }
        }
        // acc (mq, D) += P (mq, nk) V_j (nk, D)
        const acc_t* Vj = v_tile.get(p.v, b, h, j0, nk, ldv);
        attn::matmul(mq, D, nk, S.data(), kBlockK, Vj, ldv, acc.data(), D, true);
      }
      for (int64_t r = 0; r < mq; ++r) {
        const int64_t row = (b * p.H + h) * p.Sq + i0 + r;
        scalar_t* o = out + row * D;
        if (l[r] == acc_t(0)) {  // no visible key: output 0, lse +inf
          std::fill(o, o + D, scalar_t(0));
          lse[row] = std::numeric_limits<float>::infinity();
        } else {
          store_scaled_row(acc.data() + r * D, keep_scale / l[r], o, D);
          lse[row] = static_cast<float>(m[r] + std::log(l[r]));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

template <typename scalar_t>
struct BwdData {
  using acc_t = at::opmath_type<scalar_t>;
  Rows<scalar_t> dout;
  const float* lse;     // (B, H, Sq) contiguous
  const acc_t* delta;   // (B, H, Sq) contiguous: rowsum(dout * out)
  Rows<scalar_t> dq, dk, dv;  // the gradients, each row written once
};

// Per-thread scratch of the backward pass.
template <typename scalar_t>
struct BwdScratch {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<acc_t> S, dP, keep, PZ;  // (kBlockQ, kBlockK) tiles; keep / PZ only with dropout
  std::vector<acc_t> KT, VT;           // (D, kBlockK): K_j^T, V_j^T
  std::vector<acc_t> T;                // (kBlockK, kBlockQ): (P Z)^T, then dS^T
  std::vector<acc_t> dq, dk, dv;       // accumulators of the rows a task owns (leading dim D)
  OperandTile<scalar_t> q, k, v, dout;
  BwdScratch(bool dropout, int64_t D, int64_t dq_rows, int64_t dkv_rows)
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
        q(kBlockQ, D),
        k(kBlockK, D),
        v(kBlockK, D),
        dout(kBlockQ, D) {}

  // K_j, V_j (nk, D) of head (b, h) and their transposes into KT, VT.
  void load_keys(const Problem<scalar_t>& p, int64_t b, int64_t h, int64_t j0, int64_t nk,
                 const acc_t*& Kj, int64_t& ldk) {
    int64_t ldv;
    Kj = k.get(p.k, b, h, j0, nk, ldk);
    const acc_t* Vj = v.get(p.v, b, h, j0, nk, ldv);
    attn::transpose(Kj, ldk, nk, p.D, KT.data(), kBlockK);
    attn::transpose(Vj, ldv, nk, p.D, VT.data(), kBlockK);
  }
};

// One (query block, key block) tile of the backward pass: queries i0 .. i0 + mq - 1 against keys
// j0 .. j0 + nk - 1 of head (b, h), with w.KT / w.VT holding K_j^T / V_j^T. Adds dS K_j to
// dq (mq, D) when given, and (P Z)^T dO_i, dS^T Q_i to dv, dk (nk, D) when given (all with
// leading dimension D).
template <typename scalar_t>
void backward_tile(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                   int64_t b, int64_t h, int64_t i0, int64_t mq, int64_t j0, int64_t nk,
                   const at::opmath_type<scalar_t>* Kj, int64_t ldk, at::opmath_type<scalar_t>* dq,
                   at::opmath_type<scalar_t>* dk, at::opmath_type<scalar_t>* dv) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D, npad = round_up(nk, kPad), head = (b * p.H + h) * p.Sq;
  const bool dropout = p.dropout.drop;
  const DropoutScales<acc_t> drop(p.seed, p.dropout.threshold, static_cast<acc_t>(p.dropout.scale));
  int64_t ldq, lddo;
  const acc_t* Qi = w.q.get(p.q, b, h, i0, mq, ldq);            // (mq, D)
  const acc_t* dOi = w.dout.get(g.dout, b, h, i0, mq, lddo);    // (mq, D)

  // P (mq, nk) = exp(scale * Q_i K_j^T + mask - lse)
  attn::matmul(mq, nk, D, Qi, ldq, w.KT.data(), kBlockK, w.S.data(), kBlockK, false);
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t i = i0 + r;
    acc_t* s = w.S.data() + r * kBlockK;
    scale_mask_row(p.mask, p.scale, b, h, i, j0, nk, npad, s);
    const float row_lse = g.lse[head + i];
    if (row_lse == std::numeric_limits<float>::infinity()) {
      std::fill(s, s + npad, acc_t(0));  // no visible key
    } else if (std::isnan(row_lse)) {
      poison_row(s, nk, npad);  // the forward's row was NaN: so are its gradients
    } else {
      exp_sub(s, npad, static_cast<acc_t>(row_lse));
    }
    if (dropout) {
      acc_t* z = w.keep.data() + r * kBlockK;
      p.dropout_row(drop, b, h, i, j0, nk, npad, z);
      mul_into(w.PZ.data() + r * kBlockK, s, z, npad);
    }
  }

  if (dv != nullptr) {
    // dV_j (nk, D) += (P Z)^T (nk, mq) dO_i (mq, D)
    attn::transpose(dropout ? w.PZ.data() : w.S.data(), kBlockK, mq, nk, w.T.data(), kBlockQ);
    attn::matmul(nk, D, mq, w.T.data(), kBlockQ, dOi, lddo, dv, D, true);
  }

  // dP (mq, nk) = dO_i V_j^T, then dS = scale * P (dP Z - delta) in place
  attn::matmul(mq, nk, D, dOi, lddo, w.VT.data(), kBlockK, w.dP.data(), kBlockK, false);
  for (int64_t r = 0; r < mq; ++r) {
    acc_t* dp = w.dP.data() + r * kBlockK;
    std::fill(dp + nk, dp + npad, acc_t(0));
    if (dropout) mul_row(dp, w.keep.data() + r * kBlockK, npad);
    softmax_bwd_row(dp, w.S.data() + r * kBlockK, npad, g.delta[head + i0 + r], p.scale);
  }

  if (dq != nullptr) {
    // dQ_i (mq, D) += dS (mq, nk) K_j (nk, D)
    attn::matmul(mq, D, nk, w.dP.data(), kBlockK, Kj, ldk, dq, D, true);
  }
  if (dk != nullptr) {
    // dK_j (nk, D) += dS^T (nk, mq) Q_i (mq, D)
    attn::transpose(w.dP.data(), kBlockK, mq, nk, w.T.data(), kBlockQ);
    attn::matmul(nk, D, mq, w.T.data(), kBlockQ, Qi, ldq, dk, D, true);
  }
}

// delta[b, h, i] = sum_d dout[b, h, i, d] * out[b, h, i, d]
template <typename scalar_t>
void row_dots(const Problem<scalar_t>& p, const Rows<scalar_t>& dout, const Rows<scalar_t>& out,
              at::opmath_type<scalar_t>* delta) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kLowp = !std::is_same_v<scalar_t, acc_t>;
  const int64_t D = p.D;
  at::parallel_for(0, p.B * p.H * p.Sq, grain_for(D), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> x(kLowp ? D : 0), y(kLowp ? D : 0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % p.Sq, h = (row / p.Sq) % p.H, b = row / (p.Sq * p.H);
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
      delta[row] = at::vec::map2_reduce_all<acc_t>(
          [](Vec<acc_t> u, Vec<acc_t> t) { return u * t; },
          [](Vec<acc_t> u, Vec<acc_t> t) { return u + t; }, a, c, D);
    }
  });
}

// dK, dV rows [jb, jb + nb) of head (b, h): accumulated over every query block that sees them
// (into w.dk / w.dv) and stored; dq, when given, collects dS K for the whole head.
template <typename scalar_t>
void backward_key_block(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                        int64_t b, int64_t h, int64_t jb, int64_t nb, at::opmath_type<scalar_t>* dq) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D;
  std::fill(w.dk.begin(), w.dk.begin() + nb * D, acc_t(0));
  std::fill(w.dv.begin(), w.dv.begin() + nb * D, acc_t(0));
  const auto [kbegin, kend] = p.key_span(b, p.Sq);
  const int64_t j0 = std::max(jb, kbegin), j1 = std::min(jb + nb, kend);  // keys anyone sees
  if (j0 < j1) {
    const acc_t* Kj;
    int64_t ldk;
    w.load_keys(p, b, h, j0, j1 - j0, Kj, ldk);
    for (int64_t i0 = p.query_begin(j0) / kBlockQ * kBlockQ; i0 < p.Sq; i0 += kBlockQ) {
      const int64_t mq = std::min(kBlockQ, p.Sq - i0);
      backward_tile(p, g, w, b, h, i0, mq, j0, j1 - j0, Kj, ldk, dq != nullptr ? dq + i0 * D : nullptr,
                    w.dk.data() + (j0 - jb) * D, w.dv.data() + (j0 - jb) * D);
    }
  }
  store_rows(w.dk.data(), g.dk, b, h, jb, nb, D);
  store_rows(w.dv.data(), g.dv, b, h, jb, nb, D);
}

template <typename scalar_t>
void attention_bwd_kernel(const Problem<scalar_t>& p, const BwdData<scalar_t>& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t nqb = ceil_div(p.Sq, kBlockQ), nkb = ceil_div(p.Sk, kBlockK), D = p.D;
  const bool dropout = p.dropout.drop;
  const int64_t threads = at::get_num_threads(), heads = p.B * p.H;
  const bool two_pass = threads > 1 && heads < 4 * threads && (nqb > 1 || nkb > 1);

  if (!two_pass) {
    // One task per head: key blocks in turn, dQ accumulated over the whole head.
    parallel_tasks(heads, grain_for(5 * p.Sq * p.Sk * D), [&](TaskQueue& tasks) {
      attn::BlasSingleThread blas;
      BwdScratch<scalar_t> w(dropout, D, p.Sq, kBlockK);
      for (int64_t bh; tasks.pop(bh);) {
        const int64_t b = bh / p.H, h = bh % p.H;
        int64_t ld;
        w.q.get(p.q, b, h, 0, p.Sq, ld);  // bf16: convert the head's q and dout once
        w.dout.get(g.dout, b, h, 0, p.Sq, ld);
        std::fill(w.dq.begin(), w.dq.end(), acc_t(0));
        for (int64_t jb = 0; jb < p.Sk; jb += kBlockK) {
          backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, p.Sk - jb), w.dq.data());
        }
        store_rows(w.dq.data(), g.dq, b, h, 0, p.Sq, D);
      }
    });
    return;
  }
  // Pass 1: dK, dV, each (b, h, key block) task owning its rows.
  parallel_tasks(heads * nkb, grain_for(4 * p.Sq * std::min(kBlockK, p.Sk) * D), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(dropout, D, 0, kBlockK);
    for (int64_t task; tasks.pop(task);) {
      const int64_t kb = task % nkb, h = (task / nkb) % p.H, b = task / (nkb * p.H);
      const int64_t jb = kb * kBlockK;
      backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, p.Sk - jb), nullptr);
    }
  });
  // Pass 2: dQ, each (b, h, query block) task owning its rows.
  parallel_tasks(heads * nqb, grain_for(3 * std::min(kBlockQ, p.Sq) * p.Sk * D), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(dropout, D, kBlockQ, 0);
    for (int64_t task; tasks.pop(task);) {
      const int64_t qb = task % nqb, h = (task / nqb) % p.H, b = task / (nqb * p.H);
      const int64_t i0 = qb * kBlockQ, mq = std::min(kBlockQ, p.Sq - i0);
      const auto [kbegin, kend] = p.key_span(b, i0 + mq);
      std::fill(w.dq.begin(), w.dq.end(), acc_t(0));
      for (int64_t j0 = kbegin; j0 < kend; j0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, kend - j0);
        const acc_t* Kj;
        int64_t ldk;
        w.load_keys(p, b, h, j0, nk, Kj, ldk);
        backward_tile(p, g, w, b, h, i0, mq, j0, nk, Kj, ldk, w.dq.data(), nullptr, nullptr);
      }
      store_rows(w.dq.data(), g.dq, b, h, i0, mq, D);
    }
  });
}

template <typename scalar_t>
Problem<scalar_t> make_problem(const std::array<int64_t, 5>& dims, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const Masks& mask,
                               double scale, double dropout_p, uint64_t seed, uint64_t offset) {
  Problem<scalar_t> p;
  p.B = dims[0];
  p.H = dims[1];
  p.Sq = dims[2];
  p.Sk = dims[3];
  p.D = dims[4];
  p.q = rows_of<scalar_t>(q);
  p.k = rows_of<scalar_t>(k);
  p.v = rows_of<scalar_t>(v);
  p.mask = mask;
  p.scale = static_cast<at::opmath_type<scalar_t>>(scale);
  p.dropout = dropout_params(dropout_p);
  p.seed = seed;
  p.offset = offset;
  return p;
}

}  // namespace

void attention_fwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const Masks& mask, double scale, double dropout_p,
                        uint64_t seed, uint64_t offset, at::Tensor& out, at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_fwd", [&] {
    const auto p = make_problem<scalar_t>(dims, q, k, v, mask, scale, dropout_p, seed, offset);
    attention_fwd_kernel<scalar_t>(p, out.data_ptr<scalar_t>(), lse.data_ptr<float>());
  });
}

void attention_bwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& dout,
                        const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const Masks& mask,
                        double scale, double dropout_p, uint64_t seed, uint64_t offset,
                        at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_problem<scalar_t>(dims, q, k, v, mask, scale, dropout_p, seed, offset);
    BwdData<scalar_t> g{rows_of<scalar_t>(dout), lse.data_ptr<float>(), delta.data_ptr<acc_t>(),
                        rows_of<scalar_t>(dq), rows_of<scalar_t>(dk), rows_of<scalar_t>(dv)};
    row_dots(p, g.dout, rows_of<scalar_t>(out), delta.data_ptr<acc_t>());
    attention_bwd_kernel<scalar_t>(p, g);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
