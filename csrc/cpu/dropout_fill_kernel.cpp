// The dropout_fill test op's math: the level's DropoutScales::fill itself, so a test sees the
// multipliers every CPU kernel's dropout uses. Compiled once per ISA level into
// fastformer::<level> (isa.h).
#include "dropout_fill.h"
#include "dropout_scales.h"

namespace fastformer {
namespace CPU_CAPABILITY {

void dropout_fill_kernel(at::Tensor& out, uint64_t seed, uint32_t threshold, double scale, int64_t c0,
                         uint64_t row_counter) {
  if (out.scalar_type() == at::kDouble) {
    DropoutScales<double>(seed, threshold, scale).fill(out.data_ptr<double>(), c0, out.numel(), row_counter);
  } else {
    DropoutScales<float>(seed, threshold, static_cast<float>(scale))
        .fill(out.data_ptr<float>(), c0, out.numel(), row_counter);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
