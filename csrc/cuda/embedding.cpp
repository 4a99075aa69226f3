// embedding on CUDA: the glue (checks, the backward's stable sort of the keys, allocation,
// launches) around the kernels of embedding.cu. Schema, outputs and empty-tensor conventions as
// csrc/cpu/embedding.cpp. The ids' values are not read here (a device sync): the functional op
// (fastformer/ops/embedding.py) checks them.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "glue.h"
#include "launchers.h"
#include "../checks/embedding.h"

namespace fastformer {
namespace {

at::Tensor embedding_fwd_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& positional,
                              const std::optional<at::Tensor>& positions, double scale, double dropout_p,
                              const at::Tensor& philox) {
  constexpr const char* op = "embedding_fwd";
  const bool has_pos =
      checks::check_embedding_fwd(kFfBackend, op, input, weight, positional, positions, scale, dropout_p);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, weight, dropout_p);
  c10::DeviceGuard guard(weight.device());
  const int64_t N = input.size(0), D = weight.size(1);
  at::Tensor out = at::empty({N, D}, weight.options());
  if (N == 0 || D == 0) return out;
  FF_CHECK_LAUNCH(launch_embedding_fwd(
      input.const_data_ptr<int64_t>(), weight.const_data_ptr(),
      has_pos ? positions->const_data_ptr<int64_t>() : nullptr, has_pos ? positional->const_data_ptr() : nullptr,
      out.data_ptr(), N, D, ff_dtype_code(weight, "weight", op), scale, dropout_p, rng.seed, rng.offset, rng.ptr,
      ff_stream(weight)));
  return out;
}

// One table's gradient (K, D): zero-filled, then each key's row written once by its segment's warp.
at::Tensor table_grad(const char* op, const at::Tensor& grad, const at::Tensor& keys, int64_t K, int64_t skip_row,
                      double scale, double dropout_p, const FfPhiloxArgs& rng) {
  const int64_t N = grad.size(0), D = grad.size(1);
  at::Tensor table = at::zeros({K, D}, grad.options());
  if (N == 0 || D == 0 || K == 0) return table;
  const auto [sorted, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor ends = at::searchsorted(sorted, sorted, /*out_int32=*/false, /*right=*/true);
  FF_CHECK_LAUNCH(launch_embedding_bwd(
      grad.const_data_ptr(), sorted.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
      ends.const_data_ptr<int64_t>(), table.data_ptr(), N, D, skip_row, ff_dtype_code(grad, "grad", op), scale,
      dropout_p, rng.seed, rng.offset, rng.ptr, ff_stream(grad)));
  return table;
}

std::tuple<at::Tensor, at::Tensor> embedding_bwd_cuda(
    const at::Tensor& grad, const at::Tensor& input, const std::optional<at::Tensor>& positions,
    int64_t num_weights, int64_t num_positions, bool weight_grad, bool positional_grad, int64_t padding_idx,
    double scale, double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "embedding_bwd";
  checks::check_embedding_bwd(kFfBackend, op, grad, input, positions, num_weights, num_positions, positional_grad,
                              padding_idx, scale, dropout_p);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, grad, dropout_p);
  c10::DeviceGuard guard(grad.device());
  at::Tensor dweight = weight_grad ? table_grad(op, grad, input, num_weights, padding_idx, scale, dropout_p, rng)
                                   : at::empty({0}, grad.options());
  at::Tensor dpositional = positional_grad
      ? table_grad(op, grad, *positions, num_positions, -1, 1.0, dropout_p, rng)
      : at::empty({0}, grad.options());
  return {dweight, dpositional};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("embedding_fwd", &fastformer::embedding_fwd_cuda);
  m.impl("embedding_bwd", &fastformer::embedding_bwd_cuda);
}
