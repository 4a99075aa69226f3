// Grouped-query attention's dK / dV, shared by the CPU and CUDA glue of attention and
// attention_varlen: k / v with H_kv heads dividing q's H (dimension 1 of either op's layout), query
// head h reading k/v head h / (H / H_kv). The kernels write one gradient per query head into
// kv_grad_per_query_head's buffer (k's shape with H heads), and sum_kv_groups folds each group of
// H / H_kv heads into the k/v head's gradient, in the math type: deterministic, no atomics
// (FlashAttention-2's way). Calls without groups never get here.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cstdint>
#include <vector>

namespace fastformer {

inline at::Tensor kv_grad_per_query_head(const at::Tensor& k, int64_t H) {
  std::vector<int64_t> sizes = k.sizes().vec();
  sizes[1] = H;
  return at::empty(sizes, k.options());
}

inline void sum_kv_groups(const at::Tensor& per_query_head, at::Tensor& grad) {
  std::vector<int64_t> sizes = grad.sizes().vec();  // (.., H_kv, G, ..)
  sizes.insert(sizes.begin() + 2, per_query_head.size(1) / grad.size(1));
  const at::Tensor groups = per_query_head.view(sizes);
  const at::ScalarType acc = at::toOpMathType(grad.scalar_type());
  if (acc != grad.scalar_type()) {  // 16-bit: fp32 sums, rounded once
    grad.copy_(at::sum(groups, {2}, false, acc));
  } else {
    at::sum_out(grad, groups, {2});
  }
}

}  // namespace fastformer
