// fastformer::attention_varlen: the eager training path of attention over packed sequences, with
// its autograd in C++.
//
// One differentiable op whose forward runs attention_varlen_fwd through the dispatcher (CPU and CUDA
// tensors alike) and whose backward node, a torch::autograd::Function, runs attention_varlen_bwd:
// no Python runs in backward. It reproduces fastformer/autograd/attention_varlen.py's
// AttentionVarlenFunction exactly, the philox tensor drawn by the caller: the layout's 1-3 tensors
// (x0, x1, x2), cu_seqlens_k None for the queries' lengths, and a packed qkv / kv input given one
// gradient buffer that attention_varlen_bwd.into writes through slices where the tensors' device
// has that overload (else the three gradients are stacked, as the Python does for a backend
// without it). Registered for CompositeImplicitAutograd: it runs under no_grad and inference_mode.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernel.h"

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace fastformer {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          c10::SymInt, c10::SymInt, bool, double, double, const Tensor&,
                                          const std::optional<Tensor>&);
// (the fourth result, rel_bias's gradient, is empty: this op takes no rel_bias, which the Python
// Function differentiates)
using BwdSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, const Tensor&,
                                                          const Tensor&, const Tensor&, c10::SymInt, c10::SymInt,
                                                          bool, double, double, const Tensor&,
                                                          const std::optional<Tensor>&);
using IntoSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const Tensor&, const Tensor&, c10::SymInt, c10::SymInt, bool, double, double, const Tensor&,
                       const std::optional<Tensor>&, Tensor&, Tensor&, Tensor&);

// The kernels' handles, looked up once (the first call, when the library's ops are all registered).
FF_KERNEL(fwd_kernel, FwdSig, "fastformer::attention_varlen_fwd", "")
FF_KERNEL(bwd_kernel, BwdSig, "fastformer::attention_varlen_bwd", "")
FF_KERNEL(into_kernel, IntoSig, "fastformer::attention_varlen_bwd", "into")

// fastformer/autograd/attention_varlen.py's LAYOUTS: "q,k,v" (and any other string, as split()
// reads it), "qkv" (one (total, 3, H, D) tensor), "q,kv" (q and one (total_k, 2, H, D) tensor).
enum Layout : int64_t { kQKV3 = 0, kPackedQKV = 1, kPackedKV = 2 };

Layout layout_of(c10::string_view layout) {
  if (layout == "qkv") return kPackedQKV;
  if (layout == "q,kv") return kPackedKV;
  return kQKV3;
}

// split(): q, k, v (views, for the packed layouts) of the layout's tensors.
std::array<Tensor, 3> split(Layout layout, const Tensor& x0, const Tensor& x1, const Tensor& x2) {
  if (layout == kPackedQKV) {
    auto u = x0.unbind(1);
    TORCH_CHECK(u.size() == 3, "attention_varlen: the qkv layout needs a (total, 3, H, D) tensor, got shape ",
                x0.sizes());
    return {u[0], u[1], u[2]};
  }
  if (layout == kPackedKV) {
    TORCH_CHECK(x1.defined(), "attention_varlen: the q,kv layout needs two tensors, got one");
    auto u = x1.unbind(1);
    TORCH_CHECK(u.size() == 2, "attention_varlen: the q,kv layout's kv must be (total_k, 2, H, D), got shape ",
                x1.sizes());
    return {x0, u[0], u[1]};
  }
  TORCH_CHECK(x1.defined() && x2.defined(), "attention_varlen: the q,k,v layout needs three tensors");
  return {x0, x1, x2};
}

struct AttentionVarlenFunction : public torch::autograd::Function<AttentionVarlenFunction> {
  static Tensor forward(AutogradContext* ctx, c10::string_view layout_name, const Tensor& cu_seqlens_q,
                        const std::optional<Tensor>& cu_seqlens_k_in, c10::SymInt max_seqlen_q,
                        c10::SymInt max_seqlen_k, bool is_causal, double scale, double dropout_p,
                        const Tensor& philox, const Tensor& x0, const std::optional<Tensor>& x1_in,
                        const std::optional<Tensor>& x2_in) {
    const Layout layout = layout_of(layout_name);
    const Tensor x1 = x1_in.value_or(Tensor()), x2 = x2_in.value_or(Tensor());
    // The queries' lengths when None (the same tensor passed twice would break torch.compile's trace).
    const Tensor& cu_seqlens_k = cu_seqlens_k_in.has_value() ? *cu_seqlens_k_in : cu_seqlens_q;
    Tensor out, lse;
    {
      // Gradient mode is off here: the kernel's autograd fallback would only box the arguments, and
      // the packed layouts' views never leave this scope (no view tracking wanted).
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      const auto qkv = split(layout, x0, x1, x2);
      std::tie(out, lse) = fwd_kernel().call(qkv[0], qkv[1], qkv[2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, is_causal, scale, dropout_p,
                                             philox, std::nullopt);  // (total_q, H, D), (H, total_q)
    }
    // The saved inputs are the layout's tensors (x1, x2 undefined where absent), not the views.
    ctx->save_for_backward({out, lse, cu_seqlens_q, cu_seqlens_k, philox, x0, x1, x2});
    ctx->saved_data["l"] = static_cast<int64_t>(layout);
    ctx->saved_data["mq"] = std::move(max_seqlen_q);
    ctx->saved_data["mk"] = std::move(max_seqlen_k);
    ctx->saved_data["c"] = is_causal;
    ctx->saved_data["s"] = scale;
    ctx->saved_data["p"] = dropout_p;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &out = saved[0], &lse = saved[1], &cu_seqlens_q = saved[2], &cu_seqlens_k = saved[3],
                 &philox = saved[4], &x0 = saved[5], &x1 = saved[6], &x2 = saved[7];
    const auto layout = static_cast<Layout>(ctx->saved_data["l"].toInt());
    const c10::SymInt max_seqlen_q = ctx->saved_data["mq"].toSymInt();
    const c10::SymInt max_seqlen_k = ctx->saved_data["mk"].toSymInt();
    const bool is_causal = ctx->saved_data["c"].toBool();
    const double scale = ctx->saved_data["s"].toDouble();
    const double dropout_p = ctx->saved_data["p"].toDouble();

    Tensor dout = std::move(grad_outputs[0]);
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    const auto qkv = split(layout, x0, x1, x2);

    // Without create_graph the kernels' autograd fallback has nothing to record: skip it.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();

    // The Python reads the backend's attention_varlen_bwd_into: here, whether the overload has a
    // kernel for the tensors' device (the CPU has one; CUDA stacks).
    const bool into = layout != kQKV3 && into_kernel().hasKernelForDispatchKey(
                                             c10::computeDispatchKey(std::nullopt, std::nullopt, x0.device()));
    variable_list grads(12);  // the 9 arguments before x0 get none
    if (!into) {
      Tensor dq, dk, dv;
      std::tie(dq, dk, dv, std::ignore) =
          bwd_kernel().call(dout, qkv[0], qkv[1], qkv[2], out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, is_causal, scale, dropout_p, philox, std::nullopt);
      if (layout == kPackedQKV) {
        grads[9] = at::stack({dq, dk, dv}, 1);
      } else if (layout == kPackedKV) {
        grads[9] = std::move(dq);
        grads[10] = at::stack({dk, dv}, 1);
      } else {
        grads[9] = std::move(dq);
        grads[10] = std::move(dk);
        grads[11] = std::move(dv);
      }
    } else {
      grads[9] = at::empty_like(x0, at::TensorOptions(), at::MemoryFormat::Contiguous);
      if (layout == kPackedKV) grads[10] = at::empty_like(x1, at::TensorOptions(), at::MemoryFormat::Contiguous);
      auto d = split(layout, grads[9], grads[10], Tensor());
      into_kernel().call(dout, qkv[0], qkv[1], qkv[2], out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, is_causal, scale, dropout_p, philox, std::nullopt, d[0], d[1], d[2]);
    }
    return grads;
  }
};

Tensor attention_varlen(c10::string_view layout, const Tensor& cu_seqlens_q, const std::optional<Tensor>& cu_seqlens_k,
                        c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, bool is_causal, double scale,
                        double dropout_p, const Tensor& philox, const Tensor& x0, const std::optional<Tensor>& x1,
                        const std::optional<Tensor>& x2) {
  return AttentionVarlenFunction::apply(layout, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q),
                                        std::move(max_seqlen_k), is_causal, scale, dropout_p, philox, x0, x1, x2);
}

}  // namespace
}  // namespace fastformer

// AttentionVarlenFunction.apply's arguments without `kernels`, with the caller's philox in its place.
TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "attention_varlen(str layout, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, bool is_causal, float scale, float dropout_p, Tensor philox, Tensor x0, "
      "Tensor? x1=None, Tensor? x2=None) -> Tensor",
      torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(fastformer::attention_varlen)));
}
