// The direct eager entries of the differentiable ops (csrc/autograd/<op>.cpp): functions of the
// extension module (fastformer._C.<op>_eager) that an op's fast path (fastformer/internal/fast.py)
// calls instead of the registered op. The same C++ function and backward node as the registered op;
// what they skip is the boxed dispatcher call (the schema's arguments parsed into IValues, the
// outputs wrapped back) and the Python philox draw: they draw the pair here (ff_draw_philox), the
// same bits from the same generator. The registered TORCH_LIBRARY op stays the path of everything
// else (torch.compile, opcheck, a traced or autocast call).
//
// An entry takes the op's arguments without philox and returns the op's outputs. It returns None
// where the call is not eager (autocast, a dispatch or function mode: ff_eager_tls), where its
// arguments are not what it takes (a tensor subclass or a non-tensor, a tensor on another device
// than the first, a number or flag of another type: FFArgs) or where the op refused the call
// with a RuntimeError (ff_refused_as_none): the caller's checked path runs and words why.
#pragma once
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <deque>
#include <mutex>
#include <optional>

namespace fastformer {

// The philox pair of an eager call with dropout on `device`: philox.py's _draw_on, bit for bit. On
// the CPU (seed, 0) with seed torch.randint(0, 2**62)'s draw: random_(0, 2**62) of one int64
// element takes random_from_to_kernel (ATen/native/cpu/DistributionTemplates.h), which locks the
// generator's mutex and, for a range of 2**28 or more, returns random64() % range + from
// (uniform_int_from_to_distribution, ATen/core/DistributionsHelper.h). Elsewhere the same ATen
// call as the Python's: one random_ of the pair on the device.
inline at::Tensor ff_draw_philox(const c10::Device& device) {
  constexpr uint64_t kRange = uint64_t{1} << 62;
  if (device.is_cpu()) {
    uint64_t seed;
    {
      auto* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      seed = gen->random64() % kRange;
    }
    at::Tensor pair = at::empty({2}, at::TensorOptions().dtype(at::kLong));
    int64_t* p = pair.data_ptr<int64_t>();
    p[0] = static_cast<int64_t>(seed);
    p[1] = 0;
    return pair;
  }
  return at::empty({2}, at::TensorOptions().dtype(at::kLong).device(device)).random_(0, int64_t{1} << 62);
}

// philox.NO_DROPOUT's C++ side: one (0, 0) for every call without dropout (no kernel reads it)
inline const at::Tensor& ff_no_dropout() {
  static const at::Tensor zeros = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  return zeros;
}

// The philox argument of an eager call: a fresh draw with dropout, else the shared (0, 0).
inline at::Tensor ff_philox_for(double dropout_p, const c10::Device& device) {
  return dropout_p == 0.0 ? ff_no_dropout() : ff_draw_philox(device);
}

// (a, b) as a Python tuple of two tensors (nullptr with the error set if one cannot be made)
inline PyObject* ff_wrap_pair(at::Tensor&& a, at::Tensor&& b) {
  PyObject* t = PyTuple_New(2);
  if (!t) return nullptr;
  PyObject* pa = THPVariable_Wrap(std::move(a));
  PyObject* pb = pa ? THPVariable_Wrap(std::move(b)) : nullptr;
  if (!pb) {
    Py_XDECREF(pa);
    Py_DECREF(t);
    return nullptr;
  }
  PyTuple_SET_ITEM(t, 0, pa);
  PyTuple_SET_ITEM(t, 1, pb);
  return t;
}

// The entries, registered by each op's file when the library loads (FF_EAGER_ENTRY) and added to
// the module by PyInit__C (csrc/ops.cpp). A deque: the PyMethodDefs must not move.
inline std::deque<PyMethodDef>& ff_eager_entries() {
  static std::deque<PyMethodDef> entries;
  return entries;
}
struct FFEagerEntry {
  FFEagerEntry(const char* name, _PyCFunctionFast fn, const char* doc) {
    ff_eager_entries().push_back({name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)),
                                  METH_FASTCALL, doc});
  }
};
// An entry's answer where the op refused the call with a RuntimeError (a c10::Error the checks
// raise, as HANDLE_TH_ERRORS words it in Python): None, so the caller's checked path runs and words
// the error, as the fast path's `except RuntimeError` did (fast.attempt). Any other error propagates.
inline PyObject* ff_refused_as_none(PyObject* out) {
  if (out == nullptr && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return out;
}
#define FF_EAGER_ENTRY(name, fn, doc)                                                   \
  PyObject* fn##_or_none(PyObject* self, PyObject* const* args, Py_ssize_t n) {        \
    return ::fastformer::ff_refused_as_none(fn(self, args, n));                         \
  }                                                                                     \
  static const ::fastformer::FFEagerEntry ff_eager_entry_##fn(name, fn##_or_none, doc);

// fast.ready()'s thread-local half, read here (cheaper than Python's three calls): autocast off on
// every device (an autocast key not excluded is an autocast on: at::autocast::is_autocast_enabled),
// no TorchDispatchMode (FakeTensorMode, make_fx: _len_torch_dispatch_stack) and no
// TorchFunctionMode (it sees the registered op's call, the checked path's; an entry's it would
// not). torch.compiler.is_compiling stays the caller's: dynamo answers it while tracing Python.
inline bool ff_eager_tls() {
  return c10::impl::tls_local_dispatch_key_set().excluded_.isSupersetOf(c10::autocast_dispatch_keyset) &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled();
}

// Argument readers of an entry. Each sets *ok = false (and returns a dummy) where the argument is
// not what the entry takes; the entry then returns None.
struct FFArgs {
  PyObject* const* args;
  Py_ssize_t n;
  bool ok = true;
  std::optional<c10::Device> device;  // the first tensor's: every tensor must be on it

  // ok only for a call fast.ready() would take (ff_eager_tls) with the expected argument count
  FFArgs(PyObject* const* a, Py_ssize_t count, Py_ssize_t expected)
      : args(a), n(count), ok(count == expected && ff_eager_tls()) {}

  // a tensor on the call's device (fast.on's check: a tensor elsewhere would send the registered
  // op to that device's kernel before any check ran, so the checked path words it)
  // a plain torch.Tensor or Parameter (fast.plain: a subclass's call needs its __torch_function__,
  // the checked path's)
  const at::Tensor* tensor(Py_ssize_t i) {
    if (!ok || !THPVariable_CheckExact(args[i])) {
      ok = false;
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(args[i]);
    if (!device) {
      device = t.device();
    } else if (t.device() != *device) {
      ok = false;
    }
    return &t;
  }
  std::optional<at::Tensor> optional_tensor(Py_ssize_t i) {
    if (!ok || args[i] == Py_None) return std::nullopt;
    const at::Tensor* t = tensor(i);
    return t ? std::optional<at::Tensor>(*t) : std::nullopt;
  }
  double number(Py_ssize_t i) {  // a Python float or int, not a bool (fast.number)
    if (!ok) return 0.0;
    PyObject* o = args[i];
    if (PyFloat_CheckExact(o)) return PyFloat_AS_DOUBLE(o);
    if (!PyLong_CheckExact(o)) {
      ok = false;
      return 0.0;
    }
    const double v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }
  int64_t integer(Py_ssize_t i) {  // a Python int
    if (!ok) return 0;
    const long long v = PyLong_Check(args[i]) && !PyBool_Check(args[i]) ? PyLong_AsLongLong(args[i]) : -1;
    if (!PyLong_Check(args[i]) || PyBool_Check(args[i]) || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      ok = false;
    }
    return v;
  }
  c10::string_view string(Py_ssize_t i) {  // a Python str (valid while the argument lives)
    if (!ok) return {};
    Py_ssize_t size = 0;
    const char* data = PyUnicode_Check(args[i]) ? PyUnicode_AsUTF8AndSize(args[i], &size) : nullptr;
    if (!data) {
      PyErr_Clear();
      ok = false;
      return {};
    }
    return c10::string_view(data, static_cast<size_t>(size));
  }
  bool flag(Py_ssize_t i) {
    if (!ok) return false;
    if (args[i] == Py_True) return true;
    if (args[i] != Py_False) ok = false;
    return false;
  }
};

}  // namespace fastformer
