// Attention on CUDA: the glue. The four products are batched GEMMs through ATen; the row kernels
// of attention.cu do everything between them (masks, softmax, lse, dropout, softmax backward).
//   forward:  s = q k^T (fp32)  ->  p_d = dropout(softmax(scale s + masks)), lse  ->  out = p_d v
//   backward: s = q k^T again   ->  P (fp32, over s) and P_d  ->  dv = P_d^T dout; free P_d;
//             dp = dout v^T (fp32)  ->  ds = scale P (dp Z - delta)  ->  dq = ds k, dk = ds^T q
// Scores and dp are fp32 (fp32 copies of fp16 / bf16 operands); p_d and ds are in the input dtype,
// as the reference casts the probabilities to v's dtype for its second product. Each (B, H, Sq, Sk)
// temporary is released as soon as its last product has read it; only lse is kept for backward.
// Schema, checks and return conventions as csrc/cpu/attention.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <tuple>

#include "glue.h"
#include "launchers.h"
#include "../checks/attention.h"

namespace fastformer {
namespace {

// The checked masks as the launchers take them; `kpm` and `am` hold the tensors the kernels read.
struct MaskArgs {
  at::Tensor kpm, am;
  std::array<int64_t, 4> am_s{};
  explicit MaskArgs(const checks::AttentionMasks& m)
      : kpm(m.key_padding_mask.defined() ? m.key_padding_mask.contiguous() : at::Tensor()),
        am(m.attn_mask),
        am_s(m.attn_mask_strides) {}
  const bool* kpm_ptr() const { return kpm.defined() ? kpm.const_data_ptr<bool>() : nullptr; }
  const float* am_ptr() const { return am.defined() ? am.const_data_ptr<float>() : nullptr; }
};

// x as an fp32 tensor (x itself when it is fp32).
at::Tensor as_fp32(const at::Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat); }

// The gradient of x laid out like empty_like(x) (the fake implementation's promise), from g.
at::Tensor grad_like(const at::Tensor& x, const at::Tensor& g) {
  if (x.is_contiguous() && g.is_contiguous()) return g;
  at::Tensor r = at::empty_like(x);
  r.copy_(g);
  return r;
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox) {
  const char* op = "attention_fwd";
  const auto dims = checks::check_attention_qkv(kFfBackend, op, q, k, v, scale, dropout_p);
  const MaskArgs m(checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims));
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
  const auto [B, H, Sq, Sk, D] = dims;
  c10::DeviceGuard guard(q.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // the GEMMs are internal steps

  const int dtype = ff_dtype_code(q, "q", op);
  if (B * H * Sq == 0 || Sk == 0) {  // no query, or no key: out 0, lse +inf
    return {at::zeros({B, H, Sq, D}, q.options()),
            at::full({B, H, Sq}, std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat))};
  }
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));  // (B, H, Sq)
  at::Tensor s = at::matmul(as_fp32(q), as_fp32(k).transpose(-2, -1)).contiguous();  // (B, H, Sq, Sk)
  // fp32: the probabilities overwrite the scores
  at::Tensor p = dtype == 0 ? s : at::empty({B, H, Sq, Sk}, q.options());  // (B, H, Sq, Sk)
  FF_CHECK_LAUNCH(launch_attention_softmax_fwd(
      s.const_data_ptr<float>(), p.data_ptr(), lse.data_ptr<float>(), B, H, Sq, Sk, dtype, scale,
      m.kpm_ptr(), m.am_ptr(), m.am_s[0], m.am_s[1], m.am_s[2], m.am_s[3], is_causal ? 1 : 0,
      dropout_p, rng.seed, rng.offset, ff_stream(q)));
  s.reset();
  at::Tensor out = at::matmul(p, v).contiguous();  // (B, H, Sq, D)
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_mask, bool is_causal, double scale, double dropout_p,
    const at::Tensor& philox) {
  const char* op = "attention_bwd";
  const auto dims = checks::check_attention_qkv(kFfBackend, op, q, k, v, scale, dropout_p);
  checks::check_attention_bwd_tensors(kFfBackend, op, dout, out, lse_in, q, dims);
  const MaskArgs m(checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims));
  const auto [B, H, Sq, Sk, D] = dims;
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
  c10::DeviceGuard guard(q.device());
  at::AutoDispatchBelowADInplaceOrView below_autograd;

  const int dtype = ff_dtype_code(q, "q", op);
  if (B * H * Sq == 0 || Sk == 0) {  // nothing flows: every gradient is 0
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v)};
  }
  const at::Tensor lse = lse_in.contiguous();
  void* stream = ff_stream(q);

  at::Tensor prob = at::matmul(as_fp32(q), as_fp32(k).transpose(-2, -1)).contiguous();  // (B, H, Sq, Sk)
  // P_d for dv, always its own tensor: prob marks hidden keys for the softmax backward, where P_d
  // is NaN in a NaN row as the reference's. It is freed before dp is made, so at most two fp32
  // (B, H, Sq, Sk) tensors live at once (prob and dp; plus ds for fp16 / bf16).
  at::Tensor dropped = at::empty({B, H, Sq, Sk}, q.options());  // (B, H, Sq, Sk)
  FF_CHECK_LAUNCH(launch_attention_probs_bwd(
      prob.data_ptr<float>(), dropped.data_ptr(),
      lse.const_data_ptr<float>(), B, H, Sq, Sk, dtype, scale, m.kpm_ptr(), m.am_ptr(), m.am_s[0],
      m.am_s[1], m.am_s[2], m.am_s[3], is_causal ? 1 : 0, dropout_p, rng.seed, rng.offset, stream));
  at::Tensor dv = at::matmul(dropped.transpose(-2, -1), dout);  // (B, H, Sk, D)
  dropped.reset();

  at::Tensor dp = at::matmul(as_fp32(dout), as_fp32(v).transpose(-2, -1)).contiguous();  // (B, H, Sq, Sk)
  at::Tensor ds = dtype == 0 ? dp : at::empty({B, H, Sq, Sk}, q.options());  // (B, H, Sq, Sk)
  FF_CHECK_LAUNCH(launch_attention_softmax_bwd(
      prob.const_data_ptr<float>(), dp.const_data_ptr<float>(), ds.data_ptr(), dout.const_data_ptr(),
      dout.stride(0), dout.stride(1), dout.stride(2), out.const_data_ptr(), out.stride(0),
      out.stride(1), out.stride(2), B, H, Sq, Sk, D, dtype, scale, dropout_p, rng.seed, rng.offset,
      stream));
  prob.reset();
  dp.reset();
  at::Tensor dq = at::matmul(ds, k);                   // (B, H, Sq, D)
  at::Tensor dk = at::matmul(ds.transpose(-2, -1), q);  // (B, H, Sk, D)
  ds.reset();
  return {grad_like(q, dq), grad_like(k, dk), grad_like(v, dv)};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("attention_fwd", &fastformer::attention_fwd_cuda);
  m.impl("attention_bwd", &fastformer::attention_bwd_cuda);
}
