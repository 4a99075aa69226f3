// The loss side of the cross-entropy glue, shared by cross_entropy.cpp and linear_cross_entropy.cpp
// (both run the row kernel of cross_entropy.cu): the count of rows not ignored (the mean's
// divisor, kept on the device: no host synchronisation), the per-row losses and their reduction.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "glue.h"
#include "launchers.h"

struct FfCrossEntropyLoss {
  at::Tensor count;                     // () int64: rows not ignored (reduction mean or class weights)
  at::Tensor loss_rows;                 // (n,) fp32, written by launch_cross_entropy_fwd
  at::Tensor weight_stats_;             // (2,) fp32 with class weights: (sum of w[target], sum of w)
  const int64_t* mean_count = nullptr;  // count for reduction mean (1), else null
  const float* class_weight = nullptr;  // (V,) fp32 class weights, or null
  const float* weight_stats = nullptr;  // weight_stats_ with class weights, else null

  // `like`: a tensor of the call (its device); class_weight (V,) fp32 or undefined.
  // The count is launched for the mean or class weights alone: none and sum without weights never
  // read it, so their call is one launch shorter (csrc/cuda/LAUNCHES.md); `count` is then an empty
  // tensor. The same launch sums the class weights (the row kernel's smoothing term reads the sum).
  FfCrossEntropyLoss(const at::Tensor& target, int64_t n, int64_t ignore_index, int64_t reduction,
                     const at::Tensor& like, void* stream, const at::Tensor& cw = at::Tensor())
      : count(reduction == 1 || cw.defined() ? at::empty({}, target.options())
                                             : at::empty({0}, target.options())),
        loss_rows(at::empty({n}, like.options().dtype(at::kFloat))) {
    if (reduction != 1 && !cw.defined()) return;
    if (cw.defined()) {
      weight_stats_ = at::empty({2}, like.options().dtype(at::kFloat));
      class_weight = cw.const_data_ptr<float>();
      weight_stats = weight_stats_.data_ptr<float>();
    }
    FF_CHECK_LAUNCH(launch_cross_entropy_count_valid(
        target.const_data_ptr<int64_t>(), n, ignore_index, count.data_ptr<int64_t>(), class_weight,
        cw.defined() ? cw.size(0) : 0, const_cast<float*>(weight_stats), stream));
    if (reduction == 1) mean_count = count.const_data_ptr<int64_t>();
  }

  // The loss in `like`'s dtype (dtype: its launcher code): the rows (reduction 0), else their sum
  // in a fixed order, divided by the count for the mean.
  at::Tensor reduce(int64_t reduction, const at::Tensor& like, int dtype, void* stream) const {
    if (reduction == 0) return loss_rows.to(like.scalar_type());
    at::Tensor loss = at::empty({}, like.options());
    FF_CHECK_LAUNCH(launch_cross_entropy_reduce(loss_rows.const_data_ptr<float>(), loss_rows.size(0),
                                                mean_count, weight_stats, loss.data_ptr(), dtype, stream));
    return loss;
  }
};
