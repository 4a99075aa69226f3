// Plain C++ declarations of every CUDA launcher (no CUDA headers), included by the glue .cpp files.
// Each returns nullptr on success, else the CUDA error string. dtype codes: 0 float32,
// 1 float16, 2 bfloat16. Pointers to element data are void*, sizes int64_t, stream a cudaStream_t.
#pragma once
#include <cstdint>

// ---- feed_forward (csrc/cuda/feed_forward.cu)
// pre (N, F): + b1 in place when b1 is not null; a (N, F) = dropout(act(pre)), Philox v2 with
// rows of C = F columns. activation: 0 relu, 1 gelu (exact erf), 2 silu (x sigmoid(x)).
const char* launch_feed_forward_act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream);
// a (N, F) = dropout(act(pre)); dpre (N, F) holds da on entry and dpre = da * keep * scale *
// act'(pre) on return (the same mask as the forward's). With db1 (F,) fp32 not null, also
// db1 = the column sums of dpre, in the same pass per part of rows into db1_partial (parts, F)
// fp32 (parts = colsum_num_parts(N)), then the parts added in a fixed order (no atomics).
const char* launch_feed_forward_act_bwd(const void* pre, void* dpre, void* a, float* db1_partial,
                                        int64_t parts, float* db1, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream);
// The number of row parts of launch_colsum's first stage for `rows` rows (its workspace is
// (parts, cols) fp32).
int64_t colsum_num_parts(int64_t rows);
// out (cols,) fp32 = (accumulate ? out : 0) + the column sums of x (rows, cols), two stages
// through partial (parts, cols) fp32, fixed order: deterministic, no atomics.
const char* launch_colsum(const void* x, int64_t rows, int64_t cols, int dtype, float* partial,
                          int64_t parts, float* out, int accumulate, void* stream);

// ---- cross_entropy (csrc/cuda/cross_entropy.cu), also used by linear_cross_entropy.cpp
// *count (int64) = the number of target values that are not ignore_index.
const char* launch_cross_entropy_count_valid(const int64_t* target, int64_t n, int64_t ignore_index,
                                             int64_t* count, void* stream);
// Per row of logits (n, V): loss_rows (n,) fp32 and, when grad is not null (it may alias
// logits), grad = (softmax - (1 - eps) onehot(t) - eps / V) * scale_i, where scale_i is
// row_scale[i] if given, else 1 / *mean_count if given (0 when it is 0), else scale; ignored
// rows get loss 0 and gradient 0. A target outside [0, V) that is not ignore_index gives nan and
// is never used as an address.
const char* launch_cross_entropy_fwd(const void* logits, const int64_t* target, void* grad,
                                     float* loss_rows, int64_t n, int64_t V, int dtype,
                                     double label_smoothing, int64_t ignore_index,
                                     const float* row_scale, const int64_t* mean_count,
                                     double scale, void* stream);
// out () in dtype = sum of loss_rows (n,) in a fixed order, / *mean_count when given.
const char* launch_cross_entropy_reduce(const float* loss_rows, int64_t n, const int64_t* mean_count,
                                        void* out, int dtype, void* stream);

// ---- add_layer_norm (csrc/cuda/add_layer_norm.cu)
// Rows of C columns, x / residual / y / h (N, C) contiguous, weight / bias (C,), all of one dtype;
// mean / rstd (N,) fp32. 128-bit vector loads are used where every row start is 16-byte aligned.
// Forward: h = residual + dropout(x) (dropout(x) when residual is null; Philox v2 with rows of C
// columns), rounded to the dtype and stored; mean / rstd from the stored h;
// y = (h - mean) * rstd * weight + bias.
const char* launch_add_layer_norm_fwd(const void* x, const void* residual, const void* weight,
                                      const void* bias, void* y, void* h, float* mean, float* rstd,
                                      int64_t N, int64_t C, int dtype, double eps,
                                      double dropout_p, uint64_t seed, uint64_t offset,
                                      void* stream);
// The backward's blocks for N rows of C on the current device (sized from its SM count), one
// partial dweight / dbias row each: the workspace is (parts, 2, C) fp32.
int64_t add_layer_norm_bwd_parts(int64_t N, int64_t C);
// Backward: with g = dy * weight, xhat = (h - mean) * rstd,
//   dh_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dh when dh is not null],
//   dx = dh_total * keep * scale, dresidual = dh_total (written only when dresidual is not null),
//   dweight = sum over rows of dy * xhat, dbias = sum of dy: each block's sums (kept in registers
//   over its rows) into its row of partial (parts, 2, C), then the parts reduced per column as a
//   tree in a fixed order (deterministic, no atomics).
const char* launch_add_layer_norm_bwd(const void* dy, const void* dh, const void* h,
                                      const void* weight, const float* mean, const float* rstd,
                                      void* dx, void* dresidual, void* dweight, void* dbias,
                                      float* partial, int64_t parts, int64_t N, int64_t C,
                                      int dtype, double dropout_p, uint64_t seed, uint64_t offset,
                                      void* stream);

// ---- attention (csrc/cuda/attention.cu)
// Row kernels over (B, H, Sq, Sk) fp32 matrices, contiguous (row r = (b H + h) Sq + i, Sk
// columns); the products run in ATen (attention.cpp). Masks: kpm (B, Sk) bool contiguous (True =
// padded) or null; am fp32 additive, element (b, h, i, j) at b am_sb + h am_sh + i am_sq + j am_sk
// (0 strides broadcast), or null; causal: key j visible to query i iff j <= i + Sk - Sq. Dropout
// is Philox v2 with rows of C = Sk columns, one per query.
// Forward: s = q k^T (unscaled); p in dtype (may alias s when dtype is 0) = dropout(softmax(
// scale s + masks)); lse (B, H, Sq) fp32, +inf for a row with no visible key (its p is 0).
const char* launch_attention_softmax_fwd(const float* s, void* p, float* lse, int64_t B, int64_t H,
                                         int64_t Sq, int64_t Sk, int dtype, double scale,
                                         const bool* kpm, const float* am, int64_t am_sb,
                                         int64_t am_sh, int64_t am_sq, int64_t am_sk, int causal,
                                         double dropout_p, uint64_t seed, uint64_t offset,
                                         void* stream);
// Backward, first: s = q k^T on entry, P = exp(scale s + masks - lse) on return (fp32, in place;
// -0.0f marks a key hidden by the masks); dropped (when not null) in dtype = P Z, Z the forward's
// dropout multipliers (NaN at every key of a NaN row, as the reference's probabilities).
const char* launch_attention_probs_bwd(float* s, void* dropped, const float* lse, int64_t B,
                                       int64_t H, int64_t Sq, int64_t Sk, int dtype, double scale,
                                       const bool* kpm, const float* am, int64_t am_sb,
                                       int64_t am_sh, int64_t am_sq, int64_t am_sk, int causal,
                                       double dropout_p, uint64_t seed, uint64_t offset,
                                       void* stream);
// Backward, second: ds in dtype (may alias dp when dtype is 0) = scale P (dp Z - delta), 0 where
// prob is -0.0f (hidden keys, also in a NaN row), with
// dp = dO v^T (fp32) and delta = rowsum(dout * out); dout and out (B, H, Sq, D) in dtype with
// unit last stride, read through their (b, h, s) strides.
const char* launch_attention_softmax_bwd(const float* prob, const float* dp, void* ds,
                                         const void* dout, int64_t do_sb, int64_t do_sh,
                                         int64_t do_ss, const void* out, int64_t o_sb,
                                         int64_t o_sh, int64_t o_ss, int64_t B, int64_t H,
                                         int64_t Sq, int64_t Sk, int64_t D, int dtype, double scale,
                                         double dropout_p, uint64_t seed, uint64_t offset,
                                         void* stream);

// ---- attention_varlen (csrc/cuda/attention_varlen.cu)
// Fused flash-style kernels (FlashAttention-2's algorithm, fp32 accumulation) over packed rows:
// q (total_q, H, D), k / v (total_k, H, D) in dtype, unit last stride, element strides per row and
// head; cu_seqlens_q / cu_seqlens_k int32 (B + 1,) on the device, read only there (each sequence
// clamped to [0, total) and to max_seqlen: memory-safe whatever the values). causal: key j of a
// sequence visible to its query i iff j <= i + Lk - Lq. Dropout: the padded op's Philox v2
// counters on (B, H, max_seqlen_q, max_seqlen_k). D in [1, 256].
struct FfVarlenArgs {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t B, H, D, total_q, total_k, max_seqlen_q, max_seqlen_k;
  int dtype;
  bool causal;
  double scale, dropout_p;
  uint64_t seed, offset;
};
// out (total_q, H, D) contiguous in dtype; lse (H, total_q) fp32, +inf for a row with no key. Rows
// of q that no sequence owns are not written.
const char* launch_attention_varlen_fwd(const FfVarlenArgs& a, void* out, float* lse, void* stream);
// dq / dk / dv in dtype through their (row, head) strides, unit last stride; delta (H, total_q)
// fp32 workspace (= rowsum(dout * out)); dout / out through their strides, lse (H, total_q) fp32
// contiguous. Deterministic: a dK / dV kernel per key tile, then a dQ kernel per query tile.
const char* launch_attention_varlen_bwd(const FfVarlenArgs& a, const void* dout, int64_t do_row,
                                        int64_t do_head, const void* out, int64_t o_row,
                                        int64_t o_head, const float* lse, float* delta, void* dq,
                                        int64_t dq_row, int64_t dq_head, void* dk, int64_t dk_row,
                                        int64_t dk_head, void* dv, int64_t dv_row, int64_t dv_head,
                                        void* stream);
