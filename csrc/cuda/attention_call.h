// The launchers' description of one call of attention or attention_varlen, built from its tensors:
// FfAttentionArgs for the FMA kernels (attention.cu) and, from it, FfFlashFwdArgs for the
// tensor-core kernels (flash_mma.h). Included by the glue of both ops (attention.cpp,
// attention_varlen.cpp) and by the SIMT harness's test ops (tests/simt/simt_lib.cpp), so that
// every path describes a call the same way.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>

#include "flash_mma.h"
#include "glue.h"
#include "launchers.h"
#include "../checks/attention.h"
#include "../checks/attention_varlen.h"

// The rows of a padded (B, H, S, D) operand, as the kernels address them.
inline FfRows ff_heads_rows(const at::Tensor& t) { return {t.stride(0), t.stride(2), t.stride(1)}; }

// The rows of a packed (total, H, D) operand (sequence b's start from cu_seqlens).
inline FfRows ff_packed_rows(const at::Tensor& t) { return {0, t.stride(0), t.stride(1)}; }

// The bins (of rel_bias's 2R + 1) that a score of a call can reach, [lo, lo + count): query i of a
// sequence sits at i + Lk - Lq + rel_shift, so a key j < Lk is at distance j - that in
// [-(Lk - 1) - rel_shift, Lq - 1 - rel_shift], inside [-(max_k - 1) - rel_shift, max_q - 1 - rel_shift]
// for every sequence (the host never reads cu_seqlens); clamped to [-R, R]. At most
// min(2R + 1, max_q + max_k - 1) bins: the backward's partial sums stay small when R is large.
struct FfRelBins {
  int64_t lo, count;
};

inline FfRelBins ff_rel_bins(int64_t R, int64_t max_q, int64_t max_k, int64_t rel_shift) {
  auto bin = [R](int64_t d) { return (d < -R ? -R : (d > R ? R : d)) + R; };
  const int64_t lo = bin(-(max_k - 1) - rel_shift), hi = bin(max_q - 1 - rel_shift);
  return {lo, hi - lo + 1};
}

struct FfAttentionCall {
  at::Tensor kpm;  // keeps the contiguous key_padding_mask alive
  FfAttentionArgs a{};

  // attention: (B, H, S, D) operands, dims (B, H, Sq, Sk, D), the masks as checked (m's tensors
  // must outlive the call: the attn_mask is read through its own strides).
  FfAttentionCall(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const fastformer::checks::AttentionMasks& m, const std::array<int64_t, 5>& dims,
                  bool is_causal, double scale, double dropout_p, const FfPhiloxArgs& rng, int dtype) {
    const auto [B, H, Sq, Sk, D] = dims;
    set(q, k, v, ff_heads_rows, {B, H, D, Sq, Sk, Sq, Sk}, is_causal, scale, dropout_p, rng, dtype);
    if (m.key_padding_mask.defined()) {
      kpm = m.key_padding_mask.contiguous();
      a.key_padding_mask = kpm.const_data_ptr<bool>();
    }
    if (m.attn_mask.defined()) a.attn_mask = m.attn_mask.const_data_ptr<float>();
    a.am_sb = m.attn_mask_strides[0];
    a.am_sh = m.attn_mask_strides[1];
    a.am_sq = m.attn_mask_strides[2];
    a.am_sk = m.attn_mask_strides[3];
  }

  // attention_varlen: packed (total, H, D) operands whose sequences cu_q / cu_k delimit; no masks.
  FfAttentionCall(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cu_q, const at::Tensor& cu_k,
                  const fastformer::checks::VarlenDims& d, bool is_causal, double scale,
                  double dropout_p, const FfPhiloxArgs& rng, int dtype) {
    set(q, k, v, ff_packed_rows, {d.B, d.H, d.D, d.total_q, d.total_k, d.max_seqlen_q, d.max_seqlen_k},
        is_causal, scale, dropout_p, rng, dtype);
    a.cu_seqlens_q = cu_q.const_data_ptr<int32_t>();
    a.cu_seqlens_k = cu_k.const_data_ptr<int32_t>();
  }

  // The same call for the tensor-core kernels, out and lse through out_s / lse_s (all 0: the
  // padded op's contiguous layout). fp32 may run as tf32 where torch allows tf32 matmuls
  // (torch.backends.cuda.matmul.allow_tf32), unless the caller says otherwise.
  FfFlashFwdArgs flash(FfRows out_s = {}, FfRows lse_s = {}) const {
    return flash(out_s, lse_s, at::globalContext().allowTF32CuBLAS());
  }
  FfFlashFwdArgs flash(FfRows out_s, FfRows lse_s, bool allow_tf32) const {
    return ff_flash_fwd_args(a, out_s, lse_s, allow_tf32);
  }

  // A relative position bias (checked: (H, 2R + 1) fp32 contiguous, R from check_rel_bias; R < 0:
  // none); rel_shift 0 for varlen.
  void set_rel_bias(const std::optional<at::Tensor>& rel_bias, int64_t R, int64_t rel_shift) {
    if (R < 0) return;
    a.rel_bias = rel_bias->const_data_ptr<float>();
    a.rel_R = R;
    a.rel_shift = rel_shift;
  }

  // The backward's gradient of the rel_bias: the FMA dQ kernel's partial sums by block
  // (FfAttentionGrads::drel_partial), then their sum over batch and query tiles by torch, a
  // fixed order: deterministic. Without a rel_bias, nothing (rel_bias_grad's empty tensor).
  struct RelGrad {
    at::Tensor partial;  // (B, H, parts, bins) fp32, written whole by the kernel
    FfRelBins bins{0, 0};
    void describe(FfAttentionGrads& g) const {
      if (!partial.defined()) return;
      g.drel_partial = partial.data_ptr<float>();
      g.drel_lo = bins.lo;
      g.drel_bins = bins.count;
    }
  };
  RelGrad rel_grad_partial(const at::Tensor& q) const {
    RelGrad r;
    if (a.rel_bias == nullptr) return r;
    r.bins = ff_rel_bins(a.rel_R, a.max_seqlen_q, a.max_seqlen_k, a.rel_shift);
    r.partial = at::empty({a.B, a.H, attention_bwd_rel_parts(a.max_seqlen_q, a.D), r.bins.count},
                          q.options().dtype(at::kFloat));
    return r;
  }
  // The gradient (H, 2R + 1) after the kernels: the partials summed over (b, tile) (one reduction;
  // zeros around it where some bins are out of every score's reach), or rel_bias_grad's empty
  // tensor without a rel_bias.
  at::Tensor rel_grad_sum(const RelGrad& r, const at::Tensor& q) const {
    if (!r.partial.defined()) return fastformer::checks::rel_bias_grad(q, a.H, -1);
    at::Tensor sums = r.partial.sum({0, 2});  // (H, bins)
    if (r.bins.count == 2 * a.rel_R + 1) return sums;
    at::Tensor drel = fastformer::checks::rel_bias_grad(q, a.H, a.rel_R);
    drel.narrow(1, r.bins.lo, r.bins.count).copy_(sums);
    return drel;
  }

 private:
  // What both ops share; sizes = (B, H, D, total_q, total_k, max_seqlen_q, max_seqlen_k). No
  // cu_seqlens and no masks (a{} holds nulls and zeros).
  void set(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, FfRows (*rows)(const at::Tensor&),
           const std::array<int64_t, 7>& sizes, bool is_causal, double scale, double dropout_p,
           const FfPhiloxArgs& rng, int dtype) {
    a.q = q.const_data_ptr();
    a.k = k.const_data_ptr();
    a.v = v.const_data_ptr();
    a.q_s = rows(q);
    a.k_s = rows(k);
    a.v_s = rows(v);
    a.B = sizes[0];
    a.H = sizes[1];
    a.kv_group = k.size(1) > 0 ? sizes[1] / k.size(1) : 1;  // checked: k's heads divide q's
    a.D = sizes[2];
    a.total_q = sizes[3];
    a.total_k = sizes[4];
    a.max_seqlen_q = sizes[5];
    a.max_seqlen_k = sizes[6];
    a.dtype = dtype;
    a.causal = is_causal;
    a.scale = scale;
    a.dropout_p = dropout_p;
    a.seed = rng.seed;
    a.offset = rng.offset;
    a.philox = rng.ptr;
  }
};

// The tensor-core backward (flash_bwd_mma.cu) with its dQ workspace, from the caching allocator:
// an fp32 accumulator that the kernel writes before it reads (not zeroed) and a counter a
// (b, h, query tile) that orders the key blocks' adds (zeroed). None (no allocation, no memset)
// where the call runs the two-kernel backward. `like` gives the device.
inline const char* ff_launch_flash_bwd_mma(const FfFlashFwdArgs& flash, const FfAttentionGrads& g,
                                           const at::Tensor& like, void* stream) {
  FfFlashBwdArgs a = ff_flash_bwd_args(flash, g);
  int64_t acc_floats = 0, counters = 0;
  flash_bwd_mma_workspace(a, &acc_floats, &counters);
  at::Tensor acc, count;  // alive until the launch has been queued (stream-ordered frees)
  if (acc_floats > 0 && counters > 0) {
    acc = at::empty({acc_floats}, like.options().dtype(at::kFloat));
    count = at::zeros({counters}, like.options().dtype(at::kInt));
    a.dq_acc = acc.data_ptr<float>();
    a.dq_count = count.data_ptr<int32_t>();
  }
  return launch_flash_bwd_mma(a, stream);
}
