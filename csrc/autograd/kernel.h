// What the differentiable ops (csrc/autograd/<op>.cpp) share: the typed dispatcher handle of a
// kernel they call, looked up once (at the first call, when every op of the library is
// registered), so that a call costs no schema lookup.
#pragma once
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

}  // namespace fastformer
