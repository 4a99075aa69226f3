// Fused label-smoothed cross-entropy on CUDA: the glue. The valid-row count, per-row losses (and
// the gradient, in the same kernel) and the deterministic reduction are three launches with no
// host synchronisation in between. Schema and returns as csrc/cpu/cross_entropy.cpp; target
// values are checked by the Python layer (the kernel never uses an out-of-range one as an
// address: its row's loss is nan).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "glue.h"
#include "launchers.h"

namespace fastformer {
namespace {

void check_logits(const char* op, const at::Tensor& t) {
  ff_check_tensor(t, "logits", op);
  TORCH_CHECK(t.dim() == 2, op, ": logits must have 2 dimensions, got shape ", t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": logits must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(t.is_contiguous(), op, ": logits must be contiguous");
  TORCH_CHECK(t.size(1) > 0, op, ": logits must have at least one class, got shape ", t.sizes());
}

void check_target(const char* op, const at::Tensor& target, const at::Tensor& logits) {
  ff_check_tensor(target, "target", op);
  TORCH_CHECK(target.device() == logits.device(), op, ": target must be on logits' device (",
              logits.device(), "), got ", target.device());
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target must have shape (",
              logits.size(0), ",), one class index per row, got shape ", target.sizes());
  TORCH_CHECK(target.is_contiguous(), op, ": target must be contiguous");
}

}  // namespace

// logits (N, V), target (N,) -> loss (() or (N,)), grad (N, V) for an upstream gradient of 1
// (empty unless compute_grad).
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_cuda(const at::Tensor& logits,
                                                          const at::Tensor& target,
                                                          double label_smoothing,
                                                          int64_t ignore_index, int64_t reduction,
                                                          bool compute_grad) {
  constexpr const char* op = "cross_entropy_fwd";
  check_logits(op, logits);
  check_target(op, target, logits);
  TORCH_CHECK(reduction >= 0 && reduction <= 2, op,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
  c10::DeviceGuard guard(logits.device());
  const int64_t n = logits.size(0), V = logits.size(1);
  void* stream = ff_stream(logits);

  at::Tensor count = at::empty({}, target.options());  // () int64: rows not ignored
  FF_CHECK_LAUNCH(launch_cross_entropy_count_valid(target.const_data_ptr<int64_t>(), n, ignore_index,
                                                   count.data_ptr<int64_t>(), stream));
  const int64_t* mean_count = reduction == 1 ? count.const_data_ptr<int64_t>() : nullptr;
  at::Tensor loss_rows = at::empty({n}, logits.options().dtype(at::kFloat));  // (N,)
  at::Tensor grad = compute_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  const int code = ff_dtype_code(logits, "logits", op);
  FF_CHECK_LAUNCH(launch_cross_entropy_fwd(
      logits.const_data_ptr(), target.const_data_ptr<int64_t>(),
      compute_grad ? grad.data_ptr() : nullptr, loss_rows.data_ptr<float>(), n, V, code,
      label_smoothing, ignore_index, nullptr, mean_count, 1.0, stream));
  if (reduction == 0) return {loss_rows.to(logits.scalar_type()), grad};
  at::Tensor loss = at::empty({}, logits.options());
  FF_CHECK_LAUNCH(launch_cross_entropy_reduce(loss_rows.const_data_ptr<float>(), n, mean_count,
                                              loss.data_ptr(), code, stream));
  return {loss, grad};
}

}  // namespace fastformer

FF_CUDA_IMPL(m) { m.impl("cross_entropy_fwd", &fastformer::cross_entropy_fwd_cuda); }
