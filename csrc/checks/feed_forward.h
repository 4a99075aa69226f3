// The argument checks of feed_forward_fwd / feed_forward_bwd, shared by csrc/cpu/feed_forward.cpp
// and csrc/cuda/feed_forward.cpp (see common.h). Every tensor is contiguous, in x's dtype, with
// the weights in nn.Linear layout: x (N, E), w1 (F, E), b1 (F,), w2 (E, F), b2 (E,).
#pragma once
#include <optional>
#include <string>

#include "common.h"

namespace fastformer {

// The activation between the GEMMs; the values are the CUDA launchers' codes (launchers.h).
// kGeluTanh: the tanh approximation (F.gelu(approximate="tanh"), transformers' "gelu_new").
enum class Activation { kRelu = 0, kGelu = 1, kSilu = 2, kGeluTanh = 3 };

namespace checks {
namespace feed_forward_detail {

inline void check_x(const Backend& be, const char* op, const at::Tensor& x) {
  check_device(be, op, "x", x);
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (N, E), got shape ", x.sizes());
  check_float_dtype(be, op, "x", x);
  check_contiguous(op, "x", x);
}

// A 2-D tensor like x with the given shape (-1: any size), said as `want` in the message.
inline void check_matrix(const Backend& be, const char* op, const char* name, const at::Tensor& t,
                         int64_t rows, int64_t cols, const char* want, const at::Tensor& x) {
  check_device(be, op, name, t, &x, "x");
  TORCH_CHECK(t.dim() == 2 && (rows < 0 || t.size(0) == rows) && (cols < 0 || t.size(1) == cols),
              op, ": ", name, " must have shape ", want, ", got ", t.sizes());
  check_dtype_of(op, name, t, x, "x");
  check_contiguous(op, name, t);
}

// A bias like x of shape (size,), said as `want` in the message.
inline void check_bias(const Backend& be, const char* op, const char* name, const at::Tensor& b,
                       int64_t size, const char* want, const at::Tensor& x) {
  check_device(be, op, name, b, &x, "x");
  TORCH_CHECK(b.dim() == 1 && b.size(0) == size, op, ": ", name, " must have shape (", size,
              ",) ", want, ", got ", b.sizes());
  check_dtype_of(op, name, b, x, "x");
  check_contiguous(op, name, b);
}

inline Activation parse_activation(const char* op, c10::string_view activation) {
  const std::string name(activation);
  TORCH_CHECK(name == "relu" || name == "gelu" || name == "silu" || name == "gelu_tanh", op,
              ": activation must be \"relu\", \"gelu\", \"silu\" or \"gelu_tanh\", got \"", name, "\"");
  return name == "relu"   ? Activation::kRelu
         : name == "gelu" ? Activation::kGelu
         : name == "silu" ? Activation::kSilu
                          : Activation::kGeluTanh;
}

inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// x, w1 and w2 (both ops take them); returns F.
inline int64_t check_weights(const Backend& be, const char* op, const at::Tensor& x,
                             const at::Tensor& w1, const at::Tensor& w2) {
  const int64_t E = x.size(1);
  check_matrix(be, op, "w1", w1, -1, E, "(F, E) with E = x.size(1)", x);
  const int64_t F = w1.size(0);
  check_matrix(be, op, "w2", w2, E, F, "(E, F), the transpose of w1's shape", x);
  return F;
}

}  // namespace feed_forward_detail

// The forward's arguments; returns the activation. w3 / b3: the gated form's up projection
// (F, E) and its bias (F,), each None when not gated (b3 needs w3).
inline Activation check_feed_forward_fwd(const Backend& be, const char* op, const at::Tensor& x,
                                         const at::Tensor& w1, const std::optional<at::Tensor>& b1,
                                         const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                                         c10::string_view activation, double dropout_p,
                                         const std::optional<at::Tensor>& w3 = std::nullopt,
                                         const std::optional<at::Tensor>& b3 = std::nullopt) {
  using namespace feed_forward_detail;
  check_x(be, op, x);
  const int64_t F = check_weights(be, op, x, w1, w2);
  if (present(b1)) check_bias(be, op, "b1", *b1, F, "(F = w1.size(0))", x);
  if (present(b2)) check_bias(be, op, "b2", *b2, x.size(1), "(E = x.size(1))", x);
  TORCH_CHECK(!present(b3) || present(w3), op, ": b3 was given without w3 (b3 is the gated form's up-projection bias)");
  if (present(w3)) check_matrix(be, op, "w3", *w3, F, x.size(1), "(F, E), the shape of w1", x);
  if (present(b3)) check_bias(be, op, "b3", *b3, F, "(F = w1.size(0))", x);
  const Activation act = parse_activation(op, activation);
  check_dropout_p(op, dropout_p);
  return act;
}

// The backward's arguments (pre: the forward's pre-activation (N, F), gated (N, 2F): [gate | up]);
// returns the activation.
inline Activation check_feed_forward_bwd(const Backend& be, const char* op, const at::Tensor& dout,
                                         const at::Tensor& x, const at::Tensor& w1,
                                         const at::Tensor& w2, const at::Tensor& pre,
                                         c10::string_view activation, double dropout_p,
                                         const std::optional<at::Tensor>& w3 = std::nullopt,
                                         bool has_b3 = false) {
  using namespace feed_forward_detail;
  check_x(be, op, x);
  const int64_t N = x.size(0), E = x.size(1);
  check_matrix(be, op, "dout", dout, N, E, "(N, E), the shape of x", x);
  const int64_t F = check_weights(be, op, x, w1, w2);
  TORCH_CHECK(!has_b3 || present(w3), op, ": has_b3 is true without w3 (b3 is the gated form's up-projection bias)");
  if (present(w3)) {
    check_matrix(be, op, "w3", *w3, F, E, "(F, E), the shape of w1", x);
    check_matrix(be, op, "pre", pre, N, 2 * F, "(N, 2F), the forward's gate and up pre-activations", x);
  } else {
    check_matrix(be, op, "pre", pre, N, F, "(N, F), the forward's pre-activation", x);
  }
  const Activation act = parse_activation(op, activation);
  check_dropout_p(op, dropout_p);
  return act;
}

}  // namespace checks
}  // namespace fastformer
