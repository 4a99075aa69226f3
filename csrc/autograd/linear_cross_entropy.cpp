// fastformer::linear_cross_entropy: the eager training path of linear_cross_entropy with its
// autograd in C++.
//
// One differentiable op whose forward runs linear_cross_entropy_fwd through the dispatcher (CPU and
// CUDA tensors alike) and whose backward node, a torch::autograd::Function, needs no Python. It
// reproduces fastformer/autograd/cross_entropy.py's LinearCrossEntropyFunction exactly: for mean /
// sum the forward's kernel also writes the gradients (when an input requires grad) and the backward
// scales them (ce_scale_rows, defined in cross_entropy.cpp, which setup.py always builds with this
// op); for none the backward runs linear_cross_entropy_bwd with the per-row upstream gradient.
// Registered for CompositeImplicitAutograd: it runs under no_grad and inference_mode too.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <optional>
#include <tuple>

namespace fastformer {
namespace autograd {

using at::Tensor;
using torch::autograd::AutogradContext;

// csrc/autograd/cross_entropy.cpp: _scale_rows.
Tensor ce_scale_rows(AutogradContext* ctx, const char* key, const Tensor& grad, const Tensor& grad_loss);

namespace {

using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                          const Tensor&, double, int64_t, int64_t, bool,
                                                          const std::optional<Tensor>&);
using BwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                  const std::optional<Tensor>&, const Tensor&, double, int64_t,
                                                  const std::optional<Tensor>&);

// The kernels' handles, looked up once (the first call, when the library's ops are all registered).
FF_KERNEL(fwd_kernel, FwdSig, "fastformer::linear_cross_entropy_fwd", "")
FF_KERNEL(bwd_kernel, BwdSig, "fastformer::linear_cross_entropy_bwd", "")

struct LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& target, double label_smoothing,
                        int64_t ignore_index, int64_t reduction_code, const std::optional<Tensor>& class_weight) {
    const bool has_bias = bias.has_value() && bias->defined();
    const bool needs_grad = hidden.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad());
    const bool in_forward = needs_grad && reduction_code != 0;  // "none": the backward recomputes per row
    Tensor loss, dh, dw, db;
    {
      // Gradient mode is off here: the kernel's autograd fallback would only box the arguments.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, dh, dw, db) = fwd_kernel().call(hidden, weight, bias, target, label_smoothing, ignore_index,
                                                     reduction_code, in_forward, class_weight);
    }
    if (in_forward) {
      ctx->save_for_backward({dh, dw, has_bias ? db : Tensor()});  // no factor applied yet (saved_data None)
    } else {
      const bool has_cw = class_weight.has_value() && class_weight->defined();
      ctx->save_for_backward({hidden, weight, has_bias ? *bias : Tensor(), target, has_cw ? *class_weight : Tensor()});
    }
    ctx->saved_data["f"] = in_forward;
    ctx->saved_data["b"] = has_bias;
    ctx->saved_data["s"] = label_smoothing;
    ctx->saved_data["i"] = ignore_index;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& grad_loss = grad_outputs[0];
    Tensor dh, dw, db;
    if (ctx->saved_data["f"].toBool()) {
      dh = ce_scale_rows(ctx, "g0", saved[0], grad_loss);
      dw = ce_scale_rows(ctx, "g1", saved[1], grad_loss);
      if (saved[2].defined()) db = ce_scale_rows(ctx, "g2", saved[2], grad_loss);
    } else {
      const Tensor& bias = saved[2];
      const Tensor& class_weight = saved[4];
      // in the math type: fp64 keeps fp64 (the cpu kernel scales in fp64)
      const Tensor g =
          grad_loss.reshape(-1).to(saved[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
      // Without create_graph the kernel's autograd fallback has nothing to record: skip it.
      std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
      if (!at::GradMode::is_enabled()) below_autograd.emplace();
      std::tie(dh, dw, db) = bwd_kernel().call(g, saved[0], saved[1],
                                               bias.defined() ? std::optional<Tensor>(bias) : std::nullopt, saved[3],
                                               ctx->saved_data["s"].toDouble(), ctx->saved_data["i"].toInt(),
                                               class_weight.defined() ? std::optional<Tensor>(class_weight)
                                                                      : std::nullopt);
      if (!ctx->saved_data["b"].toBool()) db = Tensor();
    }
    return {dh, dw, db, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};  // class_weight: none, as torch
  }
};

Tensor linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias,
                            const Tensor& target, double label_smoothing, int64_t ignore_index,
                            int64_t reduction_code, const std::optional<Tensor>& class_weight) {
  // Class probabilities that require grad: this Function gives them none (the Python Function,
  // which ops/cross_entropy.py takes for them, does); refuse rather than drop their gradient.
  TORCH_CHECK(!(target.requires_grad() && at::GradMode::is_enabled()),
              "fastformer::linear_cross_entropy: target (class probabilities) requires grad, which this op does not ",
              "differentiate: call fastformer.ops.linear_cross_entropy (its autograd Function does)");
  return LinearCrossEntropyFunction::apply(hidden, weight, bias, target, label_smoothing, ignore_index,
                                           reduction_code, class_weight);
}

}  // namespace
}  // namespace autograd
}  // namespace fastformer

// LinearCrossEntropyFunction.apply's arguments without `kernels`.
TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, float label_smoothing, "
      "int ignore_index, int reduction_code, Tensor? class_weight=None) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd,
                      TORCH_FN(fastformer::autograd::linear_cross_entropy)));
}
