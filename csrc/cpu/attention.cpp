// attention_fwd / attention_bwd on CPU: the argument checks, the mask preparation and the op
// registration, compiled once; the flash-style math is attention_kernel_fwd.cpp and
// attention_kernel_bwd.cpp, run at the ISA level isa.h chose.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <climits>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "attention.h"
#include "large_buffers.h"
#include "../checks/attention.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

// The masks checked and as the kernels read them (fills `mask`); returns the tensors that must
// outlive the kernel.
std::vector<at::Tensor> prepare_masks(const char* op, const at::Tensor& q,
                                      const std::optional<at::Tensor>& key_padding_mask,
                                      const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                      const std::array<int64_t, 5>& dims, Masks& mask) {
  const auto masks =
      checks::check_attention_masks(checks::kCpu, op, q, key_padding_mask, attn_mask, dims);
  const auto [B, H, Sq, Sk, D] = dims;
  std::vector<at::Tensor> keep_alive;
  mask.Sk = Sk;
  mask.causal = is_causal;
  if (masks.key_padding_mask.defined()) {
    const at::Tensor padded = masks.key_padding_mask.contiguous();
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
  if (masks.attn_mask.defined()) {
    mask.am = masks.attn_mask.data_ptr<float>();
    mask.am_sb = masks.attn_mask_strides[0];
    mask.am_sh = masks.attn_mask_strides[1];
    mask.am_sq = masks.attn_mask_strides[2];
    mask.am_sk = masks.attn_mask_strides[3];
    keep_alive.push_back(masks.attn_mask);
  }
  return keep_alive;
}

// One call's arguments checked and as the kernels take them. The backward passes its own dout,
// out and lse, checked after q, k, v (and before the masks), as the forward checks none.
struct Call {
  std::array<int64_t, 5> dims;  // (B, H, Sq, Sk, D)
  Masks mask;
  std::vector<at::Tensor> keep_alive;  // what mask points into
  uint64_t seed, offset;

  Call(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
       const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
       bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
       const std::optional<at::Tensor>& rel_bias, int64_t rel_shift,
       const at::Tensor* dout = nullptr, const at::Tensor* out = nullptr, const at::Tensor* lse = nullptr) {
    const auto [s, o] = read_philox(op, philox);
    seed = static_cast<uint64_t>(s);
    offset = static_cast<uint64_t>(o);
    dims = checks::check_attention_qkv(checks::kCpu, op, q, k, v, scale, dropout_p);
    if (dout != nullptr) checks::check_attention_bwd_tensors(checks::kCpu, op, *dout, *out, *lse, q, dims);
    keep_alive = prepare_masks(op, q, key_padding_mask, attn_mask, is_causal, dims, mask);
    rel_radius = checks::check_rel_bias(checks::kCpu, op, q, rel_bias, dims[1], rel_shift);
    if (rel_radius >= 0) rel = RelBias{rel_bias->data_ptr(), rel_radius, rel_shift};
  }
  int64_t rel_radius;  // R of rel_bias (H, 2R + 1), -1 without one
  RelBias rel;         // points into the caller's rel_bias
};

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
    const std::optional<at::Tensor>& rel_bias, int64_t rel_shift) {
  const Call c("attention_fwd", q_in, k_in, v_in, key_padding_mask, attn_mask, is_causal, scale,
               dropout_p, philox, rel_bias, rel_shift);
  const auto [B, H, Sq, Sk, D] = c.dims;
  at::Tensor out = empty_large({B, H, Sq, D}, q_in.options());  // pooled when large
  at::Tensor lse = at::empty({B, H, Sq}, q_in.options().dtype(checks::stat_dtype(q_in)));
  if (out.numel() == 0) return {out, lse};
  const at::Tensor q = as_blas_rows(q_in, 2), k = as_blas_rows(k_in, 2), v = as_blas_rows(v_in, 2);
  FF_ISA(attention_fwd_impl)(c.dims, q, k, v, c.mask, c.rel, scale, dropout_p, c.seed, c.offset, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
    const std::optional<at::Tensor>& rel_bias, int64_t rel_shift) {
  const Call c("attention_bwd", q_in, k_in, v_in, key_padding_mask, attn_mask, is_causal, scale,
               dropout_p, philox, rel_bias, rel_shift, &dout_in, &out_in, &lse_in);
  const auto [B, H, Sq, Sk, D] = c.dims;
  at::Tensor dq = grad_like(q_in), dk = grad_like(k_in), dv = grad_like(v_in);
  at::Tensor drel = checks::rel_bias_grad(q_in, H, c.rel_radius);
  if (dq.numel() == 0 && dk.numel() == 0) return {dq, dk, dv, drel};
  const at::Tensor q = as_blas_rows(q_in, 2), k = as_blas_rows(k_in, 2), v = as_blas_rows(v_in, 2);
  const at::Tensor dout = as_blas_rows(dout_in, 2), lse = lse_in.contiguous();
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(checks::stat_dtype(q)));
  if (k_in.size(1) != H) {  // grouped-query: per query head, then each group summed
    at::Tensor dk_h = kv_grad_per_query_head(k_in, H), dv_h = kv_grad_per_query_head(v_in, H);
    FF_ISA(attention_bwd_impl)(c.dims, dout, q, k, v, out_in, lse, c.mask, c.rel, scale, dropout_p, c.seed,
                               c.offset, delta, dq, dk_h, dv_h, drel);
    sum_kv_groups(dk_h, dk);
    sum_kv_groups(dv_h, dv);
    return {dq, dk, dv, drel};
  }
  FF_ISA(attention_bwd_impl)(c.dims, dout, q, k, v, out_in, lse, c.mask, c.rel, scale, dropout_p, c.seed,
                             c.offset, delta, dq, dk, dv, drel);
  return {dq, dk, dv, drel};
}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("attention_fwd", &fastformer::attention_fwd_cpu);
  m.impl("attention_bwd", &fastformer::attention_bwd_cpu);
}
