// cross_entropy(hidden @ weight^T + bias) on CUDA without the (N, V) logits: rows are taken in
// chunks; per chunk one ATen GEMM makes logits = hidden_chunk weight^T + bias, the cross-entropy
// row kernel (csrc/cuda/cross_entropy.cu) writes the chunk's loss rows and, in place, dlogits;
// then dhidden_chunk = dlogits weight, dweight += dlogits^T hidden_chunk (ATen) and dbias +=
// the deterministic column sums of dlogits. 16-bit inputs accumulate dweight and dbias in fp32
// and cast at the end. Schema, returns and chunking as csrc/cpu/linear_cross_entropy.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "glue.h"
#include "launchers.h"

#ifndef FASTFORMER_LCE_CHUNK_BYTES
#define FASTFORMER_LCE_CHUNK_BYTES (16 << 20)
#endif

namespace fastformer {
namespace {

// Rows per chunk: a chunk of logits takes about FASTFORMER_LCE_CHUNK_BYTES, at least 256 rows
// (the CPU backend's rule, so both split the same way).
int64_t chunk_rows(int64_t n, int64_t V, int64_t elem_size) {
  int64_t rows = FASTFORMER_LCE_CHUNK_BYTES / std::max<int64_t>(1, V * elem_size);
  rows = std::max<int64_t>(256, rows / 16 * 16);
  return std::max<int64_t>(1, std::min(rows, n));
}

void check_float(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  ff_check_tensor(t, name, op);
  TORCH_CHECK(t.dim() == ndim, op, ": ", name, " must have ", ndim, " dimensions, got shape ",
              t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, const at::Tensor& target,
                  double label_smoothing) {
  check_float(op, "hidden", hidden, 2);
  check_float(op, "weight", weight, 2);
  TORCH_CHECK(weight.device() == hidden.device(), op, ": weight must be on hidden's device (",
              hidden.device(), "), got ", weight.device());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight has dtype ",
              weight.scalar_type(), " but hidden has dtype ", hidden.scalar_type());
  const int64_t D = hidden.size(1), V = weight.size(0);
  TORCH_CHECK(weight.size(1) == D, op, ": weight must have shape (V, ", D,
              ") with D = hidden.size(1), got shape ", weight.sizes());
  TORCH_CHECK(V > 0, op, ": weight must have at least one row (class), got shape ", weight.sizes());
  if (bias.has_value() && bias->defined()) {
    check_float(op, "bias", *bias, 1);
    TORCH_CHECK(bias->device() == hidden.device(), op, ": bias must be on hidden's device (",
                hidden.device(), "), got ", bias->device());
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type(), op, ": bias has dtype ",
                bias->scalar_type(), " but hidden has dtype ", hidden.scalar_type());
    TORCH_CHECK(bias->size(0) == V, op, ": bias must have shape (", V,
                ",) with V = weight.size(0), got shape ", bias->sizes());
  }
  ff_check_tensor(target, "target", op);
  TORCH_CHECK(target.device() == hidden.device(), op, ": target must be on hidden's device (",
              hidden.device(), "), got ", target.device());
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), op,
              ": target must have shape (", hidden.size(0), ",), one class index per row, got shape ",
              target.sizes());
  TORCH_CHECK(target.is_contiguous(), op, ": target must be contiguous");
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
}

struct Grads {
  at::Tensor dhidden, dweight, dbias;
};

// The chunk loop shared by the forward (loss rows; grads for mean / sum scaled by mean_count or
// 1) and the backward of reduction none (grads with row_scale = grad_loss).
Grads chunks(const at::Tensor& hidden, const at::Tensor& weight,
             const c10::optional<at::Tensor>& bias, const at::Tensor& target,
             double label_smoothing, int64_t ignore_index, const float* row_scale,
             const int64_t* mean_count, bool compute_grad, float* loss_rows) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // the GEMMs are internal steps
  const int64_t n = hidden.size(0), D = hidden.size(1), V = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  const at::ScalarType dtype = hidden.scalar_type();
  const bool lowp = dtype != at::kFloat;
  const auto f32 = hidden.options().dtype(at::kFloat);
  const int64_t rows_per_chunk = chunk_rows(n, V, hidden.element_size());
  const int code = ff_dtype_code(hidden, "hidden");
  void* stream = ff_stream(hidden);

  Grads out;
  at::Tensor dweight_acc, dweight_part, dbias_acc, partial;
  if (compute_grad) {
    out.dhidden = at::empty({n, D}, hidden.options());
    dweight_acc = at::zeros({V, D}, f32);
    if (lowp) dweight_part = at::empty({V, D}, weight.options());
    if (has_bias) {
      dbias_acc = at::zeros({V}, f32);
      partial = at::empty({colsum_num_parts(rows_per_chunk), V}, f32);  // (parts, V)
    }
  }
  at::Tensor buffer = at::empty({rows_per_chunk, V}, hidden.options());  // (C, V) logits, then dlogits
  const at::Tensor weight_t = weight.t();                                  // (D, V) view

  for (int64_t c0 = 0; c0 < n; c0 += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, n - c0);
    const at::Tensor h = hidden.narrow(0, c0, rows);  // (rows, D)
    at::Tensor logits = buffer.narrow(0, 0, rows);     // (rows, V)
    if (has_bias) {
      at::addmm_out(logits, *bias, h, weight_t);
    } else {
      at::mm_out(logits, h, weight_t);
    }
    FF_CHECK_LAUNCH(launch_cross_entropy_fwd(
        logits.const_data_ptr(), target.const_data_ptr<int64_t>() + c0,
        compute_grad ? logits.data_ptr() : nullptr, loss_rows + c0, rows, V, code, label_smoothing,
        ignore_index, row_scale != nullptr ? row_scale + c0 : nullptr, mean_count, 1.0, stream));
    if (!compute_grad) continue;
    // logits now holds dlogits (rows, V).
    at::Tensor dh = out.dhidden.narrow(0, c0, rows);
    at::mm_out(dh, logits, weight);  // (rows, V) @ (V, D)
    if (lowp) {
      at::mm_out(dweight_part, logits.t(), h);  // (V, rows) @ (rows, D) in 16 bits, then into fp32
      dweight_acc.add_(dweight_part);
    } else {
      dweight_acc.addmm_(logits.t(), h);  // (V, rows) @ (rows, D)
    }
    if (has_bias) {
      FF_CHECK_LAUNCH(launch_colsum(logits.const_data_ptr(), rows, V, code, partial.data_ptr<float>(),
                                    colsum_num_parts(rows), dbias_acc.data_ptr<float>(), 1, stream));
    }
  }

  if (compute_grad) {
    out.dweight = lowp ? dweight_acc.to(dtype) : dweight_acc;
    out.dbias = has_bias ? dbias_acc.to(dtype) : at::empty({0}, weight.options());
  }
  return out;
}

}  // namespace

// hidden (N, D), weight (V, D), bias (V,) or None, target (N,) -> loss (() or (N,)) and, with
// compute_grad (mean / sum), (dhidden, dweight, dbias) for an upstream gradient of 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    const at::Tensor& target, double label_smoothing, int64_t ignore_index, int64_t reduction,
    bool compute_grad) {
  constexpr const char* op = "linear_cross_entropy_fwd";
  check_inputs(op, hidden, weight, bias, target, label_smoothing);
  TORCH_CHECK(reduction >= 0 && reduction <= 2, op,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
  TORCH_CHECK(!compute_grad || reduction != 0, op,
              ": compute_grad needs reduction mean (1) or sum (2); reduction none takes its "
              "gradient from linear_cross_entropy_bwd");
  c10::DeviceGuard guard(hidden.device());
  const int64_t n = hidden.size(0);
  void* stream = ff_stream(hidden);

  at::Tensor count = at::empty({}, target.options());  // () int64: rows not ignored
  FF_CHECK_LAUNCH(launch_cross_entropy_count_valid(target.const_data_ptr<int64_t>(), n, ignore_index,
                                                   count.data_ptr<int64_t>(), stream));
  const int64_t* mean_count = reduction == 1 ? count.const_data_ptr<int64_t>() : nullptr;
  at::Tensor loss_rows = at::empty({n}, hidden.options().dtype(at::kFloat));  // (N,)
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index, nullptr, mean_count,
                   compute_grad, loss_rows.data_ptr<float>());
  at::Tensor loss;
  if (reduction == 0) {
    loss = loss_rows.to(hidden.scalar_type());
  } else {
    loss = at::empty({}, hidden.options());
    FF_CHECK_LAUNCH(launch_cross_entropy_reduce(loss_rows.const_data_ptr<float>(), n, mean_count,
                                                loss.data_ptr(), ff_dtype_code(hidden, "hidden"), stream));
  }
  if (!compute_grad) {
    return {loss, at::empty({0}, hidden.options()), at::empty({0}, weight.options()),
            at::empty({0}, weight.options())};
  }
  return {loss, g.dhidden, g.dweight, g.dbias};
}

// The gradient for reduction none: row i's loss weighted by grad_loss[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& target, double label_smoothing,
    int64_t ignore_index) {
  constexpr const char* op = "linear_cross_entropy_bwd";
  check_inputs(op, hidden, weight, bias, target, label_smoothing);
  const int64_t n = hidden.size(0);
  ff_check_tensor(grad_loss, "grad_loss", op);
  TORCH_CHECK(grad_loss.device() == hidden.device(), op, ": grad_loss must be on hidden's device (",
              hidden.device(), "), got ", grad_loss.device());
  TORCH_CHECK(at::isFloatingType(grad_loss.scalar_type()), op,
              ": grad_loss must be a floating-point tensor, got ", grad_loss.scalar_type());
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == n, op, ": grad_loss must have shape (",
              n, ",), one upstream gradient per row, got shape ", grad_loss.sizes());
  c10::DeviceGuard guard(hidden.device());

  const at::Tensor row_scale = grad_loss.to(at::kFloat).contiguous();  // (N,)
  at::Tensor loss_rows = at::empty({n}, hidden.options().dtype(at::kFloat));  // (N,), unused
  Grads g = chunks(hidden, weight, bias, target, label_smoothing, ignore_index,
                   row_scale.const_data_ptr<float>(), nullptr, true, loss_rows.data_ptr<float>());
  return {g.dhidden, g.dweight, g.dbias};
}

}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("linear_cross_entropy_fwd", &fastformer::linear_cross_entropy_fwd_cuda);
  m.impl("linear_cross_entropy_bwd", &fastformer::linear_cross_entropy_bwd_cuda);
}
