// The argument checks of embedding_fwd / embedding_bwd, shared by csrc/cpu/embedding.cpp and
// csrc/cuda/embedding.cpp (see common.h): ids and positions (N,) int64, the tables (V, D) and
// (P, D) of one floating dtype, the rows (N, D); every tensor contiguous.
#pragma once
#include <algorithm>
#include <optional>

#include "common.h"

namespace fastformer {
namespace checks {
namespace embedding_detail {

// ids or positions: (N,) int64 contiguous, N = the length of `like` (named like_name) if given.
inline void check_index(const Backend& be, const char* op, const char* name, const at::Tensor& t,
                        const at::Tensor* like = nullptr, const char* like_name = nullptr) {
  check_device(be, op, name, t, like, like_name);
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D (N,) ids, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t.scalar_type());
  if (like != nullptr) {
    TORCH_CHECK(t.size(0) == like->size(0), op, ": ", name, " must have the length of ", like_name,
                " (", like->size(0), "), got ", t.size(0));
  }
  check_contiguous(op, name, t);
}

// positional and positions: both given or both absent; returns whether given.
inline bool check_pair(const char* op, const std::optional<at::Tensor>& positional,
                       const std::optional<at::Tensor>& positions) {
  const bool has_table = positional.has_value() && positional->defined();
  const bool has_rows = positions.has_value() && positions->defined();
  TORCH_CHECK(has_table == has_rows, op, ": positional and positions must be given together, got ",
              has_table ? "positional without positions" : "positions without positional");
  return has_table;
}

}  // namespace embedding_detail

// The forward's arguments; returns whether a positional table is given.
inline bool check_embedding_fwd(const Backend& be, const char* op, const at::Tensor& input,
                                const at::Tensor& weight, const std::optional<at::Tensor>& positional,
                                const std::optional<at::Tensor>& positions, double scale,
                                double dropout_p) {
  using namespace embedding_detail;
  check_index(be, op, "input", input);
  check_device(be, op, "weight", weight, &input, "input");
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D (V, D), got shape ", weight.sizes());
  check_float_dtype(be, op, "weight", weight);
  check_contiguous(op, "weight", weight);
  const bool has_pos = check_pair(op, positional, positions);
  if (has_pos) {
    check_device(be, op, "positional", *positional, &weight, "weight");
    TORCH_CHECK(positional->dim() == 2 && positional->size(1) == weight.size(1), op,
                ": positional must have shape (P, ", weight.size(1), ") (D = weight.size(1)), got ",
                positional->sizes());
    check_dtype_of(op, "positional", *positional, weight, "weight");
    check_contiguous(op, "positional", *positional);
    check_index(be, op, "positions", *positions, &input, "input");
  }
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_dropout_p(op, dropout_p);
  return has_pos;
}

// The backward's arguments; returns whether positions are given.
inline bool check_embedding_bwd(const Backend& be, const char* op, const at::Tensor& grad,
                                const at::Tensor& input, const std::optional<at::Tensor>& positions,
                                int64_t num_weights, int64_t num_positions, bool positional_grad,
                                int64_t padding_idx, double scale, double dropout_p) {
  using namespace embedding_detail;
  check_index(be, op, "input", input);
  check_device(be, op, "grad", grad, &input, "input");
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == input.size(0), op, ": grad must have shape (",
              input.size(0), ", D) (N = input.size(0)), got ", grad.sizes());
  check_float_dtype(be, op, "grad", grad);
  check_contiguous(op, "grad", grad);
  const bool has_pos = positions.has_value() && positions->defined();
  if (has_pos) check_index(be, op, "positions", *positions, &input, "input");
  TORCH_CHECK(!positional_grad || has_pos, op, ": positional_grad needs positions");
  TORCH_CHECK(num_weights >= 0, op, ": num_weights must be >= 0, got ", num_weights);
  TORCH_CHECK(num_positions >= 0, op, ": num_positions must be >= 0, got ", num_positions);
  TORCH_CHECK(padding_idx >= -1 && padding_idx < std::max<int64_t>(num_weights, 1), op,
              ": padding_idx must be -1 (none) or in [0, ", num_weights, "), got ", padding_idx);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_dropout_p(op, dropout_p);
  return has_pos;
}

}  // namespace checks
}  // namespace fastformer
