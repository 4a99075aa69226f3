// The per-ISA entry points of embedding (embedding_kernel.cpp, one copy per level of isa.h),
// called by embedding.cpp once the arguments (ids in range included) are checked and the outputs
// allocated.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"

namespace fastformer {

// ids (N,), positions (N,) or undefined; weight (V, D), positional (P, D) or undefined; writes
// out (N, D). N, D > 0.
FF_ISA_DECLARE(void embedding_fwd_kernel(
    const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& positional,
    const at::Tensor& positions, at::Tensor& out, double scale, double dropout_p, uint64_t seed,
    uint64_t offset))

// The scatter-add of the rows grad (N, D) x keep / (1 - p) x scale by keys (N,) into table
// (K, D): every row of table written exactly once (zeros where no key, and at skip_row; -1: none).
// order (N,) and starts (K + 1,) are keys' stable counting sort: the rows of key k are
// order[starts[k] .. starts[k + 1]), in increasing index.
FF_ISA_DECLARE(void embedding_bwd_kernel(
    const at::Tensor& grad, const int64_t* order, const int64_t* starts, at::Tensor& table,
    int64_t skip_row, double scale, double dropout_p, uint64_t seed, uint64_t offset))

}  // namespace fastformer
