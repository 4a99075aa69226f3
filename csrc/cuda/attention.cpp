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
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include "glue.h"
#include "launchers.h"

namespace fastformer {
namespace {

constexpr int64_t kMaxHeadDim = 256;

void check_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor* q) {
  ff_check_tensor(t, name, op);
  if (q != nullptr) {
    TORCH_CHECK(t.device() == q->device(), op, ": ", name, " must be on q's device (", q->device(),
                "), got ", t.device());
  }
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D (B, H, S, D), got shape ", t.sizes());
  ff_dtype_code(t, name, op);
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1 || t.numel() == 0, op, ": ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but q has dtype ", q.scalar_type(), "; they must match");
}

// Checks q, k, v and the scalars; returns (B, H, Sq, Sk, D).
std::array<int64_t, 5> check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, double scale, double dropout_p) {
  check_operand(op, "q", q, nullptr);
  check_operand(op, "k", k, &q);
  check_operand(op, "v", v, &q);
  check_same_dtype(op, "k", k, q);
  check_same_dtype(op, "v", v, q);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, op,
              ": k must have shape (B, H, Sk, D) = (", B, ", ", H, ", Sk, ", D, ") to match q ",
              q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  ff_check_dropout_p(dropout_p, op);
  return {B, H, Sq, Sk, D};
}

// The masks as the launchers take them; `kpm` and `am` hold the tensors read by the kernels.
struct MaskArgs {
  at::Tensor kpm, am;
  int64_t am_s[4] = {0, 0, 0, 0};
  const bool* kpm_ptr() const { return kpm.defined() ? kpm.const_data_ptr<bool>() : nullptr; }
  const float* am_ptr() const { return am.defined() ? am.const_data_ptr<float>() : nullptr; }
};

MaskArgs check_masks(const char* op, const at::Tensor& q,
                     const std::optional<at::Tensor>& key_padding_mask,
                     const std::optional<at::Tensor>& attn_mask, const std::array<int64_t, 5>& dims) {
  const auto [B, H, Sq, Sk, D] = dims;
  MaskArgs m;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& kpm = *key_padding_mask;
    ff_check_tensor(kpm, "key_padding_mask", op);
    TORCH_CHECK(kpm.device() == q.device(), op, ": key_padding_mask must be on q's device (",
                q.device(), "), got ", kpm.device());
    TORCH_CHECK(kpm.scalar_type() == at::kBool, op,
                ": key_padding_mask must be bool (True = padded), got ", kpm.scalar_type());
    TORCH_CHECK(kpm.dim() == 2 && kpm.size(0) == B && kpm.size(1) == Sk, op,
                ": key_padding_mask must have shape (B, Sk) = (", B, ", ", Sk, "), got ", kpm.sizes());
    m.kpm = kpm.contiguous();
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& am = *attn_mask;
    ff_check_tensor(am, "attn_mask", op);
    TORCH_CHECK(am.device() == q.device(), op, ": attn_mask must be on q's device (", q.device(),
                "), got ", am.device());
    TORCH_CHECK(am.scalar_type() == at::kFloat, op, ": attn_mask must be float32 (additive), got ",
                am.scalar_type());
    TORCH_CHECK(am.dim() == 4, op,
                ": attn_mask must be a 4-D view broadcast to (B, H, Sq, Sk), got shape ", am.sizes());
    const int64_t want[4] = {B, H, Sq, Sk};
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(am.size(d) == want[d] || am.size(d) == 1, op, ": attn_mask of shape ", am.sizes(),
                  " does not broadcast to (B, H, Sq, Sk) = (", B, ", ", H, ", ", Sq, ", ", Sk, ")");
      m.am_s[d] = am.size(d) == 1 ? 0 : am.stride(d);
    }
    m.am = am;
  }
  return m;
}

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
  const auto dims = check_qkv(op, q, k, v, scale, dropout_p);
  const MaskArgs m = check_masks(op, q, key_padding_mask, attn_mask, dims);
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
  const auto dims = check_qkv(op, q, k, v, scale, dropout_p);
  const auto [B, H, Sq, Sk, D] = dims;
  check_operand(op, "dout", dout, &q);
  check_operand(op, "out", out, &q);
  check_same_dtype(op, "dout", dout, q);
  check_same_dtype(op, "out", out, q);
  TORCH_CHECK(dout.sizes() == q.sizes(), op, ": dout must have q's shape ", q.sizes(), ", got ",
              dout.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), op, ": out must have q's shape ", q.sizes(), ", got ",
              out.sizes());
  ff_check_tensor(lse_in, "lse", op);
  TORCH_CHECK(lse_in.device() == q.device(), op, ": lse must be on q's device (", q.device(),
              "), got ", lse_in.device());
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat, op, ": lse must be float32, got ",
              lse_in.scalar_type());
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == B && lse_in.size(1) == H && lse_in.size(2) == Sq,
              op, ": lse must have shape (B, H, Sq) = (", B, ", ", H, ", ", Sq, "), got ",
              lse_in.sizes());
  const MaskArgs m = check_masks(op, q, key_padding_mask, attn_mask, dims);
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
