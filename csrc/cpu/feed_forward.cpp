// The position-wise feed-forward block linear(dropout(act(linear(x, w1, b1))), w2, b2) for CPU.
//
// The GEMMs of forward and backward go to ATen's BLAS (oneDNN / MKL, see matmul_nt); everything
// between them is one vectorised parallel pass each way:
//   forward:  pre = x w1^T + b1 (bias in the GEMM), then ONE pass a = dropout(act(pre)),
//             then out = a w2^T + b2.
//   backward: da = dout w2, then ONE pass over (pre, da) that regenerates the dropout mask and
//             writes a = dropout(act(pre)) (dw2 needs it) and dpre = da * keep * scale * act'(pre)
//             over da in place, summing db1 (columns of dpre) and db2 (columns of dout) per block
//             of rows on the way; then dw2 = dout^T a, dw1 = dpre^T x, dx = dpre w1.
// Only pre (N, F) is kept between forward and backward.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "dropout_scales.h"
#include "philox.h"
#include "../philox_arg.h"
#include "vec_io.h"

namespace fastformer {
namespace {

enum class Activation { kRelu, kGelu };

Activation parse_activation(const std::string& name, const char* op) {
  TORCH_CHECK(name == "relu" || name == "gelu", op,
              ": activation must be \"relu\" or \"gelu\", got \"", name, "\"");
  return name == "relu" ? Activation::kRelu : Activation::kGelu;
}

template <typename A>
inline Vectorized<A> activate(const Vectorized<A>& p, Activation act) {
  using V = Vectorized<A>;
  if (act == Activation::kRelu) return at::vec::clamp_min(p, V(A(0)));
  // exact gelu: 0.5 p (1 + erf(p / sqrt(2)))
  const V half(A(0.5));
  return p * (half + half * (p * V(static_cast<A>(M_SQRT1_2))).erf());
}

// d act / d p. relu: 1 where p > 0 (F.relu's convention at 0); gelu: Phi(p) + p phi(p).
template <typename A>
inline Vectorized<A> activate_grad(const Vectorized<A>& p, Activation act) {
  using V = Vectorized<A>;
  if (act == Activation::kRelu) return V::blendv(V(A(0)), V(A(1)), p > V(A(0)));
  const V half(A(0.5));
  const V cdf = half + half * (p * V(static_cast<A>(M_SQRT1_2))).erf();
  const V pdf = (p * p * V(A(-0.5))).exp() * V(static_cast<A>(0.3989422804014327));  // 1/sqrt(2 pi)
  return at::vec::fmadd(p, pdf, cdf);
}

// oneDNN's linear, mkldnn::_linear_pointwise(X, W, B, "none", [], None) = X W^T + B, found at run
// time (nullptr when this torch lacks it or its schema differs, so nothing breaks without it).
const c10::OperatorHandle* onednn_linear() {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    if (!at::hasMKLDNN()) return std::nullopt;
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    const auto& args = handle->schema().arguments();
    if (args.size() != 6 || handle->schema().returns().size() != 1 || args[3].name() != "attr") {
      return std::nullopt;
    }
    return handle;
  }();
  return op ? &*op : nullptr;
}

// Whether oneDNN runs bf16 on this CPU (it needs AVX-512 or AVX2-VNNI-2; on an AVX2-only CPU its
// bf16 linear throws "could not create a primitive descriptor"). Asked once, of torch's own check.
bool onednn_bf16_supported() {
  static const bool supported = []() {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
    if (!handle) return false;
    torch::jit::Stack stack;
    handle->callBoxed(stack);
    return !stack.empty() && stack.at(0).isBool() && stack.at(0).toBool();
  }();
  return supported;
}

// a (M, K) times b (N, K) transposed, plus bias (N,) when given: (M, N) in a's dtype; a and b may
// be transposed views. oneDNN's linear takes fp32 (on CPUs where MKL's sgemm does not take its
// AVX-512 path, AMD's, it is about twice as fast) and bf16 with a bias where oneDNN supports bf16
// on this CPU (fused, where at::addmm adds it in a second pass); bf16 without a bias reaches oneDNN through at::mm anyway, and fp64, empty
// products and a torch without oneDNN go to at::addmm / at::mm.
at::Tensor matmul_nt(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const c10::OperatorHandle* op = onednn_linear();
  const auto dt = a.scalar_type();
  const bool bf16_ok = dt == at::kBFloat16 && has_bias && onednn_bf16_supported();
  if (op && (dt == at::kFloat || bf16_ok) && a.numel() > 0 && b.numel() > 0) {
    torch::jit::Stack stack{a, b, has_bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                            c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    op->callBoxed(stack);
    return stack.at(0).toTensor();
  }
  return has_bias ? at::addmm(*bias, a, b.t()) : at::mm(a, b.t());
}

// A weight gradient g^T inp, (g.size(1), inp.size(1)), summed over the N rows both share. Run with
// the shorter side as the product's rows (then transposed back), which oneDNN does fastest.
at::Tensor weight_grad(const at::Tensor& g, const at::Tensor& inp) {
  if (g.size(1) > inp.size(1)) return matmul_nt(inp.t(), g.t(), c10::nullopt).t().contiguous();
  return matmul_nt(g.t(), inp.t(), c10::nullopt);
}

void check_dropout(double dropout_p, const char* op) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
}

// A 2-D CPU contiguous tensor of the dtype of x with the given shape (-1: any size).
void check_matrix(const at::Tensor& t, const char* name, int64_t rows, int64_t cols,
                  const char* want, const at::Tensor& x, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && (rows < 0 || t.size(0) == rows) && (cols < 0 || t.size(1) == cols),
              op, ": ", name, " must have shape ", want, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have the dtype of x (",
              x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (N, E), got shape ", x.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, op,
              ": x must be float32, float64 or bfloat16, got ", dt);
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
}

void check_bias(const at::Tensor& b, const char* name, int64_t size, const char* want,
                const at::Tensor& x, const char* op) {
  TORCH_CHECK(b.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", b.device());
  TORCH_CHECK(b.dim() == 1 && b.size(0) == size, op, ": ", name, " must have shape (", size,
              ",) ", want, ", got ", b.sizes());
  TORCH_CHECK(b.scalar_type() == x.scalar_type(), op, ": ", name, " must have the dtype of x (",
              x.scalar_type(), "), got ", b.scalar_type());
  TORCH_CHECK(b.is_contiguous(), op, ": ", name, " must be contiguous");
}

// a = dropout(act(pre)) over the flat (N * F) element range, in chunks that may span rows: the
// dropout factors of element e are those of column e % F of row e / F.
template <typename T>
void act_dropout_fwd(const T* pre, T* a, int64_t N, int64_t F, Activation act, double dropout_p,
                     uint64_t seed, uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  constexpr int64_t kChunk = 2048;  // elements per dropout-factor buffer (8 KiB of fp32)
  const int64_t total = N * F;
  const bool drop = dropout_p > 0.0;
  const uint32_t threshold = dropout_threshold(dropout_p);
  const A scale = static_cast<A>(1.0 / (1.0 - dropout_p));
  at::parallel_for(0, total, 8 * kChunk, [&](int64_t begin, int64_t end) {
    std::unique_ptr<A[]> keep_buf(new A[drop ? kChunk : 0]);
    A* const keep = drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, threshold, scale);
    for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t len = std::min(kChunk, end - c0);
      for (int64_t e = c0; keep && e < c0 + len;) {  // the chunk's pieces of rows
        const int64_t row = e / F, col = e % F, n = std::min(F - col, c0 + len - e);
        dropout.fill(keep + (e - c0), col, n, dropout_row_counter(offset, row, F));
        e += n;
      }
      const T* const p = pre + c0;
      T* const out = a + c0;
      vec_loop<W>(len, [&](int64_t j, int64_t n) {
        V v = activate(load(p + j, n), act);
        if (keep) v = v * V::loadu(keep + j, n);
        store(out + j, v, n);
      });
    }
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
  if (db2_sum) {
    vec_loop<W>(E, [&](int64_t j, int64_t n) {
      (V::loadu(db2_sum + j, n) + load(gr + j, n)).store(db2_sum + j, n);
    });
  }
}

// The backward's one pass over rows (see act_dropout_bwd_row); db1 / db2 (nullptr: not wanted)
// are summed per block of rows, then the blocks' sums added in block order.
template <typename T>
void act_dropout_bwd(const T* pre, T* da_dpre, const T* dout, T* a, T* db1, T* db2, int64_t N,
                     int64_t F, int64_t E, Activation act, double dropout_p, uint64_t seed,
                     uint64_t offset) {
  using A = acc_t<T>;
  using V = AccVec<T>;
  constexpr int64_t W = V::size();
  const bool drop = dropout_p > 0.0;
  const uint32_t threshold = dropout_threshold(dropout_p);
  const A scale = static_cast<A>(1.0 / (1.0 - dropout_p));
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
  const int64_t nblocks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  const int64_t rows_per_block = (N + nblocks - 1) / nblocks;
  const int64_t F1 = db1 ? F : 0, E2 = db2 ? E : 0;
  std::unique_ptr<A[]> partial_buf(new A[nblocks * (F1 + E2)]());  // per block: db1 (F1), db2 (E2)
  A* const partial = partial_buf.get();
  at::parallel_for(0, nblocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::unique_ptr<A[]> keep_buf(new A[drop ? F : 0]);
    A* const keep = drop ? keep_buf.get() : nullptr;
    const DropoutScales<A> dropout(seed, threshold, scale);
    for (int64_t block = block_begin; block < block_end; ++block) {
      A* const db1_sum = F1 ? partial + block * (F1 + E2) : nullptr;
      A* const db2_sum = E2 ? partial + block * (F1 + E2) + F1 : nullptr;
      const int64_t row_end = std::min(N, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        if (keep) dropout.fill(keep, 0, F, dropout_row_counter(offset, row, F));
        act_dropout_bwd_row<T>(pre + row * F, da_dpre + row * F, a + row * F, keep, dout + row * E,
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

std::tuple<at::Tensor, at::Tensor> feed_forward_fwd_cpu(
    const at::Tensor& x, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
    const at::Tensor& w2, const c10::optional<at::Tensor>& b2, c10::string_view activation,
    double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "feed_forward_fwd";
  check_x(x, op);
  const int64_t N = x.size(0), E = x.size(1);
  check_matrix(w1, "w1", -1, E, "(F, E) with E = x.size(1)", x, op);
  const int64_t F = w1.size(0);
  check_matrix(w2, "w2", E, F, "(E, F), the transpose of w1's shape", x, op);
  const bool has_b1 = b1.has_value() && b1->defined(), has_b2 = b2.has_value() && b2->defined();
  if (has_b1) check_bias(*b1, "b1", F, "(F = w1.size(0))", x, op);
  if (has_b2) check_bias(*b2, "b2", E, "(E = x.size(1))", x, op);
  const Activation act = parse_activation(std::string(activation), op);
  check_dropout(dropout_p, op);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);

  at::Tensor pre = matmul_nt(x, w1, b1).contiguous();  // (N, F)
  at::Tensor a = at::empty_like(pre);                                         // (N, F)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "feed_forward_fwd", [&] {
    act_dropout_fwd<scalar_t>(pre.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), N, F, act,
                              dropout_p, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  });
  at::Tensor out = matmul_nt(a, w2, b2);  // (N, E)
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& pre, bool has_b1, bool has_b2, c10::string_view activation, double dropout_p,
    const at::Tensor& philox) {
  constexpr const char* op = "feed_forward_bwd";
  check_x(x, op);
  const int64_t N = x.size(0), E = x.size(1);
  check_matrix(dout, "dout", N, E, "(N, E), the shape of x", x, op);
  check_matrix(w1, "w1", -1, E, "(F, E) with E = x.size(1)", x, op);
  const int64_t F = w1.size(0);
  check_matrix(w2, "w2", E, F, "(E, F), the transpose of w1's shape", x, op);
  check_matrix(pre, "pre", N, F, "(N, F), the forward's pre-activation", x, op);
  const Activation act = parse_activation(std::string(activation), op);
  check_dropout(dropout_p, op);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);

  at::Tensor dpre = matmul_nt(dout, w2.t(), c10::nullopt).contiguous();  // (N, F): da, then dpre
  at::Tensor a = at::empty_like(pre);   // (N, F)
  at::Tensor db1 = has_b1 ? at::empty({F}, x.options()) : at::empty({0}, w1.options());
  at::Tensor db2 = has_b2 ? at::empty({E}, x.options()) : at::empty({0}, w2.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "feed_forward_bwd", [&] {
    act_dropout_bwd<scalar_t>(pre.data_ptr<scalar_t>(), dpre.data_ptr<scalar_t>(),
                              dout.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                              has_b1 ? db1.data_ptr<scalar_t>() : nullptr,
                              has_b2 ? db2.data_ptr<scalar_t>() : nullptr, N, F, E, act, dropout_p,
                              static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  });
  at::Tensor dw2 = weight_grad(dout, a);  // (E, F)
  a.reset();
  at::Tensor dw1 = weight_grad(dpre, x);  // (F, E)
  at::Tensor dx = matmul_nt(dpre, w1.t(), c10::nullopt);      // (N, E)
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("feed_forward_fwd", &fastformer::feed_forward_fwd_cpu);
  m.impl("feed_forward_bwd", &fastformer::feed_forward_bwd_cpu);
}
