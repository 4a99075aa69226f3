// fastformer::feed_forward: the eager training path of feed_forward with its autograd in C++.
// One differentiable op, registered for CompositeImplicitAutograd (so it runs under no_grad and
// inference_mode too, and on any device): its forward calls feed_forward_fwd through the
// dispatcher, its backward node (a hand-written torch::autograd::Node) feed_forward_bwd. It is
// fastformer/autograd/feed_forward.py's FeedForwardFunction, step for step, with the caller
// drawing `philox` (the Python Function's philox.draw(dropout_p)) and passing it in.
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

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                          const Tensor&, const OptTensor&, c10::string_view,
                                          double, const Tensor&, const OptTensor&, const OptTensor&);
using BwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, bool,
    c10::string_view, double, const Tensor&, const OptTensor&, bool);

// The kernels, looked up once.
FF_KERNEL(fwd_op, FwdSig, "fastformer::feed_forward_fwd", "")
FF_KERNEL(bwd_op, BwdSig, "fastformer::feed_forward_bwd", "")

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

constexpr int64_t kB1 = 1, kB2 = 2, kW3 = 4, kB3 = 8;

// x (..., E) as the kernels' contiguous (N, E) rows: a view where it can be (below autograd: no
// node), a copy where the layout needs one; a 0-d x is refused.
Tensor as_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "fastformer::feed_forward: x must have at least 1 dimension, got a 0-d tensor");
  return ff_rows(x).contiguous();
}

// The backward node, written as torch's generated nodes are (no AutogradContext, no IValue
// dictionary): the saved tensors SavedVariable members, the rest plain members. philox is a plain
// tensor: the caller's fresh draw, never differentiable, never an activation.
// Edges: x, w1, b1, w2, b2, w3, b3 (an absent one an empty edge).
struct FeedForwardBackward final : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "FeedForwardBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    w1_.reset_data();
    w2_.reset_data();
    pre_.reset_data();
    w3_.reset_data();
  }
  // x itself is saved (its in-place changes are caught), its rows taken again in the backward;
  // pre: (N, F), gated (N, 2F), the only activations kept
  SavedVariable x_, w1_, w2_, pre_, w3_;
  Tensor philox;
  std::string activation;
  double dropout_p = 0.0;
  int64_t flags = 0;  // kB1 | kB2 | kW3 | kB3
};

variable_list FeedForwardBackward::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  // the saved tensors first: under activation checkpointing, unpacking them recomputes the
  // checkpointed forward, which must record its graph (and save its tensors) as the first time
  const Tensor x = x_.unpack(), w1 = w1_.unpack(), w2 = w2_.unpack(), pre = pre_.unpack();
  const bool has_b1 = flags & kB1, has_b2 = flags & kB2, gated = flags & kW3, has_b3 = flags & kB3;
  const OptTensor w3 = gated ? OptTensor(w3_.unpack()) : OptTensor();
  // an undefined gradient of the output (an unused output; gradcheck's check): no gradient at all,
  // where the Function materialized zeros and ran the kernels on them
  if (!grads[0].defined()) return variable_list(7);
  // the kernels have no autograd of their own: skip it, unless a double backward (create_graph)
  // records the graph, where the kernels' calls go through it as the Python Function's do
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
  if (!at::GradMode::is_enabled()) below_autograd.emplace();
  auto [dx, dw1, db1, dw2, db2] = bwd_op().call(ff_rows(grads[0]).contiguous(), as_rows(x), w1, w2, pre,
                                                has_b1, has_b2, activation, dropout_p, philox, w3, has_b3);
  Tensor dw3, db3;
  if (gated) {  // [dw1; dw3] (2F, E) and [db1; db3] (2F,): each half a contiguous view
    const int64_t F = w1.size(0);
    dw3 = dw1.narrow(0, F, F);
    dw1 = dw1.narrow(0, 0, F);
    if (has_b3) db3 = db1.narrow(0, F, F);
    if (has_b1) db1 = db1.narrow(0, 0, F);
  }
  if (x.dim() != 2) dx = dx.view(x.sizes());  // back to x's shape
  // the edges: x, w1, b1, w2, b2, w3, b3
  return {std::move(dx), std::move(dw1), has_b1 ? std::move(db1) : Tensor(), std::move(dw2),
          has_b2 ? std::move(db2) : Tensor(), std::move(dw3), std::move(db3)};
}

Tensor feed_forward(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                    const OptTensor& b2, c10::string_view activation, double dropout_p,
                    const Tensor& philox, const OptTensor& w3, const OptTensor& b3) {
  // no graph to record (no_grad, inference_mode, or no input requiring grad): the kernel alone
  const bool record = torch::autograd::compute_requires_grad(x, w1, b1, w2, b2, w3, b3);
  if (record) ff_check_functorch();
  Tensor out, pre;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels: no autograd of their own
    std::tie(out, pre) = fwd_op().call(as_rows(x), w1, b1, w2, b2, activation, dropout_p, philox, w3, b3);
    if (x.dim() != 2) out = out.view(x.sizes());  // in x's shape (a view below autograd: no node)
  }
  if (!record) return out;
  auto node = c10::make_intrusive<FeedForwardBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, w1, b1, w2, b2, w3, b3));
  torch::autograd::set_history(out, node);
  node->x_ = SavedVariable(x, false);
  node->w1_ = SavedVariable(w1, false);
  node->w2_ = SavedVariable(w2, false);
  node->pre_ = SavedVariable(pre, false);
  if (present(w3)) node->w3_ = SavedVariable(*w3, false);
  node->philox = philox;
  node->activation = std::string(activation);
  node->dropout_p = dropout_p;
  node->flags = (present(b1) ? kB1 : 0) | (present(b2) ? kB2 : 0) | (present(w3) ? kW3 : 0) |
                (present(b3) ? kB3 : 0);
  return out;
}

// fastformer._C.feed_forward_eager(x, w1, b1, w2, b2, activation, dropout_p, w3, b3): the op's eager
// call without the dispatcher, philox drawn here (csrc/eager.h); None where a tensor is on another
// device than x.
PyObject* feed_forward_eager(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  FFArgs a(args, n, 9);
  const Tensor* x = a.tensor(0);
  const Tensor* w1 = a.tensor(1);
  const OptTensor b1 = a.optional_tensor(2);
  const Tensor* w2 = a.tensor(3);
  const OptTensor b2 = a.optional_tensor(4);
  const c10::string_view activation = a.string(5);
  const double dropout_p = a.number(6);
  const OptTensor w3 = a.optional_tensor(7), b3 = a.optional_tensor(8);
  if (!a.ok) Py_RETURN_NONE;
  Tensor out;
  {
    // the inputs are built only while a profiler (or another RecordFunction callback) listens,
    // so that record_shapes shows them as for the registered op
    RECORD_FUNCTION("fastformer::feed_forward",
                    std::vector<c10::IValue>({*x, *w1, b1, *w2, b2, std::string(activation), dropout_p, w3, b3}));
    pybind11::gil_scoped_release no_gil;  // as the registered op's call from Python
    out = feed_forward(*x, *w1, b1, *w2, b2, activation, dropout_p, ff_philox_for(dropout_p, *a.device), w3, b3);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}
FF_EAGER_ENTRY("feed_forward_eager", feed_forward_eager, "fastformer::feed_forward's eager call (csrc/eager.h).")

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  // linear(dropout(act(linear(x, w1, b1))), w2, b2) on x (..., E), in x's shape; gated (w3 given):
  // linear(dropout(act(linear(x, w1, b1)) * linear(x, w3, b3)), w2, b2). The caller draws philox.
  m.def(
      "feed_forward(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, Tensor philox, Tensor? w3=None, Tensor? b3=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastformer, CompositeImplicitAutograd, m) {
  m.impl("feed_forward", &fastformer::feed_forward);
}
