// The Philox 4x32-10 constants and the dropout group width ("Philox v2", defined in
// fastformer/philox.py): their one home for C++ and CUDA, included by the CPU definition
// (csrc/cpu/philox.h) and the CUDA one (csrc/cuda/philox.cuh). Only <cstdint>, so the .cu files
// (CUDA headers only) can include it; namespace-scope constexpr integers are usable in device code.
#pragma once
#include <cstdint>

namespace fastformer {

constexpr uint32_t kPhiloxRoundA = 0xD2511F53u, kPhiloxRoundB = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;      // key increments
constexpr int kDropoutGroup = 8;  // columns per Philox call (16 bits each from its 4 words)

// Attention's dropout ("v3", fastformer/philox.py): 16 x 32 tiles of probabilities, 32 Philox calls
// (lanes) a tile, 16 one-byte decisions a call, in the layout of an m16 x n32 mma.sync accumulator.
constexpr int kAttnDropRows = 16, kAttnDropCols = 32, kAttnDropLanes = 32;

}  // namespace fastformer
