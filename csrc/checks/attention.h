// The argument checks of attention_fwd / attention_bwd, shared by csrc/cpu/attention.cpp and
// csrc/cuda/attention.cpp (see common.h).
#pragma once
#include <array>
#include <optional>

#include "common.h"

namespace fastformer {
namespace checks {

// The largest head dim D the attention kernels take (the Python side's copy is MAX_HEAD_DIM in
// fastformer/ops/attention.py).
constexpr int64_t kMaxHeadDim = 256;

// q, k, v, dout or out of the padded op (`layout` "4-D (B, H, S, D)") or the varlen op ("3-D
// (total, H, D)"): that rank, a floating dtype of the backend, q's device and dtype, unit stride
// along D (the other strides are free: head views of a projection).
inline void check_heads_operand(const Backend& be, const char* op, const char* name, const at::Tensor& t,
                                const at::Tensor& q, int64_t rank, const char* layout) {
  check_device(be, op, name, t, &q, "q");
  TORCH_CHECK(t.dim() == rank, op, ": ", name, " must be ", layout, ", got shape ", t.sizes());
  check_float_dtype(be, op, name, t);
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1 || t.numel() == 0, op, ": ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
  if (&t != &q) check_same_dtype(op, name, t, q, "q");
}

constexpr const char* kHeadsLayout = "4-D (B, H, S, D)";  // the padded op's operands

inline void check_attention_operand(const Backend& be, const char* op, const char* name,
                                    const at::Tensor& t, const at::Tensor& q) {
  check_heads_operand(be, op, name, t, q, 4, kHeadsLayout);
}

// k's heads (dimension 1 of either op's k) for q's H heads: H itself, or a divisor of H
// (grouped-query attention: query head h reads k/v head h / (H / H_kv)).
inline void check_kv_heads(const char* op, const at::Tensor& k, int64_t H) {
  const int64_t H_kv = k.size(1);
  TORCH_CHECK(H_kv == H || (H_kv >= 1 && H % H_kv == 0), op, ": k has ", H_kv,
              " heads, which must divide q's ", H, " heads (grouped-query attention), got k of shape ",
              k.sizes());
}

// q, k, v and the scalars of both ops; returns (B, H, Sq, Sk, D) with q's H (k and v may have
// fewer heads: check_kv_heads).
inline std::array<int64_t, 5> check_attention_qkv(const Backend& be, const char* op,
                                                  const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, double scale,
                                                  double dropout_p) {
  check_attention_operand(be, op, "q", q, q);
  check_attention_operand(be, op, "k", k, q);
  check_attention_operand(be, op, "v", v, q);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, op, ": k must have shape (B, H_kv, Sk, D) = (", B,
              ", H_kv, Sk, ", D, ") to match q ", q.sizes(), ", got ", k.sizes());
  check_kv_heads(op, k, H);
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_dropout_p(op, dropout_p);
  return {B, H, Sq, Sk, D};
}

// The backward's own tensors of either op (`rank`, `layout` as check_heads_operand's): dout and
// out like q, lse in stat_dtype(q) on q's device. The caller checks lse's shape.
inline void check_bwd_tensors(const Backend& be, const char* op, const at::Tensor& dout,
                              const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q,
                              int64_t rank, const char* layout) {
  check_heads_operand(be, op, "dout", dout, q, rank, layout);
  check_heads_operand(be, op, "out", out, q, rank, layout);
  TORCH_CHECK(dout.sizes() == q.sizes(), op, ": dout must have q's shape ", q.sizes(), ", got ",
              dout.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), op, ": out must have q's shape ", q.sizes(), ", got ",
              out.sizes());
  check_device(be, op, "lse", lse, &q, "q");
  TORCH_CHECK(lse.scalar_type() == stat_dtype(q), op, ": lse must be ", stat_dtype_name(q),
              ", got ", lse.scalar_type());
}

// attention_bwd's own tensors: dout and out like q, lse (B, H, Sq) in stat_dtype(q).
inline void check_attention_bwd_tensors(const Backend& be, const char* op, const at::Tensor& dout,
                                        const at::Tensor& out, const at::Tensor& lse,
                                        const at::Tensor& q, const std::array<int64_t, 5>& dims) {
  const auto [B, H, Sq, Sk, D] = dims;
  check_bwd_tensors(be, op, dout, out, lse, q, 4, kHeadsLayout);
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == Sq, op,
              ": lse must have shape (B, H, Sq) = (", B, ", ", H, ", ", Sq, "), got ", lse.sizes());
}

// The masks of one call, checked: each undefined when not given.
struct AttentionMasks {
  at::Tensor key_padding_mask;  // (B, Sk) bool, True = padded key
  at::Tensor attn_mask;         // fp32 additive, a 4-D view broadcast to (B, H, Sq, Sk)
  std::array<int64_t, 4> attn_mask_strides{};  // its strides over (B, H, Sq, Sk), 0 where broadcast
};

inline AttentionMasks check_attention_masks(const Backend& be, const char* op, const at::Tensor& q,
                                            const std::optional<at::Tensor>& key_padding_mask,
                                            const std::optional<at::Tensor>& attn_mask,
                                            const std::array<int64_t, 5>& dims) {
  const auto [B, H, Sq, Sk, D] = dims;
  AttentionMasks m;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& kpm = *key_padding_mask;
    check_device(be, op, "key_padding_mask", kpm, &q, "q");
    TORCH_CHECK(kpm.scalar_type() == at::kBool, op,
                ": key_padding_mask must be bool (True = padded), got ", kpm.scalar_type());
    TORCH_CHECK(kpm.dim() == 2 && kpm.size(0) == B && kpm.size(1) == Sk, op,
                ": key_padding_mask must have shape (B, Sk) = (", B, ", ", Sk, "), got ", kpm.sizes());
    m.key_padding_mask = kpm;
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& am = *attn_mask;
    check_device(be, op, "attn_mask", am, &q, "q");
    TORCH_CHECK(am.scalar_type() == at::kFloat, op, ": attn_mask must be float32 (additive), got ",
                am.scalar_type());
    TORCH_CHECK(am.dim() == 4, op,
                ": attn_mask must be a 4-D view broadcast to (B, H, Sq, Sk), got shape ", am.sizes());
    const int64_t want[4] = {B, H, Sq, Sk};
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK(am.size(d) == want[d] || am.size(d) == 1, op, ": attn_mask of shape ", am.sizes(),
                  " does not broadcast to (B, H, Sq, Sk) = (", B, ", ", H, ", ", Sq, ", ", Sk, ")");
      m.attn_mask_strides[d] = am.size(d) == 1 ? 0 : am.stride(d);
    }
    m.attn_mask = am;
  }
  return m;
}

// rel_bias of either op (csrc/schemas.h): a relative position bias by distance, (H, 2R + 1) in
// stat_dtype(q), contiguous, on q's device; rel_shift bounded so that positions stay far from
// overflow. Returns R, or -1 without a rel_bias.
inline int64_t check_rel_bias(const Backend& be, const char* op, const at::Tensor& q,
                              const std::optional<at::Tensor>& rel_bias, int64_t H,
                              int64_t rel_shift = 0) {
  constexpr int64_t kMaxShift = int64_t{1} << 30;
  TORCH_CHECK(rel_shift >= -kMaxShift && rel_shift <= kMaxShift, op, ": rel_shift must be in [-2^30, 2^30], got ",
              rel_shift);
  if (!rel_bias.has_value() || !rel_bias->defined()) return -1;
  const at::Tensor& t = *rel_bias;
  check_device(be, op, "rel_bias", t, &q, "q");
  TORCH_CHECK(t.scalar_type() == stat_dtype(q), op, ": rel_bias must be ", stat_dtype_name(q), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == H && t.size(1) % 2 == 1 && t.size(1) <= kMaxShift, op,
              ": rel_bias must have shape (H, 2R + 1) = (", H, ", an odd size), got ", t.sizes());
  check_contiguous(op, "rel_bias", t);
  return (t.size(1) - 1) / 2;
}

// The backward's gradient of rel_bias: (H, 2R + 1) zeros in stat_dtype(q), or an empty (0,)
// tensor of that dtype without a rel_bias (the schema's fourth result is always a tensor).
inline at::Tensor rel_bias_grad(const at::Tensor& q, int64_t H, int64_t R) {
  const auto opts = q.options().dtype(stat_dtype(q));
  return R < 0 ? at::empty({0}, opts) : at::zeros({H, 2 * R + 1}, opts);
}

}  // namespace checks
}  // namespace fastformer
