// The per-ISA entry points of attention and attention_varlen (attention_kernel_fwd.cpp,
// attention_kernel_bwd.cpp, one copy per level of isa.h), the mask and packed-layout
// descriptions the glue (attention.cpp, attention_varlen.cpp) prepares for them, and the glue's
// shared tensor helpers.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <climits>
#include <cstdint>

#include "isa.h"
#include "../kv_groups.h"
#include "large_buffers.h"

namespace fastformer {

// The masks of one call, as plain pointers into tensors attention.cpp keeps alive.
struct Masks {
  const float* key_bias = nullptr;  // (B, Sk) contiguous: 0, or -inf for a padded key
  const int64_t* key_span = nullptr;  // (B, 2): [first, last + 1) of the keys not padded
  int64_t Sk = 0;
  const float* am = nullptr;        // additive attn_mask read through its (broadcast) strides
  int64_t am_sb = 0, am_sh = 0, am_sq = 0, am_sk = 0;
  bool causal = false;              // key j of a sequence visible to its query i iff j <= i + Lk - Lq
};

// The relative position bias of one call (csrc/schemas.h): query i of a sequence sits at position
// i + Lk - Lq + shift, and head h adds data[h, clamp(j - pos, -R, R) + R] to its score with key j.
struct RelBias {
  const void* data = nullptr;  // (H, 2R + 1) contiguous in the math type (fp32, fp64); nullptr: none
  int64_t R = 0;
  int64_t shift = 0;           // the padded op's rel_shift; 0 for packed sequences
};

// The packed rows of attention_varlen: sequence b owns rows [cu_q[b], cu_q[b + 1]) of q, out,
// dout, dq (and those columns of lse) and rows [cu_k[b], cu_k[b + 1]) of k, v, dk, dv. cu_q, cu_k
// point into checked (B + 1,) int32 tensors; max_q, max_k also give the dropout counters' grid
// (the padded op's (B, H, max_q, max_k)).
struct Varlen {
  const int32_t* cu_q;
  const int32_t* cu_k;
  int64_t B, H, D, max_q, max_k;
};

// dims = (B, H, Sq, Sk, D); q, k, v (and dout) with rows the GEMMs take (stride(2) >= D); out
// (B, H, Sq, D) and lse (B, H, Sq) fp32 are written.
FF_ISA_DECLARE(void attention_fwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& q,
                                       const at::Tensor& k, const at::Tensor& v, const Masks& mask,
                                       const RelBias& rel, double scale, double dropout_p,
                                       uint64_t seed, uint64_t offset, at::Tensor& out,
                                       at::Tensor& lse))

// delta (B, H, Sq) in the math type is scratch (rowsum(dout * out)); dq, dk, dv are written, and
// drel (H, 2R + 1), rel_bias's gradient, when rel has a bias (else drel is not touched).
FF_ISA_DECLARE(void attention_bwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& dout,
                                       const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out,
                                       const at::Tensor& lse, const Masks& mask,
                                       const RelBias& rel, double scale, double dropout_p,
                                       uint64_t seed, uint64_t offset, at::Tensor& delta,
                                       at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                                       at::Tensor& drel))

// q, k, v, dout (total, H, D) with rows the GEMMs take (stride(0) >= D); out (total_q, H, D)
// contiguous and lse (H, total_q) fp32 are written.
FF_ISA_DECLARE(void attention_varlen_fwd_impl(const Varlen& lens, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v, bool causal,
                                              const RelBias& rel, double scale, double dropout_p,
                                              uint64_t seed, uint64_t offset, at::Tensor& out,
                                              at::Tensor& lse))

// delta (H, total_q) in the math type is scratch; dq, dk, dv are written through their strides,
// drel as attention_bwd_impl's.
FF_ISA_DECLARE(void attention_varlen_bwd_impl(const Varlen& lens, const at::Tensor& dout,
                                              const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& out,
                                              const at::Tensor& lse, bool causal,
                                              const RelBias& rel, double scale, double dropout_p,
                                              uint64_t seed, uint64_t offset, at::Tensor& delta,
                                              at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                                              at::Tensor& drel))

// ---- glue helpers (attention.cpp, attention_varlen.cpp)

// t itself when its rows (dimension row_dim, D = the last dimension contiguous) can be handed to
// the GEMMs as they are (row stride in [D, INT_MAX]), else a contiguous copy.
inline at::Tensor as_blas_rows(const at::Tensor& t, int64_t row_dim) {
  const int64_t D = t.size(-1);
  const bool ok = t.size(row_dim) <= 1 || (t.stride(row_dim) >= D && t.stride(row_dim) <= INT_MAX);
  return ok ? t : t.contiguous();
}

// The gradient of x, laid out like empty_like(x) (as the fake implementations promise), with a
// contiguous last dimension; pooled when large and contiguous (large_buffers.h).
inline at::Tensor grad_like(const at::Tensor& x) {
  if (x.is_contiguous()) return empty_large_like(x);
  at::Tensor g = at::empty_like(x);
  return g.stride(-1) == 1 || g.size(-1) == 1 ? g : at::empty(x.sizes(), x.options());
}

}  // namespace fastformer
