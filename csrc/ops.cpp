// The fastformer extension module: the op schemas (csrc/schemas.h) registered under the
// namespace fastformer, implemented per device with TORCH_LIBRARY_IMPL(fastformer, CPU, m) in
// csrc/cpu/*.cpp and TORCH_LIBRARY_IMPL(fastformer, CUDA, m) in csrc/cuda/*.cpp.
#include <Python.h>
#include <torch/library.h>

#include "schemas.h"

extern "C" {
// `import fastformer._C` only has to load this library: the ops register
// themselves with the dispatcher through the static initialisers below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fastformer, m) { ff_define_schemas(m); }
