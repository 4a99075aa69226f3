// Dropout multipliers for one row of an attention tile, from the shared Philox stream
// (philox.h): out[c] = value if element counter0 + c is kept, else 0, for c < round_up(n, 16).
// The AVX-512 path runs 16 Philox streams per instruction and gives exactly the bits of the
// scalar philox_bits(); without AVX-512 the scalar definition runs per element.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "philox.h"

namespace fastformer {
namespace attn {

constexpr int64_t kDropoutLanes = 16;

#if defined(__AVX512F__)

// High 32 bits of the 16 products a[l] * m (uint32 lanes, m a broadcast constant).
inline __m512i mulhi_epu32(__m512i a, __m512i m) {
  const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(a, m), 32);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  return _mm512_mask_blend_epi32(0xAAAA, even, odd);
}

// Keep bits for kGroups * 16 consecutive counters (bit l of mask[g] <=> counter0 + 16 g + l kept).
// The groups run interleaved: one Philox stream is a chain of dependent multiplies, so several
// in flight keep the multipliers busy.
template <int kGroups>
inline void keep_masks(uint64_t seed, uint64_t counter0, uint32_t threshold, __mmask16* mask) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i mul_a = _mm512_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m512i mul_b = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m512i c0[kGroups], c1[kGroups], c2[kGroups], c3[kGroups];
  for (int g = 0; g < kGroups; ++g) {
    const uint64_t base = counter0 + 16 * static_cast<uint64_t>(g);
    const __m512i lo_base = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
    const __m512i hi_base = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
    c0[g] = _mm512_add_epi32(lo_base, lanes);
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0[g], lo_base);  // lo32 wrapped: carry into hi32
    c1[g] = _mm512_mask_add_epi32(hi_base, carry, hi_base, _mm512_set1_epi32(1));
    c2[g] = _mm512_setzero_si512();
    c3[g] = _mm512_setzero_si512();
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0));
    const __m512i vk1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < kGroups; ++g) {
      const __m512i hi_b = mulhi_epu32(c2[g], mul_b), lo_b = _mm512_mullo_epi32(c2[g], mul_b);
      const __m512i hi_a = mulhi_epu32(c0[g], mul_a), lo_a = _mm512_mullo_epi32(c0[g], mul_a);
      c0[g] = _mm512_ternarylogic_epi32(hi_b, c1[g], vk0, 0x96);  // hi_b ^ c1 ^ k0
      c2[g] = _mm512_ternarylogic_epi32(hi_a, c3[g], vk1, 0x96);  // hi_a ^ c3 ^ k1
      c1[g] = lo_b;
      c3[g] = lo_a;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  const __m512i vthreshold = _mm512_set1_epi32(static_cast<int>(threshold));
  for (int g = 0; g < kGroups; ++g) {
    mask[g] = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(c0[g], 8), vthreshold);
  }
}

#else

inline uint32_t keep_mask16(uint64_t seed, uint64_t counter0, uint32_t threshold) {
  uint32_t bits = 0;
  for (int l = 0; l < 16; ++l) {
    bits |= static_cast<uint32_t>(dropout_keep(seed, counter0 + l, threshold)) << l;
  }
  return bits;
}

#endif

// out[c] = keep(counter0 + c) ? value : 0 for c in [0, round_up(n, 16)); out must hold that many.
template <typename acc_t>
inline void dropout_multipliers(uint64_t seed, uint64_t counter0, int64_t n, uint32_t threshold,
                                acc_t value, acc_t* out) {
  auto write16 = [&](int64_t c, uint32_t mask) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<acc_t, float>) {
      const __m512 kept = _mm512_maskz_mov_ps(static_cast<__mmask16>(mask), _mm512_set1_ps(value));
      _mm512_storeu_ps(out + c, kept);
      return;
    }
#endif
    for (int l = 0; l < 16; ++l) out[c + l] = ((mask >> l) & 1) ? value : acc_t(0);
  };
#if defined(__AVX512F__)
  // four streams at a time, then the one to three groups left in one go
  __mmask16 masks[4];
  for (int64_t c = 0; c < n; c += 4 * kDropoutLanes) {
    const int64_t groups = std::min<int64_t>(4, (n - c + kDropoutLanes - 1) / kDropoutLanes);
    const uint64_t counter = counter0 + static_cast<uint64_t>(c);
    switch (groups) {
      case 4: keep_masks<4>(seed, counter, threshold, masks); break;
      case 3: keep_masks<3>(seed, counter, threshold, masks); break;
      case 2: keep_masks<2>(seed, counter, threshold, masks); break;
      default: keep_masks<1>(seed, counter, threshold, masks); break;
    }
    for (int64_t g = 0; g < groups; ++g) write16(c + g * kDropoutLanes, masks[g]);
  }
#else
  for (int64_t c = 0; c < n; c += kDropoutLanes) {
    write16(c, keep_mask16(seed, counter0 + static_cast<uint64_t>(c), threshold));
  }
#endif
}

}  // namespace attn
}  // namespace fastformer
