// The loss side of the cross-entropy glue, shared by cross_entropy.cpp and linear_cross_entropy.cpp
// (both run the row kernel of cross_entropy.cu): the count of rows not ignored (the mean's
// divisor, kept on the device: no host synchronisation), the per-row losses and their reduction.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "glue.h"
#include "launchers.h"

struct FfCrossEntropyLoss {
  at::Tensor count;                     // () int64: rows not ignored (reduction mean only)
  at::Tensor loss_rows;                 // (n,) fp32, written by launch_cross_entropy_fwd
  const int64_t* mean_count = nullptr;  // count for reduction mean (1), else null

  // `like`: a tensor of the call (its device).
  // The count is launched for the mean alone (reduction 1): none and sum never read it, so their
  // call is one launch shorter (csrc/cuda/LAUNCHES.md); `count` is then an empty tensor.
  FfCrossEntropyLoss(const at::Tensor& target, int64_t n, int64_t ignore_index, int64_t reduction,
                     const at::Tensor& like, void* stream)
      : count(reduction == 1 ? at::empty({}, target.options()) : at::empty({0}, target.options())),
        loss_rows(at::empty({n}, like.options().dtype(at::kFloat))) {
    if (reduction != 1) return;
    FF_CHECK_LAUNCH(launch_cross_entropy_count_valid(target.const_data_ptr<int64_t>(), n, ignore_index,
                                                     count.data_ptr<int64_t>(), stream));
    mean_count = count.const_data_ptr<int64_t>();
  }

  // The loss in `like`'s dtype (dtype: its launcher code): the rows (reduction 0), else their sum
  // in a fixed order, divided by the count for the mean.
  at::Tensor reduce(int64_t reduction, const at::Tensor& like, int dtype, void* stream) const {
    if (reduction == 0) return loss_rows.to(like.scalar_type());
    at::Tensor loss = at::empty({}, like.options());
    FF_CHECK_LAUNCH(launch_cross_entropy_reduce(loss_rows.const_data_ptr<float>(), loss_rows.size(0),
                                                mean_count, loss.data_ptr(), dtype, stream));
    return loss;
  }
};
