// add_layer_norm on CUDA: the glue (checks, allocation, launches) around the kernels of
// add_layer_norm.cu. Schema, outputs, dtypes and empty-tensor conventions as
// csrc/cpu/add_layer_norm.cpp: y, h in x's dtype, mean / rstd (N,) fp32; backward returns
// (dx, dresidual, dweight, dbias) with dresidual empty unless it differs from dx (a residual and
// dropout_p > 0).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "glue.h"
#include "launchers.h"
#include "../checks/add_layer_norm.h"

namespace fastformer {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, double dropout_p, const at::Tensor& philox, bool rms_norm) {
  constexpr const char* op = "add_layer_norm_fwd";
  const bool has_res =
      checks::check_add_layer_norm_fwd(kFfBackend, op, x, residual, weight, bias, eps, dropout_p);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, x, dropout_p);
  c10::DeviceGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1);
  at::Tensor y = at::empty_like(x), h = at::empty_like(x);
  at::Tensor mean = at::empty({N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({N}, x.options().dtype(at::kFloat));
  if (N == 0 || C == 0) return {y, h, mean, rstd};
  FF_CHECK_LAUNCH(launch_add_layer_norm_fwd(
      x.const_data_ptr(), has_res ? residual->const_data_ptr() : nullptr, weight.const_data_ptr(),
      bias.const_data_ptr(), y.data_ptr(), h.data_ptr(), mean.data_ptr<float>(),
      rstd.data_ptr<float>(), N, C, ff_dtype_code(x, "x", op), eps, dropout_p, rng.seed,
      rng.offset, rng.ptr, ff_stream(x), rms_norm));
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_cuda(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool rms_norm) {
  constexpr const char* op = "add_layer_norm_bwd";
  const bool has_dh =
      checks::check_add_layer_norm_bwd(kFfBackend, op, dy, dh, h, weight, mean, rstd, dropout_p);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, h, dropout_p);
  c10::DeviceGuard guard(h.device());
  const int64_t N = h.size(0), C = h.size(1);
  // dresidual = dh_total differs from dx only under dropout; otherwise it is returned empty
  const bool separate_dres = has_residual && dropout_p > 0.0;
  at::Tensor dx = at::empty_like(h);
  at::Tensor dres = separate_dres ? at::empty_like(h) : at::empty({0}, h.options());
  at::Tensor dweight = at::empty_like(weight), dbias = at::empty_like(weight);
  if (N == 0 || C == 0) {
    dweight.zero_();
    dbias.zero_();
    return {dx, dres, dweight, dbias};
  }
  const int64_t parts = add_layer_norm_bwd_parts(N, C);
  at::Tensor partial = at::empty({parts, 2, C}, h.options().dtype(at::kFloat));
  FF_CHECK_LAUNCH(launch_add_layer_norm_bwd(
      dy.const_data_ptr(), has_dh ? dh->const_data_ptr() : nullptr, h.const_data_ptr(),
      weight.const_data_ptr(), mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
      dx.data_ptr(), separate_dres ? dres.data_ptr() : nullptr, dweight.data_ptr(),
      dbias.data_ptr(), partial.data_ptr<float>(), parts, N, C, ff_dtype_code(h, "h", op),
      dropout_p, rng.seed, rng.offset, rng.ptr, ff_stream(h), rms_norm));
  return {dx, dres, dweight, dbias};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("add_layer_norm_fwd", &fastformer::add_layer_norm_fwd_cuda);
  m.impl("add_layer_norm_bwd", &fastformer::add_layer_norm_bwd_cuda);
}
