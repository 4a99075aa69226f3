// cross_entropy(hidden @ weight^T + bias) on CUDA without the (N, V) logits: rows are taken in
// chunks; per chunk one ATen GEMM makes logits = hidden_chunk weight^T + bias, the cross-entropy
// row kernel (csrc/cuda/cross_entropy.cu) writes the chunk's loss rows and, in place, dlogits;
// then dhidden_chunk = dlogits weight, dweight += dlogits^T hidden_chunk (ATen) and dbias +=
// the deterministic column sums of dlogits. 16-bit inputs accumulate dweight and dbias in fp32
// and cast at the end. Schema, returns and chunking as csrc/cpu/linear_cross_entropy.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "glue.h"
#include "launchers.h"
#include "../checks/cross_entropy.h"

namespace fastformer {
namespace {

using Grads = checks::LinearCrossEntropyGrads;

// The chunk loop shared by the forward (loss rows; grads for mean / sum scaled by mean_count or
// 1) and the backward of reduction none (grads with row_scale = grad_loss).
Grads chunks(const at::Tensor& hidden, const at::Tensor& weight,
             const c10::optional<at::Tensor>& bias, const at::Tensor& target,
             double label_smoothing, int64_t ignore_index, const float* row_scale,
             const int64_t* mean_count, bool compute_grad, float* loss_rows) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // the GEMMs are internal steps
  const int64_t n = hidden.size(0), D = hidden.size(1), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = hidden.scalar_type();
  const bool lowp = dtype != at::kFloat;
  const auto f32 = hidden.options().dtype(at::kFloat);
  const int64_t rows_per_chunk = checks::linear_cross_entropy_chunk_rows(n, V, hidden.element_size());
  const int code = ff_dtype_code(hidden, "hidden");
  void* stream = ff_stream(hidden);

  Grads out;
  at::Tensor dweight_acc, dweight_part, dbias_acc, partial;
  if (compute_grad) {
    out.dhidden = at::empty({n, D}, hidden.options());
    dweight_acc = at::zeros({V, D}, f32);
    if (lowp) dweight_part = at::empty({V, D}, weight.options());
    if (has_bias) {
      dbias_acc = at::zeros({V}, f32);
      partial = at::empty({colsum_num_parts(rows_per_chunk), V}, f32);  // (parts, V)
    }
  }
  at::Tensor buffer = at::empty({rows_per_chunk, V}, hidden.options());  // (C, V) logits, then dlogits
  const at::Tensor weight_t = weight.t();                                  // (D, V) view

  for (int64_t c0 = 0; c0 < n; c0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, n - c0);
    const at::Tensor h = hidden.narrow(0, c0, rows);  // (rows, D)
    at::Tensor logits = buffer.narrow(0, 0, rows);     // (rows, V)
    if (has_bias) {
      at::addmm_out(logits, *bias, h, weight_t);
    } else {
      at::mm_out(logits, h, weight_t);
    }
    FF_CHECK_LAUNCH(launch_cross_entropy_fwd(
        logits.const_data_ptr(), target.const_data_ptr<int64_t>() + c0,
        compute_grad ? logits.data_ptr() : nullptr, loss_rows + c0, rows, V, code, label_smoothing,
        ignore_index, row_scale != nullptr ? row_scale + c0 : nullptr, mean_count, 1.0, stream));
    if (!compute_grad) continue;
    // logits now holds dlogits (rows, V).
    at::Tensor dh = out.dhidden.narrow(0, c0, rows);
    at::mm_out(dh, logits, weight);  // (rows, V) @ (V, D)
    if (lowp) {
      at::mm_out(dweight_part, logits.t(), h);  // (V, rows) @ (rows, D) in 16 bits, then into fp32
      dweight_acc.add_(dweight_part);
    } else {
      dweight_acc.addmm_(logits.t(), h);  // (V, rows) @ (rows, D)
    }
    if (has_bias) {
      FF_CHECK_LAUNCH(launch_colsum(logits.const_data_ptr(), rows, V, code, partial.data_ptr<float>(),
                                    colsum_num_parts(rows), dbias_acc.data_ptr<float>(), 1, stream));
    }
  }

  if (compute_grad) {
    out.dweight = lowp ? dweight_acc.to(dtype) : dweight_acc;
    out.dbias = has_bias ? dbias_acc.to(dtype) : at::empty({0}, weight.options());
  }
  return out;
}

// The ops stay in the unnamed namespace: only FF_CUDA_IMPL below names them.

// hidden (N, D), weight (V, D), bias (V,) or None, target (N,) -> loss (() or (N,)) and, with
// compute_grad (mean / sum), (dhidden, dweight, dbias) for an upstream gradient of 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, int64_t reduction,
    bool compute_grad) {
  constexpr const char* op = "linear_cross_entropy_fwd";
  checks::check_linear_cross_entropy(kFfBackend, op, hidden, weight, bias, target, label_smoothing);
  checks::check_linear_cross_entropy_fwd(op, reduction, compute_grad);
  c10::DeviceGuard guard(hidden.device());
  const int64_t n = hidden.size(0);
  void* stream = ff_stream(hidden);

  at::Tensor count = at::empty({}, target.options());  // () int64: rows not ignored
  FF_CHECK_LAUNCH(launch_cross_entropy_count_valid(target.const_data_ptr<int64_t>(), n, ignore_index,
                                                   count.data_ptr<int64_t>(), stream));
  const int64_t* mean_count = reduction == 1 ? count.const_data_ptr<int64_t>() : nullptr;
  at::Tensor loss_rows = at::empty({n}, hidden.options().dtype(at::kFloat));  // (N,)
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index, nullptr, mean_count,
                   compute_grad, loss_rows.data_ptr<float>());
  at::Tensor loss;
  if (reduction == 0) {
    loss = loss_rows.to(hidden.scalar_type());
  } else {
    loss = at::empty({}, hidden.options());
    FF_CHECK_LAUNCH(launch_cross_entropy_reduce(loss_rows.const_data_ptr<float>(), n, mean_count,
                                                loss.data_ptr(), ff_dtype_code(hidden, "hidden"), stream));
  }
  return checks::linear_cross_entropy_fwd_returns(loss, g, compute_grad, hidden, weight);
}

// The gradient for reduction none: row i's loss weighted by grad_loss[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& target, double label_smoothing,
    int64_t ignore_index) {
  constexpr const char* op = "linear_cross_entropy_bwd";
  checks::check_linear_cross_entropy(kFfBackend, op, hidden, weight, bias, target, label_smoothing);
  checks::check_grad_loss(kFfBackend, op, grad_loss, hidden);
  const int64_t n = hidden.size(0);
  c10::DeviceGuard guard(hidden.device());

  const at::Tensor row_scale = grad_loss.to(at::kFloat).contiguous();  // (N,)
  at::Tensor loss_rows = at::empty({n}, hidden.options().dtype(at::kFloat));  // (N,), unused
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index,
                   row_scale.const_data_ptr<float>(), nullptr, true, loss_rows.data_ptr<float>());
  return {g.dhidden, g.dweight, g.dbias};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("linear_cross_entropy_fwd", &fastformer::linear_cross_entropy_fwd_cuda);
  m.impl("linear_cross_entropy_bwd", &fastformer::linear_cross_entropy_bwd_cuda);
}
