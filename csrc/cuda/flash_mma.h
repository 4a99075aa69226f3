// Plain C++ declaration of the tensor-core flash attention launcher (csrc/cuda/flash_fwd_mma.cu),
// as csrc/cuda/launchers.h declares the others: no CUDA headers, nullptr on success, else the
// error string. The glue of attention and attention_varlen (csrc/cuda/attention.cpp,
// attention_varlen.cpp) runs their forwards here whenever flash_fwd_mma_why_not says it can; the
// SIMT harness's test op fastformer_simt_selftest::flash_fwd_mma (tests/simt/simt_lib.cpp) calls
// the launcher directly; the backward launcher below, likewise, by both ops' glue and by
// fastformer_simt_selftest::flash_bwd_mma.
#pragma once
#include <cstdint>

#include "launchers.h"  // FfRows, FfAttentionGrads: the FMA kernels' description of the same call

// The forward of `attention` (fastformer/ops/reference.py) for 16-bit inputs on sm_80+, and fp32
// ones as tf32 when allowed: q (B, H, Sq, D), k / v (B, H, Sk, D) in dtype (1 float16, 2 bfloat16,
// 0 float32 with allow_tf32), unit last stride, any
// (batch, head, row) element strides. D in [1, 256]. Rows whose starts are all 16-byte aligned
// (pointers 16-byte aligned, strides multiples of 8 elements) go through cp.async; any others
// through plain loads (slower, same result).
// Masks: kpm (B, Sk) bool (True = padded), element (b, j) at b kpm_sb + j, or null; am fp32
// additive (a bool mask as 0 / -inf), element (b, h, i, j) at b am_sb + h am_sh + i am_sq + j am_sk
// (0 strides broadcast batch, head and query; am_sk must be 1), or null; causal: key j visible to
// query i iff j <= i + Sk - Sq. A key is hidden where a mask says so (am -inf included); a row
// with no visible key gives out 0, lse +inf.
// Dropout: attention's v3 (philox.cuh), 16 x 32 tiles of the padded (B, H, Sq, Sk) probabilities.
// Varlen (attention_varlen's packed rows, as FfAttentionArgs in launchers.h): cu_seqlens_q / _k
// int32 (B + 1,) on the device, read there only, each sequence clamped to [0, total) and to
// Sq / Sk, which are then max_seqlen_q / _k (the grid, and the padded op's dropout counters);
// sequence b's row i is element b q_sb + (cu_seqlens_q[b] + i) q_ss + h q_sh (q_sb = 0 for packed
// rows), causal per sequence; no kpm or am. Both null: the padded op.
struct FfFlashFwdArgs {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_ss;  // element strides of batch, head, row
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t B, H, Sq, Sk, D;
  int dtype;  // 1 float16, 2 bfloat16
  bool causal;
  double scale;
  const bool* kpm;
  int64_t kpm_sb;
  const float* am;
  int64_t am_sb, am_sh, am_sq, am_sk;
  double dropout_p;
  uint64_t seed, offset;
  const int64_t* philox;  // the device (seed, offset) the kernels read instead, or null
  const int32_t* cu_seqlens_q;  // varlen, or null
  const int32_t* cu_seqlens_k;
  int64_t total_q, total_k;  // varlen: the rows of q and of k / v
  // out's and lse's element strides (batch, head, row); all 0: the padded op's contiguous
  // (B, H, Sq, D) and (B, H, Sq). Rows of a varlen q that no sequence owns are not written.
  int64_t out_sb, out_sh, out_ss, lse_sb, lse_sh, lse_ss;
  // dtype 0 (float32) runs here only with allow_tf32 (torch.backends.cuda.matmul.allow_tf32, read
  // by the glue), as mma.sync m16n8k8 .tf32 (operands rounded to 10 mantissa bits), D <= 128
  bool allow_tf32;
  int64_t kv_group = 1;  // query head h reads k/v head h / kv_group (FfAttentionArgs::kv_group)
  // FfAttentionArgs::rel_bias, rel_R, rel_shift: the forward adds it; the backward declines it
  const float* rel_bias = nullptr;
  int64_t rel_R = 0, rel_shift = 0;
};

// The tensor-core kernels' description of the call that a describes to the FMA kernels: the one
// place FfFlashFwdArgs is filled (both ops' glue and the SIMT harness's test ops, through
// attention_call.h). out_s / lse_s: the rows of out and lse (all 0: the padded op's contiguous
// (B, H, Sq, D) and (B, H, Sq)); the grid Sq / Sk is max_seqlen_q / _k; kpm, when given, is
// (B, max_seqlen_k) contiguous.
inline FfFlashFwdArgs ff_flash_fwd_args(const FfAttentionArgs& a, FfRows out_s, FfRows lse_s,
                                        bool allow_tf32) {
  FfFlashFwdArgs f{};
  f.q = a.q, f.k = a.k, f.v = a.v;
  f.q_sb = a.q_s.batch, f.q_sh = a.q_s.head, f.q_ss = a.q_s.row;
  f.k_sb = a.k_s.batch, f.k_sh = a.k_s.head, f.k_ss = a.k_s.row;
  f.v_sb = a.v_s.batch, f.v_sh = a.v_s.head, f.v_ss = a.v_s.row;
  f.B = a.B, f.H = a.H, f.Sq = a.max_seqlen_q, f.Sk = a.max_seqlen_k, f.D = a.D;
  f.dtype = a.dtype;
  f.causal = a.causal;
  f.scale = a.scale;
  f.kpm = a.key_padding_mask;
  f.kpm_sb = a.max_seqlen_k;
  f.am = a.attn_mask;
  f.am_sb = a.am_sb, f.am_sh = a.am_sh, f.am_sq = a.am_sq, f.am_sk = a.am_sk;
  f.dropout_p = a.dropout_p;
  f.seed = a.seed, f.offset = a.offset, f.philox = a.philox;
  f.cu_seqlens_q = a.cu_seqlens_q, f.cu_seqlens_k = a.cu_seqlens_k;
  f.total_q = a.total_q, f.total_k = a.total_k;
  f.out_sb = out_s.batch, f.out_sh = out_s.head, f.out_ss = out_s.row;
  f.lse_sb = lse_s.batch, f.lse_sh = lse_s.head, f.lse_ss = lse_s.row;
  f.allow_tf32 = allow_tf32;
  f.kv_group = a.kv_group;
  f.rel_bias = a.rel_bias;
  f.rel_R = a.rel_R;
  f.rel_shift = a.rel_shift;
  return f;
}

// nullptr when the kernel can take the call, else why not (a 32-bit dtype, an attn_mask without a
// unit key stride, masks with cu_seqlens, a GPU older than sm_80, sizes out of range). A relative
// position bias (rel_bias) is added as the FMA kernel adds it.
const char* flash_fwd_mma_why_not(const FfFlashFwdArgs& a);

// out (B, H, Sq, D) in dtype and lse (B, H, Sq) fp32, contiguous unless out_s* / lse_s* say; lse
// the log-sum-exp of the visible scaled scores (+inf for a row with no visible key, NaN for a NaN
// row).
const char* launch_flash_fwd_mma(const FfFlashFwdArgs& a, void* out, float* lse, void* stream);

// The backward of the same call on tensor cores (csrc/cuda/flash_bwd_mma.cu): f is the forward's
// description; dout and out (B, H, Sq, D) in its dtype through their strides (unit last stride);
// lse fp32, the forward's, laid out as f.lse_s* say (all 0: (B, H, Sq) contiguous; rows
// contiguous); delta fp32 the same, a workspace (written: rowsum(dout * out)); dq (B, H, Sq, D),
// dk / dv (B, H, Sk, D) in the dtype, written through their strides (unit last stride). Varlen (f's
// cu_seqlens): as the forward, each sequence's rows through the strides; rows no sequence owns
// are not written. Deterministic (no atomics).
struct FfFlashBwdArgs {
  FfFlashFwdArgs f;
  const void* dout;
  int64_t do_sb, do_sh, do_ss;
  const void* out;
  int64_t o_sb, o_sh, o_ss;
  const float* lse;
  float* delta;
  void* dq;
  int64_t dq_sb, dq_sh, dq_ss;
  void* dk;
  int64_t dk_sb, dk_sh, dk_ss;
  void* dv;
  int64_t dv_sb, dv_sh, dv_ss;
  // the one-kernel backward's dQ workspace (flash_bwd_mma_workspace's sizes): an fp32 dQ
  // accumulator (need not be zeroed) and a counter a (b, h, query tile), zeroed; both null (or
  // sizes 0) sends the call to the two-kernel backward
  float* dq_acc;
  int32_t* dq_count;
};

// The backward's arguments from the FMA kernels' description of the same gradients (the glue
// builds that for either path): g's pointers and (batch, head, row) strides. lse / delta are laid
// out as f says (g.stat_s describes the same layout to the FMA kernels).
inline FfFlashBwdArgs ff_flash_bwd_args(const FfFlashFwdArgs& f, const FfAttentionGrads& g) {
  FfFlashBwdArgs b{};
  b.f = f;
  b.dout = g.dout, b.do_sb = g.dout_s.batch, b.do_sh = g.dout_s.head, b.do_ss = g.dout_s.row;
  b.out = g.out, b.o_sb = g.out_s.batch, b.o_sh = g.out_s.head, b.o_ss = g.out_s.row;
  b.lse = g.lse, b.delta = g.delta;
  b.dq = g.dq, b.dq_sb = g.dq_s.batch, b.dq_sh = g.dq_s.head, b.dq_ss = g.dq_s.row;
  b.dk = g.dk, b.dk_sb = g.dk_s.batch, b.dk_sh = g.dk_s.head, b.dk_ss = g.dk_s.row;
  b.dv = g.dv, b.dv_sb = g.dv_s.batch, b.dv_sh = g.dv_s.head, b.dv_ss = g.dv_s.row;
  return b;
}

// nullptr when the backward kernels can take the call: the forward's rule (16-bit dtype, an
// attn_mask with a unit key stride, varlen without masks, no relative position bias, sm_80+, sizes
// in range) and lse rows contiguous, checked on its own.
const char* flash_bwd_mma_why_not(const FfFlashFwdArgs& a);

// The dQ workspace launch_flash_bwd_mma needs for a call the one-kernel backward takes (fp32
// floats of the accumulator, int32 counters, to be zeroed); 0 and 0 where it runs the two-kernel
// backward (head dims past 128, rows not 16-byte aligned at D <= 64, Sq = 0 or Sk = 0): then
// nothing need be allocated. dout's pointer and strides count (alignment); the gradients' not.
void flash_bwd_mma_workspace(const FfFlashBwdArgs& a, int64_t* acc_floats, int64_t* counters);

const char* launch_flash_bwd_mma(const FfFlashBwdArgs& a, void* stream);
