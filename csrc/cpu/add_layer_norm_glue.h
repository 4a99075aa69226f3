// The autograd glue's CPU calls of add_layer_norm (csrc/autograd/add_layer_norm.cpp), made without
// the dispatcher where it would send the call straight to the CPU kernels: add_layer_norm_fwd
// (.x_bias where x_bias is given) and add_layer_norm_bwd (.x_bias where want_dx_bias) with the same
// checks, errors and math (csrc/cpu/add_layer_norm.cpp), but (one_block) mean, rstd and (h_in_block)
// h views of one allocation, and dresidual, where it is dx, one shared empty tensor (not a fresh one).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace fastformer {

// (y, h, mean, rstd)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_glue_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, double dropout_p, const at::Tensor& philox,
    const at::Tensor* x_bias, bool rms_norm, bool one_block, bool h_in_block);

// (dx, dresidual, dweight, dbias, dx_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_glue_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool want_dx_bias, bool rms_norm);

}  // namespace fastformer
