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

// one_block (the autograd glue's call): mean, rstd and, with h_in_block, h as views of one
// allocation (the glue only saves them for its backward, or drops them: h is no output the user
// differentiates unless prenorm, which leaves it out of the block), so one allocation and one free
// where there were three. They are never outputs of the registered op, whose schema promises no
// aliasing.
Fwd fwd(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
        const at::Tensor& weight, const at::Tensor& bias, double eps, double dropout_p,
        const at::Tensor& philox, const at::Tensor* x_bias, bool rms_norm, bool one_block = false,
        bool h_in_block = false) {
  const bool has_res = checks::check_add_layer_norm_fwd(checks::kCpu, op, x, residual, weight,
                                                        bias, eps, dropout_p, x_bias);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const int64_t N = x.size(0), C = x.size(1);
  at::Tensor y = empty_large_like(x), h, mean, rstd;  // pooled when large
  // (empty_large: at::empty without its dispatcher hops for these small ones)
  const at::ScalarType stat_dtype = checks::stat_dtype(x);
  if (one_block) {  // [h] mean rstd, each at a 64-byte boundary
    const int64_t h_bytes = h_in_block ? round_up_64(N * C * static_cast<int64_t>(x.element_size())) : 0;
    const int64_t stat_bytes = round_up_64(N * static_cast<int64_t>(c10::elementSize(stat_dtype)));
    const at::Tensor block = empty_large({h_bytes + 2 * stat_bytes}, x.options().dtype(at::kByte));
    h = h_in_block ? block_view(block, {N, C}, x.scalar_type(), 0) : empty_large_like(x);
    mean = block_view(block, {N}, stat_dtype, h_bytes);
    rstd = block_view(block, {N}, stat_dtype, h_bytes + stat_bytes);
  } else {
    h = empty_large_like(x);
    const auto stat_options = x.options().dtype(stat_dtype);
    mean = empty_large({N}, stat_options);
    rstd = empty_large({N}, stat_options);
  }
  if (N == 0 || C == 0) return {y, h, mean, rstd};
  FF_ISA(add_layer_norm_fwd_kernel)(x, has_res ? *residual : at::Tensor(), weight, bias,
                                    x_bias ? *x_bias : at::Tensor(), y, h, mean, rstd, eps,
                                    dropout_p, static_cast<uint64_t>(seed),
                                    static_cast<uint64_t>(offset), rms_norm);
  return {y, h, mean, rstd};
}

// One empty tensor for every call whose dresidual is dx (the kernel only asks its numel)
const at::Tensor& no_dres() {
  static const at::Tensor empty = at::empty({0});
  return empty;
}

// (dx, dresidual, dweight, dbias, dx_bias); dx_bias is undefined unless want_dx_bias. shared_dres:
// where dresidual is dx, return the one shared empty tensor, not a fresh one (the autograd glue's
// call, which then passes dx on)
Bwd5 bwd(
    const char* op, const at::Tensor& dy, const c10::optional<at::Tensor>& dh, const at::Tensor& h,
    const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
    const at::Tensor& philox, bool has_residual, bool want_dx_bias, bool rms_norm,
    bool shared_dres = false) {
  const bool has_dh =
      checks::check_add_layer_norm_bwd(checks::kCpu, op, dy, dh, h, weight, mean, rstd, dropout_p);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const int64_t N = h.size(0), C = h.size(1);
  // dresidual = dh_total differs from dx only under dropout; otherwise it is returned empty
  const bool separate_dres = has_residual && dropout_p > 0.0;
  at::Tensor dx = empty_large_like(h);
  at::Tensor dres = separate_dres ? empty_large_like(h) : shared_dres ? no_dres() : empty_large({0}, h.options());
  // (weight is contiguous: checked; empty_large_like is at::empty_like without the dispatcher)
  at::Tensor dweight = empty_large_like(weight), dbias = empty_large_like(weight);
  at::Tensor dx_bias = want_dx_bias ? empty_large_like(weight) : at::Tensor();
  if (N == 0 || C == 0) {
    dweight.zero_();
    dbias.zero_();
    if (want_dx_bias) dx_bias.zero_();
    return {dx, dres, dweight, dbias, dx_bias};
  }
  FF_ISA(add_layer_norm_bwd_kernel)(dy, has_dh ? *dh : at::Tensor(), h, weight, mean, rstd, dx,
                                    dres, dweight, dbias, dx_bias, dropout_p,
                                    static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                                    rms_norm);
  return {dx, dres, dweight, dbias, dx_bias};
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

Fwd add_layer_norm_fwd_glue_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                const at::Tensor& weight, const at::Tensor& bias, double eps,
                                double dropout_p, const at::Tensor& philox, const at::Tensor* x_bias,
                                bool rms_norm, bool one_block, bool h_in_block) {
  return fwd(x_bias ? "add_layer_norm_fwd.x_bias" : "add_layer_norm_fwd", x, residual, weight, bias, eps,
             dropout_p, philox, x_bias, rms_norm, one_block, one_block && h_in_block);
}

Bwd5 add_layer_norm_bwd_glue_cpu(const at::Tensor& dy, const c10::optional<at::Tensor>& dh,
                                 const at::Tensor& h, const at::Tensor& weight, const at::Tensor& mean,
                                 const at::Tensor& rstd, double dropout_p, const at::Tensor& philox,
                                 bool has_residual, bool want_dx_bias, bool rms_norm) {
  return bwd(want_dx_bias ? "add_layer_norm_bwd.x_bias" : "add_layer_norm_bwd", dy, dh, h, weight, mean, rstd,
             dropout_p, philox, has_residual, want_dx_bias, rms_norm, true);
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("add_layer_norm_fwd", &fastformer::add_layer_norm_fwd_cpu);
  m.impl("add_layer_norm_bwd", &fastformer::add_layer_norm_bwd_cpu);
  m.impl("add_layer_norm_fwd.x_bias", &fastformer::add_layer_norm_fwd_x_bias_cpu);
  m.impl("add_layer_norm_bwd.x_bias", &fastformer::add_layer_norm_bwd_x_bias_cpu);
}
