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

#include "flash_mma.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/attention.h"

namespace fastformer {
namespace {

// The rows of a (B, H, S, D) operand, as the kernels address them.
FfRows heads_rows(const at::Tensor& t) { return {t.stride(0), t.stride(2), t.stride(1)}; }

// lse and delta: (B, H, Sq) contiguous fp32.
FfRows stat_rows(int64_t H, int64_t Sq) { return {H * Sq, 1, Sq}; }

// The launchers' description of one call; `kpm` keeps the contiguous key_padding_mask alive.
struct Call {
  at::Tensor kpm;
  FfAttentionArgs a{};
  Call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
       const checks::AttentionMasks& m, const std::array<int64_t, 5>& dims, bool is_causal,
       double scale, double dropout_p, const FfPhiloxArgs& rng, int dtype) {
    const auto [B, H, Sq, Sk, D] = dims;
    a.q = q.const_data_ptr();
    a.k = k.const_data_ptr();
    a.v = v.const_data_ptr();
    a.q_s = heads_rows(q);
    a.k_s = heads_rows(k);
    a.v_s = heads_rows(v);
    a.cu_seqlens_q = nullptr;  // every sequence: Sq queries, Sk keys
    a.cu_seqlens_k = nullptr;
    a.B = B;
    a.H = H;
    a.D = D;
    a.total_q = Sq;
    a.total_k = Sk;
    a.max_seqlen_q = Sq;
    a.max_seqlen_k = Sk;
    if (m.key_padding_mask.defined()) {
      kpm = m.key_padding_mask.contiguous();
      a.key_padding_mask = kpm.const_data_ptr<bool>();
    } else {
      a.key_padding_mask = nullptr;
    }
    a.attn_mask = m.attn_mask.defined() ? m.attn_mask.const_data_ptr<float>() : nullptr;
    a.am_sb = m.attn_mask_strides[0];
    a.am_sh = m.attn_mask_strides[1];
    a.am_sq = m.attn_mask_strides[2];
    a.am_sk = m.attn_mask_strides[3];
    a.dtype = dtype;
    a.causal = is_causal;
    a.scale = scale;
    a.dropout_p = dropout_p;
    a.seed = rng.seed;
    a.offset = rng.offset;
  }

  // The same call for the tensor-core forward (flash_fwd_mma.cu), padded rows only.
  FfFlashFwdArgs flash() const {
    FfFlashFwdArgs f{};
    f.q = a.q;
    f.k = a.k;
    f.v = a.v;
    f.q_sb = a.q_s.batch, f.q_sh = a.q_s.head, f.q_ss = a.q_s.row;
    f.k_sb = a.k_s.batch, f.k_sh = a.k_s.head, f.k_ss = a.k_s.row;
    f.v_sb = a.v_s.batch, f.v_sh = a.v_s.head, f.v_ss = a.v_s.row;
    f.B = a.B, f.H = a.H, f.Sq = a.total_q, f.Sk = a.total_k, f.D = a.D;
    f.dtype = a.dtype;
    f.causal = a.causal;
    f.scale = a.scale;
    f.kpm = a.key_padding_mask;
    f.kpm_sb = a.total_k;  // kpm is (B, Sk) contiguous
    f.am = a.attn_mask;
    f.am_sb = a.am_sb, f.am_sh = a.am_sh, f.am_sq = a.am_sq, f.am_sk = a.am_sk;
    f.dropout_p = a.dropout_p;
    f.seed = a.seed;
    f.offset = a.offset;
    f.allow_tf32 = at::globalContext().allowTF32CuBLAS();  // torch.backends.cuda.matmul.allow_tf32
    return f;
  }
};

// The gradient of x laid out like empty_like(x) (the fake implementation's promise) where that
// has a unit stride along D, which the kernels write through; else contiguous.
at::Tensor grad_like(const at::Tensor& x) {
  at::Tensor g = at::empty_like(x);
  return g.stride(-1) == 1 || g.size(-1) == 1 ? g : at::empty(x.sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox) {
  const char* op = "attention_fwd";
  const auto dims = checks::check_attention_qkv(kFfBackend, op, q, k, v, scale, dropout_p);
  const auto masks = checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims);
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
  const auto [B, H, Sq, Sk, D] = dims;
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  const auto f32 = q.options().dtype(at::kFloat);
  if (B * H * Sq == 0 || Sk == 0) {  // no query, or no key: out 0, lse +inf
    return {at::zeros({B, H, Sq, D}, q.options()),
            at::full({B, H, Sq}, std::numeric_limits<float>::infinity(), f32)};
  }
  const Call call(q, k, v, masks, dims, is_causal, scale, dropout_p, rng, dtype);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());  // (B, H, Sq, D)
  at::Tensor lse = at::empty({B, H, Sq}, f32);              // (B, H, Sq)
  // 16-bit inputs on tensor cores wherever that kernel takes the call (flash_fwd_mma_why_not: an
  // sm_80+ GPU, an attn_mask with a unit key stride), fp32 too as tf32 where torch allows tf32
  // matmuls (D <= 128); else the FMA kernel (fp32 exact). Both write the same out / lse
  // contract, so the backward (FMA) reads either.
  const FfFlashFwdArgs flash = call.flash();
  if (flash_fwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(launch_flash_fwd_mma(flash, out.data_ptr(), lse.data_ptr<float>(), ff_stream(q)));
  } else {
    FF_CHECK_LAUNCH(launch_attention_fwd(call.a, out.data_ptr(), heads_rows(out), lse.data_ptr<float>(),
                                         stat_rows(H, Sq), ff_stream(q)));
  }
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
  const auto masks = checks::check_attention_masks(kFfBackend, op, q, key_padding_mask, attn_mask, dims);
  const auto [B, H, Sq, Sk, D] = dims;
  const FfPhiloxArgs rng = ff_philox_args(philox, op);
  const int dtype = ff_dtype_code(q, "q", op);
  c10::DeviceGuard guard(q.device());
  if (B * H * Sq == 0 || Sk == 0) {  // nothing flows: every gradient is 0
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v)};
  }
  const Call call(q, k, v, masks, dims, is_causal, scale, dropout_p, rng, dtype);
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));  // (B, H, Sq)
  at::Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  const FfAttentionGrads g{dout.const_data_ptr(), heads_rows(dout), out.const_data_ptr(), heads_rows(out),
                           lse.const_data_ptr<float>(), delta.data_ptr<float>(), stat_rows(H, Sq),
                           dq.data_ptr(), heads_rows(dq), dk.data_ptr(), heads_rows(dk),
                           dv.data_ptr(), heads_rows(dv)};
  // 16-bit inputs on the tensor-core backward (flash_bwd_mma.cu) wherever flash_bwd_mma_why_not
  // admits the call (the forward's rule: an sm_80+ GPU, an attn_mask with a unit key stride);
  // else, and for fp32, the FMA kernels.
  const FfFlashFwdArgs flash = call.flash();
  if (flash_bwd_mma_why_not(flash) == nullptr) {
    FF_CHECK_LAUNCH(launch_flash_bwd_mma(ff_flash_bwd_args(flash, g), ff_stream(q)));
    return {dq, dk, dv};
  }
  FF_CHECK_LAUNCH(launch_attention_bwd(call.a, g, ff_stream(q)));
  return {dq, dk, dv};
}

}  // namespace
}  // namespace fastformer

FF_CUDA_IMPL(m) {
  m.impl("attention_fwd", &fastformer::attention_fwd_cuda);
  m.impl("attention_bwd", &fastformer::attention_bwd_cuda);
}
