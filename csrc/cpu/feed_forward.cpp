// feed_forward_fwd / feed_forward_bwd on CPU: the argument checks, the GEMMs (ATen's BLAS,
// oneDNN / MKL) and the op registration, compiled once; the pass between the GEMMs is
// feed_forward_kernel.cpp, run at the ISA level isa.h chose.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "feed_forward.h"
#include "large_buffers.h"
#include "../checks/feed_forward.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

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

// Whether fp32 products go to oneDNN's linear rather than ATen's BLAS (MKL's sgemm): not on an
// Intel CPU, where MKL is faster at the feed-forward's shapes (Xeon model 207, 2 threads, N 1558,
// E 256, F 1024: 2.5-3.0 ms a product against oneDNN's 3.1-4.4 ms), but elsewhere (AMD), where
// MKL's sgemm does not take its AVX-512 path and oneDNN is about twice as fast on an AVX-512 EPYC.
// (On an AVX2-only EPYC, Zen 3, the two take the same time within 10% at N 1536, best of 30.)
bool onednn_for_fp32() {
#if FF_ISA_X86 && defined(__GNUC__)
  static const bool use = [] {
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel");
  }();
  return use;
#else
  return true;
#endif
}

// The smallest fp32 product M * N * K that goes to oneDNN where onednn_for_fp32() says so: each
// oneDNN call costs a fixed ~10-15 us more than ATen's BLAS, which wins below it (AMD EPYC Zen 4, 1
// and 2 threads, medians of 3 x 200: oneDNN / addmm 4.1x at M N K 8 x 32 x 16, 1.8x at 32 x 256 x 64,
// 1.06x at 64 x 512 x 128 = 2^22; 0.77-0.94x at 64 x 1024 x 128 = 2^23, 0.6-0.96x above).
constexpr int64_t kOnednnMinMNK = int64_t{1} << 23;

// a (M, K) times b (N, K) transposed, plus bias (N,) when given: (M, N) in a's dtype; a and b may
// be transposed views. oneDNN's linear takes fp32 where onednn_for_fp32() says so and the product
// has at least kOnednnMinMNK multiply-adds, and bf16 with
// a bias where oneDNN supports bf16 on this CPU (fused, where at::addmm adds it in a second pass);
// bf16 without a bias reaches oneDNN through at::mm anyway, and fp64, empty products and a torch
// without oneDNN go to at::addmm / at::mm.
// The first GEMM's epilogue: what the caller lets matmul_nt leave out of the product (relu, the
// bias) and what it did leave out.
struct Epilogue {
  bool relu_allowed = false;  // oneDNN may apply relu
  bool bias_allowed = false;  // ATen's fp32 / fp64 BLAS may leave the bias to the caller's pass
  bool relu_done = false;
  bool bias_left = false;
};

// epi (when not nullptr): see Epilogue. ATen's addmm would copy the bias into the (M, N) output
// before the GEMM: a pass over it that the feed-forward's own pass after the GEMM does for free.
at::Tensor matmul_nt(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                     Epilogue* epi = nullptr) {
  const bool has_bias = bias.has_value() && bias->defined();
  const c10::OperatorHandle* op = onednn_linear();
  const auto dt = a.scalar_type();
  const bool bf16_ok = dt == at::kBFloat16 && has_bias && onednn_bf16_supported();
  const bool fp32_ok = dt == at::kFloat && onednn_for_fp32() &&
                       a.size(0) * b.size(0) * a.size(1) >= kOnednnMinMNK;
  if (op && (fp32_ok || bf16_ok) && a.numel() > 0 && b.numel() > 0) {
    const bool relu = epi && epi->relu_allowed;
    torch::jit::Stack stack{a, b, has_bias ? c10::IValue(*bias) : c10::IValue(),
                            c10::IValue(relu ? "relu" : "none"),
                            c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    op->callBoxed(stack);
    if (epi) epi->relu_done = relu;
    return stack.at(0).toTensor();
  }
  if (has_bias && epi && epi->bias_allowed && dt != at::kBFloat16) {
    epi->bias_left = true;
    return at::mm(a, b.t());
  }
  return has_bias ? at::addmm(*bias, a, b.t()) : at::mm(a, b.t());
}

// A weight gradient g^T inp, (g.size(1), inp.size(1)), summed over the N rows both share: one
// BLAS GEMM that reads g transposed in place, as torch's own Linear backward does. (oneDNN's linear
// wants its input contiguous: g^T, and for the wider side the product too, would be transposed
// copies, 1.3 ms apiece at N 2048 x E 256, about 20 ms of the base training step.)
at::Tensor weight_grad(const at::Tensor& g, const at::Tensor& inp) { return at::mm(g.t(), inp); }

// The gated form's up weights as one (2F, E) [w1; w3]: its two products are then one GEMM (N x 2F),
// each way. The copy is 2FE elements against the GEMM's 2NFE multiply-adds.
at::Tensor up_weights(const at::Tensor& w1, const at::Tensor& w3) { return at::cat({w1, w3}); }

// [b1; b3] (2F,), a zero half for the one not given; undefined without either.
at::Tensor up_bias(const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& b3,
                   const at::Tensor& w1) {
  const bool has_b1 = checks::feed_forward_detail::present(b1);
  const bool has_b3 = checks::feed_forward_detail::present(b3);
  if (!has_b1 && !has_b3) return at::Tensor();
  return at::cat({has_b1 ? *b1 : at::zeros({w1.size(0)}, w1.options()),
                  has_b3 ? *b3 : at::zeros({w1.size(0)}, w1.options())});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> feed_forward_fwd_cpu(
    const at::Tensor& x, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
    const at::Tensor& w2, const c10::optional<at::Tensor>& b2, c10::string_view activation,
    double dropout_p, const at::Tensor& philox, const c10::optional<at::Tensor>& w3,
    const c10::optional<at::Tensor>& b3) {
  constexpr const char* op = "feed_forward_fwd";
  const Activation act = checks::check_feed_forward_fwd(checks::kCpu, op, x, w1, b1, w2, b2, activation,
                                                        dropout_p, w3, b3);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);

  if (checks::feed_forward_detail::present(w3)) {
    // [g | u] = x [w1; w3]^T + [b1; b3] (N, 2F), kept for backward; then h (N, F) in one pass
    const at::Tensor bias = up_bias(b1, b3, w1);
    Epilogue epi{/*relu_allowed=*/false, /*bias_allowed=*/true};
    at::Tensor pre = matmul_nt(x, up_weights(w1, *w3), bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                               &epi).contiguous();
    at::Tensor h = empty_large({x.size(0), w1.size(0)}, x.options());
    FF_ISA(glu_dropout_fwd_kernel)(pre, epi.bias_left ? bias : at::Tensor(), h, act, dropout_p,
                                   static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
    return {matmul_nt(h, w2, b2), pre};  // (N, E), (N, 2F)
  }

  if (act == Activation::kRelu) {
    // a = dropout(relu(pre)) over pre in place, kept for backward (feed_forward_kernel.cpp);
    // relu in oneDNN's epilogue where it runs the GEMM, then only dropout is left (if any)
    Epilogue epi{/*relu_allowed=*/true, /*bias_allowed=*/true};
    at::Tensor a = matmul_nt(x, w1, b1, &epi).contiguous();  // (N, F)
    if (!epi.relu_done || dropout_p > 0.0) {
      FF_ISA(act_dropout_fwd_kernel)(a, epi.bias_left ? *b1 : at::Tensor(), a, act, dropout_p,
                                     static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
    }
    return {matmul_nt(a, w2, b2), a};  // (N, E), (N, F)
  }
  Epilogue epi{/*relu_allowed=*/false, /*bias_allowed=*/true};
  at::Tensor pre = matmul_nt(x, w1, b1, &epi).contiguous();  // (N, F)
  at::Tensor a = empty_large_like(pre);  // (N, F); pooled when large (large_buffers.h)
  FF_ISA(act_dropout_fwd_kernel)(pre, epi.bias_left ? *b1 : at::Tensor(), a, act, dropout_p,
                                 static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  at::Tensor out = matmul_nt(a, w2, b2);  // (N, E)
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& pre, bool has_b1, bool has_b2, c10::string_view activation, double dropout_p,
    const at::Tensor& philox, const c10::optional<at::Tensor>& w3, bool has_b3) {
  constexpr const char* op = "feed_forward_bwd";
  const Activation act = checks::check_feed_forward_bwd(checks::kCpu, op, dout, x, w1, w2, pre,
                                                        activation, dropout_p, w3, has_b3);
  const int64_t E = x.size(1), F = w1.size(0);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);

  if (checks::feed_forward_detail::present(w3)) {
    // dh = dout w2 (N, F); one pass writes [dg | du] (N, 2F), h for dw2 and the bias sums
    const at::Tensor dh = matmul_nt(dout, w2.t(), c10::nullopt).contiguous();
    at::Tensor dpre = empty_large_like(pre);                     // (N, 2F)
    at::Tensor h = empty_large_like(dh);                         // (N, F)
    at::Tensor db1 = has_b1 || has_b3 ? at::empty({2 * F}, x.options()) : at::empty({0}, w1.options());
    at::Tensor db2 = has_b2 ? at::empty({E}, x.options()) : at::empty({0}, w2.options());
    FF_ISA(glu_dropout_bwd_kernel)(pre, dh, dpre, dout, h, db1, db2, act, dropout_p,
                                   static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
    at::Tensor dw2 = weight_grad(dout, h);  // (E, F)
    h.reset();
    at::Tensor dw13 = weight_grad(dpre, x);  // (2F, E): [dw1; dw3]
    at::Tensor dx = matmul_nt(dpre, up_weights(w1, *w3).t(), c10::nullopt);  // (N, E)
    return {dx, dw13, db1, dw2, db2};
  }

  at::Tensor dpre = matmul_nt(dout, w2.t(), c10::nullopt).contiguous();  // (N, F): da, then dpre
  // relu: pre holds what forward kept, a itself; else a is recomputed, freed after dw2
  const bool relu = act == Activation::kRelu;
  at::Tensor a = relu ? at::Tensor() : empty_large_like(pre);  // (N, F)
  at::Tensor db1 = has_b1 ? at::empty({F}, x.options()) : at::empty({0}, w1.options());
  at::Tensor db2 = has_b2 ? at::empty({E}, x.options()) : at::empty({0}, w2.options());
  FF_ISA(act_dropout_bwd_kernel)(pre, dpre, dout, a, db1, db2, act, dropout_p,
                                 static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  at::Tensor dw2 = weight_grad(dout, relu ? pre : a);  // (E, F)
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
