// fastformer::feed_forward: the eager training path of feed_forward with its autograd in C++.
// One differentiable op, registered for CompositeImplicitAutograd (so it runs under no_grad and
// inference_mode too, and on any device): its forward calls feed_forward_fwd through the
// dispatcher, its backward node (a torch::autograd::Function) feed_forward_bwd. It is
// fastformer/autograd/feed_forward.py's FeedForwardFunction, step for step, with the caller
// drawing `philox` (the Python Function's philox.draw(dropout_p)) and passing it in.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <optional>
#include <string>
#include <tuple>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
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
bool requires_grad(const OptTensor& t) { return present(t) && t->requires_grad(); }

// ctx->saved_data keys
constexpr const char* kFlags = "flags";  // kB1 | kB2 | kW3 | kB3
constexpr const char* kActivation = "activation";
constexpr const char* kP = "p";
constexpr int64_t kB1 = 1, kB2 = 2, kW3 = 4, kB3 = 8;

// x (..., E) as the kernels' contiguous (N, E) rows: a view where it can be (below autograd: no
// node), a copy where the layout needs one; a 0-d x is refused.
Tensor as_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "fastformer::feed_forward: x must have at least 1 dimension, got a 0-d tensor");
  return ff_rows(x).contiguous();
}

struct FeedForwardFunction : public torch::autograd::Function<FeedForwardFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const OptTensor& b1,
                        const Tensor& w2, const OptTensor& b2, c10::string_view activation,
                        double dropout_p, const Tensor& philox, const OptTensor& w3, const OptTensor& b3) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the kernels: no autograd of their own
    auto [out, pre] = fwd_op().call(as_rows(x), w1, b1, w2, b2, activation, dropout_p, philox, w3, b3);
    // x itself is saved (its in-place changes are caught), its rows taken again in the backward
    // pre: (N, F), gated (N, 2F), the only activations kept
    ctx->save_for_backward({x, w1, w2, pre, philox, present(w3) ? *w3 : Tensor()});
    ctx->saved_data[kFlags] = (present(b1) ? kB1 : 0) | (present(b2) ? kB2 : 0) | (present(w3) ? kW3 : 0) |
                              (present(b3) ? kB3 : 0);
    ctx->saved_data[kActivation] = std::string(activation);
    ctx->saved_data[kP] = dropout_p;
    return out.view(x.sizes());  // in x's shape (a view below autograd: no node)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // the saved tensors first: under activation checkpointing, unpacking them recomputes the
    // checkpointed forward, which must record its graph (and save its tensors) as the first time
    const variable_list saved = ctx->get_saved_variables();
    // the kernels have no autograd of their own: skip it, unless a double backward (create_graph)
    // records the graph, where the kernels' calls go through it as the Python Function's do
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const int64_t flags = ctx->saved_data[kFlags].toInt();
    const bool has_b1 = flags & kB1, has_b2 = flags & kB2, gated = flags & kW3, has_b3 = flags & kB3;
    const Tensor& x = saved[0];
    auto [dx, dw1, db1, dw2, db2] = bwd_op().call(
        ff_rows(grads[0]).contiguous(), as_rows(x), saved[1], saved[2], saved[3], has_b1, has_b2,
        ctx->saved_data[kActivation].toStringRef(), ctx->saved_data[kP].toDouble(), saved[4],
        gated ? OptTensor(saved[5]) : OptTensor(), has_b3);
    Tensor dw3, db3;
    if (gated) {  // [dw1; dw3] (2F, E) and [db1; db3] (2F,): each half a contiguous view
      const int64_t F = saved[1].size(0);
      dw3 = dw1.narrow(0, F, F);
      dw1 = dw1.narrow(0, 0, F);
      if (has_b3) db3 = db1.narrow(0, F, F);
      if (has_b1) db1 = db1.narrow(0, 0, F);
    }
    // x, w1, b1, w2, b2, activation, dropout_p, philox, w3, b3
    return {dx.view(x.sizes()), dw1, has_b1 ? db1 : Tensor(), dw2, has_b2 ? db2 : Tensor(), Tensor(), Tensor(),
            Tensor(), dw3, db3};
  }
};

Tensor feed_forward(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                    const OptTensor& b2, c10::string_view activation, double dropout_p,
                    const Tensor& philox, const OptTensor& w3, const OptTensor& b3) {
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || w1.requires_grad() || requires_grad(b1) ||
                                       w2.requires_grad() || requires_grad(b2) || requires_grad(w3) ||
                                       requires_grad(b3))) {
    // no graph to record (no_grad, inference_mode, or no input requiring grad): the kernel alone,
    // what the Function's forward returns then, without its node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return std::get<0>(fwd_op().call(as_rows(x), w1, b1, w2, b2, activation, dropout_p, philox, w3, b3))
        .view(x.sizes());
  }
  return FeedForwardFunction::apply(x, w1, b1, w2, b2, activation, dropout_p, philox, w3, b3);
}

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
