// Philox 4x32-10, the counter-based RNG every fastformer backend shares for dropout.
//
// Element i of an op's dropout tensor (row-major index) uses counter
// (lo32(offset + i), hi32(offset + i), 0, 0) and key (lo32(seed), hi32(seed)); the first
// output word is its random bits -- the same bits triton.language.randint(seed, offset + i)
// returns, and fastformer/philox.py defines. The element is kept iff
// (bits >> 8) >= threshold, threshold = round(p * 2^24).
#pragma once
#include <cmath>
#include <cstdint>

namespace fastformer {

inline uint32_t philox_bits(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t pb = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint64_t pa = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(pb);
    c3 = static_cast<uint32_t>(pa);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// The 24-bit keep threshold for dropout probability p.
inline uint32_t dropout_threshold(double p) {
  return static_cast<uint32_t>(std::llround(p * 16777216.0));
}

inline bool dropout_keep(uint64_t seed, uint64_t counter, uint32_t threshold) {
  return (philox_bits(seed, counter) >> 8) >= threshold;
}

}  // namespace fastformer
