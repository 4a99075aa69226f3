// add_layer_norm_fwd / add_layer_norm_bwd on CPU: the argument checks and the op registration,
// compiled once; the math is add_layer_norm_kernel.cpp, run at the ISA level isa.h chose.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "add_layer_norm.h"
#include "large_buffers.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

void check_dropout(double dropout_p, const char* op) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name,
                const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have the shape of ", like_name, " ",
              like.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have the dtype of ",
              like_name, " (", like.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_rows(const at::Tensor& x, const char* name, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D (N, C), got shape ", x.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, op, ": ", name,
              " must be float32, float64 or bfloat16, got ", dt);
  TORCH_CHECK(x.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_param(const at::Tensor& p, const char* name, const at::Tensor& x, const char* op) {
  TORCH_CHECK(p.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", p.device());
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1), op, ": ", name, " must have shape (",
              x.size(1), ",) (C), got ", p.sizes());
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), op, ": ", name, " must have the dtype of x (",
              x.scalar_type(), "), got ", p.scalar_type());
  TORCH_CHECK(p.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_stat(const at::Tensor& s, const char* name, int64_t N, const char* op) {
  TORCH_CHECK(s.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", s.device());
  TORCH_CHECK(s.dim() == 1 && s.size(0) == N, op, ": ", name, " must have shape (", N,
              ",) (N), got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              s.scalar_type());
  TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "add_layer_norm_fwd";
  check_rows(x, "x", op);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) check_like(*residual, "residual", x, "x", op);
  check_param(weight, "weight", x, op);
  check_param(bias, "bias", x, op);
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), op, ": eps must be > 0 and finite, got ", eps);
  check_dropout(dropout_p, op);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const int64_t N = x.size(0), C = x.size(1);
  at::Tensor y = empty_large_like(x), h = empty_large_like(x);  // pooled when large (large_buffers.h)
  at::Tensor mean = at::empty({N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({N}, x.options().dtype(at::kFloat));
  if (N == 0 || C == 0) return {y, h, mean, rstd};
  FF_ISA(add_layer_norm_fwd_kernel)(x, has_res ? *residual : at::Tensor(), weight, bias, y, h,
                                    mean, rstd, eps, dropout_p, static_cast<uint64_t>(seed),
                                    static_cast<uint64_t>(offset));
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual) {
  constexpr const char* op = "add_layer_norm_bwd";
  check_rows(h, "h", op);
  check_like(dy, "dy", h, "h", op);
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_like(*dh, "dh", h, "h", op);
  check_param(weight, "weight", h, op);
  check_stat(mean, "mean", h.size(0), op);
  check_stat(rstd, "rstd", h.size(0), op);
  check_dropout(dropout_p, op);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const int64_t N = h.size(0), C = h.size(1);
  // dresidual = dh_total differs from dx only under dropout; otherwise it is returned empty
  const bool separate_dres = has_residual && dropout_p > 0.0;
  at::Tensor dx = empty_large_like(h);
  at::Tensor dres = separate_dres ? empty_large_like(h) : at::empty({0}, h.options());
  at::Tensor dweight = at::empty_like(weight), dbias = at::empty_like(weight);
  if (N == 0 || C == 0) {
    dweight.zero_();
    dbias.zero_();
    return {dx, dres, dweight, dbias};
  }
  FF_ISA(add_layer_norm_bwd_kernel)(dy, has_dh ? *dh : at::Tensor(), h, weight, mean, rstd, dx,
                                    dres, dweight, dbias, dropout_p, static_cast<uint64_t>(seed),
                                    static_cast<uint64_t>(offset));
  return {dx, dres, dweight, dbias};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("add_layer_norm_fwd", &fastformer::add_layer_norm_fwd_cpu);
  m.impl("add_layer_norm_bwd", &fastformer::add_layer_norm_bwd_cpu);
}
