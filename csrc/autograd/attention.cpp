// fastformer::attention: the eager training path of attention with its autograd in C++.
//
// One differentiable op whose forward runs attention_fwd through the dispatcher (so a CPU and a
// CUDA tensor alike reach their kernel) and whose backward node, a torch::autograd::Function,
// runs attention_bwd: no Python runs in backward. It reproduces fastformer/autograd/attention.py's
// AttentionFunction exactly (same kernels, same saved tensors, same backward), with the (2,)
// philox tensor drawn by the caller (philox.draw(dropout_p)) instead of inside the Function.
// Registered for CompositeImplicitAutograd: it runs under no_grad and inference_mode too (the
// Function then builds no graph and saves nothing).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <optional>
#include <tuple>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                          const std::optional<Tensor>&, bool, double, double, const Tensor&,
                                          const std::optional<Tensor>&, int64_t);
// (the fourth result, rel_bias's gradient, is empty: this op takes no rel_bias, which the Python
// Function differentiates)
using BwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, const Tensor&,
                                                          const std::optional<Tensor>&,
                                                          const std::optional<Tensor>&, bool, double, double,
                                                          const Tensor&, const std::optional<Tensor>&, int64_t);

// The kernels' handles, looked up once (the first call, when the library's ops are all registered).
FF_KERNEL(fwd_kernel, FwdSig, "fastformer::attention_fwd", "")
FF_KERNEL(bwd_kernel, BwdSig, "fastformer::attention_bwd", "")


struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::optional<Tensor>& key_padding_mask, const std::optional<Tensor>& attn_mask,
                        bool is_causal, double scale, double dropout_p, const Tensor& philox) {
    Tensor out, lse;
    {
      // Gradient mode is off here: the kernel's autograd fallback would only box the arguments.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse) = fwd_kernel().call(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p,
                                             philox, std::nullopt, 0);  // (B, H, Sq, D), (B, H, Sq)
    }
    ctx->save_for_backward({q, k, v, out, lse, key_padding_mask.value_or(Tensor()), attn_mask.value_or(Tensor()),
                            philox});
    ctx->saved_data["c"] = is_causal;
    ctx->saved_data["s"] = scale;
    ctx->saved_data["p"] = dropout_p;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    Tensor dout = std::move(grad_outputs[0]);
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    Tensor dq, dk, dv;
    {
      // Without create_graph the kernel's autograd fallback has nothing to record: skip it.
      std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
      if (!at::GradMode::is_enabled()) below_autograd.emplace();
      std::tie(dq, dk, dv, std::ignore) = bwd_kernel().call(
          dout, saved[0], saved[1], saved[2], saved[3], saved[4], ff_optional_of(saved[5]), ff_optional_of(saved[6]),
          ctx->saved_data["c"].toBool(), ctx->saved_data["s"].toDouble(), ctx->saved_data["p"].toDouble(),
          saved[7], std::nullopt, 0);
    }
    return {dq, dk, dv, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& key_padding_mask,
                 const std::optional<Tensor>& attn_mask, bool is_causal, double scale, double dropout_p,
                 const Tensor& philox) {
  return AttentionFunction::apply(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, philox);
}

}  // namespace
}  // namespace fastformer

// AttentionFunction.apply's arguments without `kernels`, with the caller's philox in its place.
TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, bool is_causal, "
      "float scale, float dropout_p, Tensor philox) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(fastformer::attention)));
}
