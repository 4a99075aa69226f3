// cross_entropy(hidden @ weight^T + bias) on CUDA without the (N, V) logits: rows are taken in
// chunks; per chunk one ATen GEMM makes logits = hidden_chunk weight^T + bias, the cross-entropy
// row kernel (csrc/cuda/cross_entropy.cu) writes the chunk's loss rows and, in place, dlogits;
// then dhidden_chunk = dlogits weight, dweight += dlogits^T hidden_chunk (ATen) and dbias +=
// the deterministic column sums of dlogits. dweight and dbias accumulate in fp32 for 16-bit
// inputs too (dweight inside the GEMM, addmm_f32_) and are cast once at the end. Schema and
// returns as csrc/cpu/linear_cross_entropy.cpp; chunks sized for the device (chunk_rows). Class
// probabilities as the target ((N, V) fp32, torch's soft targets) take the same loop with the soft row
// kernel reading the chunk's (rows, V) probabilities; every row counts 1 in the mean.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "cross_entropy_loss.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/cross_entropy.h"

namespace fastformer {
namespace {

using Grads = checks::LinearCrossEntropyGrads;

// Whether ATen has the 16-bit x 16-bit -> fp32 GEMM (addmm.dtype_out: cuBLAS with fp32 compute and
// an fp32 C, beta = 1 in place) for the kernel device's tensors. CUDA builds of torch >= 2.8 do;
// CPU ATen (the SIMT harness) does not.
bool has_fp32_out_gemm() {
  static const bool has = [] {
    const auto op = c10::Dispatcher::singleton().findSchema({"aten::addmm", "dtype_out"});
    return op.has_value() && op->hasKernelForDispatchKey(kFfKernelDevice == c10::DeviceType::CUDA
                                                             ? c10::DispatchKey::CUDA
                                                             : c10::DispatchKey::CPU);
  }();
  return has;
}

// acc (M, N) fp32 += a (M, K) @ b (K, N), a and b of one dtype: the products accumulate in fp32
// inside the GEMM and land in acc in place, so a 16-bit dweight is rounded once, at the end, and
// no (V, D) 16-bit partial product is written and re-read per chunk. first: acc = a @ b (beta 0:
// acc's old contents, uninitialised memory, are never read, NaN included), which folds the zero
// fill of acc into the first chunk's GEMM (csrc/cuda/LAUNCHES.md).
void addmm_f32_(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  const int beta = first ? 0 : 1;
  if (a.scalar_type() == at::kFloat) {
    acc.addmm_(a, b, beta);
  } else if (has_fp32_out_gemm()) {
    at::addmm_out(acc, acc, a, b, at::kFloat, beta);  // alpha = 1
  } else {
    // CPU ATen has no such GEMM: the same arithmetic from fp32 copies (16-bit values and their
    // products are exact in fp32; the sum accumulates in fp32). Only the harness comes here.
    acc.addmm_(a.to(at::kFloat), b.to(at::kFloat), beta);
  }
}

// Rows per chunk: sized for the device (checks::linear_cross_entropy_device_chunk_rows) from the
// memory it has to spare. Where that is unknown (the SIMT harness unless a test models some memory,
// an allocator that cannot tell) the CPU rule, 16 MiB of logits: the harness's chunk-loop tests are
// written for it.
int64_t chunk_rows(const at::Tensor& hidden, int64_t V) {
  const int64_t n = hidden.size(0), elem = hidden.element_size();
  const int64_t free_bytes = ff_device_free_bytes(hidden);
  return free_bytes < 0 ? checks::linear_cross_entropy_chunk_rows(n, V, elem)
                        : checks::linear_cross_entropy_device_chunk_rows(n, V, elem, free_bytes);
}

// The chunk loop shared by the forward (loss rows; grads for mean / sum scaled by mean_count or
// 1) and the backward of reduction none (grads with row_scale = grad_loss). `weights`: the class
// weights and their sums (FfCrossEntropyLoss), or none. target: (N,) int64 class indices, or (N, V)
// fp32 class probabilities with grad_scale (the mean's 1 / N, else 1) and loss_scale (the same for the
// forward's loss rows, so their sum is the mean) in place of mean_count.
Grads chunks(const at::Tensor& hidden, const at::Tensor& weight,
             const c10::optional<at::Tensor>& bias, const at::Tensor& target,
             double label_smoothing, int64_t ignore_index, const float* row_scale,
             const int64_t* mean_count, const FfCrossEntropyLoss& weights, bool compute_grad,
             float* loss_rows, double grad_scale = 1.0, double loss_scale = 1.0) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // the GEMMs are internal steps
  const int64_t n = hidden.size(0), D = hidden.size(1), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = hidden.scalar_type();
  const auto f32 = hidden.options().dtype(at::kFloat);
  const int64_t rows_per_chunk = chunk_rows(hidden, V);
  const int code = ff_dtype_code(hidden, "hidden");
  void* stream = ff_stream(hidden);

  Grads out;
  at::Tensor dweight_acc, dbias_acc, partial;
  if (compute_grad) {
    out.dhidden = at::empty({n, D}, hidden.options());
    // written (not accumulated into) by the first chunk; zero-filled only when no chunk runs
    dweight_acc = n > 0 ? at::empty({V, D}, f32) : at::zeros({V, D}, f32);
    if (has_bias) {
      dbias_acc = n > 0 ? at::empty({V}, f32) : at::zeros({V}, f32);
      partial = at::empty({colsum_num_parts(rows_per_chunk), V}, f32);  // (parts, V)
    }
  }
  at::Tensor buffer = at::empty({rows_per_chunk, V}, hidden.options());  // (C, V) logits, then dlogits
  const at::Tensor weight_t = weight.t();                                  // (D, V) view
  const bool soft = target.is_floating_point();

  for (int64_t c0 = 0; c0 < n; c0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, n - c0);
    const at::Tensor h = hidden.narrow(0, c0, rows);  // (rows, D)
    at::Tensor logits = buffer.narrow(0, 0, rows);     // (rows, V)
    if (has_bias) {
      at::addmm_out(logits, *bias, h, weight_t);
    } else {
      at::mm_out(logits, h, weight_t);
    }
    if (soft) {
      FF_CHECK_LAUNCH(launch_soft_cross_entropy_fwd(
          logits.const_data_ptr(), target.const_data_ptr<float>() + c0 * V, compute_grad ? logits.data_ptr() : nullptr,
          loss_rows + c0, rows, V, code, label_smoothing, grad_scale, loss_scale, weights.class_weight,
          row_scale != nullptr ? row_scale + c0 : nullptr, stream));
    } else {
      FF_CHECK_LAUNCH(launch_cross_entropy_fwd(
          logits.const_data_ptr(), target.const_data_ptr<int64_t>() + c0,
          compute_grad ? logits.data_ptr() : nullptr, loss_rows + c0, rows, V, code, label_smoothing,
          ignore_index, row_scale != nullptr ? row_scale + c0 : nullptr, mean_count, 1.0, weights.class_weight,
          weights.weight_stats, stream));
    }
    if (!compute_grad) continue;
    // logits now holds dlogits (rows, V).
    at::Tensor dh = out.dhidden.narrow(0, c0, rows);
    at::mm_out(dh, logits, weight);  // (rows, V) @ (V, D)
    addmm_f32_(dweight_acc, logits.t(), h, c0 == 0);  // (V, rows) @ (rows, D), fp32 accumulation
    if (has_bias) {
      FF_CHECK_LAUNCH(launch_colsum(logits.const_data_ptr(), rows, V, code, partial.data_ptr<float>(),
                                    colsum_num_parts(rows), dbias_acc.data_ptr<float>(), 0,
                                    c0 == 0 ? 0 : 1, stream));
    }
  }

  if (compute_grad) {
    out.dweight = dweight_acc.to(dtype);  // no copy for fp32
    out.dbias = has_bias ? dbias_acc.to(dtype) : at::empty({0}, weight.options());
  }
  return out;
}

// The ops stay in the unnamed namespace: only FF_CUDA_IMPL below names them.

// hidden (N, D), weight (V, D), bias (V,) or None, target (N,) or (N, V) probabilities -> loss (() or (N,)) and, with
// compute_grad (mean / sum), (dhidden, dweight, dbias) for an upstream gradient of 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, int64_t reduction,
    bool compute_grad, const c10::optional<at::Tensor>& class_weight) {
  constexpr const char* op = "linear_cross_entropy_fwd";
  const at::Tensor cw = checks::check_linear_cross_entropy(kFfBackend, op, hidden, weight, bias, target,
                                                           label_smoothing, class_weight);
  checks::check_linear_cross_entropy_fwd(op, reduction, compute_grad);
  c10::DeviceGuard guard(hidden.device());
  const int64_t n = hidden.size(0);
  void* stream = ff_stream(hidden);

  if (target.is_floating_point()) {  // class probabilities: the mean's 1 / n is known here (no count)
    const double mean_scale = reduction == 1 ? (n > 0 ? 1.0 / static_cast<double>(n) : 0.0) : 1.0;
    FfCrossEntropyLoss rows(target, n, ignore_index, 2, hidden, stream);  // the loss rows alone: no launch
    if (cw.defined()) rows.class_weight = cw.const_data_ptr<float>();
    Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index, nullptr, nullptr, rows,
                     compute_grad, rows.loss_rows.data_ptr<float>(), mean_scale, mean_scale);
    at::Tensor out = rows.reduce(reduction == 0 ? 0 : 2, hidden, ff_dtype_code(hidden, "hidden"), stream);
    if (reduction == 1 && n == 0) out.fill_(NAN);  // 0 / 0, as torch
    return checks::linear_cross_entropy_fwd_returns(out, g, compute_grad, hidden, weight);
  }
  const FfCrossEntropyLoss loss(target, n, ignore_index, reduction, hidden, stream, cw);
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index, nullptr, loss.mean_count,
                   loss, compute_grad, loss.loss_rows.data_ptr<float>());
  return checks::linear_cross_entropy_fwd_returns(
      loss.reduce(reduction, hidden, ff_dtype_code(hidden, "hidden"), stream), g, compute_grad, hidden,
      weight);
}

// The gradient for reduction none: row i's loss weighted by grad_loss[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& target, double label_smoothing,
    int64_t ignore_index, const c10::optional<at::Tensor>& class_weight) {
  constexpr const char* op = "linear_cross_entropy_bwd";
  const at::Tensor cw = checks::check_linear_cross_entropy(kFfBackend, op, hidden, weight, bias, target,
                                                           label_smoothing, class_weight);
  checks::check_grad_loss(kFfBackend, op, grad_loss, hidden);
  const int64_t n = hidden.size(0);
  c10::DeviceGuard guard(hidden.device());
  void* stream = ff_stream(hidden);

  const at::Tensor row_scale = grad_loss.to(at::kFloat).contiguous();  // (N,)
  // reduction none: no count; with class weights their sums (and loss rows, unused). Class
  // probabilities read the class weights alone (no target scan).
  const bool soft = target.is_floating_point();
  FfCrossEntropyLoss rows(target, n, ignore_index, 0, hidden, stream, soft ? at::Tensor() : cw);
  if (soft && cw.defined()) rows.class_weight = cw.const_data_ptr<float>();
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index,
                   row_scale.const_data_ptr<float>(), nullptr, rows, true,
                   const_cast<float*>(rows.loss_rows.data_ptr<float>()));
  return {g.dhidden, g.dweight, g.dbias};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("linear_cross_entropy_fwd", &fastformer::linear_cross_entropy_fwd_cuda);
  m.impl("linear_cross_entropy_bwd", &fastformer::linear_cross_entropy_bwd_cuda);
}
