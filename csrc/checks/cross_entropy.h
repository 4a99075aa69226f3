// The argument checks of cross_entropy_fwd and linear_cross_entropy_fwd / _bwd, shared by
// csrc/{cpu,cuda}/cross_entropy.cpp and csrc/{cpu,cuda}/linear_cross_entropy.cpp (see common.h),
// and the chunking rules and forward returns of linear_cross_entropy (the CPU rule is also the
// SIMT harness's; a GPU sizes its chunks for the device, linear_cross_entropy_device_chunk_rows).
// The target's values are not checked here: the CPU glue scans them (count_valid_targets); the
// CUDA kernels never use an out-of-range one as an address.
#pragma once
#include <algorithm>
#include <optional>
#include <tuple>

#include "common.h"

#ifndef FASTFORMER_LCE_CHUNK_BYTES
#define FASTFORMER_LCE_CHUNK_BYTES (16 << 20)
#endif

namespace fastformer {
namespace checks {

inline void check_reduction(const char* op, int64_t reduction) {
  TORCH_CHECK(reduction >= 0 && reduction <= 2, op,
              ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", reduction);
}

inline void check_label_smoothing(const char* op, double label_smoothing) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
}

// logits, hidden, weight or bias: `ndim` dimensions, a floating dtype of the backend, contiguous,
// on ref's device when ref is given.
inline void check_float_input(const Backend& be, const char* op, const char* name,
                              const at::Tensor& t, int64_t ndim, const at::Tensor* ref = nullptr,
                              const char* ref_name = nullptr) {
  check_device(be, op, name, t, ref, ref_name);
  TORCH_CHECK(t.dim() == ndim, op, ": ", name, " must have ", ndim, " dimensions, got shape ",
              t.sizes());
  check_float_dtype(be, op, name, t);
  check_contiguous(op, name, t);
}

// target: (n,) int64 contiguous on the device of ref (logits or hidden, n rows).
inline void check_target(const Backend& be, const char* op, const at::Tensor& target,
                         const at::Tensor& ref, const char* ref_name) {
  check_device(be, op, "target", target, &ref, ref_name);
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == ref.size(0), op, ": target must have shape (",
              ref.size(0), ",), one class index per row, got shape ", target.sizes());
  check_contiguous(op, "target", target);
}

// class_weight, when given: (V,) contiguous on ref's device (logits or hidden), in the math type
// of ref's dtype (fp64 for fp64, else fp32). Returns it, or an undefined tensor without one.
inline at::Tensor check_class_weight(const Backend& be, const char* op,
                                     const std::optional<at::Tensor>& class_weight,
                                     const at::Tensor& ref, const char* ref_name, int64_t V) {
  if (!class_weight.has_value() || !class_weight->defined()) return at::Tensor();
  const at::Tensor& w = *class_weight;
  check_device(be, op, "class_weight", w, &ref, ref_name);
  const at::ScalarType want = ref.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(w.scalar_type() == want, op, ": class_weight must be ", want, " (the math type of ",
              ref_name, "'s ", ref.scalar_type(), "), got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == V, op, ": class_weight must have shape (", V,
              ",), one weight per class, got shape ", w.sizes());
  check_contiguous(op, "class_weight", w);
  return w;
}

// Class probabilities (torch's soft targets) as the target of cross_entropy_fwd (ref = logits) or
// linear_cross_entropy_fwd / _bwd (ref = hidden): (ref.size(0), V), contiguous, on ref's device, in
// ref's math type (fp64 for fp64, else fp32).
inline void check_probability_target(const Backend& be, const char* op, const at::Tensor& target,
                                     const at::Tensor& ref, const char* ref_name, int64_t V) {
  check_device(be, op, "target", target, &ref, ref_name);
  const at::ScalarType want = ref.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(target.scalar_type() == want, op, ": target (class probabilities) must be ", want,
              " (the math type of ", ref_name, "'s ", ref.scalar_type(), "), got ", target.scalar_type());
  TORCH_CHECK(target.dim() == 2 && target.size(0) == ref.size(0) && target.size(1) == V, op,
              ": target (class probabilities) must have shape (", ref.size(0), ", ", V, "), one row of ", V,
              " class probabilities per row of ", ref_name, ", got shape ", target.sizes());
  check_contiguous(op, "target", target);
}

// cross_entropy_fwd: logits (N, V) with V >= 1, target (N,) int64 or (N, V) class probabilities
// (floating), the scalars, class_weight (V,) or none (returned, undefined when none).
inline at::Tensor check_cross_entropy_fwd(const Backend& be, const char* op, const at::Tensor& logits,
                                          const at::Tensor& target, double label_smoothing,
                                          int64_t reduction,
                                          const std::optional<at::Tensor>& class_weight) {
  check_float_input(be, op, "logits", logits, 2);
  TORCH_CHECK(logits.size(1) > 0, op, ": logits must have at least one class, got shape ",
              logits.sizes());
  if (at::isFloatingType(target.scalar_type())) {
    check_probability_target(be, op, target, logits, "logits", logits.size(1));
  } else {
    check_target(be, op, target, logits, "logits");
  }
  check_reduction(op, reduction);
  check_label_smoothing(op, label_smoothing);
  return check_class_weight(be, op, class_weight, logits, "logits", logits.size(1));
}

// What linear_cross_entropy_fwd and _bwd share: hidden (N, D), weight (V, D) with V >= 1, bias
// (V,) or none, all of hidden's dtype; target (N,) int64 or (N, V) class probabilities (floating);
// label_smoothing; class_weight (V,) or none (returned, undefined when none).
inline at::Tensor check_linear_cross_entropy(const Backend& be, const char* op, const at::Tensor& hidden,
                                             const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias,
                                             const at::Tensor& target, double label_smoothing,
                                             const std::optional<at::Tensor>& class_weight) {
  check_float_input(be, op, "hidden", hidden, 2);
  check_float_input(be, op, "weight", weight, 2, &hidden, "hidden");
  check_same_dtype(op, "weight", weight, hidden, "hidden");
  const int64_t D = hidden.size(1), V = weight.size(0);
  TORCH_CHECK(weight.size(1) == D, op, ": weight must have shape (V, ", D,
              ") with D = hidden.size(1), got shape ", weight.sizes());
  TORCH_CHECK(V > 0, op, ": weight must have at least one row (class), got shape ", weight.sizes());
  if (bias.has_value() && bias->defined()) {
    check_float_input(be, op, "bias", *bias, 1, &hidden, "hidden");
    check_same_dtype(op, "bias", *bias, hidden, "hidden");
    TORCH_CHECK(bias->size(0) == V, op, ": bias must have shape (", V,
                ",) with V = weight.size(0), got shape ", bias->sizes());
  }
  if (at::isFloatingType(target.scalar_type())) {
    check_probability_target(be, op, target, hidden, "hidden", V);
  } else {
    check_target(be, op, target, hidden, "hidden");
  }
  check_label_smoothing(op, label_smoothing);
  return check_class_weight(be, op, class_weight, hidden, "hidden", V);
}

// linear_cross_entropy_fwd's own scalars.
inline void check_linear_cross_entropy_fwd(const char* op, int64_t reduction, bool compute_grad) {
  check_reduction(op, reduction);
  TORCH_CHECK(!compute_grad || reduction != 0, op,
              ": compute_grad needs reduction mean (1) or sum (2); reduction none takes its "
              "gradient from linear_cross_entropy_bwd");
}

// linear_cross_entropy_bwd's grad_loss: (N,), one upstream gradient per row of hidden, any
// floating dtype.
inline void check_grad_loss(const Backend& be, const char* op, const at::Tensor& grad_loss,
                            const at::Tensor& hidden) {
  const int64_t n = hidden.size(0);
  check_device(be, op, "grad_loss", grad_loss, &hidden, "hidden");
  TORCH_CHECK(at::isFloatingType(grad_loss.scalar_type()), op,
              ": grad_loss must be a floating-point tensor, got ", grad_loss.scalar_type());
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == n, op, ": grad_loss must have shape (",
              n, ",), one upstream gradient per row, got shape ", grad_loss.sizes());
}

// linear_cross_entropy's rows per chunk: a chunk of logits takes about FASTFORMER_LCE_CHUNK_BYTES
// (16 MB), but at least 256 rows. Each chunk costs three GEMMs with M or K = rows and a few
// parallel regions; with fewer rows the multi-threaded GEMMs lose efficiency (measured on CPU:
// 256-row chunks cost ~1.8x the CPU time of one (2048, 256) x (256, 8000) GEMM on 2 threads,
// 1024-row chunks ~1.15x).
inline int64_t linear_cross_entropy_chunk_rows(int64_t n, int64_t V, int64_t elem_size) {
  int64_t rows = FASTFORMER_LCE_CHUNK_BYTES / std::max<int64_t>(1, V * elem_size);
  rows = std::max<int64_t>(256, rows / 16 * 16);
  return std::max<int64_t>(1, std::min(rows, n));
}

// linear_cross_entropy's rows per chunk on a GPU with free_bytes of memory to spare (the driver's
// free memory plus what the caching allocator holds unused). Each chunk's weight-gradient GEMM
// reads and writes the fp32 (V, D) accumulator, 8 V D bytes, against the chunk's three GEMMs'
// 6 C V D flops; on an H100 (~990 TFLOP/s dense 16-bit, ~3.35 TB/s) that traffic is at most ~10%
// of the GEMM time once C >= 4 * 990 / 3.35 / 3 / 0.1 ~ 3900, so 4096 rows: more gains nothing
// and costs memory. The (C, V) logits buffer takes at most 1/8 of free_bytes, so the chunk never
// is what runs the device out of memory (4096 rows of V = 32k in bf16: 256 MiB). Rows are a
// multiple of 64 (whole tensor-core tiles along the GEMMs' M / K), at least 256, at most n.
constexpr int64_t kLceDeviceChunkRows = 4096;

inline int64_t linear_cross_entropy_device_chunk_rows(int64_t n, int64_t V, int64_t elem_size,
                                                      int64_t free_bytes) {
  const int64_t row_bytes = std::max<int64_t>(1, V * elem_size);
  int64_t rows = std::min(kLceDeviceChunkRows, std::max<int64_t>(0, free_bytes) / 8 / row_bytes);
  rows = std::max<int64_t>(256, rows / 64 * 64);
  return std::max<int64_t>(1, std::min(rows, n));
}

// The gradients of linear_cross_entropy's chunk loop, undefined unless computed.
struct LinearCrossEntropyGrads {
  at::Tensor dhidden, dweight, dbias;
};

// linear_cross_entropy_fwd's returns (loss, dhidden, dweight, dbias). Without compute_grad the
// gradients are empty (0,) tensors: the schema returns four tensors either way.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_fwd_returns(
    const at::Tensor& loss, const LinearCrossEntropyGrads& g, bool compute_grad,
    const at::Tensor& hidden, const at::Tensor& weight) {
  if (!compute_grad) {
    return {loss, at::empty({0}, hidden.options()), at::empty({0}, weight.options()),
            at::empty({0}, weight.options())};
  }
  return {loss, g.dhidden, g.dweight, g.dbias};
}

}  // namespace checks
}  // namespace fastformer
