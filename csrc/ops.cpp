// The fastformer op schemas: declared once here, implemented per device with
// TORCH_LIBRARY_IMPL(fastformer, CPU, m) in csrc/cpu/*.cpp and
// TORCH_LIBRARY_IMPL(fastformer, CUDA, m) in csrc/cuda/*.cpp.
//
// Conventions shared by every kernel (the Python layer guarantees them):
//   * floating inputs of one op share one dtype (fp32 / fp64 / bf16 on CPU);
//     statistics (mean, rstd, lse) are fp32; attn_mask is fp32.
//   * dropout ("Philox v2", defined in fastformer/philox.py; scalar C++ form in
//     csrc/cpu/philox.h): the op's dropout tensor is viewed as rows of its last dimension C;
//     group g of eight columns of row r makes one Philox-4x32-10 call with counter
//     offset + r * ceil(C / 8) + g and key seed, whose four words give the eight columns 16
//     bits each; an element is kept iff its 16 bits are >= round(dropout_p * 2^16), and kept
//     values are scaled by 1 / (1 - dropout_p).
//   * `Tensor philox` is (seed, offset): an int64 CPU tensor of shape (2,), both values >= 0,
//     drawn by fastformer::next_seed() (defined from Python in fastformer/philox.py, so that
//     torch.compile keeps the draws in the graph). Kernels read the two values on the host;
//     being on the CPU it costs no device sync. It is always checked, its values used only
//     when dropout_p > 0 (a call without dropout passes zeros and draws nothing).
//   * reduction: 0 = none, 1 = mean, 2 = sum (torch's Reduction enum).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import fastformer._C` only has to load this library: the ops register
// themselves with the dispatcher through the static initialisers below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fastformer, m) {
  // Philox 4x32-10 bits for counters offset .. offset + n - 1 (int64 holding uint32).
  m.def("philox_bits(int n, int seed, int offset) -> Tensor");

  // q (B, H, Sq, D), k/v (B, H, Sk, D), last dim contiguous; key_padding_mask (B, Sk) bool,
  // True = padded; attn_mask fp32 additive, 4-D view broadcast to (B, H, Sq, Sk) (any strides).
  // out (B, H, Sq, D) contiguous; lse (B, H, Sq) fp32, +inf for a row with no visible key.
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, "
      "bool is_causal, float scale, float dropout_p, Tensor philox) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? key_padding_mask, Tensor? attn_mask, bool is_causal, float scale, float dropout_p, "
      "Tensor philox) -> (Tensor, Tensor, Tensor)");

  // x, residual (N, C) contiguous; weight, bias (C,). Returns y = LN(h), h = residual + dropout(x)
  // (h = dropout(x) without a residual), mean (N,) and rstd (N,) fp32.
  m.def(
      "add_layer_norm_fwd(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps, "
      "float dropout_p, Tensor philox) -> (Tensor, Tensor, Tensor, Tensor)");
  // dy: gradient of y; dh: extra gradient of h (prenorm's second output) or None.
  // Returns (dx, dresidual, dweight, dbias); dresidual is an empty tensor when it equals dx
  // (dropout_p == 0) or when there is no residual (has_residual false).
  m.def(
      "add_layer_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor weight, Tensor mean, Tensor rstd, "
      "float dropout_p, Tensor philox, bool has_residual) -> (Tensor, Tensor, Tensor, Tensor)");

  // x (N, E); w1 (F, E), b1 (F,), w2 (E, F), b2 (E,), nn.Linear layout. activation "relu"|"gelu"
  // (exact erf gelu). Returns out (N, E) and pre = x w1^T + b1 (N, F), saved for backward.
  m.def(
      "feed_forward_fwd(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, Tensor philox) -> (Tensor, Tensor)");
  // Returns (dx, dw1, db1, dw2, db2); db1 / db2 are empty tensors when has_b1 / has_b2 is false.
  m.def(
      "feed_forward_bwd(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor pre, bool has_b1, "
      "bool has_b2, str activation, float dropout_p, Tensor philox) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // logits (N, V) contiguous, target (N,) int64. loss: () for mean/sum, (N,) for none, in the
  // logits dtype. grad (N, V) = d(loss)/d(logits) for an upstream gradient of 1 (per row for
  // reduction none), empty when compute_grad is false.
  m.def(
      "cross_entropy_fwd(Tensor logits, Tensor target, float label_smoothing, int ignore_index, "
      "int reduction, bool compute_grad) -> (Tensor, Tensor)");

  // hidden (N, D), weight (V, D), bias (V,): the loss of logits = hidden weight^T + bias,
  // computed in row chunks so the (N, V) logits never exist. With compute_grad (mean / sum only)
  // also returns (dhidden, dweight, dbias) for an upstream gradient of 1; otherwise empty tensors.
  m.def(
      "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "float label_smoothing, int ignore_index, int reduction, bool compute_grad) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // The gradient for reduction none: grad_loss (N,) weights each row's loss. dbias empty without bias.
  m.def(
      "linear_cross_entropy_bwd(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, float label_smoothing, int ignore_index) -> (Tensor, Tensor, Tensor)");
}
