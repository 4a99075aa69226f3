// embedding_fwd / embedding_bwd on CPU: the argument checks (the ids' values too: they address
// memory), the backward's counting sort of the ids, and the op registration, compiled once; the
// math is embedding_kernel.cpp, run at the ISA level isa.h chose.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "embedding.h"
#include "large_buffers.h"
#include "../checks/embedding.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

// Every value of keys (N,) in [0, size); the first one outside is named with its index.
void check_in_range(const char* op, const char* name, const at::Tensor& keys, int64_t size,
                    const char* what) {
  const int64_t* k = keys.const_data_ptr<int64_t>();
  const int64_t n = keys.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(k[i] >= 0 && k[i] < size, op, ": ", name, "[", i, "] = ", k[i], " is outside [0, ",
                size, ") (", what, ")");
  }
}

// The stable counting sort of keys (N,) in [0, K): starts (K + 1,), order (N,). O(N + K), serial:
// N and K are a batch's ids and a vocabulary, microseconds beside the rows' work.
void counting_sort(const at::Tensor& keys, int64_t K, std::vector<int64_t>& starts,
                   std::vector<int64_t>& order) {
  const int64_t* k = keys.const_data_ptr<int64_t>();
  const int64_t n = keys.size(0);
  starts.assign(K + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++starts[k[i] + 1];
  for (int64_t v = 0; v < K; ++v) starts[v + 1] += starts[v];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  order.resize(n);
  for (int64_t i = 0; i < n; ++i) order[next[k[i]]++] = i;
}

}  // namespace

at::Tensor embedding_fwd_cpu(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& positional,
                             const std::optional<at::Tensor>& positions, double scale,
                             double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "embedding_fwd";
  const bool has_pos = checks::check_embedding_fwd(checks::kCpu, op, input, weight, positional,
                                                   positions, scale, dropout_p);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  check_in_range(op, "input", input, weight.size(0), "the rows of weight");
  if (has_pos) check_in_range(op, "positions", *positions, positional->size(0), "the rows of positional");
  const int64_t N = input.size(0), D = weight.size(1);
  at::Tensor out = empty_large({N, D}, weight.options());  // pooled when large (large_buffers.h)
  if (N == 0 || D == 0) return out;
  FF_ISA(embedding_fwd_kernel)(input, weight, has_pos ? *positional : at::Tensor(),
                               has_pos ? *positions : at::Tensor(), out, scale, dropout_p,
                               static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  return out;
}

std::tuple<at::Tensor, at::Tensor> embedding_bwd_cpu(
    const at::Tensor& grad, const at::Tensor& input, const std::optional<at::Tensor>& positions,
    int64_t num_weights, int64_t num_positions, bool weight_grad, bool positional_grad,
    int64_t padding_idx, double scale, double dropout_p, const at::Tensor& philox) {
  constexpr const char* op = "embedding_bwd";
  checks::check_embedding_bwd(checks::kCpu, op, grad, input, positions, num_weights, num_positions,
                              positional_grad, padding_idx, scale, dropout_p);
  int64_t seed, offset;
  std::tie(seed, offset) = read_philox(op, philox);
  const int64_t D = grad.size(1);
  std::vector<int64_t> starts, order;
  // One table's gradient: every row written once by the kernel (no zero fill before it).
  auto table_grad = [&](const at::Tensor& keys, int64_t K, const char* name, const char* what,
                        int64_t skip_row, double row_scale) {
    check_in_range(op, name, keys, K, what);
    at::Tensor table = empty_large({K, D}, grad.options());
    if (K == 0 || D == 0) return table;
    counting_sort(keys, K, starts, order);
    FF_ISA(embedding_bwd_kernel)(grad, order.data(), starts.data(), table, skip_row, row_scale,
                                 dropout_p, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
    return table;
  };
  at::Tensor dweight = weight_grad
      ? table_grad(input, num_weights, "input", "the rows of weight", padding_idx, scale)
      : empty_large({0}, grad.options());
  at::Tensor dpositional = positional_grad
      ? table_grad(*positions, num_positions, "positions", "the rows of positional", -1, 1.0)
      : empty_large({0}, grad.options());
  return {dweight, dpositional};
}

}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("embedding_fwd", &fastformer::embedding_fwd_cpu);
  m.impl("embedding_bwd", &fastformer::embedding_bwd_cpu);
}
