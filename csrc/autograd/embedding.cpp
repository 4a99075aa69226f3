// fastformer::embedding: the eager training path of embedding with its autograd in C++.
// One differentiable op, registered for CompositeImplicitAutograd (so it runs under no_grad and
// inference_mode too, and on any device): its forward calls embedding_fwd through the dispatcher,
// its backward node (a torch::autograd::Function) embedding_bwd. It is
// fastformer/autograd/embedding.py's EmbeddingFunction, step for step, with the caller drawing
// `philox` (the Python Function's philox.draw(dropout_p)) and passing it in.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <optional>
#include <tuple>
#include <vector>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

using FwdSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, double,
                      double, const Tensor&);
// num_positions is a SymInt (a symbolic size under tracing); the kernels take it as int64_t,
// which the dispatcher converts to.
using BwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, int64_t,
                                          c10::SymInt, bool, bool, int64_t, double, double,
                                          const Tensor&);

// The kernels, looked up once.
FF_KERNEL(fwd_op, FwdSig, "fastformer::embedding_fwd", "")
FF_KERNEL(bwd_op, BwdSig, "fastformer::embedding_bwd", "")

// ctx->saved_data keys
constexpr const char* kV = "V";  // weight.shape[0]
constexpr const char* kP = "P";  // positional.shape[0], 0 without positional
constexpr const char* kPaddingIdx = "padding_idx";
constexpr const char* kScale = "scale";
constexpr const char* kDropoutP = "dropout_p";
constexpr const char* kHasPositional = "has_positional";
constexpr const char* kRows = "rows";  // N: the output's rows (it comes back in the ids' shape + (D,))

struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& ids, const Tensor& weight,
                        const OptTensor& positional, const OptTensor& positions, double scale,
                        double dropout_p, int64_t padding_idx, const Tensor& philox,
                        const std::vector<int64_t>& shape) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels: no autograd of their own
    Tensor out = fwd_op().call(ids, weight, positional, positions, scale, dropout_p, philox);
    ctx->saved_data[kRows] = ids.size(0);
    const bool has_positional = positional.has_value() && positional->defined();
    const bool has_positions = positions.has_value() && positions->defined();
    // the ids, never the rows or a mask; positions only when given (saved as None otherwise)
    if (has_positions) {
      ctx->save_for_backward({ids, philox, *positions});
    } else {
      ctx->save_for_backward({ids, philox});
    }
    ctx->saved_data[kV] = weight.size(0);
    ctx->saved_data[kP] = has_positional ? positional->sym_size(0) : c10::SymInt(0);
    ctx->saved_data[kPaddingIdx] = padding_idx;
    ctx->saved_data[kScale] = scale;
    ctx->saved_data[kDropoutP] = dropout_p;
    ctx->saved_data[kHasPositional] = has_positional;
    return out.view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradients asked for: weight is the second variable input (after ids), positional (when
    // given) the third. Only these two are computed, as the Python's ctx.needs_input_grad.
    const bool has_positional = ctx->saved_data[kHasPositional].toBool();
    const bool need_w = ctx->needs_input_grad(1);
    const bool need_p = has_positional && ctx->needs_input_grad(2);
    // the saved tensors first: under activation checkpointing, unpacking them recomputes the
    // checkpointed forward, which must record its graph (and save its tensors) as the first time
    const variable_list saved = ctx->get_saved_variables();
    // the kernels have no autograd of their own: skip it, unless a double backward (create_graph)
    // records the graph, where the kernels' calls go through it as the Python Function's do
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    OptTensor positions;
    if (saved.size() > 2) positions = saved[2];
    const Tensor dout = grads[0].reshape({ctx->saved_data[kRows].toInt(), grads[0].size(-1)});  // (N, D)
    auto [dweight, dpositional] = bwd_op().call(
        dout.contiguous(), saved[0], positions, ctx->saved_data[kV].toInt(),
        ctx->saved_data[kP].toSymInt(), need_w, need_p, ctx->saved_data[kPaddingIdx].toInt(),
        ctx->saved_data[kScale].toDouble(), ctx->saved_data[kDropoutP].toDouble(), saved[1]);
    // ids, weight, positional, positions, scale, dropout_p, padding_idx, philox, shape
    return {Tensor(), need_w ? dweight : Tensor(), need_p ? dpositional : Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// ids or positions of any shape and integer dtype as the kernels' contiguous (N,) int64 (they
// have no gradient: the copies and views here record nothing)
Tensor as_index(const Tensor& t) {
  if (t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous()) return t;  // saved as given
  return t.reshape({-1}).to(at::kLong).contiguous();
}

Tensor embedding(const Tensor& ids_in, const Tensor& weight, const OptTensor& positional,
                 const OptTensor& positions_in, double scale, double dropout_p, int64_t padding_idx,
                 const Tensor& philox) {
  // the output in the ids' shape + (D,): a view of the kernels' (N, D) rows made below autograd,
  // where it records no node (the Function's backward takes the rows back)
  std::vector<int64_t> shape(ids_in.sizes().begin(), ids_in.sizes().end());
  shape.push_back(weight.dim() == 2 ? weight.size(1) : -1);
  TORCH_CHECK(!positions_in.has_value() || !positions_in->defined() ||
                  positions_in->numel() == ids_in.numel(),
              "fastformer::embedding: positions must have one row per id (", ids_in.numel(),
              "), got shape ", positions_in->sizes());
  Tensor ids;
  OptTensor positions;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ids = as_index(ids_in);
    if (positions_in.has_value() && positions_in->defined()) positions = as_index(*positions_in);
  }
  if (!at::GradMode::is_enabled() ||
      !(weight.requires_grad() ||
        (positional.has_value() && positional->defined() && positional->requires_grad()))) {
    // no graph to record (no_grad, inference_mode, or no table requiring grad): the kernel alone,
    // what the Function's forward returns then, without its node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fwd_op().call(ids, weight, positional, positions, scale, dropout_p, philox).view(shape);
  }
  return EmbeddingFunction::apply(ids, weight, positional, positions, scale, dropout_p, padding_idx,
                                  philox, shape);
}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  // dropout(weight[ids] * scale + positional[positions]) on integer ids (and positions: one per
  // id) of any shape -> ids.shape + (D,); padding_idx -1: none. The caller draws philox.
  m.def(
      "embedding(Tensor ids, Tensor weight, Tensor? positional, Tensor? positions, float scale, "
      "float dropout_p, int padding_idx, Tensor philox) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastformer, CompositeImplicitAutograd, m) {
  m.impl("embedding", &fastformer::embedding);
}
