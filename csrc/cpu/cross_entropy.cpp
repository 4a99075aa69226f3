// cross_entropy_fwd on CPU: the target scan the cross-entropy ops share, the loss reduction
// (summed in a fixed order: deterministic) and the op registration, compiled once; the row kernel is
// cross_entropy_kernel.cpp, run at the ISA level isa.h chose.
#include "cross_entropy.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "large_buffers.h"
#include "../checks/cross_entropy.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

namespace fastformer {

int64_t count_valid_targets(const char* what, const at::Tensor& target, int64_t num_classes,
                            int64_t ignore_index) {
  const int64_t n = target.size(0);
  const int64_t* t = target.const_data_ptr<int64_t>();
  int64_t num_valid = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore_index) continue;
    TORCH_CHECK(t[i] >= 0 && t[i] < num_classes, what, ": target[", i, "] = ", t[i],
                " is out of range: class indices must be in [0, ", num_classes,
                ") or equal ignore_index = ", ignore_index);
    ++num_valid;
  }
  return num_valid;
}

double mean_divisor(const at::Tensor& target, const at::Tensor& class_weight, int64_t ignore_index,
                    int64_t num_valid) {
  if (!class_weight.defined()) return static_cast<double>(num_valid);
  const int64_t n = target.size(0);
  const int64_t* t = target.const_data_ptr<int64_t>();
  double total = 0.0;
  AT_DISPATCH_FLOATING_TYPES(class_weight.scalar_type(), "mean_divisor", [&] {
    const scalar_t* w = class_weight.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (t[i] != ignore_index) total += static_cast<double>(w[t[i]]);
    }
  });
  return total;
}

double mean_grad_scale(double divisor, int64_t num_valid) {
  if (num_valid == 0) return 0.0;
  return divisor == 0.0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / divisor;
}

at::Tensor reduce_loss_rows(const double* loss_rows, int64_t n, double divisor, int64_t reduction,
                            at::ScalarType dtype) {
  if (reduction == 0) {
    at::Tensor rows = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
    std::copy(loss_rows, loss_rows + n, rows.data_ptr<double>());
    return rows.to(dtype);
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += loss_rows[i];  // fixed order: deterministic
  if (reduction == 1) total = divisor == 0.0 ? std::numeric_limits<double>::quiet_NaN() : total / divisor;
  return at::scalar_tensor(total, at::TensorOptions().dtype(dtype));
}

// logits (N, V), target (N,), class_weight (V,) or none -> loss (() or (N,)), grad (N, V) for an
// upstream gradient of 1 (empty unless compute_grad).
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_cpu(const at::Tensor& logits,
                                                         const at::Tensor& target,
                                                         double label_smoothing, int64_t ignore_index,
                                                         int64_t reduction, bool compute_grad,
                                                         const std::optional<at::Tensor>& class_weight) {
  constexpr const char* what = "cross_entropy_fwd";
  const at::Tensor cw = checks::check_cross_entropy_fwd(checks::kCpu, what, logits, target, label_smoothing,
                                                        reduction, class_weight);
  const int64_t n = logits.size(0), V = logits.size(1);
  if (target.is_floating_point()) {  // class probabilities: every row counts 1 in the mean (torch's)
    at::Tensor grad = compute_grad ? empty_large_like(logits) : at::empty({0}, logits.options());
    RowScale rs;
    rs.scale = reduction == 1 ? mean_grad_scale(static_cast<double>(n), n) : 1.0;
    std::vector<double> loss_rows(n);
    FF_ISA(soft_cross_entropy_rows)(logits, cw, target, label_smoothing, rs, compute_grad ? grad : at::Tensor(),
                                    loss_rows.data());
    return {reduce_loss_rows(loss_rows.data(), n, static_cast<double>(n), reduction, logits.scalar_type()), grad};
  }
  const int64_t num_valid = count_valid_targets(what, target, V, ignore_index);
  const double divisor = mean_divisor(target, cw, ignore_index, num_valid);

  at::Tensor grad = compute_grad ? empty_large_like(logits)  // (N, V): pooled, see large_buffers.h
                                 : at::empty({0}, logits.options());
  RowScale rs;
  rs.scale = reduction == 1 ? mean_grad_scale(divisor, num_valid) : 1.0;
  std::vector<double> loss_rows(n);
  FF_ISA(cross_entropy_rows)(logits, at::Tensor(), cw, target.const_data_ptr<int64_t>(), label_smoothing,
                             ignore_index, rs, compute_grad ? grad : at::Tensor(), loss_rows.data(),
                             at::Tensor());
  return {reduce_loss_rows(loss_rows.data(), n, divisor, reduction, logits.scalar_type()), grad};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("cross_entropy_fwd", &fastformer::cross_entropy_fwd_cpu);
}
