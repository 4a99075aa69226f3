// Flash-style CPU attention: fastformer::attention_fwd / attention_bwd and attention_varlen_fwd /
// attention_varlen_bwd (schemas in csrc/schemas.h).
//
// One problem description serves both ops: attention's (B, H, S, D) batch of equal-length rows
// and attention_varlen's packed sequences (total, H, D) with cu_seqlens (Problem::Lq / Lk per
// sequence, Rows addressing a sequence's rows through cu), so every tile, mask and dropout step
// below is the same code for both.
//
// Forward, per (sequence, head, block of kBlockQ queries): S = Q K^T for one block of kBlockK keys
// at a time, scale and masks applied while the tile is hot, an online softmax (running max m and
// sum l per row), dropout on the probabilities from the shared Philox stream, and O += P V.
// Only the per-row log-sum-exp lse = m + log(l) is kept for backward (+inf for a row with no
// visible key, so exp(s - lse) recomputes P = 0 there).
//
// Backward recomputes P = exp(S - lse) tile by tile and regenerates the dropout mask from
// (seed, offset): with Z the dropout multipliers (0 or 1 / (1 - p)) and delta = rowsum(dO * O),
//   dV += (P Z)^T dO,  dP = (dO V^T) Z,  dS = scale P (dP - delta),  dQ += dS K,  dK += dS^T Q.
// Two race-free schedules, chosen per sequence:
//   * one task per (sequence, head) computing dQ, dK and dV together (five products per tile),
//     when the head is a small share of the whole call's work; a head of one tile (fp32 / fp64)
//     has each product write its gradient rows in place (backward_single_tile), and the task
//     computes its rows' delta itself unless some head is split (then row_dots runs first);
//   * otherwise two passes: dK and dV per (sequence, head, key block), then dQ per
//     (sequence, head, query block), recomputing S and dP in each (seven products per tile).
// Tiles wholly hidden by the causal mask or by key padding (leading / trailing padded keys)
// are skipped. Threads take tasks one at a time from a shared counter, heaviest first
// (TaskList, parallel_tasks), so sequences of different lengths do not leave a thread waiting
// for another.
//
// The tile products are plain row-major C (+)= A B (attention_gemm.h: oneDNN's brgemm ukernel
// through at::native::cpublas for fp32, MKL for fp64; neither takes a transposed operand); the
// transposed operands (K^T, V^T, (P Z)^T, dS^T) are built explicitly (attention_transpose.h).
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
// Score rows are padded (with -inf) to whole vectors. The products whose N is the key count
// (Q K^T, dO V^T) run npad wide: columns [nk, npad) of K^T / V^T hold whatever an earlier tile
// left there, and what they give is overwritten before it is read (-inf, or 0 in dP). oneDNN's
// brgemm then sees a few N instead of every length (a ragged N was ~20-35% slower per product at
// attention's tile sizes on AMD EPYC / AVX2, ragged M and K not).
constexpr int64_t kPad = 16;

template <typename T>
using Vec = at::vec::Vectorized<T>;

// Softmax rows whose statistics are computed together: one vector of them.
template <typename T>
constexpr int64_t kRowGroup = Vec<T>::size();

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

// Runs fn(queue) on as many of at::parallel_for's threads as tasks [0, n) of `work` multiply-adds
// in all keep busy (~2^17 each; one thread, inline, for small problems); each thread sets up its
// scratch once and then pops tasks until none is left. at::parallel_for alone hands each thread
// one contiguous range of tasks, and with sequences of different lengths (key padding, packed
// sequences) or a causal mask one range can hold much more work than another while the other
// threads wait at the barrier. Each task writes only its own rows, so which thread runs it does
// not change a bit of the result.
template <typename Fn>
void parallel_tasks(int64_t n, int64_t work, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = std::clamp<int64_t>(ceil_div(work, int64_t{1} << 17), 1,
                                              std::min<int64_t>(n, at::get_num_threads()));
  TaskQueue queue(n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { fn(queue); });
}

// The tasks of one pass: items (sequence b, block) each run for every one of H heads, task
// h * items + item. Each head's items go heaviest first (longest processing time first): with
// the dynamic queue the last tasks are light ones, so a long sequence among short ones is started
// early instead of being the last thing one thread works on while the others wait. Head-major:
// threads working at once take different sequences of one head, not neighbouring heads of one
// sequence, whose pieces of the packed rows (H D apart) lie side by side.
class TaskList {
 public:
  struct Item {
    int64_t b, block, work;  // block: a query or key block index, or kWholeHead
  };
  static constexpr int64_t kWholeHead = -1;

  explicit TaskList(int64_t H) : H_(H) {}
  void add(int64_t b, int64_t block, int64_t work) {
    items_.push_back({b, block, work});
    work_ += work;
  }
  // Call once every item is added.
  void sort() {
    std::stable_sort(items_.begin(), items_.end(),
                     [](const Item& x, const Item& y) { return x.work > y.work; });
  }
  int64_t size() const { return static_cast<int64_t>(items_.size()) * H_; }
  int64_t work() const { return work_ * H_; }  // multiply-adds of all tasks
  const Item& item(int64_t task, int64_t& h) const {
    const int64_t n = static_cast<int64_t>(items_.size());
    h = task / n;
    return items_[task % n];
  }

 private:
  int64_t H_, work_ = 0;
  std::vector<Item> items_;
};

template <typename T>
constexpr T neg_inf() { return -std::numeric_limits<T>::infinity(); }

// ---------------------------------------------------------------------------------------------
// Operands and masks
// ---------------------------------------------------------------------------------------------

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

template <typename scalar_t>
struct Problem {
  using acc_t = at::opmath_type<scalar_t>;
  // Sq, Sk: every sequence's lengths (padded) or the longest (packed); either way the dropout
  // counters' grid (B, H, Sq, Sk).
  int64_t B, H, Sq, Sk, D;
  const int32_t* cu_q = nullptr;  // packed: sequence b's query rows [cu_q[b], cu_q[b + 1])
  const int32_t* cu_k = nullptr;  //          and key rows [cu_k[b], cu_k[b + 1])
  Rows<scalar_t> q, k, v;
  Masks mask;
  acc_t scale;
  DropoutParams dropout;
  uint64_t seed, offset;

  // Sequence b's query and key counts.
  int64_t Lq(int64_t b) const { return cu_q != nullptr ? int64_t{cu_q[b + 1]} - cu_q[b] : Sq; }
  int64_t Lk(int64_t b) const { return cu_k != nullptr ? int64_t{cu_k[b + 1]} - cu_k[b] : Sk; }
  // Causal (bottom-right): key j of sequence b is visible to its query i iff j <= i + shift(b).
  int64_t shift(int64_t b) const { return Lk(b) - Lq(b); }
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
  // out[0, nk) = the dropout multipliers (drop's value or 0) of keys [j0, j0 + nk) of query
  // (b, h, i), then up to npad multipliers of the next columns or zeros: out holds kBlockK, and
  // the last Philox call's columns are written whole there instead of through a copy (padding
  // columns only ever multiply P = 0). The probabilities (B, H, Sq, Sk) are rows of Sk, one per
  // query, row-major.
  template <typename A>
  void dropout_row(const DropoutScales<A>& drop, int64_t b, int64_t h, int64_t i, int64_t j0,
                   int64_t nk, int64_t npad, A* out) const {
    const int64_t n = std::min(round_up(nk, dropout_detail::kMinFill), kBlockK);
    drop.fill(out, j0, n, dropout_row_counter(offset, (b * H + h) * Sq + i, Sk));
    if (n < npad) std::fill(out + n, out + npad, A(0));
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

// s[0, n) = scale * s + masks for query i against keys j0 .. j0 + n - 1 (causal: key j visible
// iff j <= i + shift), and the padding s[n, n_pad) = -inf.
template <typename T>
void scale_mask_row(const Masks& mk, T scale, int64_t b, int64_t h, int64_t i, int64_t shift,
                    int64_t j0, int64_t n, int64_t n_pad, T* s) {
  scale_row(s, n, scale);
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

// s[0, n_pad) = f(scale * s + masks) for query i against keys j0 .. j0 + n - 1, f(-inf) where a
// mask hides the key and in the padding [n, n_pad): scale_mask_row and the next pass over the row
// (forward: the row max, backward: exp(s - lse)) in one sweep, the causal mask and the padding
// as whole vectors. Without an attn_mask (fp32: also with key padding) only; see fusable().
template <typename T, typename F>
void scale_mask_map_row(const Masks& mk, T scale, int64_t b, int64_t i, int64_t shift, int64_t j0,
                        int64_t n, int64_t n_pad, T* s, const F& f) {
  constexpr int64_t V = Vec<T>::size();
  const Vec<T> vs(scale), hidden(neg_inf<T>());
  // columns [visible, n_pad) are hidden: causal, then padding
  const int64_t visible = mk.causal ? std::clamp<int64_t>(i + shift - j0 + 1, 0, n) : n;
  const float* kb = mk.key_bias != nullptr ? mk.key_bias + b * mk.Sk + j0 : nullptr;
  auto score = [&](int64_t c, int64_t count) {
    Vec<T> x = Vec<T>::loadu(s + c) * vs;
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

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

// out: rows of (b, h, i) as Rows (D each); lse: p.stat_rows.
template <typename scalar_t>
void attention_fwd_kernel(const Problem<scalar_t>& p, const Rows<scalar_t>& out, const Rows<float>& lse) {
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
    const DropoutScales<acc_t> drop(p.seed, p.dropout.threshold, acc_t(1));  // scaled at the end
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
        const acc_t* Kj = k_tile.get(p.k, b, h, j0, nk, ldk);  // (nk, D)
        attn::transpose(Kj, ldk, nk, D, KT.data(), kBlockK);         // (D, nk)
        // S (mq, nk) = Q_i K_j^T, computed npad wide (see kPad)
        attn::matmul(mq, npad, D, Qi, ldq, KT.data(), kBlockK, S.data(), kBlockK, false);
        // the softmax rows in groups of kGroup, their maxima and sums reduced together
        for (int64_t g0 = 0; g0 < mq; g0 += kGroup) {
          const int64_t rows = std::min(kGroup, mq - g0);
          acc_t* s0 = S.data() + g0 * kBlockK;
          if (dropout) {  // first: the multipliers' stores are done when the rows read them
            for (int64_t r = 0; r < rows; ++r) {
              p.dropout_row(drop, b, h, i0 + g0 + r, j0, nk, npad, keep.data() + r * kBlockK);
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            acc_t* s = s0 + r * kBlockK;
            if (fused) {
              Vec<acc_t> mx(neg_inf<acc_t>());
              scale_mask_map_row(p.mask, p.scale, b, i0 + g0 + r, shift, j0, nk, npad, s,
                                 [&](const Vec<acc_t>& x) {
                                   mx = at::vec::maximum(mx, x);
                                   return x;
                                 });
              part[r] = mx;
            } else {
              scale_mask_row(p.mask, p.scale, b, h, i0 + g0 + r, shift, j0, nk, npad, s);
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
        const acc_t* Vj = v_tile.get(p.v, b, h, j0, nk, ldv);
        attn::matmul(mq, D, nk, S.data(), kBlockK, Vj, ldv, acc.data(), D, true);
      }
      float* lse_rows = lse.row(b, h, i0);
      for (int64_t g0 = 0; g0 < mq; g0 += kGroup) {
        alignas(64) acc_t log_l[kGroup];  // a group's logs in one vector call
        Vec<acc_t>::loadu(l.data() + g0).log().store(log_l);
        for (int64_t r = g0; r < std::min(mq, g0 + kGroup); ++r) {
          scalar_t* o = out.row(b, h, i0 + r);
          if (l[r] == acc_t(0)) {  // no visible key: output 0, lse +inf
            std::fill(o, o + D, scalar_t(0));
            lse_rows[r] = std::numeric_limits<float>::infinity();
          } else {
            store_scaled_row(acc.data() + r * D, keep_scale / l[r], o, D);
            lse_rows[r] = static_cast<float>(m[r] + log_l[r - g0]);
          }
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
  Rows<float> lse;      // Problem::stat_rows
  Rows<acc_t> delta;    // Problem::stat_rows: rowsum(dout * out)
  Rows<scalar_t> dq, dk, dv;  // the gradients, each row written once
  Rows<scalar_t> out;         // the forward's output (for delta)
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
        x(std::is_same_v<scalar_t, acc_t> ? 0 : D),
        y(std::is_same_v<scalar_t, acc_t> ? 0 : D),
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
// j0 .. j0 + nk - 1 of head (b, h), with w.KT / w.VT holding K_j^T / V_j^T. Adds (accumulate) or
// writes dS K_j to dq (mq, D) when given, and (P Z)^T dO_i, dS^T Q_i to dv, dk (nk, D) when given.
template <typename scalar_t>
void backward_tile(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                   int64_t b, int64_t h, int64_t i0, int64_t mq, int64_t j0, int64_t nk,
                   const at::opmath_type<scalar_t>* Kj, int64_t ldk, GradRows<at::opmath_type<scalar_t>> dq,
                   GradRows<at::opmath_type<scalar_t>> dk, GradRows<at::opmath_type<scalar_t>> dv,
                   bool accumulate = true) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D, npad = round_up(nk, kPad), shift = p.shift(b);
  const float* lse = g.lse.row(b, h, i0);
  const acc_t* delta = g.delta.row(b, h, i0);
  const bool dropout = p.dropout.drop;
  const DropoutScales<acc_t> drop(p.seed, p.dropout.threshold, static_cast<acc_t>(p.dropout.scale));
  int64_t ldq, lddo;
  const acc_t* Qi = w.q.get(p.q, b, h, i0, mq, ldq);            // (mq, D)
  const acc_t* dOi = w.dout.get(g.dout, b, h, i0, mq, lddo);    // (mq, D)

  if (dropout) {  // before the product: the multipliers' stores are done when the rows read them
    for (int64_t r = 0; r < mq; ++r) p.dropout_row(drop, b, h, i0 + r, j0, nk, npad, w.keep.data() + r * kBlockK);
  }
  // P (mq, nk) = exp(scale * Q_i K_j^T + mask - lse)
  attn::matmul(mq, npad, D, Qi, ldq, w.KT.data(), kBlockK, w.S.data(), kBlockK, false);
  const bool fused = fusable<acc_t>(p.mask);
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t i = i0 + r;
    acc_t* s = w.S.data() + r * kBlockK;
    const float row_lse = lse[r];
    if (row_lse == std::numeric_limits<float>::infinity()) {
      std::fill(s, s + npad, acc_t(0));  // no visible key
    } else if (std::isnan(row_lse)) {
      poison_row(s, nk, npad);  // the forward's row was NaN: so are its gradients
    } else if (fused) {
      const Vec<acc_t> vlse(static_cast<acc_t>(row_lse));
      scale_mask_map_row(p.mask, p.scale, b, i, shift, j0, nk, npad, s,
                         [&](const Vec<acc_t>& x) { return vexp(x - vlse); });
    } else {
      scale_mask_row(p.mask, p.scale, b, h, i, shift, j0, nk, npad, s);
      exp_sub(s, npad, static_cast<acc_t>(row_lse));
    }
    if (dropout) mul_into(w.PZ.data() + r * kBlockK, s, w.keep.data() + r * kBlockK, npad);
  }

  if (dv.data != nullptr) {
    // dV_j (nk, D) += (P Z)^T (nk, mq) dO_i (mq, D)
    attn::transpose(dropout ? w.PZ.data() : w.S.data(), kBlockK, mq, nk, w.T.data(), kBlockQ);
    attn::matmul(nk, D, mq, w.T.data(), kBlockQ, dOi, lddo, dv.data, dv.ld, accumulate);
  }

  // dP (mq, nk) = dO_i V_j^T, then dS = scale * P (dP Z - delta) in place
  attn::matmul(mq, npad, D, dOi, lddo, w.VT.data(), kBlockK, w.dP.data(), kBlockK, false);
  for (int64_t r = 0; r < mq; ++r) {
    acc_t* dp = w.dP.data() + r * kBlockK;
    if (npad > nk) std::fill(dp + nk, dp + npad, acc_t(0));
    softmax_bwd_row(dp, w.S.data() + r * kBlockK, dropout ? w.keep.data() + r * kBlockK : nullptr,
                    npad, delta[r], p.scale);
  }

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
// zero first and copy out after.
template <typename scalar_t>
void backward_single_tile(const Problem<scalar_t>& p, const BwdData<scalar_t>& g, BwdScratch<scalar_t>& w,
                          int64_t b, int64_t h) {
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
                {g.dk.row(b, h, kbegin), g.dk.ld}, {g.dv.row(b, h, kbegin), g.dv.ld}, /*accumulate=*/false);
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
                    {w.dk.data() + (j0 - jb) * D, D}, {w.dv.data() + (j0 - jb) * D, D});
    }
  }
  store_rows(w.dk.data(), g.dk, b, h, jb, nb, D);
  store_rows(w.dv.data(), g.dv, b, h, jb, nb, D);
}

template <typename scalar_t>
void attention_bwd_kernel(const Problem<scalar_t>& p, const BwdData<scalar_t>& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t D = p.D, threads = at::get_num_threads();
  const bool dropout = p.dropout.drop;

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
  // delta: up front when split heads need it (their key-block tasks read every query row's),
  // else by each whole-head task for its own rows
  const bool head_delta = pass2.size() == 0;
  if (!head_delta) row_dots(p, g.dout, g.out, g.delta);

  // Pass 1: each whole-head task owns its dQ, dK, dV rows, each key-block task its dK, dV rows.
  parallel_tasks(pass1.size(), pass1.work(), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(dropout, D, whole_rows, kBlockK);
    for (int64_t task; tasks.pop(task);) {
      int64_t h;
      const TaskList::Item& it = pass1.item(task, h);
      const int64_t b = it.b, lq = p.Lq(b), lk = p.Lk(b);
      if (it.block != TaskList::kWholeHead) {
        const int64_t jb = it.block * kBlockK;
        backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, lk - jb), nullptr);
        continue;
      }
      if (head_delta) head_deltas(p, g, b, h, lq, w.x.data(), w.y.data());
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        if (lq <= kBlockQ && lk <= kBlockK) {
          backward_single_tile(p, g, w, b, h);
          continue;
        }
      }
      // key blocks in turn, dQ accumulated over the whole head
      int64_t ld;
      w.q.get(p.q, b, h, 0, lq, ld);  // bf16: convert the head's q and dout once
      w.dout.get(g.dout, b, h, 0, lq, ld);
      std::fill(w.dq.begin(), w.dq.begin() + lq * D, acc_t(0));
      for (int64_t jb = 0; jb < lk; jb += kBlockK) {
        backward_key_block(p, g, w, b, h, jb, std::min(kBlockK, lk - jb), w.dq.data());
      }
      store_rows(w.dq.data(), g.dq, b, h, 0, lq, D);
    }
  });
  // Pass 2: dQ of the split heads, each (sequence, head, query block) task owning its rows.
  parallel_tasks(pass2.size(), pass2.work(), [&](TaskQueue& tasks) {
    attn::BlasSingleThread blas;
    BwdScratch<scalar_t> w(dropout, D, kBlockQ, 0);
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
        backward_tile(p, g, w, b, h, i0, mq, j0, nk, Kj, ldk, {w.dq.data(), D}, {nullptr, D}, {nullptr, D});
      }
      store_rows(w.dq.data(), g.dq, b, h, i0, mq, D);
    }
  });
}

// The problem of q, k, v read as Rows (rows_of or packed_rows_of).
template <typename scalar_t>
Problem<scalar_t> make_problem(const std::array<int64_t, 5>& dims, const Rows<scalar_t>& q,
                               const Rows<scalar_t>& k, const Rows<scalar_t>& v, const Masks& mask,
                               double scale, double dropout_p, uint64_t seed, uint64_t offset) {
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
  p.dropout = dropout_params(dropout_p);
  p.seed = seed;
  p.offset = offset;
  return p;
}

// Padded (B, H, S, D) operands.
template <typename scalar_t>
Problem<scalar_t> make_problem(const std::array<int64_t, 5>& dims, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const Masks& mask,
                               double scale, double dropout_p, uint64_t seed, uint64_t offset) {
  return make_problem<scalar_t>(dims, rows_of<scalar_t>(q), rows_of<scalar_t>(k), rows_of<scalar_t>(v),
                                mask, scale, dropout_p, seed, offset);
}

// Packed sequences: no masks but the per-sequence causal one.
template <typename scalar_t>
Problem<scalar_t> make_varlen_problem(const Varlen& lens, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, bool causal, double scale,
                                      double dropout_p, uint64_t seed, uint64_t offset) {
  Masks mask;
  mask.causal = causal;
  return make_problem<scalar_t>({lens.B, lens.H, lens.max_q, lens.max_k, lens.D},
                                packed_rows_of<scalar_t>(q, lens.cu_q),
                                packed_rows_of<scalar_t>(k, lens.cu_k),
                                packed_rows_of<scalar_t>(v, lens.cu_k), mask, scale, dropout_p, seed,
                                offset);
}

}  // namespace

void attention_fwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const Masks& mask, double scale, double dropout_p,
                        uint64_t seed, uint64_t offset, at::Tensor& out, at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_fwd", [&] {
    const auto p = make_problem<scalar_t>(dims, q, k, v, mask, scale, dropout_p, seed, offset);
    attention_fwd_kernel<scalar_t>(p, rows_of<scalar_t>(out), p.stat_rows(lse.data_ptr<float>()));
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
    BwdData<scalar_t> g{rows_of<scalar_t>(dout), p.stat_rows(lse.data_ptr<float>()),
                        p.stat_rows(delta.data_ptr<acc_t>()), rows_of<scalar_t>(dq),
                        rows_of<scalar_t>(dk), rows_of<scalar_t>(dv), rows_of<scalar_t>(out)};
    attention_bwd_kernel<scalar_t>(p, g);
  });
}

void attention_varlen_fwd_impl(const Varlen& lens, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, bool causal, double scale, double dropout_p,
                               uint64_t seed, uint64_t offset, at::Tensor& out, at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_varlen_fwd", [&] {
    const auto p = make_varlen_problem<scalar_t>(lens, q, k, v, causal, scale, dropout_p, seed, offset);
    attention_fwd_kernel<scalar_t>(p, packed_rows_of<scalar_t>(out, lens.cu_q),
                                   p.stat_rows(lse.data_ptr<float>()));
  });
}

void attention_varlen_bwd_impl(const Varlen& lens, const at::Tensor& dout, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse, bool causal, double scale, double dropout_p,
                               uint64_t seed, uint64_t offset, at::Tensor& delta, at::Tensor& dq,
                               at::Tensor& dk, at::Tensor& dv) {
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "attention_varlen_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_varlen_problem<scalar_t>(lens, q, k, v, causal, scale, dropout_p, seed, offset);
    BwdData<scalar_t> g{packed_rows_of<scalar_t>(dout, lens.cu_q), p.stat_rows(lse.data_ptr<float>()),
                        p.stat_rows(delta.data_ptr<acc_t>()), packed_rows_of<scalar_t>(dq, lens.cu_q),
                        packed_rows_of<scalar_t>(dk, lens.cu_k), packed_rows_of<scalar_t>(dv, lens.cu_k),
                        packed_rows_of<scalar_t>(out, lens.cu_q)};
    attention_bwd_kernel<scalar_t>(p, g);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
