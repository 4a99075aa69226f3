// The per-ISA entry points of attention (attention_kernel.cpp, one copy per level of isa.h) and
// the mask description attention.cpp prepares for them.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cstdint>

#include "isa.h"

namespace fastformer {

// The masks of one call, as plain pointers into tensors attention.cpp keeps alive.
struct Masks {
  const float* key_bias = nullptr;  // (B, Sk) contiguous: 0, or -inf for a padded key
  const int64_t* key_span = nullptr;  // (B, 2): [first, last + 1) of the keys not padded
  int64_t Sk = 0;
  const float* am = nullptr;        // additive attn_mask read through its (broadcast) strides
  int64_t am_sb = 0, am_sh = 0, am_sq = 0, am_sk = 0;
  bool causal = false;
  int64_t shift = 0;                // causal: key j is visible to query i iff j <= i + shift
};

// dims = (B, H, Sq, Sk, D); q, k, v (and dout) with rows the GEMMs take (stride(2) >= D); out
// (B, H, Sq, D) and lse (B, H, Sq) fp32 are written.
FF_ISA_DECLARE(void attention_fwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& q,
                                       const at::Tensor& k, const at::Tensor& v, const Masks& mask,
                                       double scale, double dropout_p, uint64_t seed,
                                       uint64_t offset, at::Tensor& out, at::Tensor& lse))

// delta (B, H, Sq) in the math type is scratch (rowsum(dout * out)); dq, dk, dv are written.
FF_ISA_DECLARE(void attention_bwd_impl(const std::array<int64_t, 5>& dims, const at::Tensor& dout,
                                       const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out,
                                       const at::Tensor& lse, const Masks& mask, double scale,
                                       double dropout_p, uint64_t seed, uint64_t offset,
                                       at::Tensor& delta, at::Tensor& dq, at::Tensor& dk,
                                       at::Tensor& dv))

}  // namespace fastformer
