// add_layer_norm_fwd / add_layer_norm_bwd (and their .x_bias overloads) on CPU: the argument
// checks and the op registration, compiled once; the math is add_layer_norm_kernel.cpp, run at the
// ISA level isa.h chose.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "add_layer_norm.h"
#include "add_layer_norm_glue.h"
#include "large_buffers.h"
#include "../checks/add_layer_norm.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

using Fwd = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Bwd5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A contiguous view of `sizes` in `dtype` at byte `offset` (a multiple of 64) of the block, made
// without the dispatcher (as at::native::alias's)
at::Tensor block_view(const at::Tensor& block, at::IntArrayRef sizes, at::ScalarType dtype, int64_t offset) {
  const caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(block.storage()),
                                                             block.key_set(), meta);
  view.unsafeGetTensorImpl()->set_storage_offset(offset / static_cast<int64_t>(meta.itemsize()));
  view.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return view;
}
int64_t round_up_64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// The forward after its checks: y, and h, mean, rstd (one_block: [h] mean rstd in one allocation,
// each at a 64-byte boundary, given as the block and offsets, no tensors made for them: the
// autograd glue only keeps them for its backward, or drops h; a caller that differentiates h
// (prenorm) or receives it (the registered op's) has h_in_block false). They are never outputs of
// the registered op, whose schema promises no aliasing.
AddLayerNormFwdGlue fwd_run(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor* x_bias, double eps, double dropout_p,
                            int64_t seed, int64_t offset, bool rms_norm, bool one_block, bool h_in_block) {
  const int64_t N = x.size(0), C = x.size(1);
  AddLayerNormFwdGlue out;
  out.y = empty_large_like(x);  // pooled when large
  // (empty_large: at::empty without its dispatcher hops for these small ones)
  const at::ScalarType stat_dtype = checks::stat_dtype(x);
  void *h, *mean, *rstd;
  if (one_block) {
    const int64_t h_bytes = h_in_block ? round_up_64(N * C * static_cast<int64_t>(x.element_size())) : 0;
    const int64_t stat_bytes = round_up_64(N * static_cast<int64_t>(c10::elementSize(stat_dtype)));
    out.block = empty_large({h_bytes + 2 * stat_bytes}, x.options().dtype(at::kByte));
    out.mean_at = h_bytes;
    out.rstd_at = h_bytes + stat_bytes;
    char* base = static_cast<char*>(out.block.data_ptr());
    if (!h_in_block) out.h = empty_large_like(x);
    h = h_in_block ? base : out.h.data_ptr();
    mean = base + out.mean_at;
    rstd = base + out.rstd_at;
  } else {
    out.h = empty_large_like(x);
    const auto stat_options = x.options().dtype(stat_dtype);
    out.mean = empty_large({N}, stat_options);
    out.rstd = empty_large({N}, stat_options);
    h = out.h.data_ptr();
    mean = out.mean.data_ptr();
    rstd = out.rstd.data_ptr();
  }
  if (N == 0 || C == 0) return out;
  FF_ISA(add_layer_norm_fwd_kernel)(x, residual, weight, bias, x_bias ? *x_bias : at::Tensor(), out.y, h,
                                    mean, rstd, eps, dropout_p, static_cast<uint64_t>(seed),
                                    static_cast<uint64_t>(offset), rms_norm);
  return out;
}

Fwd fwd(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
        const at::Tensor& weight, const at::Tensor& bias, double eps, double dropout_p,
        const at::Tensor& philox, const at::Tensor* x_bias, bool rms_norm) {
  const bool has_res = checks::check_add_layer_norm_fwd(checks::kCpu, op, x, residual, weight,
                                                        bias, eps, dropout_p, x_bias);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  AddLayerNormFwdGlue out = fwd_run(x, has_res ? *residual : at::Tensor(), weight, bias, x_bias, eps,
                                    dropout_p, seed, offset, rms_norm, false, false);
  return {std::move(out.y), std::move(out.h), std::move(out.mean), std::move(out.rstd)};
}

// One empty tensor for every call whose dresidual is dx (the kernel only asks its numel)
const at::Tensor& no_dres() {
  static const at::Tensor empty = at::empty({0});
  return empty;
}

// The backward after its checks, of the rows dy (N, C) with h, mean, rstd the forward's memory:
// (dx, dresidual, dweight, dbias, dx_bias); dx_bias is undefined unless want_dx_bias. shared_dres:
// where dresidual is dx, return the one shared empty tensor, not a fresh one (the autograd glue's
// call, which then passes dx on)
Bwd5 bwd_run(const at::Tensor& dy, const at::Tensor& dh, const void* h, const at::Tensor& weight,
             const void* mean, const void* rstd, double dropout_p, int64_t seed, int64_t offset,
             bool has_residual, bool want_dx_bias, bool rms_norm, bool shared_dres) {
  const int64_t N = dy.size(0), C = dy.size(1);
  // dresidual = dh_total differs from dx only under dropout; otherwise it is returned empty
  const bool separate_dres = has_residual && dropout_p > 0.0;
  at::Tensor dx = empty_large_like(dy);
  at::Tensor dres = separate_dres ? empty_large_like(dy) : shared_dres ? no_dres() : empty_large({0}, dy.options());
  // (weight is contiguous: checked; empty_large_like is at::empty_like without the dispatcher)
  at::Tensor dweight = empty_large_like(weight), dbias = empty_large_like(weight);
  at::Tensor dx_bias = want_dx_bias ? empty_large_like(weight) : at::Tensor();
  if (N == 0 || C == 0) {
    dweight.zero_();
    dbias.zero_();
    if (want_dx_bias) dx_bias.zero_();
    return {dx, dres, dweight, dbias, dx_bias};
  }
  FF_ISA(add_layer_norm_bwd_kernel)(dy, dh, h, weight, mean, rstd, dx, dres, dweight, dbias, dx_bias,
                                    dropout_p, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                    rms_norm);
  return {std::move(dx), std::move(dres), std::move(dweight), std::move(dbias), std::move(dx_bias)};
}

Bwd5 bwd(
    const char* op, const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool want_dx_bias, bool rms_norm,
    bool shared_dres = false) {
  const bool has_dh =
      checks::check_add_layer_norm_bwd(checks::kCpu, op, dy, dh, h, weight, mean, rstd, dropout_p);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  return bwd_run(dy, has_dh ? *dh : at::Tensor(), h.const_data_ptr(), weight, mean.const_data_ptr(),
                 rstd.const_data_ptr(), dropout_p, seed, offset, has_residual, want_dx_bias, rms_norm,
                 shared_dres);
}

}  // namespace

Fwd add_layer_norm_fwd_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                           const at::Tensor& weight, const at::Tensor& bias, double eps,
                           double dropout_p, const at::Tensor& philox, bool rms_norm) {
  return fwd("add_layer_norm_fwd", x, residual, weight, bias, eps, dropout_p, philox, nullptr,
             rms_norm);
}

Fwd add_layer_norm_fwd_x_bias_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                  const at::Tensor& weight, const at::Tensor& bias, double eps,
                                  double dropout_p, const at::Tensor& philox,
                                  const at::Tensor& x_bias, bool rms_norm) {
  return fwd("add_layer_norm_fwd.x_bias", x, residual, weight, bias, eps, dropout_p, philox,
             &x_bias, rms_norm);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool rms_norm) {
  auto [dx, dres, dweight, dbias, unused] = bwd("add_layer_norm_bwd", dy, dh, h, weight, mean,
                                                rstd, dropout_p, philox, has_residual, false,
                                                rms_norm);
  return {dx, dres, dweight, dbias};
}

Bwd5 add_layer_norm_bwd_x_bias_cpu(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool rms_norm) {
  return bwd("add_layer_norm_bwd.x_bias", dy, dh, h, weight, mean, rstd, dropout_p, philox,
             has_residual, true, rms_norm);
}

AddLayerNormFwdGlue add_layer_norm_fwd_glue_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, const at::Tensor& bias, double eps,
                                                double dropout_p, const at::Tensor& philox, const at::Tensor* x_bias,
                                                bool rms_norm, bool one_block, bool h_in_block) {
  const char* op = x_bias ? "add_layer_norm_fwd.x_bias" : "add_layer_norm_fwd";
  const bool has_res = checks::check_add_layer_norm_fwd(checks::kCpu, op, x, residual, weight,
                                                        bias, eps, dropout_p, x_bias);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  return fwd_run(x, has_res ? *residual : at::Tensor(), weight, bias, x_bias, eps, dropout_p, seed, offset,
                 rms_norm, one_block, one_block && h_in_block);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_block_views(
    const at::Tensor& block, int64_t N, int64_t C, at::ScalarType dtype, bool h_in_block,
    int64_t mean_at, int64_t rstd_at) {
  const at::ScalarType stat_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;  // (checks::stat_dtype)
  return {h_in_block ? block_view(block, {N, C}, dtype, 0) : at::Tensor(),
          block_view(block, {N}, stat_dtype, mean_at), block_view(block, {N}, stat_dtype, rstd_at)};
}

Bwd5 add_layer_norm_bwd_glue_cpu(const at::Tensor& dy, const c10::optional<at::Tensor>& dh,
                                 const at::Tensor& h, const at::Tensor& weight, const at::Tensor& mean,
                                 const at::Tensor& rstd, double dropout_p, const at::Tensor& philox,
                                 bool has_residual, bool want_dx_bias, bool rms_norm) {
  return bwd(want_dx_bias ? "add_layer_norm_bwd.x_bias" : "add_layer_norm_bwd", dy, dh, h, weight, mean, rstd,
             dropout_p, philox, has_residual, want_dx_bias, rms_norm, true);
}

Bwd5 add_layer_norm_bwd_glue_cpu(const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const void* h,
                                 const at::Tensor& weight, const void* mean, const void* rstd, double dropout_p,
                                 const at::Tensor& philox, bool has_residual, bool want_dx_bias, bool rms_norm) {
  // the checks of the tensors given: dy as the rows (h's shape and dtype where the caller's memory
  // is what its forward wrote), dh like dy, weight of dy's C and dtype
  using namespace checks::add_layer_norm_detail;
  const char* op = want_dx_bias ? "add_layer_norm_bwd.x_bias" : "add_layer_norm_bwd";
  check_rows(checks::kCpu, op, "dy", dy);
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_like(checks::kCpu, op, "dh", *dh, dy, "dy");
  check_param(checks::kCpu, op, "weight", weight, dy, "dy");
  checks::check_dropout_p(op, dropout_p);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  return bwd_run(dy, has_dh ? *dh : at::Tensor(), h, weight, mean, rstd, dropout_p, seed, offset, has_residual,
                 want_dx_bias, rms_norm, true);
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("add_layer_norm_fwd", &fastformer::add_layer_norm_fwd_cpu);
  m.impl("add_layer_norm_bwd", &fastformer::add_layer_norm_bwd_cpu);
  m.impl("add_layer_norm_fwd.x_bias", &fastformer::add_layer_norm_fwd_x_bias_cpu);
  m.impl("add_layer_norm_bwd.x_bias", &fastformer::add_layer_norm_bwd_x_bias_cpu);
}
