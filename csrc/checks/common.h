// The argument checks every op shares, one copy for the CPU glue (csrc/cpu/<op>.cpp) and the CUDA
// glue (csrc/cuda/<op>.cpp) alike; csrc/checks/<op>.h build each op's checks from them. What
// differs by device (where a backend's tensors live, which floating dtypes its kernels take) is
// the Backend argument, never a second copy of a check. Every message starts with the op's name
// and names the argument. Header-only and free of macros that differ between builds, so the same
// inline definitions serve the extension and the SIMT harness (tests/simt).
#pragma once
#include <ATen/ATen.h>

#include <cmath>

namespace fastformer {
namespace checks {

// What one backend's kernels take.
struct Backend {
  c10::DeviceType device;     // the device type of every tensor argument
  const char* device_name;    // that device in the messages: "CPU", "CUDA", ...
  at::ScalarType floats[3];   // the floating dtypes of the data tensors
  const char* float_names;    // those dtypes in the messages
};

// The C++ CPU kernels (csrc/cpu). The CUDA kernels' Backend is kFfBackend (csrc/cuda/glue.h).
constexpr Backend kCpu{c10::DeviceType::CPU, "CPU", {at::kFloat, at::kDouble, at::kBFloat16},
                       "float32, float64 or bfloat16"};

// t is defined, on the backend's device and, when `ref` is given, on ref's device (one op never
// mixes devices).
inline void check_device(const Backend& be, const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor* ref = nullptr, const char* ref_name = nullptr) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.device().type() == be.device, op, ": ", name, " must be a ", be.device_name,
              " tensor, got ", t.device());
  if (ref != nullptr) {
    TORCH_CHECK(t.device() == ref->device(), op, ": ", name, " must be on the device of ", ref_name,
                " (", ref->device(), "), got ", t.device());
  }
}

// t's dtype is one of the backend's floating dtypes.
inline void check_float_dtype(const Backend& be, const char* op, const char* name,
                              const at::Tensor& t) {
  const at::ScalarType dt = t.scalar_type();
  TORCH_CHECK(dt == be.floats[0] || dt == be.floats[1] || dt == be.floats[2], op, ": ", name,
              " must be ", be.float_names, ", got ", dt);
}

// The dtype of the per-row statistics the kernels keep for backward (log-sum-exp, mean, rstd):
// fp32, and fp64 for fp64 inputs, so that fp64 calls are fp64 end to end.
inline at::ScalarType stat_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}
inline const char* stat_dtype_name(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? "float64 (as the float64 inputs)" : "float32";
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// t has ref's dtype, said as "<name> must have the dtype of <ref_name> (<dtype>), got <dtype>".
inline void check_dtype_of(const char* op, const char* name, const at::Tensor& t,
                           const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
}

// t has ref's dtype, said as "<name> has dtype <dtype> but <ref_name> has dtype <dtype>".
inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t,
                             const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but ", ref_name, " has dtype ", ref.scalar_type(), "; they must match");
}

inline void check_dropout_p(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
}

}  // namespace checks
}  // namespace fastformer
