// The fastformer extension module: the op schemas (csrc/schemas.h) registered under the
// namespace fastformer, implemented per device with TORCH_LIBRARY_IMPL(fastformer, CPU, m) in
// csrc/cpu/*.cpp and TORCH_LIBRARY_IMPL(fastformer, CUDA, m) in csrc/cuda/*.cpp.
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/library.h>

#include "cpu/large_buffers.h"
#include "eager.h"
#include "schemas.h"

namespace {

// fastformer._C.cpu_pool_stats() -> dict: the CPU buffer pool's counters (csrc/cpu/large_buffers.h).
PyObject* cpu_pool_stats(PyObject*, PyObject*) {
  const fastformer::PoolStats s = fastformer::pool_stats();
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L}", "in_use_bytes", static_cast<long long>(s.in_use_bytes),
                       "cached_bytes", static_cast<long long>(s.cached_bytes), "cap_bytes",
                       static_cast<long long>(s.cap_bytes), "hits", static_cast<long long>(s.hits),
                       "misses", static_cast<long long>(s.misses));
}

// fastformer._C.cpu_pool_empty_cache() -> int: frees the pool's kept blocks, returns their bytes.
PyObject* cpu_pool_empty_cache(PyObject*, PyObject*) {
  return PyLong_FromLongLong(static_cast<long long>(fastformer::pool_empty_cache()));
}

// fastformer._C.draw_philox(device) -> Tensor: the philox pair the direct entries draw for a call with
// dropout on `device` (csrc/eager.h; the tests hold it to philox.py's draw).
PyObject* draw_philox(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(THPDevice_Check(arg), "draw_philox: device must be a torch.device, got ", Py_TYPE(arg)->tp_name);
  return THPVariable_Wrap(fastformer::ff_draw_philox(reinterpret_cast<THPDevice*>(arg)->device));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"draw_philox", draw_philox, METH_O, "The philox pair of an eager call with dropout on a device."},
    {"cpu_pool_stats", cpu_pool_stats, METH_NOARGS, "The CPU buffer pool's counters."},
    {"cpu_pool_empty_cache", cpu_pool_empty_cache, METH_NOARGS, "Free the CPU buffer pool's kept blocks."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
// `import fastformer._C` loads this library: the ops register themselves with the dispatcher
// through the static initialisers below; the module's functions are the CPU pool's controls.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (!module) return nullptr;
  // the direct eager entries of the differentiable ops built into this library (csrc/eager.h)
  for (PyMethodDef& def : fastformer::ff_eager_entries()) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, nullptr);
    if (!fn || PyModule_AddObject(module, def.ml_name, fn) < 0) {
      Py_XDECREF(fn);
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
}

TORCH_LIBRARY(fastformer, m) { ff_define_schemas(m); }
