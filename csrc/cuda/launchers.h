// Plain C++ declarations of every CUDA launcher (no CUDA headers), included by the glue .cpp files.
// Dropout launchers take (seed, offset) by value and `philox`: null, or a device pointer to the
// (2,) int64 (seed, offset) that the kernels then read on the device (ff_philox_resolve,
// philox.cuh) in place of the values, so a captured CUDA graph draws a new mask per replay.
// Each returns nullptr on success, else the CUDA error string. dtype codes: 0 float32,
// 1 float16, 2 bfloat16. Pointers to element data are void*, sizes int64_t, stream a cudaStream_t.
#pragma once
#include <cstdint>

// ---- feed_forward (csrc/cuda/feed_forward.cu)
// pre (N, F): + b1 in place when b1 is not null; a (N, F) = dropout(act(pre)), Philox v2 with
// rows of C = F columns. activation: 0 relu, 1 gelu (exact erf), 2 silu (x sigmoid(x)), 3 gelu_tanh
// (the tanh approximation).
const char* launch_feed_forward_act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream);
// The gated form: pre (N, 2F) rows [g | u]: + b1 / b3 (F,) in place where not null; h (N, F) =
// dropout(act(g) u), the dropout as launch_feed_forward_act_fwd's over (N, F).
const char* launch_feed_forward_glu_fwd(void* pre, const void* b1, const void* b3, void* h, int64_t N,
                                        int64_t F, int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream);
// Its backward: from pre (N, 2F) and dh (N, F), dpre (N, 2F) = [dh keep u act'(g) | dh keep act(g)]
// and h (N, F) = dropout(act(g) u), the forward's mask.
const char* launch_feed_forward_glu_bwd(const void* pre, const void* dh, void* dpre, void* h, int64_t N,
                                        int64_t F, int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream);
// a (N, F) = dropout(act(pre)); dpre (N, F) holds da on entry and dpre = da * keep * scale *
// act'(pre) on return (the same mask as the forward's). With db1 (F,) in dtype not null, also
// db1 = the column sums of dpre, in the same pass per part of rows into db1_partial (parts, F)
// fp32 (parts = colsum_num_parts(N)), then the parts added in a fixed order (no atomics), in
// fp32, rounded once to the dtype.
const char* launch_feed_forward_act_bwd(const void* pre, void* dpre, void* a, float* db1_partial,
                                        int64_t parts, void* db1, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, const int64_t* philox, void* stream);
// The number of row parts of launch_colsum's first stage for `rows` rows (its workspace is
// (parts, cols) fp32).
int64_t colsum_num_parts(int64_t rows);
// out (cols,) in out_dtype = (accumulate ? out : 0) + the column sums of x (rows, cols), two
// stages through partial (parts, cols) fp32, fixed order: deterministic, no atomics; the sum is
// fp32, rounded once to out_dtype (accumulate is meant for an fp32 out).
const char* launch_colsum(const void* x, int64_t rows, int64_t cols, int dtype, float* partial,
                          int64_t parts, void* out, int out_dtype, int accumulate, void* stream);

// ---- cross_entropy (csrc/cuda/cross_entropy.cu), also used by linear_cross_entropy.cpp
// *count (int64) = the number of target values that are not ignore_index. With class_weight (V,)
// fp32 (else nullptr): weight_stats (2,) fp32 = (the sum of class_weight[target] over those rows,
// the sum of class_weight).
const char* launch_cross_entropy_count_valid(const int64_t* target, int64_t n, int64_t ignore_index,
                                             int64_t* count, const float* class_weight, int64_t V,
                                             float* weight_stats, void* stream);
// Per row of logits (n, V): loss_rows (n,) fp32 and, when grad is not null (it may alias
// logits), grad = (softmax - (1 - eps) onehot(t) - eps / V) * scale_i, where scale_i is
// row_scale[i] if given, else 1 / *mean_count if given (0 when it is 0), else scale; ignored
// rows get loss 0 and gradient 0. A target outside [0, V) that is not ignore_index gives nan and
// is never used as an address. class_weight (V,) fp32 with weight_stats (2,) from
// launch_cross_entropy_count_valid, or both nullptr: torch's class weights (the mean's scale is
// then 1 / weight_stats[0], NaN when it is 0 and a row counts).
const char* launch_cross_entropy_fwd(const void* logits, const int64_t* target, void* grad,
                                     float* loss_rows, int64_t n, int64_t V, int dtype,
                                     double label_smoothing, int64_t ignore_index,
                                     const float* row_scale, const int64_t* mean_count,
                                     double scale, const float* class_weight,
                                     const float* weight_stats, void* stream);
// Class probabilities probs (n, V) fp32 as the target (torch's soft targets): loss_rows (n,) fp32 =
// (-sum_c w_c q_c log softmax(x)_c) * loss_scale with q = (1 - eps) probs + eps / V (w = class_weight,
// (V,) fp32, or 1 when null) and, when grad is not null (it may alias logits), grad =
// (sum(w q) softmax - w q) * scale_i, scale_i = row_scale[i] (row_scale (n,) fp32) or, when null, scale.
const char* launch_soft_cross_entropy_fwd(const void* logits, const float* probs, void* grad,
                                          float* loss_rows, int64_t n, int64_t V, int dtype,
                                          double label_smoothing, double scale, double loss_scale,
                                          const float* class_weight, const float* row_scale, void* stream);
// out () in dtype = sum of loss_rows (n,) in a fixed order, / *mean_count when given, or with
// mean_weight (class weights) / *mean_weight (NaN when it is 0).
const char* launch_cross_entropy_reduce(const float* loss_rows, int64_t n, const int64_t* mean_count,
                                        const float* mean_weight, void* out, int dtype, void* stream);

// ---- add_layer_norm (csrc/cuda/add_layer_norm.cu)
// Rows of C columns, x / residual / y / h (N, C) contiguous, weight / bias (C,), all of one dtype;
// mean / rstd (N,) fp32. 128-bit vector loads are used where every row start is 16-byte aligned.
// Forward: h = residual + dropout(x) (dropout(x) when residual is null; Philox v2 with rows of C
// columns), rounded to the dtype and stored; mean / rstd from the stored h;
// y = (h - mean) * rstd * weight + bias. rms_norm: RMSNorm, mean = 0 (written as 0), rstd from
// mean(h^2), (h * rstd) rounded to the dtype before the weight multiply (T5's cast).
const char* launch_add_layer_norm_fwd(const void* x, const void* residual, const void* weight,
                                      const void* bias, void* y, void* h, float* mean, float* rstd,
                                      int64_t N, int64_t C, int dtype, double eps,
                                      double dropout_p, uint64_t seed, uint64_t offset,
                                      const int64_t* philox, void* stream, bool rms_norm);
// The backward's blocks for N rows of C on the current device (sized from its SM count), one
// partial dweight / dbias row each: the workspace is (parts, 2, C) fp32.
int64_t add_layer_norm_bwd_parts(int64_t N, int64_t C);
// Backward: with g = dy * weight, xhat = (h - mean) * rstd,
//   dh_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ dh when dh is not null],
//   dx = dh_total * keep * scale, dresidual = dh_total (written only when dresidual is not null),
//   dweight = sum over rows of dy * xhat, dbias = sum of dy: each block's sums (kept in registers
//   over its rows) into its row of partial (parts, 2, C), then the parts reduced per column as a
//   tree in a fixed order (deterministic, no atomics). rms_norm: without the mean(g) term.
const char* launch_add_layer_norm_bwd(const void* dy, const void* dh, const void* h,
                                      const void* weight, const float* mean, const float* rstd,
                                      void* dx, void* dresidual, void* dweight, void* dbias,
                                      float* partial, int64_t parts, int64_t N, int64_t C,
                                      int dtype, double dropout_p, uint64_t seed, uint64_t offset,
                                      const int64_t* philox, void* stream, bool rms_norm);

// ---- embedding (csrc/cuda/embedding.cu)
// out (N, D) = (weight[ids] * scale + positional[positions]) * keep / (1 - p), Philox v2 over rows
// of D columns; weight (V, D) and positional (P, D) of one dtype, positional / positions null for
// none; ids and positions (N,) int64 in range (the glue's caller checks).
const char* launch_embedding_fwd(const int64_t* ids, const void* weight, const int64_t* positions,
                                 const void* positional, void* out, int64_t N, int64_t D, int dtype,
                                 double scale, double dropout_p, uint64_t seed, uint64_t offset,
                                 const int64_t* philox, void* stream);
// table (K, D), zero on entry: row k = scale * the sum of the rows i of grad * keep / (1 - p) with
// key k, in increasing i, except row skip_row (-1: none). sorted_keys (N,) the keys sorted stably,
// order (N,) each sorted key's row i, ends (N,) the end of each sorted position's run of equal keys.
const char* launch_embedding_bwd(const void* grad, const int64_t* sorted_keys, const int64_t* order,
                                 const int64_t* ends, void* table, int64_t N, int64_t D, int64_t skip_row,
                                 int dtype, double scale, double dropout_p, uint64_t seed, uint64_t offset,
                                 const int64_t* philox, void* stream);

// ---- attention and attention_varlen (csrc/cuda/attention.cu)
// Fused flash-style kernels (FlashAttention-2's algorithm, fp32 accumulation, no Sq x Sk buffer),
// one source for both ops. Row i of sequence b, head h of an operand in dtype (unit stride along
// the head dim) is element b batch + (start_b + i) row + h head: the padded op's (B, H, S, D)
// tensors have start_b = 0 (every sequence max_seqlen_q queries and max_seqlen_k keys); varlen's
// (total, H, D) rows have batch = 0 and start_b = cu_seqlens[b]. lse and delta (fp32, one value
// a row) are described the same way.
struct FfRows {
  int64_t batch, row, head;  // element strides
};
// cu_seqlens_q / cu_seqlens_k: varlen's int32 (B + 1,) on the device, read only there (each
// sequence clamped to [0, total) and to max_seqlen: memory-safe whatever the values), or null for
// the padded op. key_padding_mask (B, max_seqlen_k) bool contiguous (True = padded) or null;
// attn_mask fp32 additive (-inf hides a key whatever its score), element (b, h, i, j) at
// b am_sb + h am_sh + i am_sq + j am_sk (0 strides broadcast), or null. causal: key j of a sequence
// visible to its query i iff j <= i + Lk - Lq. Dropout: Philox v2 counters of the padded
// (B, H, max_seqlen_q, max_seqlen_k) probabilities. D in [1, 256].
struct FfAttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  FfRows q_s, k_s, v_s;
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t B, H, D, total_q, total_k, max_seqlen_q, max_seqlen_k;
  const bool* key_padding_mask;
  const float* attn_mask;
  int64_t am_sb, am_sh, am_sq, am_sk;
  int dtype;
  bool causal;
  double scale, dropout_p;
  uint64_t seed, offset;
  const int64_t* philox;  // the device (seed, offset) the kernels read instead, or null
  // query heads per k/v head (grouped-query attention: k / v have H / kv_group heads, query head
  // h reads k/v head h / kv_group); the gradients dk / dv stay per query head (H heads)
  int64_t kv_group = 1;
  // A relative position bias by distance, (H, 2 rel_R + 1) fp32 contiguous, or null: query i of a
  // sequence, at position i + Lk - Lq + rel_shift (varlen: rel_shift 0), and key j add
  // rel_bias[h, clamp(j - position, -rel_R, rel_R) + rel_R] (h the query head) to their score
  // scale q.k + attn_mask, for visible keys.
  const float* rel_bias = nullptr;
  int64_t rel_R = 0, rel_shift = 0;
};
// out in dtype and lse fp32 through their rows (lse +inf for a row with no visible key, whose out
// is 0). Rows of a varlen q that no sequence owns are not written.
const char* launch_attention_fwd(const FfAttentionArgs& a, void* out, FfRows out_s, float* lse,
                                 FfRows lse_s, void* stream);
// The backward's tensors: dout and out (the forward's) in dtype; lse (read) and delta (fp32
// workspace, = rowsum(dout * out)) with the rows stat_s; dq / dk / dv in dtype, written.
struct FfAttentionGrads {
  const void* dout;
  FfRows dout_s;
  const void* out;
  FfRows out_s;
  const float* lse;
  float* delta;
  FfRows stat_s;
  void* dq;
  FfRows dq_s;
  void* dk;
  FfRows dk_s;
  void* dv;
  FfRows dv_s;
  // With a rel_bias: the dQ kernel's partial sums of dS = dL/ds (the gradient of the bias), by
  // distance bin: (B, H, attention_bwd_rel_parts(max_seqlen_q, D), drel_bins) fp32, one row a
  // block (b, h, query tile), written whole (every element); column c is bin drel_lo + c of the
  // 2R + 1, where ff_rel_bins (attention_call.h) puts every bin a score can reach. Summed over
  // (b, tile) by the caller in a fixed order: no atomics, deterministic.
  float* drel_partial = nullptr;
  int64_t drel_lo = 0, drel_bins = 0;
};
// Deterministic: a dQ kernel per query tile (which also writes delta and, with a rel_bias, its
// row of drel_partial), then a dK / dV kernel per key tile.
const char* launch_attention_bwd(const FfAttentionArgs& a, const FfAttentionGrads& g, void* stream);
// The query tiles of each (sequence, head) of the dQ kernel, the rows of drel_partial a (b, h):
// ceil(max_seqlen_q / tile rows of head dim D's bucket).
int64_t attention_bwd_rel_parts(int64_t max_seqlen_q, int64_t D);
