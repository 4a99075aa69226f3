// add_layer_norm on CUDA: the glue (checks, allocation, launches) around the kernels of
// add_layer_norm.cu. Schema, outputs, dtypes and empty-tensor conventions as
// csrc/cpu/add_layer_norm.cpp: y, h in x's dtype, mean / rstd (N,) fp32; backward returns
// (dx, dresidual, dweight, dbias) with dresidual empty unless it differs from dx (a residual and
// dropout_p > 0).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "glue.h"
#include "launchers.h"

namespace fastformer {
namespace {

void check_rows(const at::Tensor& x, const char* name, const char* op) {
  ff_check_tensor(x, name, op);
  TORCH_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D (N, C), got shape ", x.sizes());
  ff_dtype_code(x, name, op);
  TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name, const char* op) {
  ff_check_tensor(t, name, op);
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on the device of ", like_name,
              " (", like.device(), "), got ", t.device());
  TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have the shape of ", like_name, " ",
              like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have the dtype of ",
              like_name, " (", like.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_param(const at::Tensor& p, const char* name, const at::Tensor& x, const char* op) {
  ff_check_tensor(p, name, op);
  TORCH_CHECK(p.device() == x.device(), op, ": ", name, " must be on the device of x (", x.device(),
              "), got ", p.device());
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1), op, ": ", name, " must have shape (",
              x.size(1), ",) (C), got ", p.sizes());
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), op, ": ", name, " must have the dtype of x (",
              x.scalar_type(), "), got ", p.scalar_type());
  TORCH_CHECK(p.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_stat(const at::Tensor& s, const char* name, const at::Tensor& h, const char* op) {
  ff_check_tensor(s, name, op);
  TORCH_CHECK(s.device() == h.device(), op, ": ", name, " must be on the device of h (", h.device(),
              "), got ", s.device());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == h.size(0), op, ": ", name, " must have shape (",
              h.size(0), ",) (N), got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              s.scalar_type());
  TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "add_layer_norm_fwd";
  check_rows(x, "x", op);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) check_like(*residual, "residual", x, "x", op);
  check_param(weight, "weight", x, op);
  check_param(bias, "bias", x, op);
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), op, ": eps must be > 0 and finite, got ", eps);
  ff_check_dropout_p(dropout_p, op);
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
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
      rng.offset, ff_stream(x)));
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_cuda(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual) {
  constexpr const char* op = "add_layer_norm_bwd";
  check_rows(h, "h", op);
  check_like(dy, "dy", h, "h", op);
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_like(*dh, "dh", h, "h", op);
  check_param(weight, "weight", h, op);
  check_stat(mean, "mean", h, op);
  check_stat(rstd, "rstd", h, op);
  ff_check_dropout_p(dropout_p, op);
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
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
      dropout_p, rng.seed, rng.offset, ff_stream(h)));
  return {dx, dres, dweight, dbias};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("add_layer_norm_fwd", &fastformer::add_layer_norm_fwd_cuda);
  m.impl("add_layer_norm_bwd", &fastformer::add_layer_norm_bwd_cuda);
}
