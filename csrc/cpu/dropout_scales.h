// Vectorised dropout scale factors from the shared Philox stream (philox.h).
//
// dropout_scales(out, n, seed, counter0, threshold, scale) writes, for j in [0, n),
//   out[j] = scale  if element counter0 + j is kept ((philox(seed, counter0 + j) >> 8) >= threshold)
//          = 0      otherwise,
// i.e. the multiplier dropout applies to that element. The kernels fill one row (or chunk) of
// factors into a small buffer that stays in L1 and multiply by it. With AVX-512 (AVX2) sixteen
// (eight) Philox-4x32-10 counters run side by side in a vector register, and with AVX-512 four such
// registers are interleaved; the bits are exactly those of the scalar philox_bits(), which is the
// fallback elsewhere.
#pragma once
#include <cstdint>

#include "philox.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fastformer {

constexpr uint32_t kPhiloxRoundA = 0xD2511F53u, kPhiloxRoundB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;

#if defined(__AVX512F__)

// (hi, lo) 32-bit halves of m * b per 32-bit lane: two 32x32->64 multiplies (even lanes, then odd
// lanes moved down), and one masked pair-swap each to gather the high and the low words.
inline void philox_mulhilo16(__m512i m, __m512i b, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(m, b);                                // lanes 0, 2, ...
  const __m512i odd = _mm512_mul_epu32(m, _mm512_shuffle_epi32(b, _MM_PERM_CDAB));  // lanes 1, 3, ...
  hi = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
  lo = _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
}

// First Philox output words for the U * 16 counters counter0 .. counter0 + 16 U - 1: U independent
// streams are interleaved so the multiplies of one hide the latency of the others.
template <int U>
inline void philox_bits16(uint64_t seed, uint64_t counter0, __m512i (&out)[U]) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i ma = _mm512_set1_epi32(static_cast<int>(kPhiloxRoundA));
  const __m512i mb = _mm512_set1_epi32(static_cast<int>(kPhiloxRoundB));
  __m512i c0[U], c1[U], c2[U], c3[U];
  for (int u = 0; u < U; ++u) {
    const uint64_t base = counter0 + 16 * static_cast<uint64_t>(u);
    const __m512i base_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
    const __m512i base_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
    c0[u] = _mm512_add_epi32(base_lo, lane);
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0[u], base_lo);  // low word wrapped
    c1[u] = _mm512_mask_add_epi32(base_hi, carry, base_hi, _mm512_set1_epi32(1));
    c2[u] = _mm512_setzero_si512();
    c3[u] = _mm512_setzero_si512();
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  // round 0: c2 = c3 = 0, so the B product vanishes
  {
    const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0));
    const __m512i vk1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m512i hi_a, lo_a;
      philox_mulhilo16(ma, c0[u], hi_a, lo_a);
      c0[u] = _mm512_xor_si512(c1[u], vk0);
      c2[u] = _mm512_xor_si512(hi_a, vk1);
      c1[u] = _mm512_setzero_si512();
      c3[u] = lo_a;
    }
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  for (int round = 1; round < 9; ++round) {
    const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0));
    const __m512i vk1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m512i hi_b, lo_b, hi_a, lo_a;
      philox_mulhilo16(mb, c2[u], hi_b, lo_b);
      philox_mulhilo16(ma, c0[u], hi_a, lo_a);
      c0[u] = _mm512_ternarylogic_epi32(hi_b, c1[u], vk0, 0x96);
      c2[u] = _mm512_ternarylogic_epi32(hi_a, c3[u], vk1, 0x96);
      c1[u] = lo_b;
      c3[u] = lo_a;
    }
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // round 9: only the first output word is used, i.e. hi(B c2) ^ c1 ^ k0
  const __m512i vk0 = _mm512_set1_epi32(static_cast<int>(k0));
  for (int u = 0; u < U; ++u) {
    const __m512i even = _mm512_mul_epu32(mb, c2[u]);
    const __m512i odd = _mm512_mul_epu32(mb, _mm512_shuffle_epi32(c2[u], _MM_PERM_CDAB));
    const __m512i hi_b = _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
    out[u] = _mm512_ternarylogic_epi32(hi_b, c1[u], vk0, 0x96);
  }
}

template <int U>
inline void dropout_keep16(uint64_t seed, uint64_t counter0, uint32_t threshold, __mmask16 (&keep)[U]) {
  __m512i bits[U];
  philox_bits16<U>(seed, counter0, bits);
  const __m512i t = _mm512_set1_epi32(static_cast<int>(threshold));
  for (int u = 0; u < U; ++u) keep[u] = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(bits[u], 8), t);
}

inline void dropout_scales(float* out, int64_t n, uint64_t seed, uint64_t counter0,
                           uint32_t threshold, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {  // four streams at a time
    __mmask16 keep[4];
    dropout_keep16<4>(seed, counter0 + j, threshold, keep);
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(out + j + 16 * u, _mm512_maskz_mov_ps(keep[u], s));
  }
  for (; j < n; j += 16) {
    __mmask16 keep[1];
    dropout_keep16<1>(seed, counter0 + j, threshold, keep);
    const __mmask16 m = n - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(out + j, m, _mm512_maskz_mov_ps(keep[0], s));
  }
}

inline void dropout_scales(double* out, int64_t n, uint64_t seed, uint64_t counter0,
                           uint32_t threshold, double scale) {
  const __m512d s = _mm512_set1_pd(scale);
  for (int64_t j = 0; j < n; j += 16) {
    __mmask16 keep[1];
    dropout_keep16<1>(seed, counter0 + j, threshold, keep);
    const int64_t left = n - j;
    const __mmask8 m_lo = left >= 8 ? 0xFF : static_cast<__mmask8>((1u << left) - 1);
    const __mmask8 m_hi = left >= 16 ? 0xFF : left <= 8 ? 0 : static_cast<__mmask8>((1u << (left - 8)) - 1);
    _mm512_mask_storeu_pd(out + j, m_lo, _mm512_maskz_mov_pd(static_cast<__mmask8>(keep[0]), s));
    _mm512_mask_storeu_pd(out + j + 8, m_hi, _mm512_maskz_mov_pd(static_cast<__mmask8>(keep[0] >> 8), s));
  }
}

#elif defined(__AVX2__)

inline void philox_mulhilo8(__m256i m, __m256i b, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(m, b);
  const __m256i odd = _mm256_mul_epu32(m, _mm256_srli_epi64(b, 32));
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// All-ones lanes where the 8 counters counter0 .. counter0 + 7 are kept.
inline __m256i dropout_keep8(uint64_t seed, uint64_t counter0, uint32_t threshold) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i base_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(counter0)));
  __m256i c0 = _mm256_add_epi32(base_lo, lane);
  // unsigned c0 < base_lo (the low word wrapped) as all-ones lanes; subtracting -1 adds the carry
  const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(base_lo, sign), _mm256_xor_si256(c0, sign));
  __m256i c1 = _mm256_sub_epi32(
      _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(counter0 >> 32))), carry);
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundA));
  const __m256i mb = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundB));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    __m256i hi_b, lo_b, hi_a, lo_a;
    philox_mulhilo8(mb, c2, hi_b, lo_b);
    philox_mulhilo8(ma, c0, hi_a, lo_a);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo_b;
    c3 = lo_a;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // (bits >> 8) < 2^24 and threshold <= 2^24, so the signed compare is exact
  const __m256i drop = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(threshold)),
                                          _mm256_srli_epi32(c0, 8));
  return _mm256_xor_si256(drop, _mm256_set1_epi32(-1));
}

template <typename A>
inline void dropout_scales(A* out, int64_t n, uint64_t seed, uint64_t counter0, uint32_t threshold,
                           A scale) {
  alignas(32) int32_t keep[8];
  for (int64_t j = 0; j < n; j += 8) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(keep), dropout_keep8(seed, counter0 + j, threshold));
    const int64_t m = n - j < 8 ? n - j : 8;
    for (int64_t k = 0; k < m; ++k) out[j + k] = keep[k] ? scale : A(0);
  }
}

#else

template <typename A>
inline void dropout_scales(A* out, int64_t n, uint64_t seed, uint64_t counter0, uint32_t threshold,
                           A scale) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = dropout_keep(seed, counter0 + static_cast<uint64_t>(j), threshold) ? scale : A(0);
  }
}

#endif

}  // namespace fastformer
