// attention_fwd / attention_bwd on CPU: the argument checks, the mask preparation and the op
// registration, compiled once; the flash-style math is attention_kernel.cpp, run at the ISA level
// isa.h chose.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <climits>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "attention.h"
#include "large_buffers.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

bool blas_rows_ok(const at::Tensor& t) {
  const int64_t D = t.size(3);
  return t.size(2) <= 1 || (t.stride(2) >= D && t.stride(2) <= INT_MAX);
}

// t itself when its rows can be handed to the GEMMs as they are, else a contiguous copy.
at::Tensor as_blas_rows(const at::Tensor& t) { return blas_rows_ok(t) ? t : t.contiguous(); }

void check_operand(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D (B, H, S, D), got shape ", t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16, op, ": ", name,
              " must be float32, float64 or bfloat16 on CPU, got ", dt);
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1 || t.numel() == 0, op, ": ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but q has dtype ", q.scalar_type(), "; they must match");
}

// Checks q, k, v (and the scalar arguments); returns (B, H, Sq, Sk, D).
std::array<int64_t, 5> check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, double scale, double dropout_p) {
  check_operand(op, "q", q);
  check_operand(op, "k", k);
  check_operand(op, "v", v);
  check_same_dtype(op, "k", k, q);
  check_same_dtype(op, "v", v, q);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, op,
              ": k must have shape (B, H, Sk, D) = (", B, ", ", H, ", Sk, ", D, ") to match q ",
              q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ", dropout_p);
  return {B, H, Sq, Sk, D};
}

// Checks the masks and fills `mask`; returns the tensors that must outlive the kernel.
std::vector<at::Tensor> prepare_masks(const char* op,
                                      const std::optional<at::Tensor>& key_padding_mask,
                                      const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                      const std::array<int64_t, 5>& dims, Masks& mask) {
  const auto [B, H, Sq, Sk, D] = dims;
  std::vector<at::Tensor> keep_alive;
  mask.Sk = Sk;
  mask.causal = is_causal;
  mask.shift = Sk - Sq;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& kpm = *key_padding_mask;
    TORCH_CHECK(kpm.device().is_cpu(), op, ": key_padding_mask must be a CPU tensor, got device ",
                kpm.device());
    TORCH_CHECK(kpm.scalar_type() == at::kBool, op,
                ": key_padding_mask must be bool (True = padded), got ", kpm.scalar_type());
    TORCH_CHECK(kpm.dim() == 2 && kpm.size(0) == B && kpm.size(1) == Sk, op,
                ": key_padding_mask must have shape (B, Sk) = (", B, ", ", Sk, "), got ", kpm.sizes());
    const at::Tensor padded = kpm.contiguous();
    at::Tensor bias = at::zeros({B, Sk}, at::kFloat)
                          .masked_fill_(padded, -std::numeric_limits<float>::infinity());
    at::Tensor span = at::empty({B, 2}, at::kLong);
    const bool* pad = padded.data_ptr<bool>();
    int64_t* sp = span.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const bool* row = pad + b * Sk;
      int64_t lo = 0, hi = Sk;
      while (lo < Sk && row[lo]) ++lo;
      while (hi > lo && row[hi - 1]) --hi;
      sp[2 * b] = lo;
      sp[2 * b + 1] = hi;
    }
    mask.key_bias = bias.data_ptr<float>();
    mask.key_span = sp;
    keep_alive.push_back(bias);
    keep_alive.push_back(span);
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& am = *attn_mask;
    TORCH_CHECK(am.device().is_cpu(), op, ": attn_mask must be a CPU tensor, got device ", am.device());
    TORCH_CHECK(am.scalar_type() == at::kFloat, op, ": attn_mask must be float32 (additive), got ",
                am.scalar_type());
    TORCH_CHECK(am.dim() == 4, op,
                ": attn_mask must be a 4-D view broadcast to (B, H, Sq, Sk), got shape ", am.sizes());
    const int64_t want[4] = {B, H, Sq, Sk};
    int64_t strides[4];
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(am.size(d) == want[d] || am.size(d) == 1, op, ": attn_mask of shape ", am.sizes(),
                  " does not broadcast to (B, H, Sq, Sk) = (", B, ", ", H, ", ", Sq, ", ", Sk, ")");
      strides[d] = am.size(d) == 1 ? 0 : am.stride(d);
    }
    mask.am = am.data_ptr<float>();
    mask.am_sb = strides[0];
    mask.am_sh = strides[1];
    mask.am_sq = strides[2];
    mask.am_sk = strides[3];
    keep_alive.push_back(am);
  }
  return keep_alive;
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox) {
  const char* op = "attention_fwd";
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const auto dims = check_qkv(op, q_in, k_in, v_in, scale, dropout_p);
  Masks mask;
  const auto keep_alive = prepare_masks(op, key_padding_mask, attn_mask, is_causal, dims, mask);
  const auto [B, H, Sq, Sk, D] = dims;
  at::Tensor out = empty_large({B, H, Sq, D}, q_in.options());  // pooled when large
  at::Tensor lse = at::empty({B, H, Sq}, q_in.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const at::Tensor q = as_blas_rows(q_in), k = as_blas_rows(k_in), v = as_blas_rows(v_in);
  FF_ISA(attention_fwd_impl)(dims, q, k, v, mask, scale, dropout_p, static_cast<uint64_t>(seed),
                             static_cast<uint64_t>(offset), out, lse);
  return {out, lse};
}

// The gradient of x, laid out like empty_like(x) (as the fake implementation promises).
at::Tensor grad_like(const at::Tensor& x) {
  if (x.is_contiguous()) return empty_large_like(x);  // pooled when large (large_buffers.h)
  at::Tensor g = at::empty_like(x);
  return g.stride(3) == 1 || g.size(3) == 1 ? g : at::empty(x.sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox) {
  const char* op = "attention_bwd";
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const auto dims = check_qkv(op, q_in, k_in, v_in, scale, dropout_p);
  const auto [B, H, Sq, Sk, D] = dims;
  check_operand(op, "dout", dout_in);
  check_operand(op, "out", out_in);
  check_same_dtype(op, "dout", dout_in, q_in);
  check_same_dtype(op, "out", out_in, q_in);
  TORCH_CHECK(dout_in.sizes() == q_in.sizes(), op, ": dout must have q's shape ", q_in.sizes(), ", got ",
              dout_in.sizes());
  TORCH_CHECK(out_in.sizes() == q_in.sizes(), op, ": out must have q's shape ", q_in.sizes(), ", got ",
              out_in.sizes());
  TORCH_CHECK(lse_in.defined() && lse_in.device().is_cpu(), op, ": lse must be a CPU tensor");
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat, op, ": lse must be float32, got ",
              lse_in.scalar_type());
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == B && lse_in.size(1) == H && lse_in.size(2) == Sq,
              op, ": lse must have shape (B, H, Sq) = (", B, ", ", H, ", ", Sq, "), got ",
              lse_in.sizes());
  Masks mask;
  const auto keep_alive = prepare_masks(op, key_padding_mask, attn_mask, is_causal, dims, mask);

  at::Tensor dq = grad_like(q_in), dk = grad_like(k_in), dv = grad_like(v_in);
  if (dq.numel() == 0 && dk.numel() == 0) return {dq, dk, dv};
  const at::Tensor q = as_blas_rows(q_in), k = as_blas_rows(k_in), v = as_blas_rows(v_in);
  const at::Tensor dout = as_blas_rows(dout_in), lse = lse_in.contiguous();
  const at::ScalarType acc_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(acc_dtype));
  FF_ISA(attention_bwd_impl)(dims, dout, q, k, v, out_in, lse, mask, scale, dropout_p,
                             static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), delta, dq,
                             dk, dv);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("attention_fwd", &fastformer::attention_fwd_cpu);
  m.impl("attention_bwd", &fastformer::attention_bwd_cpu);
}
