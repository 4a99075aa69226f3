// The fused cross-entropy row kernel, shared by cross_entropy_fwd (csrc/cpu/cross_entropy.cpp)
// and the chunked linear_cross_entropy ops (csrc/cpu/linear_cross_entropy.cpp). The kernels are
// compiled once per ISA level (cross_entropy_kernel.cpp, isa.h): call them as FF_ISA(fn)(...).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"

namespace fastformer {

// The per-row gradient scale: row_scale[i] when given, else `scale`; ignored rows get 0.
struct RowScale {
  double scale = 1.0;
  const double* row_scale = nullptr;  // (n,) or nullptr
};

// For every row i of x = logits (n, V) (+ bias (V,) when defined), contiguous, fp32 / fp64 / bf16:
//   loss_rows[i] = lse_i - (1 - eps) * x_i[t_i] - eps * mean_c(x_i[c])   (0 if t_i == ignore_index)
// and, when grad is defined (it may alias logits), in the same kernel
//   grad_i = (softmax(x_i) - (1 - eps) * onehot(t_i) - eps / V) * scale_i.
// One pass over each row gives max, log-sum-exp and the logit sum (online, per block of
// vectors); the gradient pass re-reads the row while it is still in cache. Rows run in
// parallel; target values must already be checked. grad_colsum, when defined with grad, is a
// zeroed-or-accumulating (at::get_num_threads(), V) tensor in the math type (fp32 for bf16):
// each thread adds the gradient rows it writes into its own row (the bias gradient, unrounded).
// grad_colsum: undefined when not wanted.
// class_weight (V,) in the math type, when defined: torch's class weights w, i.e.
//   loss_rows[i] = (1 - eps) w[t_i] (lse_i - x_i[t_i]) + eps / V sum_c w_c (lse_i - x_i[c])
//   grad_i = (((1 - eps) w[t_i] + eps sum(w) / V) softmax(x_i) - (1 - eps) w[t_i] onehot(t_i)
//             - eps / V w) * scale_i
// (the unweighted formulas for w = 1).
FF_ISA_DECLARE(void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& bias,
                                       const at::Tensor& class_weight,
                                       const int64_t* target, double label_smoothing,
                                       int64_t ignore_index, RowScale scale, const at::Tensor& grad,
                                       double* loss_rows, const at::Tensor& grad_colsum))

// Class probabilities as the target (torch's soft targets): probs (n, V) contiguous in the math
// type, class_weight (V,) or undefined, w = class_weight (1 without): with q = (1 - eps) probs + eps / V
//   loss_rows[i] = -sum_c w_c q_c log softmax(x_i)_c
//   grad_i = ((sum_c w_c q_c) softmax(x_i) - w q) * scale_i   (when grad is defined; it may alias logits)
FF_ISA_DECLARE(void soft_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& class_weight,
                                            const at::Tensor& probs, double label_smoothing, RowScale scale,
                                            const at::Tensor& grad, double* loss_rows))

// acc[i] += src[i] for i in [0, n) (linear_cross_entropy's bf16 dweight into its fp32 sum).
FF_ISA_DECLARE(void accumulate_bf16(const at::BFloat16* src, int64_t n, float* acc))

// The number of rows of target (n,), already checked by checks::check_target, whose value is
// not ignore_index; a TORCH_CHECK names the first value outside [0, num_classes) that is.
// `what` names the op in the message.
int64_t count_valid_targets(const char* what, const at::Tensor& target, int64_t num_classes,
                            int64_t ignore_index);

// The mean's divisor: num_valid without class_weight, else the sum of class_weight[target] over
// the rows not ignored (torch's), summed in a fixed order. Targets already checked.
double mean_divisor(const at::Tensor& target, const at::Tensor& class_weight, int64_t ignore_index,
                    int64_t num_valid);

// The row scale of the mean's gradient: 1 / divisor; 0 when no row counts (torch's zero gradient
// when every row is ignored), NaN when rows count but their weights sum to 0 (torch's NaN).
double mean_grad_scale(double divisor, int64_t num_valid);

// sum (reduction 2) or the mean (reduction 1: the sum over `divisor`, NaN when it is 0, as torch)
// of loss_rows, summed in a fixed order (deterministic); reduction 0 returns the rows. In `dtype`.
at::Tensor reduce_loss_rows(const double* loss_rows, int64_t n, double divisor, int64_t reduction,
                            at::ScalarType dtype);

}  // namespace fastformer
