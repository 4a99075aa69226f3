// The autograd glue's CPU calls of add_layer_norm (csrc/autograd/add_layer_norm.cpp), made without
// the dispatcher where it would send the call straight to the CPU kernels: add_layer_norm_fwd
// (.x_bias where x_bias is given) and add_layer_norm_bwd (.x_bias where want_dx_bias) with the same
// checks, errors and math (csrc/cpu/add_layer_norm.cpp), but (one_block) mean, rstd and (h_in_block)
// h in one allocation, and dresidual, where it is dx, one shared empty tensor (not a fresh one).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace fastformer {

// The glue forward's outputs: y (N, C), and h, mean, rstd as tensors; or (block defined: one_block)
// mean and rstd (N,) at byte offsets mean_at and rstd_at of block and h (N, C) at its start where
// h_in_block (h then undefined): no tensor is made for what only the backward reads.
struct AddLayerNormFwdGlue {
  at::Tensor y, h, mean, rstd, block;
  int64_t mean_at = 0, rstd_at = 0;
};
AddLayerNormFwdGlue add_layer_norm_fwd_glue_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    const at::Tensor& bias, double eps, double dropout_p, const at::Tensor& philox,
    const at::Tensor* x_bias, bool rms_norm, bool one_block, bool h_in_block);

// (h (N, C) where h_in_block, else undefined; mean; rstd) as tensors viewing such a block: for the
// backward's calls that take tensors (the dispatcher's). dtype: x's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_block_views(
    const at::Tensor& block, int64_t N, int64_t C, at::ScalarType dtype, bool h_in_block,
    int64_t mean_at, int64_t rstd_at);

// (dx, dresidual, dweight, dbias, dx_bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_glue_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool want_dx_bias, bool rms_norm);

// The same of the rows dy (N, C) with h, mean and rstd the forward's memory (a block's, as
// add_layer_norm_fwd_glue_cpu wrote it: the caller's to vouch for; dy, dh, weight are checked).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_glue_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const void* h, const at::Tensor& weight,
    const void* mean, const void* rstd, double dropout_p, const at::Tensor& philox, bool has_residual,
    bool want_dx_bias, bool rms_norm);

}  // namespace fastformer
