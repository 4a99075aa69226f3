// The argument checks of add_layer_norm_fwd / add_layer_norm_bwd, shared by
// csrc/cpu/add_layer_norm.cpp and csrc/cuda/add_layer_norm.cpp (see common.h). Every tensor is
// contiguous: rows (N, C), parameters (C,), statistics (N,) fp32.
#pragma once
#include <optional>

#include "common.h"

namespace fastformer {
namespace checks {
namespace add_layer_norm_detail {

// x or h: the (N, C) rows every other tensor is measured against.
inline void check_rows(const Backend& be, const char* op, const char* name, const at::Tensor& x) {
  check_device(be, op, name, x);
  TORCH_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D (N, C), got shape ", x.sizes());
  check_float_dtype(be, op, name, x);
  check_contiguous(op, name, x);
}

// residual, dy or dh: the shape and dtype of the rows `like`.
inline void check_like(const Backend& be, const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like, const char* like_name) {
  check_device(be, op, name, t, &like, like_name);
  TORCH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have the shape of ", like_name, " ",
              like.sizes(), ", got ", t.sizes());
  check_dtype_of(op, name, t, like, like_name);
  check_contiguous(op, name, t);
}

// weight or bias: (C,) in the dtype of the rows x (named x_name).
inline void check_param(const Backend& be, const char* op, const char* name, const at::Tensor& p,
                        const at::Tensor& x, const char* x_name) {
  check_device(be, op, name, p, &x, x_name);
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1), op, ": ", name, " must have shape (",
              x.size(1), ",) (C), got ", p.sizes());
  check_dtype_of(op, name, p, x, x_name);
  check_contiguous(op, name, p);
}

// mean or rstd: (N,) in stat_dtype(h) for the rows h.
inline void check_stat(const Backend& be, const char* op, const char* name, const at::Tensor& s,
                       const at::Tensor& h) {
  check_device(be, op, name, s, &h, "h");
  TORCH_CHECK(s.dim() == 1 && s.size(0) == h.size(0), op, ": ", name, " must have shape (",
              h.size(0), ",) (N), got ", s.sizes());
  TORCH_CHECK(s.scalar_type() == stat_dtype(h), op, ": ", name, " must be ", stat_dtype_name(h),
              ", got ", s.scalar_type());
  check_contiguous(op, name, s);
}

}  // namespace add_layer_norm_detail

// The forward's arguments; returns whether a residual is given.
inline bool check_add_layer_norm_fwd(const Backend& be, const char* op, const at::Tensor& x,
                                     const std::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, const at::Tensor& bias, double eps,
                                     double dropout_p, const at::Tensor* x_bias = nullptr) {
  using namespace add_layer_norm_detail;
  check_rows(be, op, "x", x);
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) check_like(be, op, "residual", *residual, x, "x");
  check_param(be, op, "weight", weight, x, "x");
  check_param(be, op, "bias", bias, x, "x");
  if (x_bias) check_param(be, op, "x_bias", *x_bias, x, "x");
  TORCH_CHECK(eps > 0.0 && std::isfinite(eps), op, ": eps must be > 0 and finite, got ", eps);
  check_dropout_p(op, dropout_p);
  return has_residual;
}

// The backward's arguments; returns whether dh is given.
inline bool check_add_layer_norm_bwd(const Backend& be, const char* op, const at::Tensor& dy,
                                     const std::optional<at::Tensor>& dh, const at::Tensor& h,
                                     const at::Tensor& weight, const at::Tensor& mean,
                                     const at::Tensor& rstd, double dropout_p) {
  using namespace add_layer_norm_detail;
  check_rows(be, op, "h", h);
  check_like(be, op, "dy", dy, h, "h");
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_like(be, op, "dh", *dh, h, "h");
  check_param(be, op, "weight", weight, h, "h");
  check_stat(be, op, "mean", mean, h);
  check_stat(be, op, "rstd", rstd, h);
  check_dropout_p(op, dropout_p);
  return has_dh;
}

}  // namespace checks
}  // namespace fastformer
