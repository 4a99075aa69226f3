// The per-ISA entry point of the dropout_fill test op (dropout_fill_kernel.cpp, one copy per
// level of isa.h), called by dropout_fill.cpp once the arguments are checked.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"

namespace fastformer {

// DropoutScales<A>(seed, threshold, scale).fill(out, c0, out.numel(), row_counter), A the dtype
// of out (1-D contiguous fp32 or fp64).
FF_ISA_DECLARE(void dropout_fill_kernel(at::Tensor& out, uint64_t seed, uint32_t threshold, double scale,
                                        int64_t c0, uint64_t row_counter))

}  // namespace fastformer
