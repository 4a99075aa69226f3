// cross_entropy(hidden @ weight^T + bias) on CPU without the (N, V) logits: rows are taken in
// chunks; per chunk one GEMM (ATen / MKL) makes hidden @ weight^T, the fused row kernel adds the
// bias as it reads, turns the row into the loss and, in place, into dlogits (adding its column
// sums into per-thread dbias partials), and two more GEMMs give dhidden[chunk] and add into
// dweight. bf16 accumulates dweight and dbias in fp32 and casts at the end. Class probabilities as
// the target (torch's soft targets, (N, V) in the math type) take the same loop: the GEMM adds the
// bias (addmm), the soft row kernel reads the chunk's (rows, V) probabilities, and dbias is the
// chunk's column sums of dlogits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cross_entropy.h"
#include "large_buffers.h"
#include "../checks/cross_entropy.h"

namespace fastformer {
namespace {

using Grads = checks::LinearCrossEntropyGrads;

// The chunk loop shared by the forward (loss, and grads for mean / sum) and the backward of
// reduction none (grads with the per-row upstream gradient in scale.row_scale). target: (N,) int64
// class indices or (N, V) class probabilities (floating).
Grads linear_cross_entropy_chunks(const at::Tensor& hidden, const at::Tensor& weight,
                                  const c10::optional<at::Tensor>& bias, const at::Tensor& class_weight,
                                  const at::Tensor& target, double label_smoothing, int64_t ignore_index,
                                  RowScale scale, bool compute_grad, double* loss_rows) {
  // The GEMMs below are internal steps of this kernel: keep them out of autograd.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t n = hidden.size(0), D = hidden.size(1), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = hidden.scalar_type();
  const bool lowp = dtype == at::kBFloat16;
  const auto acc_opts = hidden.options().dtype(lowp ? at::kFloat : dtype);
  const int64_t rows_per_chunk = checks::linear_cross_entropy_chunk_rows(n, V, hidden.element_size());

  Grads out;
  at::Tensor dweight_acc, dbias_partial, dweight_part;
  if (compute_grad) {
    out.dhidden = at::empty({n, D}, hidden.options());
    dweight_acc = empty_large({V, D}, acc_opts);  // pooled: no fresh pages a call
    if (n == 0 || lowp) dweight_acc.zero_();       // else the first chunk's product overwrites it
    if (has_bias) dbias_partial = at::zeros({at::get_num_threads(), V}, acc_opts);  // per thread
    if (lowp) dweight_part = at::empty({V, D}, weight.options());
  }
  at::Tensor buffer = empty_large({rows_per_chunk, V}, hidden.options());  // (C, V) logits, then dlogits
  const at::Tensor weight_t = weight.t();                                  // (D, V) view
  const bool soft = target.is_floating_point();
  const int64_t* target_index = soft ? nullptr : target.const_data_ptr<int64_t>();

  for (int64_t c0 = 0; c0 < n; c0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, n - c0);
    const at::Tensor h = hidden.narrow(0, c0, rows);  // (rows, D)
    at::Tensor logits = buffer.narrow(0, 0, rows);     // (rows, V)
    RowScale chunk_scale = scale;
    if (scale.row_scale != nullptr) chunk_scale.row_scale = scale.row_scale + c0;
    if (soft) {  // the bias in the GEMM; the soft row kernel has no bias or column sums of its own
      if (has_bias) {
        at::addmm_out(logits, *bias, h, weight_t);
      } else {
        at::mm_out(logits, h, weight_t);
      }
      FF_ISA(soft_cross_entropy_rows)(logits, class_weight, target.narrow(0, c0, rows), label_smoothing,
                                      chunk_scale, compute_grad ? logits : at::Tensor(), loss_rows + c0);
      if (compute_grad && has_bias) {  // dbias: the chunk's column sums of dlogits, in the math type
        dbias_partial[0].add_(logits.sum(at::IntArrayRef{0}, false, lowp ? at::kFloat : dtype));
      }
    } else {
      at::mm_out(logits, h, weight_t);  // without the bias: the row kernel adds it as it reads
      FF_ISA(cross_entropy_rows)(logits, has_bias ? *bias : at::Tensor(), class_weight, target_index + c0,
                                 label_smoothing, ignore_index, chunk_scale,
                                 compute_grad ? logits : at::Tensor(), loss_rows + c0, dbias_partial);
    }
    if (!compute_grad) continue;
    // logits now holds dlogits (rows, V).
    at::Tensor dh = out.dhidden.narrow(0, c0, rows);
    at::mm_out(dh, logits, weight);  // (rows, V) @ (V, D)
    if (lowp) {
      at::mm_out(dweight_part, logits.t(), h);  // (V, rows) @ (rows, D) in bf16, then into fp32
      FF_ISA(accumulate_bf16)(dweight_part.const_data_ptr<at::BFloat16>(), V * D,
                                dweight_acc.data_ptr<float>());
    } else if (c0 == 0) {
      at::mm_out(dweight_acc, logits.t(), h);  // (V, rows) @ (rows, D): no zero fill first
    } else {
      dweight_acc.addmm_(logits.t(), h);
    }
  }

  if (compute_grad) {
    out.dweight = lowp ? dweight_acc.to(dtype) : dweight_acc;
    // dbias: the row kernel's per-thread column sums of dlogits (fp32 for bf16), added up.
    out.dbias = has_bias ? dbias_partial.sum(0).to(dtype) : at::empty({0}, weight.options());
  }
  return out;
}

}  // namespace

// hidden (N, D), weight (V, D), bias (V,) or None, target (N,) int64 or (N, V) class probabilities,
// class_weight (V,) or None -> loss
// (() or (N,)) and, with compute_grad (mean / sum), (dhidden, dweight, dbias) for an upstream
// gradient of 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, int64_t reduction,
    bool compute_grad, const c10::optional<at::Tensor>& class_weight) {
  constexpr const char* what = "linear_cross_entropy_fwd";
  const at::Tensor cw = checks::check_linear_cross_entropy(checks::kCpu, what, hidden, weight, bias, target,
                                                           label_smoothing, class_weight);
  checks::check_linear_cross_entropy_fwd(what, reduction, compute_grad);
  const int64_t n = hidden.size(0);
  // class probabilities: every row counts 1 in the mean (torch's); class indices: the rows not
  // ignored, or their targets' class weights
  const bool soft = target.is_floating_point();
  const int64_t num_valid = soft ? n : count_valid_targets(what, target, weight.size(0), ignore_index);
  const double divisor = soft ? static_cast<double>(n) : mean_divisor(target, cw, ignore_index, num_valid);

  RowScale rs;
  rs.scale = reduction == 1 ? mean_grad_scale(divisor, num_valid) : 1.0;
  std::vector<double> loss_rows(n);
  Grads g = linear_cross_entropy_chunks(hidden, weight, bias, cw, target, label_smoothing, ignore_index, rs,
                                        compute_grad, loss_rows.data());
  return checks::linear_cross_entropy_fwd_returns(
      reduce_loss_rows(loss_rows.data(), n, divisor, reduction, hidden.scalar_type()), g,
      compute_grad, hidden, weight);
}

// The gradient for reduction none: row i's loss (class-weighted by class_weight) times grad_loss[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& target, double label_smoothing,
    int64_t ignore_index, const c10::optional<at::Tensor>& class_weight) {
  constexpr const char* what = "linear_cross_entropy_bwd";
  const at::Tensor cw = checks::check_linear_cross_entropy(checks::kCpu, what, hidden, weight, bias, target,
                                                           label_smoothing, class_weight);
  checks::check_grad_loss(checks::kCpu, what, grad_loss, hidden);
  const int64_t n = hidden.size(0);
  if (!target.is_floating_point()) count_valid_targets(what, target, weight.size(0), ignore_index);

  const at::Tensor row_scale = grad_loss.to(at::kDouble).contiguous();  // (N,)
  RowScale rs;
  rs.row_scale = row_scale.const_data_ptr<double>();
  std::vector<double> loss_rows(n);
  Grads g = linear_cross_entropy_chunks(hidden, weight, bias, cw, target, label_smoothing, ignore_index, rs, true,
                                        loss_rows.data());
  return {g.dhidden, g.dweight, g.dbias};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("linear_cross_entropy_fwd", &fastformer::linear_cross_entropy_fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &fastformer::linear_cross_entropy_bwd_cpu);
}
