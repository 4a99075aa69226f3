// Attention on CUDA: the glue of the fused kernels of attention.cu (FlashAttention-2's algorithm,
// shared with attention_varlen) and, for the forward of 16-bit inputs, of the tensor-core kernel
// flash_fwd_mma.cu. The forward makes out (B, H, Sq, D) and lse (B, H, Sq) fp32 only; the
// backward adds the fp32 delta (B, H, Sq) and the three gradients. Nothing of size Sq x Sk exists
// at any point. q, k, v, dout and out are read through their strides (unit stride along D); the
// masks as csrc/checks/attention.h returns them (key_padding_mask made contiguous, attn_mask a
// broadcast fp32 view read through its strides). Schema, checks and return conventions as
// csrc/cpu/attention.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <tuple>

#include "attention_call.h"
#include "flash_mma.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/attention.h"
#include "../kv_groups.h"

namespace fastformer {
namespace {

// lse and delta: (B, H, Sq) contiguous fp32.
FfRows stat_rows(int64_t H, int64_t Sq) { return {H * Sq, 1, Sq}; }

// The gradient of x laid out like empty_like(x) (the fake implementation's promise) where that
// has a unit stride along D, which the kernels write through; else contiguous.
at::Tensor grad_like(const at::Tensor& x) {
  at::Tensor g = at::empty_like(x);
  return g.stride(-1) == 1 || g.size(-1) == 1 ? g : at::empty(x.sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
    const std::optional<at::Tensor>& rel_bias, int64_t rel_shift) {
  const char* op = "attention_fwd";
  const auto dims = checks::check_attention_qkv(kFfBackend, op, q, k, v, scale, dropout_p);
  const auto masks = checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims);
  const int64_t R = checks::check_rel_bias(kFfBackend, op, q, rel_bias, dims[1], rel_shift);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, q, dropout_p);
  const auto [B, H, Sq, Sk, D] = dims;
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  if (B * H * Sq == 0 || Sk == 0) {  // no query, or no key: out 0, lse +inf
    return {at::zeros({B, H, Sq, D}, q.options()),
            at::full({B, H, Sq}, std::numeric_limits<float>::infinity(), f32)};
  }
  FfAttentionCall call(q, k, v, masks, dims, is_causal, scale, dropout_p, rng, dtype);
  call.set_rel_bias(rel_bias, R, rel_shift);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());  // (B, H, Sq, D)
  at::Tensor lse = at::empty({B, H, Sq}, f32);              // (B, H, Sq)
  // 16-bit inputs on tensor cores wherever that kernel takes the call (flash_fwd_mma_why_not: an
  // sm_80+ GPU, an attn_mask with a unit key stride), fp32 too as tf32 where torch allows tf32
  // matmuls (D <= 128); else the FMA kernel (fp32 exact). Both write the same out / lse
  // contract, so the backward (FMA) reads either. Both take a rel_bias.
  const FfFlashFwdArgs flash = call.flash();
  if (flash_fwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(launch_flash_fwd_mma(flash, out.data_ptr(), lse.data_ptr<float>(), ff_stream(q)));
  } else {
    FF_CHECK_LAUNCH(launch_attention_fwd(call.a, out.data_ptr(), ff_heads_rows(out),
                                         lse.data_ptr<float>(), stat_rows(H, Sq), ff_stream(q)));
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, double scale, double dropout_p,
    const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias, int64_t rel_shift) {
  const char* op = "attention_bwd";
  const auto dims = checks::check_attention_qkv(kFfBackend, op, q, k, v, scale, dropout_p);
  checks::check_attention_bwd_tensors(kFfBackend, op, dout, out, lse_in, q, dims);
  const auto masks = checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims);
  const int64_t R = checks::check_rel_bias(kFfBackend, op, q, rel_bias, dims[1], rel_shift);
  const auto [B, H, Sq, Sk, D] = dims;
  const FfPhiloxArgs rng = ff_philox_args(philox, op, q, dropout_p);
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  if (B * H * Sq == 0 || Sk == 0) {  // nothing flows: every gradient is 0
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v), checks::rel_bias_grad(q, H, R)};
  }
  FfAttentionCall call(q, k, v, masks, dims, is_causal, scale, dropout_p, rng, dtype);
  call.set_rel_bias(rel_bias, R, rel_shift);
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));  // (B, H, Sq)
  at::Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  // grouped-query (k with fewer heads): dK / dV per query head, each group summed after
  const bool grouped = k.size(1) != H;
  at::Tensor dk_h = grouped ? kv_grad_per_query_head(k, H) : dk;
  at::Tensor dv_h = grouped ? kv_grad_per_query_head(v, H) : dv;
  FfAttentionGrads g{dout.const_data_ptr(), ff_heads_rows(dout), out.const_data_ptr(),
                     ff_heads_rows(out), lse.const_data_ptr<float>(), delta.data_ptr<float>(),
                     stat_rows(H, Sq), dq.data_ptr(), ff_heads_rows(dq), dk_h.data_ptr(),
                     ff_heads_rows(dk_h), dv_h.data_ptr(), ff_heads_rows(dv_h)};
  const FfAttentionCall::RelGrad rel_grad = call.rel_grad_partial(q);  // with a rel_bias (FMA kernels)
  rel_grad.describe(g);
  // 16-bit inputs on the tensor-core backward (flash_bwd_mma.cu) wherever flash_bwd_mma_why_not
  // admits the call (the forward's rule: an sm_80+ GPU, an attn_mask with a unit key stride, no
  // rel_bias); else, and for fp32, the FMA kernels.
  const FfFlashFwdArgs flash = call.flash();
  if (flash_bwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(ff_launch_flash_bwd_mma(flash, g, q, ff_stream(q)));
  } else {
    FF_CHECK_LAUNCH(launch_attention_bwd(call.a, g, ff_stream(q)));
  }
  if (grouped) {
    sum_kv_groups(dk_h, dk);
    sum_kv_groups(dv_h, dv);
  }
  return {dq, dk, dv, call.rel_grad_sum(rel_grad, q)};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("attention_fwd", &fastformer::attention_fwd_cuda);
  m.impl("attention_bwd", &fastformer::attention_bwd_cuda);
}
