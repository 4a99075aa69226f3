// The argument checks of attention_varlen_fwd / attention_varlen_bwd (csrc/schemas.h), shared by
// csrc/cpu/attention_varlen.cpp and csrc/cuda/attention_varlen.cpp (see common.h).
#pragma once
#include <array>
#include <climits>
#include <cstdint>

#include "attention.h"
#include "common.h"

namespace fastformer {
namespace checks {

// The sizes of one varlen call: B sequences of H query heads of dim D, total_q / total_k packed
// rows (k and v may have fewer heads: check_kv_heads).
struct VarlenDims {
  int64_t B, H, total_q, total_k, D, max_seqlen_q, max_seqlen_k;
};

constexpr const char* kPackedLayout = "3-D (total, H, D)";  // the varlen op's operands

inline void check_varlen_operand(const Backend& be, const char* op, const char* name,
                                 const at::Tensor& t, const at::Tensor& q) {
  check_heads_operand(be, op, name, t, q, 3, kPackedLayout);
}

// A cu_seqlens argument: int32, 1-D (B + 1,), contiguous, on q's device. Its values are checked by
// check_cu_seqlens_values where the host can read them.
inline void check_cu_seqlens(const Backend& be, const char* op, const char* name,
                             const at::Tensor& cu, const at::Tensor& q) {
  check_device(be, op, name, cu, &q, "q");
  TORCH_CHECK(cu.scalar_type() == at::kInt, op, ": ", name,
              " must be int32 (cumulative sequence lengths), got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": ", name,
              " must have shape (B + 1,) with B >= 0, got ", cu.sizes());
  check_contiguous(op, name, cu);
}

// q, k, v, both cu_seqlens and the scalars of both ops.
inline VarlenDims check_varlen_qkv(const Backend& be, const char* op, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                   int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                   double dropout_p) {
  check_varlen_operand(be, op, "q", q, q);
  check_varlen_operand(be, op, "k", k, q);
  check_varlen_operand(be, op, "v", v, q);
  const int64_t H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.size(2) == D, op, ": k must have shape (total_k, H_kv, D) = (total_k, H_kv, ", D,
              ") to match q ", q.sizes(), ", got ", k.sizes());
  check_kv_heads(op, k, H);
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": head dim D must be in [1, ", kMaxHeadDim, "], got ", D);
  check_cu_seqlens(be, op, "cu_seqlens_q", cu_seqlens_q, q);
  check_cu_seqlens(be, op, "cu_seqlens_k", cu_seqlens_k, q);
  TORCH_CHECK(cu_seqlens_k.size(0) == cu_seqlens_q.size(0), op,
              ": cu_seqlens_k must have cu_seqlens_q's shape (B + 1,) = ", cu_seqlens_q.sizes(),
              ", got ", cu_seqlens_k.sizes());
  TORCH_CHECK(max_seqlen_q >= 0, op, ": max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK(max_seqlen_k >= 0, op, ": max_seqlen_k must be >= 0, got ", max_seqlen_k);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_dropout_p(op, dropout_p);
  return {cu_seqlens_q.size(0) - 1, H, q.size(0), k.size(0), D, max_seqlen_q, max_seqlen_k};
}

// The values of a host-readable cu_seqlens: cu[0] = 0, non-decreasing, cu[B] = total, every
// length <= max_seqlen. (A device's kernels clamp each sequence to [0, total) instead.)
inline void check_cu_seqlens_values(const char* op, const char* name, const at::Tensor& cu,
                                    int64_t total, int64_t max_seqlen, const char* total_name,
                                    const char* max_name) {
  const int32_t* c = cu.const_data_ptr<int32_t>();
  const int64_t B = cu.size(0) - 1;
  TORCH_CHECK(c[0] == 0, op, ": ", name, "[0] must be 0, got ", c[0]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = static_cast<int64_t>(c[b + 1]) - c[b];
    TORCH_CHECK(len >= 0, op, ": ", name, " must be non-decreasing, got ", name, "[", b, "] = ", c[b],
                " > ", name, "[", b + 1, "] = ", c[b + 1]);
    TORCH_CHECK(len <= max_seqlen, op, ": sequence ", b, " has ", len, " rows by ", name, " but ",
                max_name, " is ", max_seqlen);
  }
  TORCH_CHECK(c[B] == total, op, ": ", name, "[-1] must equal ", total_name, " (", total, "), got ",
              c[B]);
}

// attention_varlen_bwd's own tensors: dout and out like q, lse (H, total_q) in stat_dtype(q).
inline void check_varlen_bwd_tensors(const Backend& be, const char* op, const at::Tensor& dout,
                                     const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& q, const VarlenDims& dims) {
  check_bwd_tensors(be, op, dout, out, lse, q, 3, kPackedLayout);
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == dims.H && lse.size(1) == dims.total_q, op,
              ": lse must have shape (H, total_q) = (", dims.H, ", ", dims.total_q, "), got ",
              lse.sizes());
}

// A gradient attention_varlen_bwd.into writes: `like`'s shape, dtype and device, laid out as
// (total, H, D) rows (last dim contiguous, heads D or more apart, rows past the row's last head):
// the layout of a slice of a packed (total, 3, H, D) qkv or (total, 2, H, D) kv buffer, which is
// what the .into overload is for.
inline void check_varlen_grad_out(const Backend& be, const char* op, const char* name,
                                  const at::Tensor& g, const at::Tensor& like, const char* like_name) {
  check_device(be, op, name, g, &like, like_name);
  check_dtype_of(op, name, g, like, like_name);
  TORCH_CHECK(g.sizes() == like.sizes(), op, ": ", name, " must have ", like_name, "'s shape ",
              like.sizes(), ", got ", g.sizes());
  const int64_t H = g.size(1), D = g.size(2);
  TORCH_CHECK(g.numel() == 0 ||
                  (g.stride(2) == 1 && (H == 1 || g.stride(1) >= D) &&
                   (g.size(0) == 1 || (g.stride(0) >= (H - 1) * g.stride(1) + D && g.stride(0) <= INT_MAX))),
              op, ": ", name, " must be (total, H, D) rows: last dim contiguous, heads at least D = ", D,
              " apart and rows past their last head, got strides ", g.strides());
}

// The three gradients of the .into overload write disjoint elements: any two sharing memory must be
// packed side by side, i.e. have equal strides (s0, D, 1) and rows of H * D elements that do not
// meet modulo the row stride s0 (a qkv / kv buffer's slices). None may share memory with an input.
inline void check_varlen_grads_disjoint(const char* op, const std::array<const at::Tensor*, 3>& grads,
                                        const std::array<const at::Tensor*, 5>& inputs) {
  static const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& a = *grads[i];
    if (a.numel() == 0) continue;
    for (const at::Tensor* in : inputs) {
      TORCH_CHECK(!in->defined() || in->numel() == 0 || !a.is_alias_of(*in), op, ": ", names[i],
                  " must not share memory with the op's inputs");
    }
    for (int j = i + 1; j < 3; ++j) {
      const at::Tensor& b = *grads[j];
      if (b.numel() == 0 || !a.is_alias_of(b)) continue;
      const int64_t H = a.size(1), D = a.size(2), s0 = a.stride(0), width = H * D;
      const int64_t delta = b.storage_offset() - a.storage_offset();
      const bool dense_rows = (H == 1 || (a.stride(1) == D && b.stride(1) == D));
      bool side_by_side;
      if (a.size(0) == 1) {  // one row each: two spans of H * D elements
        side_by_side = dense_rows && (delta >= width || -delta >= width);
      } else {
        const int64_t gap = ((delta % s0) + s0) % s0;  // b's rows start gap elements into a's row period
        side_by_side = dense_rows && a.strides() == b.strides() && gap >= width && s0 - gap >= width;
      }
      TORCH_CHECK(side_by_side, op, ": ", names[i], " and ", names[j],
                  " share memory; they must be slices of one packed buffer whose elements do not overlap");
    }
  }
}

// attention_varlen_bwd.into's checks before the backward's own: q, k, v, cu_seqlens and the
// scalars, the gradients' layouts, and that they write disjoint memory.
inline void check_varlen_bwd_into(const Backend& be, const char* op, const at::Tensor& dout,
                                  const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                  int64_t max_seqlen_k, double scale, double dropout_p,
                                  const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
  check_varlen_qkv(be, op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                   dropout_p);
  check_varlen_grad_out(be, op, "dq", dq, q, "q");
  check_varlen_grad_out(be, op, "dk", dk, k, "k");
  check_varlen_grad_out(be, op, "dv", dv, v, "v");
  check_varlen_grads_disjoint(op, {&dq, &dk, &dv}, {&dout, &q, &k, &v, &out});
}

}  // namespace checks
}  // namespace fastformer
