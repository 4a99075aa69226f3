// Fused label-smoothed cross-entropy on CUDA: the glue. The valid-row count, per-row losses (and
// the gradient, in the same kernel) and the deterministic reduction are three launches with no
// host synchronisation in between. Schema and returns as csrc/cpu/cross_entropy.cpp; target
// values are checked by the Python layer (the kernel never uses an out-of-range one as an
// address: its row's loss is nan).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cross_entropy_loss.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/cross_entropy.h"

namespace fastformer {

// logits (N, V), target (N,), class_weight (V,) or None -> loss (() or (N,)), grad (N, V) for an
// upstream gradient of 1 (empty unless compute_grad).
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_cuda(const at::Tensor& logits,
                                                          const at::Tensor& target,
                                                          double label_smoothing,
                                                          int64_t ignore_index, int64_t reduction,
                                                          bool compute_grad,
                                                          const std::optional<at::Tensor>& class_weight) {
  constexpr const char* op = "cross_entropy_fwd";
  const at::Tensor cw =
      checks::check_cross_entropy_fwd(kFfBackend, op, logits, target, label_smoothing, reduction, class_weight);
  c10::DeviceGuard guard(logits.device());
  const int64_t n = logits.size(0), V = logits.size(1);
  void* stream = ff_stream(logits);
  if (target.is_floating_point()) {  // class probabilities: every row counts 1 in the mean (torch's)
    // the mean's 1 / n is known here: the rows are scaled by it and summed (no count kernel)
    const double mean_scale = n > 0 ? 1.0 / static_cast<double>(n) : 0.0;
    const FfCrossEntropyLoss rows(target, n, ignore_index, 2, logits, stream);
    at::Tensor grad = compute_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
    const int code = ff_dtype_code(logits, "logits", op);
    FF_CHECK_LAUNCH(launch_soft_cross_entropy_fwd(
        logits.const_data_ptr(), target.const_data_ptr<float>(), compute_grad ? grad.data_ptr() : nullptr,
        rows.loss_rows.data_ptr<float>(), n, V, code, label_smoothing, reduction == 1 ? mean_scale : 1.0,
        reduction == 1 ? mean_scale : 1.0, cw.defined() ? cw.const_data_ptr<float>() : nullptr, nullptr,
        stream));
    at::Tensor loss = rows.reduce(reduction == 0 ? 0 : 2, logits, code, stream);
    if (reduction == 1 && n == 0) loss.fill_(NAN);  // 0 / 0, as torch
    return {loss, grad};
  }

  const FfCrossEntropyLoss loss(target, n, ignore_index, reduction, logits, stream, cw);
  at::Tensor grad = compute_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  const int code = ff_dtype_code(logits, "logits", op);
  FF_CHECK_LAUNCH(launch_cross_entropy_fwd(
      logits.const_data_ptr(), target.const_data_ptr<int64_t>(),
      compute_grad ? grad.data_ptr() : nullptr, loss.loss_rows.data_ptr<float>(), n, V, code,
      label_smoothing, ignore_index, nullptr, loss.mean_count, 1.0, loss.class_weight, loss.weight_stats,
      stream));
  return {loss.reduce(reduction, logits, code, stream), grad};
}

}  // namespace fastformer

FF_CUDA_IMPL(m) { m.impl("cross_entropy_fwd", &fastformer::cross_entropy_fwd_cuda); }
