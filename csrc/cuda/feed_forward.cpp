// The feed-forward block linear(dropout(act(linear(x, w1, b1))), w2, b2) on CUDA: the glue.
//   forward:  pre = x w1^T (ATen GEMM), then ONE kernel adds b1 in place and writes
//             a = dropout(act(pre)), then out = a w2^T + b2 (ATen). relu without dropout (and
//             with b1): a = relu(x w1^T + b1) in one at::_addmm_activation (cuBLASLt's bias + relu
//             epilogue), saved in pre's place. gelu stays out of it: cuBLASLt's is the tanh form.
//   backward: da = dout w2 (ATen), then ONE kernel regenerates the mask and writes a (dw2 needs
//             it) and dpre over da, summing db1's per-part column sums of dpre on the way (a
//             small second kernel adds the parts in order); db2 is the two-stage column sum of
//             dout (deterministic, no atomics); dw2 = dout^T a, dw1 = dpre^T x, dx = dpre w1.
// Schema, saved tensor (pre) and return conventions as csrc/cpu/feed_forward.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "glue.h"
#include "launchers.h"
#include "../checks/feed_forward.h"

namespace fastformer {
namespace {

// The column sums of t (rows, cols) in t's dtype, through the deterministic two-stage kernel
// (fp32 sums, rounded once to the dtype by its second stage: no cast launch).
at::Tensor column_sums(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  const auto f32 = t.options().dtype(at::kFloat);
  const int64_t parts = colsum_num_parts(rows);
  const int code = ff_dtype_code(t, "dout");
  at::Tensor partial = at::empty({rows > 0 ? parts : 0, cols}, f32);  // (parts, cols)
  at::Tensor out = at::empty({cols}, t.options());
  FF_CHECK_LAUNCH(launch_colsum(t.const_data_ptr(), rows, cols, code, partial.data_ptr<float>(),
                                rows > 0 ? parts : 0, out.data_ptr(), code, 0, ff_stream(t)));
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> feed_forward_fwd_cuda(
    const at::Tensor& x, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
    const at::Tensor& w2, const c10::optional<at::Tensor>& b2, c10::string_view activation,
    double dropout_p, const at::Tensor& philox, const c10::optional<at::Tensor>& w3,
    const c10::optional<at::Tensor>& b3) {
  constexpr const char* op = "feed_forward_fwd";
  const int act = static_cast<int>(checks::check_feed_forward_fwd(kFfBackend, op, x, w1, b1, w2, b2, activation,
                                                                  dropout_p, w3, b3));
  const int64_t N = x.size(0), F = w1.size(0);
  const bool has_b1 = b1.has_value() && b1->defined(), has_b2 = b2.has_value() && b2->defined();
  const FfPhiloxArgs rng = ff_philox_args(philox, op, x, dropout_p);
  c10::DeviceGuard guard(x.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // the GEMMs are internal steps

  if (checks::feed_forward_detail::present(w3)) {
    // [g | u] = x [w1; w3]^T (N, 2F): one GEMM on the concatenated weights (a copy of 2FE
    // elements); the kernel adds b1 / b3 in place and writes h (N, F)
    const bool has_b3 = checks::feed_forward_detail::present(b3);
    at::Tensor pre = at::mm(x, at::cat({w1, *w3}).t()).contiguous();  // (N, 2F)
    at::Tensor h = at::empty({N, F}, x.options());
    FF_CHECK_LAUNCH(launch_feed_forward_glu_fwd(
        pre.data_ptr(), has_b1 ? b1->const_data_ptr() : nullptr, has_b3 ? b3->const_data_ptr() : nullptr,
        h.data_ptr(), N, F, ff_dtype_code(x, "x", op), act, dropout_p, rng.seed, rng.offset, rng.ptr,
        ff_stream(x)));
    at::Tensor out = has_b2 ? at::addmm(*b2, h, w2.t()) : at::mm(h, w2.t());  // (N, E)
    return {out, pre};
  }

  if (act == static_cast<int>(Activation::kRelu) && dropout_p == 0.0 && has_b1) {
    // b1 and relu in the GEMM's epilogue (cuBLASLt, through ATen). The saved tensor is then
    // relu(pre) instead of pre: the backward kernel reads the same relu mask (a > 0 iff pre > 0)
    // and relu(a) = a, so it computes what it computes from pre.
    at::Tensor a = at::_addmm_activation(*b1, x, w1.t(), 1, 1, /*use_gelu=*/false);  // (N, F)
    at::Tensor out = has_b2 ? at::addmm(*b2, a, w2.t()) : at::mm(a, w2.t());          // (N, E)
    return {out, a.contiguous()};
  }
  at::Tensor pre = at::mm(x, w1.t()).contiguous();  // (N, F), b1 added by the kernel
  at::Tensor a = at::empty_like(pre);               // (N, F)
  FF_CHECK_LAUNCH(launch_feed_forward_act_fwd(pre.data_ptr(), has_b1 ? b1->const_data_ptr() : nullptr,
                                              a.data_ptr(), N, F, ff_dtype_code(x, "x", op), act,
                                              dropout_p, rng.seed, rng.offset, rng.ptr, ff_stream(x)));
  at::Tensor out = has_b2 ? at::addmm(*b2, a, w2.t()) : at::mm(a, w2.t());  // (N, E)
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& pre, bool has_b1, bool has_b2, c10::string_view activation, double dropout_p,
    const at::Tensor& philox, const c10::optional<at::Tensor>& w3, bool has_b3) {
  constexpr const char* op = "feed_forward_bwd";
  const int act = static_cast<int>(checks::check_feed_forward_bwd(kFfBackend, op, dout, x, w1, w2,
                                                                  pre, activation, dropout_p, w3, has_b3));
  const int64_t N = x.size(0), F = w1.size(0);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, x, dropout_p);
  c10::DeviceGuard guard(x.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;

  if (checks::feed_forward_detail::present(w3)) {
    // dh = dout w2 (N, F); one kernel writes [dg | du] (N, 2F) and h; [db1; db3] is the two-stage
    // column sum of [dg | du] (deterministic); [dw1; dw3] and dx one GEMM each
    at::Tensor dh = at::mm(dout, w2).contiguous();  // (N, F)
    at::Tensor dpre = at::empty({N, 2 * F}, x.options());
    at::Tensor h = at::empty({N, F}, x.options());
    FF_CHECK_LAUNCH(launch_feed_forward_glu_bwd(pre.const_data_ptr(), dh.const_data_ptr(), dpre.data_ptr(),
                                                h.data_ptr(), N, F, ff_dtype_code(x, "x", op), act, dropout_p,
                                                rng.seed, rng.offset, rng.ptr, ff_stream(x)));
    dh.reset();
    at::Tensor db13 = has_b1 || has_b3 ? column_sums(dpre) : at::empty({0}, w1.options());  // (2F,)
    at::Tensor db2 = has_b2 ? column_sums(dout) : at::empty({0}, w2.options());            // (E,)
    at::Tensor dw2 = at::mm(dout.t(), h);  // (E, F)
    h.reset();
    at::Tensor dw13 = at::mm(dpre.t(), x);                 // (2F, E): [dw1; dw3]
    at::Tensor dx = at::mm(dpre, at::cat({w1, *w3}));      // (N, E)
    return {dx, dw13, db13, dw2, db2};
  }

  at::Tensor dpre = at::mm(dout, w2).contiguous();  // (N, F): da, then dpre
  at::Tensor a = at::empty_like(pre);               // (N, F)
  const auto f32 = x.options().dtype(at::kFloat);
  const int64_t parts = colsum_num_parts(N);
  at::Tensor db1_partial = at::empty({has_b1 && N > 0 ? parts : 0, F}, f32);  // (parts, F)
  // (F,) in the dtype, written by the kernel's second stage (fp32 sums rounded once)
  at::Tensor db1 = has_b1 ? at::empty({F}, x.options()) : at::empty({0}, w1.options());
  FF_CHECK_LAUNCH(launch_feed_forward_act_bwd(
      pre.const_data_ptr(), dpre.data_ptr(), a.data_ptr(), db1_partial.data_ptr<float>(), parts,
      has_b1 ? db1.data_ptr() : nullptr, N, F, ff_dtype_code(x, "x", op), act,
      dropout_p, rng.seed, rng.offset, rng.ptr, ff_stream(x)));
  at::Tensor db2 = has_b2 ? column_sums(dout) : at::empty({0}, w2.options());             // (E,)
  at::Tensor dw2 = at::mm(dout.t(), a);  // (E, F)
  a.reset();
  at::Tensor dw1 = at::mm(dpre.t(), x);  // (F, E)
  at::Tensor dx = at::mm(dpre, w1);      // (N, E)
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("feed_forward_fwd", &fastformer::feed_forward_fwd_cuda);
  m.impl("feed_forward_bwd", &fastformer::feed_forward_bwd_cuda);
}
