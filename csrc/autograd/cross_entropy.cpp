// fastformer::cross_entropy: the eager training path of cross_entropy with its autograd in C++.
//
// One differentiable op whose forward runs cross_entropy_fwd through the dispatcher (CPU and CUDA
// tensors alike); the kernel writes d(loss)/d(logits) in that same pass, and the backward node, a
// torch::autograd::Function, only scales it by the upstream gradient: no Python runs in backward.
// It reproduces fastformer/autograd/cross_entropy.py's CrossEntropyFunction exactly, _scale_rows
// included (ce_scale_rows below, which linear_cross_entropy.cpp shares: setup.py builds
// cross_entropy with linear_cross_entropy). Registered for CompositeImplicitAutograd: it runs under
// no_grad and inference_mode too.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace fastformer {
namespace autograd {

using at::Tensor;
using torch::autograd::AutogradContext;

namespace {

// torch.compiler.is_compiling()'s reading here: the backward is being traced (torch.compile's
// AOTAutograd runs it on fake, functional tensors under dispatch modes; .item() cannot run there).
bool traced(const Tensor& t) {
  return c10::impl::dispatch_mode_enabled() ||
         t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize})) ||
         t.is_meta();
}

}  // namespace

// _scale_rows: the stored d(loss)/d(input) `grad` (written by the forward's kernel for an upstream
// gradient of 1, read only by this backward) times the upstream gradient `grad_loss`, a scalar or
// one per row. The first backward scales it in place by a scalar upstream gradient and hands it
// out (nothing at all for exactly 1 on the CPU); ctx->saved_data[key] keeps the factor applied
// (None, a double, or a tensor on an accelerator), so a later backward through a retained graph
// multiplies out of place by the ratio. A factor that could not be undone (zero or non-finite, on
// the CPU), a per-row upstream gradient (reduction none) and a traced backward multiply out of place.
Tensor ce_scale_rows(AutogradContext* ctx, const char* key, const Tensor& grad, const Tensor& grad_loss) {
  if (grad_loss.dim() != 0) {
    std::vector<int64_t> shape(grad.dim(), 1);
    shape[0] = -1;
    return grad * grad_loss.reshape(shape).to(grad.scalar_type());
  }
  if (traced(grad_loss)) return grad * grad_loss.to(grad.scalar_type());
  at::IValue& applied = ctx->saved_data[key];
  if (applied.isDouble()) return grad * (grad_loss.to(grad.scalar_type()) / applied.toDouble());
  if (applied.isTensor()) return grad * (grad_loss.to(grad.scalar_type()) / applied.toTensor());
  if (grad_loss.device().is_cpu()) {
    const double factor = grad_loss.item<double>();
    if (factor == 0.0 || !std::isfinite(factor)) return grad * factor;
    applied = factor;
    if (factor != 1.0) {
      // grad.data: a version counter of its own, so a retained graph's second backward may read
      // it (knowing the factor applied). The alias never requires grad: no autograd to run.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      grad.variable_data().mul_(factor);
    }
    return grad;
  }
  applied = grad_loss.detach().to(grad.scalar_type()).clone();  // no host synchronisation
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    grad.variable_data().mul_(applied.toTensor());
  }
  return grad;
}

namespace {

using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double, int64_t, int64_t, bool,
                                          const std::optional<Tensor>&);

// The kernel's handle, looked up once (the first call, when the library's ops are all registered).
FF_KERNEL(fwd_kernel, FwdSig, "fastformer::cross_entropy_fwd", "")

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, double label_smoothing,
                        int64_t ignore_index, int64_t reduction_code, const std::optional<Tensor>& class_weight) {
    Tensor loss, grad;
    {
      // Gradient mode is off here: the kernel's autograd fallback would only box the arguments.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, grad) = fwd_kernel().call(logits, target, label_smoothing, ignore_index, reduction_code,
                                               logits.requires_grad(), class_weight);
    }
    ctx->save_for_backward({grad});  // (N, V): d(loss)/d(logits) for an upstream gradient of 1
    return loss;                     // no factor applied yet: saved_data["g"] is None
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    // class_weight gets no gradient, as in torch's cross_entropy
    return {ce_scale_rows(ctx, "g", saved[0], grad_outputs[0]), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing, int64_t ignore_index,
                     int64_t reduction_code, const std::optional<Tensor>& class_weight) {
  // Class probabilities that require grad: this Function gives them none (the Python Function,
  // which ops/cross_entropy.py takes for them, does); refuse rather than drop their gradient.
  TORCH_CHECK(!(target.requires_grad() && at::GradMode::is_enabled()),
              "fastformer::cross_entropy: target (class probabilities) requires grad, which this op does not ",
              "differentiate: call fastformer.ops.cross_entropy (its autograd Function does)");
  return CrossEntropyFunction::apply(logits, target, label_smoothing, ignore_index, reduction_code, class_weight);
}

}  // namespace
}  // namespace autograd
}  // namespace fastformer

// CrossEntropyFunction.apply's arguments without `kernels`.
TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "cross_entropy(Tensor logits, Tensor target, float label_smoothing, int ignore_index, int reduction_code, "
      "Tensor? class_weight=None) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(fastformer::autograd::cross_entropy)));
}
