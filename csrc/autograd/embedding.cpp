// fastformer::embedding: the eager training path of embedding with its autograd in C++.
// One differentiable op, registered for CompositeImplicitAutograd (so it runs under no_grad and
// inference_mode too, and on any device): its forward calls embedding_fwd through the dispatcher,
// its backward node (a hand-written torch::autograd::Node) embedding_bwd. It is
// fastformer/autograd/embedding.py's EmbeddingFunction, step for step, with the caller drawing
// `philox` (the Python Function's philox.draw(dropout_p)) and passing it in.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include "../eager.h"
#include "kernel.h"

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::SavedVariable;
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

// The backward node, written as torch's generated nodes are (no AutogradContext, no IValue
// dictionary): the ids and positions SavedVariable members (an in-place change to them is caught),
// the rest plain members; philox is a plain tensor: the caller's fresh draw, never differentiable.
// Edges: weight, positional (absent: an empty edge).
struct EmbeddingBackward final : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "EmbeddingBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ids_.reset_data();
    positions_.reset_data();
  }
  SavedVariable ids_, positions_;  // positions: only when given
  Tensor philox;
  int64_t V = 0;       // weight.shape[0]
  c10::SymInt P = 0;   // positional.shape[0], 0 without positional
  int64_t rows = 0;    // N: the output's rows (it comes back in the ids' shape + (D,))
  int64_t padding_idx = -1;
  double scale = 1.0, dropout_p = 0.0;
  bool has_positional = false, has_positions = false;
};

variable_list EmbeddingBackward::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The gradients asked for (the Python's ctx.needs_input_grad): only these two are computed.
  const bool need_w = task_should_compute_output(0);
  const bool need_p = has_positional && task_should_compute_output(1);
  // the saved tensors first: under activation checkpointing, unpacking them recomputes the
  // checkpointed forward, which must record its graph (and save its tensors) as the first time
  const Tensor ids = ids_.unpack();
  OptTensor positions;
  if (has_positions) positions = positions_.unpack();
  // an undefined gradient of the output (an unused output; gradcheck's check): no gradient at all,
  // where the Function materialized zeros and ran the kernels on them
  if (!grads[0].defined()) return variable_list(2);
  // the kernels have no autograd of their own: skip it, unless a double backward (create_graph)
  // records the graph, where the kernels' calls go through it as the Python Function's do
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
  if (!at::GradMode::is_enabled()) below_autograd.emplace();
  const Tensor& g = grads[0];
  const Tensor dout = g.dim() == 2 ? g : g.reshape({rows, g.size(-1)});  // (N, D)
  auto [dweight, dpositional] = bwd_op().call(dout.contiguous(), ids, positions, V, P, need_w, need_p,
                                              padding_idx, scale, dropout_p, philox);
  // the edges: weight, positional
  return {need_w ? std::move(dweight) : Tensor(), need_p ? std::move(dpositional) : Tensor()};
}

// ids or positions of any shape and integer dtype as the kernels' contiguous (N,) int64 (they
// have no gradient: the copies and views here record nothing)
Tensor as_index(const Tensor& t) {
  if (t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous()) return t;  // saved as given
  return t.reshape({-1}).to(at::kLong).contiguous();
}

Tensor embedding(const Tensor& ids_in, const Tensor& weight, const OptTensor& positional,
                 const OptTensor& positions_in, double scale, double dropout_p, int64_t padding_idx,
                 const Tensor& philox) {
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
  // no graph to record (no_grad, inference_mode, or no table requiring grad): the kernel alone
  const bool record = torch::autograd::compute_requires_grad(weight, positional);
  if (record) ff_check_functorch();
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels: no autograd of their own
    out = fwd_op().call(ids, weight, positional, positions, scale, dropout_p, philox);
    // the output in the ids' shape + (D,): a view of the kernels' (N, D) rows made below autograd,
    // where it records no node (the backward takes the rows back); (N,) ids give (N, D) as it is
    if (ids_in.dim() != 1) {
      std::vector<int64_t> shape(ids_in.sizes().begin(), ids_in.sizes().end());
      shape.push_back(weight.dim() == 2 ? weight.size(1) : -1);
      out = out.view(shape);
    }
  }
  if (!record) return out;
  auto node = c10::make_intrusive<EmbeddingBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(weight, positional));
  torch::autograd::set_history(out, node);
  // the ids, never the rows or a mask; positions only when given
  node->ids_ = SavedVariable(ids, false);
  node->has_positions = positions.has_value();
  if (node->has_positions) node->positions_ = SavedVariable(*positions, false);
  node->has_positional = positional.has_value() && positional->defined();
  node->philox = philox;
  node->V = weight.size(0);
  node->P = node->has_positional ? positional->sym_size(0) : c10::SymInt(0);
  node->rows = ids.size(0);
  node->padding_idx = padding_idx;
  node->scale = scale;
  node->dropout_p = dropout_p;
  return out;
}

// fastformer._C.embedding_eager(ids, weight, positional, positions, scale, dropout_p, padding_idx): the
// op's eager call without the dispatcher, philox drawn here (csrc/eager.h); None where a tensor is on
// another device than the ids.
PyObject* embedding_eager(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  FFArgs a(args, n, 7);
  const Tensor* ids = a.tensor(0);
  const Tensor* weight = a.tensor(1);
  const OptTensor positional = a.optional_tensor(2), positions = a.optional_tensor(3);
  const double scale = a.number(4), dropout_p = a.number(5);
  const int64_t padding_idx = a.integer(6);
  if (!a.ok) Py_RETURN_NONE;
  Tensor out;
  {
    // the inputs built only while a profiler listens (record_shapes), as for the registered op
    RECORD_FUNCTION("fastformer::embedding",
                    std::vector<c10::IValue>({*ids, *weight, positional, positions, scale, dropout_p, padding_idx}));
    pybind11::gil_scoped_release no_gil;  // as the registered op's call from Python
    out = embedding(*ids, *weight, positional, positions, scale, dropout_p, padding_idx,
                    ff_philox_for(dropout_p, *a.device));
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}
FF_EAGER_ENTRY("embedding_eager", embedding_eager, "fastformer::embedding's eager call (csrc/eager.h).")

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
