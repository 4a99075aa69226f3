// attention_varlen on CUDA: the glue of the fused kernels of attention.cu, which the padded op
// shares (schema in csrc/schemas.h, checks in csrc/checks/attention_varlen.h), and, for 16-bit
// inputs, of the tensor-core kernels flash_fwd_mma.cu (forward) and flash_bwd_mma.cu (backward).
// The host never reads cu_seqlens (that would synchronise with the device): the kernels read them
// and clamp every sequence to the tensors' rows. Only out and lse are made by the forward; the
// backward adds the fp32 delta (H, total_q) and the three gradients: nothing of size Lq x Lk
// exists.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "attention_call.h"
#include "flash_mma.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/attention_varlen.h"
#include "../kv_groups.h"

namespace fastformer {
namespace {

// lse and delta: (H, total_q) contiguous fp32.
FfRows stat_rows(int64_t total_q) { return {0, 1, total_q}; }

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    double scale, double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias) {
  const char* op = "attention_varlen_fwd";
  const auto dims = checks::check_varlen_qkv(kFfBackend, op, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, scale, dropout_p);
  const int64_t R = checks::check_rel_bias(kFfBackend, op, q, rel_bias, dims.H);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, q, dropout_p);
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  if (dims.total_q * dims.H == 0 || dims.total_k == 0 || dims.max_seqlen_k == 0) {
    // no query, or no key for any query: out 0, lse +inf
    return {at::zeros({dims.total_q, dims.H, dims.D}, q.options()),
            at::full({dims.H, dims.total_q}, std::numeric_limits<float>::infinity(), f32)};
  }
  at::Tensor out = at::empty({dims.total_q, dims.H, dims.D}, q.options());  // (total_q, H, D)
  at::Tensor lse = at::empty({dims.H, dims.total_q}, f32);                  // (H, total_q)
  FfAttentionCall call(q, k, v, cu_seqlens_q, cu_seqlens_k, dims, is_causal, scale, dropout_p, rng, dtype);
  call.set_rel_bias(rel_bias, R, 0);
  const FfAttentionArgs& a = call.a;
  // 16-bit inputs on tensor cores wherever that kernel takes the call (an sm_80+ GPU), fp32 too as
  // tf32 where torch allows tf32 matmuls (D <= 128); else the FMA kernel (fp32 exact). Both write
  // the same out / lse, so the backward reads either. Both take a rel_bias.
  const FfFlashFwdArgs flash = call.flash(ff_packed_rows(out), stat_rows(dims.total_q));
  if (flash_fwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(launch_flash_fwd_mma(flash, out.data_ptr(), lse.data_ptr<float>(), ff_stream(q)));
  } else {
    FF_CHECK_LAUNCH(launch_attention_fwd(a, out.data_ptr(), ff_packed_rows(out),
                                         lse.data_ptr<float>(), stat_rows(dims.total_q), ff_stream(q)));
  }
  return {out, lse};
}

// The backward into dq, dk, dv (checked by the caller), written through their strides; every
// element of them is written. Returns rel_bias's gradient (checks::rel_bias_grad).
at::Tensor attention_varlen_bwd_into(const char* op, const at::Tensor& dout, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                               bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
                               const std::optional<at::Tensor>& rel_bias, at::Tensor& dq, at::Tensor& dk,
                               at::Tensor& dv) {
  const auto dims = checks::check_varlen_qkv(kFfBackend, op, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, scale, dropout_p);
  checks::check_varlen_bwd_tensors(kFfBackend, op, dout, out, lse_in, q, dims);
  const int64_t R = checks::check_rel_bias(kFfBackend, op, q, rel_bias, dims.H);
  const FfPhiloxArgs rng = ff_philox_args(philox, op, q, dropout_p);
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  if (dims.total_q * dims.H == 0 || dims.total_k == 0 || dims.max_seqlen_k == 0 ||
      dims.max_seqlen_q == 0) {  // nothing flows: every gradient is 0
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return checks::rel_bias_grad(q, dims.H, R);
  }
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor delta = at::empty({dims.H, dims.total_q}, q.options().dtype(at::kFloat));  // (H, total_q)
  FfAttentionCall call(q, k, v, cu_seqlens_q, cu_seqlens_k, dims, is_causal, scale, dropout_p, rng, dtype);
  call.set_rel_bias(rel_bias, R, 0);
  const FfAttentionArgs& a = call.a;
  // Both kernels write the rows the sequences own; rows no sequence owns (cu_seqlens ending before
  // total, or out of range: unknown to the host, which never reads them) get 0 here.
  // Grouped-query (k with fewer heads): dK / dV per query head, each group summed after.
  const bool grouped = k.size(1) != dims.H;
  at::Tensor dk_h = grouped ? kv_grad_per_query_head(k, dims.H) : dk;
  at::Tensor dv_h = grouped ? kv_grad_per_query_head(v, dims.H) : dv;
  dq.zero_();
  dk_h.zero_();
  dv_h.zero_();
  FfAttentionGrads g{dout.const_data_ptr(), ff_packed_rows(dout), out.const_data_ptr(),
                     ff_packed_rows(out), lse.const_data_ptr<float>(), delta.data_ptr<float>(),
                     stat_rows(dims.total_q), dq.data_ptr(), ff_packed_rows(dq), dk_h.data_ptr(),
                     ff_packed_rows(dk_h), dv_h.data_ptr(), ff_packed_rows(dv_h)};
  const FfAttentionCall::RelGrad rel_grad = call.rel_grad_partial(q);  // with a rel_bias (FMA kernels)
  rel_grad.describe(g);
  // 16-bit inputs on the tensor-core backward wherever flash_bwd_mma_why_not admits the call (an
  // sm_80+ GPU, no rel_bias); else, and for fp32, the FMA kernels. lse / delta (H, total_q)
  // contiguous.
  const FfFlashFwdArgs flash = call.flash(ff_packed_rows(out), stat_rows(dims.total_q));
  if (flash_bwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(ff_launch_flash_bwd_mma(flash, g, q, ff_stream(q)));
  } else {
    FF_CHECK_LAUNCH(launch_attention_bwd(a, g, ff_stream(q)));
  }
  if (grouped) {
    sum_kv_groups(dk_h, dk);
    sum_kv_groups(dv_h, dv);
  }
  return call.rel_grad_sum(rel_grad, q);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    double scale, double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias) {
  const char* op = "attention_varlen_bwd";
  checks::check_varlen_qkv(kFfBackend, op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, scale, dropout_p);  // before empty_like reads q, k, v
  // laid out like empty_like (the fake implementation's promise)
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor drel = attention_varlen_bwd_into(op, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p, philox,
                                              rel_bias, dq, dk, dv);
  return {dq, dk, dv, drel};
}

at::Tensor attention_varlen_bwd_into_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal,
    double scale, double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias,
    at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const char* op = "attention_varlen_bwd.into";
  checks::check_varlen_bwd_into(kFfBackend, op, dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, scale, dropout_p, dq, dk, dv);
  return attention_varlen_bwd_into(op, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, is_causal, scale, dropout_p, philox, rel_bias, dq, dk, dv);
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("attention_varlen_fwd", &fastformer::attention_varlen_fwd_cuda);
  m.impl("attention_varlen_bwd", &fastformer::attention_varlen_bwd_cuda);
  m.impl("attention_varlen_bwd.into", &fastformer::attention_varlen_bwd_into_cuda);
}
