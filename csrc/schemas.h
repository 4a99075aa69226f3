// The fastformer op schemas, as one function so that two libraries declare exactly the same ops:
// TORCH_LIBRARY(fastformer, m) in csrc/ops.cpp (the real extension, implemented per device with
// TORCH_LIBRARY_IMPL(fastformer, CPU|CUDA, m)) and TORCH_LIBRARY(fastformer_simt, m) in the SIMT
// test harness (tests/simt/, the CUDA kernels compiled as host C++ on CPU tensors).
//
// Conventions shared by every kernel (the Python layer guarantees them):
//   * floating inputs of one op share one dtype (fp32 / fp64 / bf16 on CPU; fp32 / fp16 / bf16
//     on CUDA); statistics (mean, rstd, lse) are fp32; attn_mask is fp32.
//   * dropout: Philox v2, see fastformer/philox.py (the definition), csrc/cpu/philox.h and
//     csrc/cuda/philox.cuh: the dropout tensor is viewed as rows of C columns (its last
//     dimension); group g of 8 columns of row r makes one Philox-4x32-10 call with counter
//     offset + r * ceil(C / 8) + g and key seed, column 8 g + j takes the 16 bits
//     u = (w[j / 2] >> (16 * (j % 2))) & 0xFFFF and is kept iff u >= round(dropout_p * 2^16);
//     kept values are scaled by 1 / (1 - dropout_p).
//     Attention (attention*, attention_varlen*) drops by "v3" instead, at FlashAttention-2's price:
//     16 x 32 tiles of each head's (Sq, Sk) probabilities, 32 Philox calls a tile whose 16 bytes are
//     a warp lane's m16 x n32 accumulator elements, kept iff byte >= round(dropout_p * 256), kept
//     values scaled by 256 / (256 - that threshold) (fastformer/philox.py, philox.cuh).
//   * `Tensor philox` is (seed, offset): an int64 CPU tensor of shape (2,), both values >= 0,
//     drawn by fastformer::next_seed() (defined from Python in fastformer/philox.py, so that
//     torch.compile keeps the draws in the graph). Kernels read the two values on the host
//     (csrc/philox_arg.h); being on the CPU it costs no device sync. It is always checked, its
//     values used only when dropout_p > 0 (a call without dropout passes zeros, draws nothing).
//   * reduction: 0 = none, 1 = mean, 2 = sum (torch's Reduction enum).
//   * SymInt marks a size that follows the batch's shape (max_seqlen_*, num_positions): a
//     torch.compile'd model keeps it symbolic instead of compiling again for each row width. The
//     kernels take it as int64_t, which the dispatcher allows for a SymInt argument.
#pragma once
#include <torch/library.h>

inline void ff_define_schemas(torch::Library& m) {
  // Philox 4x32-10 bits for counters offset .. offset + n - 1 (int64 holding uint32).
  m.def("philox_bits(int n, int seed, int offset) -> Tensor");

  // q (B, H, Sq, D), k/v (B, H, Sk, D), last dim contiguous; key_padding_mask (B, Sk) bool,
  // True = padded; attn_mask fp32 additive, 4-D view broadcast to (B, H, Sq, Sk) (any strides).
  // out (B, H, Sq, D) contiguous; lse (B, H, Sq) fp32, +inf for a row with no visible key.
  // rel_bias: a relative position bias by distance, (H, 2R + 1) fp32 contiguous on q's device:
  // query i (at position i + Sk - Sq + rel_shift) and key j add rel_bias[h, clamp(j - pos, -R, R) + R]
  // to their scaled score (T5's bucketed table gathered on the host, fastformer/ops/relative_position.py).
  // The backward's fourth result is its gradient (H, 2R + 1) fp32, reduced in a fixed order
  // (deterministic), or an empty (0,) fp32 tensor without rel_bias. Varlen: the same per sequence,
  // query i at position i + Lk - Lq.
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, "
      "bool is_causal, float scale, float dropout_p, Tensor philox, Tensor? rel_bias=None, "
      "int rel_shift=0) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? key_padding_mask, Tensor? attn_mask, bool is_causal, float scale, float dropout_p, "
      "Tensor philox, Tensor? rel_bias=None, int rel_shift=0) -> (Tensor, Tensor, Tensor, Tensor)");

  // Variable-length attention over packed rows (FlashAttention's varlen layout): q (total_q, H, D),
  // k/v (total_k, H, D), last dim contiguous (any row stride); cu_seqlens_q / cu_seqlens_k int32
  // (B + 1,) on q's device, cu[0] = 0, non-decreasing, cu[B] = total; sequence b owns rows
  // [cu[b], cu[b + 1]), at most max_seqlen_q / max_seqlen_k of them. is_causal: query i of a
  // sequence sees its key j iff j <= i + Lk - Lq (bottom-right per sequence). out (total_q, H, D)
  // contiguous; lse (H, total_q) fp32, +inf for a row with no key. Dropout: the padded op's
  // counters on (B, H, max_seqlen_q, max_seqlen_k), i.e. row (b * H + h) * max_seqlen_q + i with
  // ceil(max_seqlen_k / 8) groups a row, so the same sequences right-padded draw the same bits.
  m.def(
      "attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, bool is_causal, float scale, float dropout_p, "
      "Tensor philox, Tensor? rel_bias=None) -> (Tensor, Tensor)");
  m.def(
      "attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool is_causal, "
      "float scale, float dropout_p, Tensor philox, Tensor? rel_bias=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // The same backward writing into given gradients (FlashAttention's dq_ / dk_ / dv_): slices of
  // one packed (total, 3, H, D) qkv or (total, 2, H, D) kv gradient, so a caller holding packed
  // inputs gets one gradient without stacking three. Every element of dq, dk and dv is written.
  m.def(
      "attention_varlen_bwd.into(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool is_causal, "
      "float scale, float dropout_p, Tensor philox, Tensor? rel_bias=None, *, Tensor(a!) dq, Tensor(b!) dk, "
      "Tensor(c!) dv) -> Tensor");

  // x, residual (N, C) contiguous; weight, bias (C,). Returns y = LN(h), h = residual + dropout(x)
  // (h = dropout(x) without a residual), mean (N,) and rstd (N,) fp32.
  // rms_norm: RMSNorm (T5LayerNorm): y = round(h * rstd) * weight + bias, rstd = 1 / sqrt(mean(h^2)
  // + eps), round = to x's dtype (T5's cast; a no-op in fp32 / fp64); mean is returned as zeros
  // (the backward reads it as the LayerNorm's and finds no mean to subtract).
  m.def(
      "add_layer_norm_fwd(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps, "
      "float dropout_p, Tensor philox, bool rms_norm=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // dy: gradient of y; dh: extra gradient of h (prenorm's second output) or None.
  // Returns (dx, dresidual, dweight, dbias); dresidual is an empty tensor when it equals dx
  // (dropout_p == 0) or when there is no residual (has_residual false).
  m.def(
      "add_layer_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor weight, Tensor mean, Tensor rstd, "
      "float dropout_p, Tensor philox, bool has_residual, bool rms_norm=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // The same with x_bias (C,), the bias of the linear layer that produced x, added to x before
  // the dropout: h = residual + dropout(x + x_bias). It spares the layer its own bias pass (a copy
  // of (N, C) in addmm, a column sum in its backward). The backward also returns dx_bias, the
  // column sum of dx. Backends without these overloads add the bias on the host.
  m.def(
      "add_layer_norm_fwd.x_bias(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps, "
      "float dropout_p, Tensor philox, Tensor x_bias, bool rms_norm=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "add_layer_norm_bwd.x_bias(Tensor dy, Tensor? dh, Tensor h, Tensor weight, Tensor mean, "
      "Tensor rstd, float dropout_p, Tensor philox, bool has_residual, bool rms_norm=False) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // x (N, E); w1 (F, E), b1 (F,), w2 (E, F), b2 (E,), nn.Linear layout. activation
  // "relu"|"gelu"|"silu"|"gelu_tanh" (exact erf gelu; silu x sigmoid(x); gelu_tanh the tanh
  // approximation). Returns out (N, E) and pre = x w1^T + b1 (N, F), saved for backward (relu
  // without dropout on CUDA: relu(pre), which the backward reads the same way).
  // Gated (w3 (F, E) given, b3 (F,) or None; last, with defaults: the calls without them are
  // unchanged): out = dropout(act(x w1^T + b1) * (x w3^T + b3)) w2^T + b2, and pre is (N, 2F), the
  // gate's then the up projection's pre-activations, [x w1^T + b1 | x w3^T + b3].
  m.def(
      "feed_forward_fwd(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, Tensor philox, Tensor? w3=None, Tensor? b3=None) -> (Tensor, Tensor)");
  // Returns (dx, dw1, db1, dw2, db2); db1 / db2 are empty tensors when has_b1 / has_b2 is false.
  // Gated (w3 given; pre (N, 2F)): dw1 is (2F, E), [dw1; dw3], and db1 is (2F,), [db1; db3], when
  // has_b1 or has_b3 (the caller keeps the half it has a bias for), else empty.
  m.def(
      "feed_forward_bwd(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor pre, bool has_b1, "
      "bool has_b2, str activation, float dropout_p, Tensor philox, Tensor? w3=None, "
      "bool has_b3=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // logits (N, V) contiguous, target (N,) int64. loss: () for mean/sum, (N,) for none, in the
  // logits dtype. grad (N, V) = d(loss)/d(logits) for an upstream gradient of 1 (per row for
  // reduction none), empty when compute_grad is false. class_weight: torch's per-class weights
  // (V,) contiguous, fp32 (fp64 for fp64 logits), or None; the mean then divides by the valid
  // rows' sum of class_weight[target] (NaN when it is 0). Last, with a default: the calls
  // without it are unchanged.
  m.def(
      "cross_entropy_fwd(Tensor logits, Tensor target, float label_smoothing, int ignore_index, "
      "int reduction, bool compute_grad, Tensor? class_weight=None) -> (Tensor, Tensor)");

  // hidden (N, D), weight (V, D), bias (V,): the loss of logits = hidden weight^T + bias,
  // computed in row chunks so the (N, V) logits never exist. With compute_grad (mean / sum only)
  // also returns (dhidden, dweight, dbias) for an upstream gradient of 1; otherwise empty tensors.
  // class_weight: the per-class weights, as cross_entropy_fwd's (weight is the linear layer's).
  m.def(
      "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "float label_smoothing, int ignore_index, int reduction, bool compute_grad, "
      "Tensor? class_weight=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // The gradient for reduction none: grad_loss (N,) weights each row's loss. dbias empty without bias.
  m.def(
      "linear_cross_entropy_bwd(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, float label_smoothing, int ignore_index, Tensor? class_weight=None) "
      "-> (Tensor, Tensor, Tensor)");

  // The fused input embedding out = dropout(weight[input] * scale + positional[positions]).
  // input (N,) int64 ids in [0, V); weight (V, D) contiguous; positional (P, D) of weight's dtype
  // and positions (N,) int64 in [0, P), both given or both None. out (N, D) in weight's dtype,
  // computed in fp32 (fp64 for fp64) and rounded once; dropout over the (N, D) rows.
  m.def(
      "embedding_fwd(Tensor input, Tensor weight, Tensor? positional, Tensor? positions, float scale, "
      "float dropout_p, Tensor philox) -> Tensor");
  // grad (N, D). Returns (dweight (num_weights, D), dpositional (num_positions, D)), each an empty
  // tensor when not asked for (weight_grad / positional_grad false). dweight = scale * the
  // scatter-add of grad * keep / (1 - p) by input, its padding_idx row 0 (-1: no padding_idx);
  // dpositional the same scatter-add by positions. Deterministic: each row a fixed-order sum.
  m.def(
      "embedding_bwd(Tensor grad, Tensor input, Tensor? positions, int num_weights, SymInt num_positions, "
      "bool weight_grad, bool positional_grad, int padding_idx, float scale, float dropout_p, Tensor philox) "
      "-> (Tensor, Tensor)");
}
