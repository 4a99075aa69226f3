// The `Tensor philox` argument of the dropout ops (csrc/schemas.h): (seed, offset) in an int64 CPU
// tensor of shape (2,), drawn by fastformer::next_seed() (fastformer/philox.py). It lives on the
// CPU for every device, so reading it on the host never waits for a device.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>
#include <utility>

namespace fastformer {

// (seed, offset) of `philox`, both checked to be >= 0; every malformed tensor is a TORCH_CHECK.
inline std::pair<int64_t, int64_t> read_philox(const char* op, const at::Tensor& philox) {
  TORCH_CHECK(philox.defined(), op, ": philox must be an int64 CPU tensor of shape (2,) = (seed, offset), "
              "got an undefined tensor");
  TORCH_CHECK(philox.device().is_cpu(), op, ": philox must be a CPU tensor (int64, shape (2,) = "
              "(seed, offset)) whatever the device of the op, got device ", philox.device());
  TORCH_CHECK(philox.scalar_type() == at::kLong, op, ": philox must be int64 (shape (2,) = (seed, offset)), got ",
              philox.scalar_type());
  TORCH_CHECK(philox.dim() == 1 && philox.size(0) == 2, op,
              ": philox must have shape (2,) = (seed, offset), got ", philox.sizes());
  TORCH_CHECK(philox.is_contiguous(), op, ": philox must be contiguous, got strides ", philox.strides());
  const int64_t* v = philox.const_data_ptr<int64_t>();
  TORCH_CHECK(v[0] >= 0, op, ": the philox seed philox[0] must be >= 0, got ", v[0]);
  TORCH_CHECK(v[1] >= 0, op, ": the philox offset philox[1] must be >= 0, got ", v[1]);
  return {v[0], v[1]};
}

}  // namespace fastformer
