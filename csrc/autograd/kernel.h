// What the differentiable ops (csrc/autograd/<op>.cpp) share: the typed dispatcher handle of a
// kernel they call, looked up once (at the first call, when every op of the library is
// registered), so that a call costs no schema lookup.
#pragma once
#include <ATen/FuncTorchTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

// Defines `const c10::TypedOperatorHandle<Sig>& fn()`: the handle of `name`.`overload` ("" for the
// default overload).
#define FF_KERNEL(fn, Sig, name, overload)                                               \
  const c10::TypedOperatorHandle<Sig>& fn() {                                            \
    static const auto handle =                                                           \
        c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Sig>();     \
    return handle;                                                                       \
  }

namespace fastformer {

// A saved tensor that may be undefined, as the kernels' `Tensor?` argument.
inline std::optional<at::Tensor> ff_optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// t (..., C) as (N, C) with N the product of its leading sizes (a view where the layout allows),
// for ops whose kernels take rows. N is counted, not left to -1: an empty t has N = 0 either way,
// and with C = 0 a -1 would be ambiguous. A 0-d t is one row of one. Called below autograd, so the
// reshape records no node.
inline at::Tensor ff_rows(const at::Tensor& t) {
  if (t.dim() == 0) return t.reshape({1, 1});
  if (t.dim() == 2) return t;
  const int64_t C = t.size(-1);
  int64_t N = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) N *= t.size(d);
  return t.reshape({N, C});
}

// What torch::autograd::Function::apply checks before it records a node, for the ops whose backward
// node is written by hand (a torch::autograd::Node subclass, as torch's generated code does: no
// AutogradContext, no IValue dictionary of saved values, no per-call wrapping of the outputs): a
// C++ custom node is not supported under a functorch transform, which must say so rather than be
// silently wrong.
inline void ff_check_functorch() {
  const auto& functorch_tls = at::functorch::functorchTLSAccessor();
  if (functorch_tls) functorch_tls->checkSupportsCppAutogradFunction();
}

}  // namespace fastformer
