// cross_entropy_fwd on CPU: the argument checks the cross-entropy ops share, the loss reduction
// (summed in a fixed order: deterministic) and the op registration, compiled once; the row kernel is
// cross_entropy_kernel.cpp, run at the ISA level isa.h chose.
#include "cross_entropy.h"

#include <torch/library.h>

#include "large_buffers.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace fastformer {

void check_reduction(const char* what, int64_t reduction) {
  TORCH_CHECK(reduction >= 0 && reduction <= 2, what,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
}

void check_label_smoothing(const char* what, double label_smoothing) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, what,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
}

void check_float_input(const char* what, const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK(t.defined(), what, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), what, ": ", name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == ndim, what, ": ", name, " must have ", ndim, " dimensions, got shape ",
              t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, what, ": ", name,
              " must be float32, float64 or bfloat16, got ", dt);
  TORCH_CHECK(t.is_contiguous(), what, ": ", name, " must be contiguous");
}

int64_t check_target(const char* what, const at::Tensor& target, int64_t n, int64_t num_classes,
                     int64_t ignore_index) {
  TORCH_CHECK(target.defined(), what, ": target is an undefined tensor");
  TORCH_CHECK(target.device().is_cpu(), what, ": target must be a CPU tensor, got device ",
              target.device());
  TORCH_CHECK(target.scalar_type() == at::kLong, what, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == n, what, ": target must have shape (", n,
              ",), one class index per row, got shape ", target.sizes());
  TORCH_CHECK(target.is_contiguous(), what, ": target must be contiguous");
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

at::Tensor reduce_loss_rows(const double* loss_rows, int64_t n, int64_t num_valid, int64_t reduction,
                            at::ScalarType dtype) {
  if (reduction == 0) {
    at::Tensor rows = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
    std::copy(loss_rows, loss_rows + n, rows.data_ptr<double>());
    return rows.to(dtype);
  }
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += loss_rows[i];  // fixed order: deterministic
  if (reduction == 1) total /= static_cast<double>(num_valid);  // 0 / 0 = nan, as torch
  return at::scalar_tensor(total, at::TensorOptions().dtype(dtype));
}

// logits (N, V), target (N,) -> loss (() or (N,)), grad (N, V) for an upstream gradient of 1
// (empty unless compute_grad).
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_cpu(const at::Tensor& logits,
                                                         const at::Tensor& target,
                                                         double label_smoothing, int64_t ignore_index,
                                                         int64_t reduction, bool compute_grad) {
  constexpr const char* what = "cross_entropy_fwd";
  check_float_input(what, "logits", logits, 2);
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, what, ": logits must have at least one class, got shape ", logits.sizes());
  check_reduction(what, reduction);
  check_label_smoothing(what, label_smoothing);
  const int64_t num_valid = check_target(what, target, n, V, ignore_index);

  at::Tensor grad = compute_grad ? empty_large_like(logits)  // (N, V): pooled, see large_buffers.h
                                 : at::empty({0}, logits.options());
  RowScale rs;
  rs.scale = reduction == 1 ? (num_valid > 0 ? 1.0 / static_cast<double>(num_valid) : 0.0) : 1.0;
  std::vector<double> loss_rows(n);
  FF_ISA(cross_entropy_rows)(logits, at::Tensor(), target.const_data_ptr<int64_t>(), label_smoothing,
                             ignore_index, rs, compute_grad ? grad : at::Tensor(), loss_rows.data(),
                             at::Tensor());
  return {reduce_loss_rows(loss_rows.data(), n, num_valid, reduction, logits.scalar_type()), grad};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("cross_entropy_fwd", &fastformer::cross_entropy_fwd_cpu);
}
