// The per-ISA entry points of add_layer_norm (add_layer_norm_kernel.cpp, one copy per level of
// isa.h), called by add_layer_norm.cpp once the arguments are checked and the outputs allocated.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"

namespace fastformer {

// x, residual (undefined: none) (N, C); weight, bias, x_bias (undefined: none) (C,); writes y, h
// (N, C), mean, rstd (N,). N, C > 0. rms_norm: RMSNorm (mean written as 0, xhat rounded to T).
// h, mean, rstd: contiguous memory of x's dtype (h) and its statistics' (stat_dtype): tensors'
// data or parts of one block (the autograd glue's, csrc/cpu/add_layer_norm_glue.h).
FF_ISA_DECLARE(void add_layer_norm_fwd_kernel(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& x_bias, at::Tensor& y, void* h, void* mean,
    void* rstd, double eps, double dropout_p, uint64_t seed, uint64_t offset, bool rms_norm))

// dy (N, C); dh: undefined when there is none; h, mean, rstd: the forward's (as it wrote them);
// dres: empty when it is not written (it equals dx); dx_bias:
// undefined when not wanted, else (C,), written with the column sums of dx. rms_norm: RMSNorm's
// gradient (no mean term; mean is the forward's zeros).
FF_ISA_DECLARE(void add_layer_norm_bwd_kernel(
    const at::Tensor& dy, const at::Tensor& dh, const void* h, const at::Tensor& weight,
    const void* mean, const void* rstd, at::Tensor& dx, at::Tensor& dres,
    at::Tensor& dweight, at::Tensor& dbias, at::Tensor& dx_bias, double dropout_p, uint64_t seed,
    uint64_t offset, bool rms_norm))

}  // namespace fastformer
