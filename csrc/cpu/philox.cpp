// The philox_bits op: exposes the shared dropout RNG so tests can check that the C++
// generator gives the very bits of the Python definition (fastformer/philox.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "philox.h"

namespace fastformer {

at::Tensor philox_bits_cpu(int64_t n, int64_t seed, int64_t offset) {
  TORCH_CHECK(n >= 0, "philox_bits: n must be >= 0, got ", n);
  TORCH_CHECK(seed >= 0, "philox_bits: seed must be >= 0, got ", seed);
  TORCH_CHECK(offset >= 0, "philox_bits: offset must be >= 0, got ", offset);
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      o[i] = philox_bits(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset + i));
    }
  });
  return out;
}

}  // namespace fastformer

// philox_bits takes no tensor, so it is registered for the backend-independent key.
TORCH_LIBRARY_IMPL(fastformer, CompositeExplicitAutograd, m) {
  m.impl("philox_bits", &fastformer::philox_bits_cpu);
}
