// The dropout_fill op: exposes DropoutScales::fill (dropout_scales.h), the vectorised dropout
// mask generator every CPU kernel uses, at the chosen ISA level, so tests can check each level's
// multipliers against fastformer/philox.py for any start column and length -- which the kernels
// only reach in the combinations their shapes give. A test hook, like philox_bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "dropout_fill.h"

namespace fastformer {

void dropout_fill_cpu(at::Tensor& out, int64_t seed, int64_t threshold, double scale, int64_t c0,
                      int64_t row_counter) {
  constexpr const char* op = "dropout_fill";
  TORCH_CHECK(out.device().is_cpu(), op, ": out must be a CPU tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble, op,
              ": out must be float32 or float64, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be 1-D and contiguous");
  TORCH_CHECK(seed >= 0, op, ": seed must be >= 0, got ", seed);
  TORCH_CHECK(threshold >= 0 && threshold <= INT64_C(0xFFFFFFFF), op,
              ": threshold must be in [0, 2**32), got ", threshold);
  TORCH_CHECK(c0 >= 0, op, ": c0 must be >= 0, got ", c0);
  TORCH_CHECK(row_counter >= 0, op, ": row_counter must be >= 0, got ", row_counter);
  FF_ISA(dropout_fill_kernel)(out, static_cast<uint64_t>(seed), static_cast<uint32_t>(threshold), scale, c0,
                              static_cast<uint64_t>(row_counter));
}

}  // namespace fastformer

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  // out[k] = scale if column c0 + k of the dropout row whose first counter is row_counter is kept
  // at threshold T (u >= T), else 0, for k in [0, out.numel()); out fp32 / fp64, 1-D contiguous.
  m.def("dropout_fill(Tensor(a!) out, int seed, int threshold, float scale, int c0, int row_counter) -> ()");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) { m.impl("dropout_fill", &fastformer::dropout_fill_cpu); }
