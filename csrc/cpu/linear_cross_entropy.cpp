// cross_entropy(hidden @ weight^T + bias) on CPU without the (N, V) logits: rows are taken in
// chunks; per chunk one GEMM (ATen / MKL) makes hidden @ weight^T, the fused row kernel adds the
// bias as it reads, turns the row into the loss and, in place, into dlogits (adding its column
// sums into per-thread dbias partials), and two more GEMMs give dhidden[chunk] and add into
// dweight. bf16 accumulates dweight and dbias in fp32 and casts at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cross_entropy.h"
#include "large_buffers.h"

#ifndef FASTFORMER_LCE_CHUNK_BYTES
#define FASTFORMER_LCE_CHUNK_BYTES (16 << 20)
#endif

namespace fastformer {
namespace {

// Rows per chunk: a chunk of logits takes about FASTFORMER_LCE_CHUNK_BYTES (16 MB), but at least
// 256 rows. Each chunk costs three GEMMs with M or K = rows and a few parallel regions; with
// fewer rows the multi-threaded GEMMs lose efficiency (measured: 256-row chunks cost ~1.8x the
// CPU time of one (2048, 256) x (256, 8000) GEMM on 2 threads, 1024-row chunks ~1.15x).
int64_t chunk_rows(int64_t n, int64_t V, int64_t elem_size) {
  int64_t rows = FASTFORMER_LCE_CHUNK_BYTES / std::max<int64_t>(1, V * elem_size);
  rows = std::max<int64_t>(256, rows / 16 * 16);
  return std::max<int64_t>(1, std::min(rows, n));
}

struct Grads {
  at::Tensor dhidden, dweight, dbias;
};

// The chunk loop shared by the forward (loss, and grads for mean / sum) and the backward of
// reduction none (grads with the per-row upstream gradient in scale.row_scale).
Grads linear_cross_entropy_chunks(const at::Tensor& hidden, const at::Tensor& weight,
                                  const c10::optional<at::Tensor>& bias, const int64_t* target,
                                  double label_smoothing, int64_t ignore_index, RowScale scale,
                                  bool compute_grad, double* loss_rows) {
  // The GEMMs below are internal steps of this kernel: keep them out of autograd.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t n = hidden.size(0), D = hidden.size(1), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = hidden.scalar_type();
  const bool lowp = dtype == at::kBFloat16;
  const auto acc_opts = hidden.options().dtype(lowp ? at::kFloat : dtype);
  const int64_t rows_per_chunk = chunk_rows(n, V, hidden.element_size());

  Grads out;
  at::Tensor dweight_acc, dbias_partial, dweight_part;
  if (compute_grad) {
    out.dhidden = at::empty({n, D}, hidden.options());
    dweight_acc = empty_large({V, D}, acc_opts).zero_();  // pooled: no fresh pages a call
    if (has_bias) dbias_partial = at::zeros({at::get_num_threads(), V}, acc_opts);  // per thread
    if (lowp) dweight_part = at::empty({V, D}, weight.options());
  }
  at::Tensor buffer = empty_large({rows_per_chunk, V}, hidden.options());  // (C, V) logits, then dlogits
  const at::Tensor weight_t = weight.t();                                  // (D, V) view

  for (int64_t c0 = 0; c0 < n; c0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, n - c0);
    const at::Tensor h = hidden.narrow(0, c0, rows);  // (rows, D)
    at::Tensor logits = buffer.narrow(0, 0, rows);     // (rows, V), without the bias:
    at::mm_out(logits, h, weight_t);                   // the row kernel adds it as it reads
    RowScale chunk_scale = scale;
    if (scale.row_scale != nullptr) chunk_scale.row_scale = scale.row_scale + c0;
    FF_ISA(cross_entropy_rows)(logits, has_bias ? *bias : at::Tensor(), target + c0,
                               label_smoothing, ignore_index, chunk_scale,
                               compute_grad ? logits : at::Tensor(), loss_rows + c0, dbias_partial);
    if (!compute_grad) continue;
    // logits now holds dlogits (rows, V).
    at::Tensor dh = out.dhidden.narrow(0, c0, rows);
    at::mm_out(dh, logits, weight);  // (rows, V) @ (V, D)
    if (lowp) {
      at::mm_out(dweight_part, logits.t(), h);  // (V, rows) @ (rows, D) in bf16, then into fp32
      FF_ISA(accumulate_bf16)(dweight_part.const_data_ptr<at::BFloat16>(), V * D,
                                dweight_acc.data_ptr<float>());
    } else {
      dweight_acc.addmm_(logits.t(), h);  // (V, rows) @ (rows, D)
    }
  }

  if (compute_grad) {
    out.dweight = lowp ? dweight_acc.to(dtype) : dweight_acc;
    // dbias: the row kernel's per-thread column sums of dlogits (fp32 for bf16), added up.
    out.dbias = has_bias ? dbias_partial.sum(0).to(dtype) : at::empty({0}, weight.options());
  }
  return out;
}

// The checks both ops share (target is checked by the callers, with their ignore_index).
void check_inputs(const char* what, const at::Tensor& hidden, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, double label_smoothing) {
  check_float_input(what, "hidden", hidden, 2);
  check_float_input(what, "weight", weight, 2);
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), what, ": weight has dtype ",
              weight.scalar_type(), " but hidden has dtype ", hidden.scalar_type());
  const int64_t D = hidden.size(1), V = weight.size(0);
  TORCH_CHECK(weight.size(1) == D, what, ": weight must have shape (V, ", D,
              ") with D = hidden.size(1), got shape ", weight.sizes());
  TORCH_CHECK(V > 0, what, ": weight must have at least one row (class), got shape ", weight.sizes());
  if (bias.has_value() && bias->defined()) {
    check_float_input(what, "bias", *bias, 1);
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type(), what, ": bias has dtype ",
                bias->scalar_type(), " but hidden has dtype ", hidden.scalar_type());
    TORCH_CHECK(bias->size(0) == V, what, ": bias must have shape (", V,
                ",) with V = weight.size(0), got shape ", bias->sizes());
  }
  check_label_smoothing(what, label_smoothing);
}

}  // namespace

// hidden (N, D), weight (V, D), bias (V,) or None, target (N,) -> loss (() or (N,)) and, with
// compute_grad (mean / sum), (dhidden, dweight, dbias) for an upstream gradient of 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, int64_t reduction,
    bool compute_grad) {
  constexpr const char* what = "linear_cross_entropy_fwd";
  check_inputs(what, hidden, weight, bias, label_smoothing);
  check_reduction(what, reduction);
  TORCH_CHECK(!compute_grad || reduction != 0, what,
              ": compute_grad needs reduction mean (1) or sum (2); reduction none takes its "
              "gradient from linear_cross_entropy_bwd");
  const int64_t n = hidden.size(0);
  const int64_t num_valid = check_target(what, target, n, weight.size(0), ignore_index);

  RowScale rs;
  rs.scale = reduction == 1 ? (num_valid > 0 ? 1.0 / static_cast<double>(num_valid) : 0.0) : 1.0;
  std::vector<double> loss_rows(n);
  Grads g = linear_cross_entropy_chunks(hidden, weight, bias, target.const_data_ptr<int64_t>(),
                                        label_smoothing, ignore_index, rs, compute_grad,
                                        loss_rows.data());
  at::Tensor loss = reduce_loss_rows(loss_rows.data(), n, num_valid, reduction, hidden.scalar_type());
  if (!compute_grad) {
    return {loss, at::empty({0}, hidden.options()), at::empty({0}, weight.options()),
            at::empty({0}, weight.options())};
  }
  return {loss, g.dhidden, g.dweight, g.dbias};
}

// The gradient for reduction none: row i's loss weighted by grad_loss[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& target, double label_smoothing,
    int64_t ignore_index) {
  constexpr const char* what = "linear_cross_entropy_bwd";
  check_inputs(what, hidden, weight, bias, label_smoothing);
  const int64_t n = hidden.size(0);
  TORCH_CHECK(grad_loss.defined(), what, ": grad_loss is an undefined tensor");
  TORCH_CHECK(grad_loss.device().is_cpu(), what, ": grad_loss must be a CPU tensor, got device ",
              grad_loss.device());
  TORCH_CHECK(at::isFloatingType(grad_loss.scalar_type()), what,
              ": grad_loss must be a floating-point tensor, got ", grad_loss.scalar_type());
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == n, what, ": grad_loss must have shape (",
              n, ",), one upstream gradient per row, got shape ", grad_loss.sizes());
  check_target(what, target, n, weight.size(0), ignore_index);

  const at::Tensor row_scale = grad_loss.to(at::kDouble).contiguous();  // (N,)
  RowScale rs;
  rs.row_scale = row_scale.const_data_ptr<double>();
  std::vector<double> loss_rows(n);
  Grads g = linear_cross_entropy_chunks(hidden, weight, bias, target.const_data_ptr<int64_t>(),
                                        label_smoothing, ignore_index, rs, true, loss_rows.data());
  return {g.dhidden, g.dweight, g.dbias};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("linear_cross_entropy_fwd", &fastformer::linear_cross_entropy_fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &fastformer::linear_cross_entropy_bwd_cpu);
}
