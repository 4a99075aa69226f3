// Dropout multipliers from the shared Philox v2 stream (philox.h), vectorised: the one place the
// CPU kernels draw dropout bits.
//
// dropout_scales(out, c0, n, seed, row_counter, threshold, scale) writes, for k in [0, n),
//   out[k] = scale  if column c0 + k of the row whose first counter is row_counter is kept,
//          = 0      otherwise,
// i.e. the multiplier dropout applies to that element (row_counter = dropout_row_counter(offset,
// r, C)). The kernels fill one row (or part of one) into a small buffer that stays in L1 and
// multiply by it.
//
// With AVX2 one Philox call runs 8 counters (8 groups = 64 columns) side by side in a vector
// register, two calls interleaved so the multiplies of one hide the latency of the other. The four
// words of a group, stored little-endian, are its 8 uint16 values in column order, so a 4 x 8 word
// transpose gives the 64 columns' 16-bit values in order, and one unsigned 16-bit compare against
// T the keep masks. Without AVX2 the scalar definition of philox.h runs per group. Both give
// exactly the bits of fastformer/philox.py (AVX-512 CPUs run the AVX2 path).
#pragma once
#include <algorithm>
#include <cstdint>

#include "philox.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fastformer {
namespace dropout_detail {

#if defined(__AVX2__)

constexpr int64_t kBlock = 64;  // columns per 8-lane Philox call

// (hi, lo) 32-bit halves of m * b per 32-bit lane: even lanes, then odd lanes moved down.
inline void mulhilo8(__m256i m, __m256i b, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(m, b);
  const __m256i odd = _mm256_mul_epu32(m, _mm256_srli_epi64(b, 32));
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// 16-bit keep masks (0xFFFF: kept) of the U * 64 columns of groups n0 .. n0 + 8 U - 1:
// keep[4 u + k] holds groups 8 u + 2 k and 8 u + 2 k + 1, i.e. its 16 columns in order.
template <int U>
inline void keep_masks(uint64_t seed, uint64_t n0, uint32_t threshold, __m256i (&keep)[4 * U]) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i ma = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundA));
  const __m256i mb = _mm256_set1_epi32(static_cast<int>(kPhiloxRoundB));
  __m256i c0[U], c1[U], c2[U], c3[U];
  for (int u = 0; u < U; ++u) {
    const uint64_t base = n0 + 8 * static_cast<uint64_t>(u);
    const __m256i base_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base)));
    const __m256i base_hi = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(base >> 32)));
    c0[u] = _mm256_add_epi32(base_lo, lane);
    // unsigned c0 < base_lo (the low word wrapped) as all-ones lanes; subtracting -1 adds the carry
    const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(base_lo, sign), _mm256_xor_si256(c0[u], sign));
    c1[u] = _mm256_sub_epi32(base_hi, carry);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  {  // round 0: c2 = c3 = 0, so the B product vanishes
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i vk1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m256i hi_a, lo_a;
      mulhilo8(ma, c0[u], hi_a, lo_a);
      c0[u] = _mm256_xor_si256(c1[u], vk0);
      c1[u] = _mm256_setzero_si256();
      c2[u] = _mm256_xor_si256(hi_a, vk1);
      c3[u] = lo_a;
    }
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  for (int round = 1; round < 10; ++round) {
    const __m256i vk0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i vk1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int u = 0; u < U; ++u) {
      __m256i hi_b, lo_b, hi_a, lo_a;
      mulhilo8(mb, c2[u], hi_b, lo_b);
      mulhilo8(ma, c0[u], hi_a, lo_a);
      c0[u] = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1[u]), vk0);
      c2[u] = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3[u]), vk1);
      c1[u] = lo_b;
      c3[u] = lo_a;
    }
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  // kept iff u >= T (unsigned 16-bit): max(u, T) == u; the callers handle T = 0 and T = 65536
  const __m256i t16 = _mm256_set1_epi16(static_cast<short>(threshold));
  for (int u = 0; u < U; ++u) {
    // 4 x 8 transpose: lane l of c0..c3 are group l's words; gather each group's four words
    const __m256i t0 = _mm256_unpacklo_epi32(c0[u], c1[u]);  // g0: w0 w1, g1: w0 w1 | g4, g5
    const __m256i t1 = _mm256_unpackhi_epi32(c0[u], c1[u]);  // g2, g3 | g6, g7
    const __m256i t2 = _mm256_unpacklo_epi32(c2[u], c3[u]);  // g0: w2 w3, g1: w2 w3 | g4, g5
    const __m256i t3 = _mm256_unpackhi_epi32(c2[u], c3[u]);
    const __m256i g04 = _mm256_unpacklo_epi64(t0, t2);  // g0 | g4, four words each
    const __m256i g15 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i g26 = _mm256_unpacklo_epi64(t1, t3);
    const __m256i g37 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i x[4] = {_mm256_permute2x128_si256(g04, g15, 0x20),   // g0 | g1
                          _mm256_permute2x128_si256(g26, g37, 0x20),   // g2 | g3
                          _mm256_permute2x128_si256(g04, g15, 0x31),   // g4 | g5
                          _mm256_permute2x128_si256(g26, g37, 0x31)};  // g6 | g7
    for (int k = 0; k < 4; ++k) keep[4 * u + k] = _mm256_cmpeq_epi16(_mm256_max_epu16(x[k], t16), x[k]);
  }
}

// out[0, 16) = scale where the 16-bit lanes of keep are all ones, else 0.
inline void store16(float* out, __m256i keep, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(keep));
  const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(keep, 1));
  _mm256_storeu_ps(out, _mm256_and_ps(_mm256_castsi256_ps(lo), s));
  _mm256_storeu_ps(out + 8, _mm256_and_ps(_mm256_castsi256_ps(hi), s));
}

inline void store16(double* out, __m256i keep, double scale) {
  const __m256d s = _mm256_set1_pd(scale);
  const __m128i half[2] = {_mm256_castsi256_si128(keep), _mm256_extracti128_si256(keep, 1)};
  for (int h = 0; h < 2; ++h) {
    const __m256i a = _mm256_cvtepi16_epi64(half[h]);                     // 4 lanes
    const __m256i b = _mm256_cvtepi16_epi64(_mm_srli_si128(half[h], 8));  // the next 4
    _mm256_storeu_pd(out + 8 * h, _mm256_and_pd(_mm256_castsi256_pd(a), s));
    _mm256_storeu_pd(out + 8 * h + 4, _mm256_and_pd(_mm256_castsi256_pd(b), s));
  }
}

// out[0, 64 U) = the multipliers of the U * 64 columns of groups n0 .. n0 + 8 U - 1.
template <int U, typename A>
inline void write_blocks(A* out, uint64_t seed, uint64_t n0, uint32_t threshold, A scale) {
  __m256i keep[4 * U];
  keep_masks<U>(seed, n0, threshold, keep);
  for (int i = 0; i < 4 * U; ++i) store16(out + 16 * i, keep[i], scale);
}

#else

constexpr int64_t kBlock = kDropoutGroup;  // columns per scalar Philox call

// out[0, 8 U) = the multipliers of the 8 U columns of groups n0 .. n0 + U - 1.
template <int U, typename A>
inline void write_blocks(A* out, uint64_t seed, uint64_t n0, uint32_t threshold, A scale) {
  for (int u = 0; u < U; ++u) {
    const PhiloxWords w = philox4x32(seed, n0 + static_cast<uint64_t>(u));
    for (int64_t j = 0; j < kDropoutGroup; ++j) {
      out[kDropoutGroup * u + j] = group_random16(w, j) >= threshold ? scale : A(0);
    }
  }
}

#endif

}  // namespace dropout_detail

// out[k] = scale if column c0 + k of the row starting at counter row_counter is kept, else 0,
// for k in [0, n). Any c0 >= 0 and n; only out[0, n) is written.
template <typename A>
inline void dropout_scales(A* out, int64_t c0, int64_t n, uint64_t seed, uint64_t row_counter,
                           uint32_t threshold, A scale) {
  using dropout_detail::kBlock;
  using dropout_detail::write_blocks;
  if (n <= 0) return;
  if (threshold == 0 || threshold > 0xFFFFu) {  // every u >= 0; no u >= 65536
    std::fill(out, out + n, threshold == 0 ? scale : A(0));
    return;
  }
  constexpr uint64_t kGroups = kBlock / kDropoutGroup;  // counters per block
  const int64_t skip = c0 % kDropoutGroup;  // columns of the first group before c0
  const int64_t total = skip + n;           // columns from the first group's start
  uint64_t counter = row_counter + static_cast<uint64_t>(c0 / kDropoutGroup);
  int64_t k = 0;  // block start, in columns from the first group's start (out[k - skip])
  alignas(32) A tmp[kBlock];
  // a block only partly in [skip, total): through tmp, copying its columns [lo, hi)
  auto partial = [&](int64_t lo, int64_t hi) {
    write_blocks<1>(tmp, seed, counter, threshold, scale);
    std::copy(tmp + lo, tmp + hi, out + k + lo - skip);
  };
  if (skip != 0) {
    partial(skip, std::min(kBlock, total));
    k += kBlock;
    counter += kGroups;
  }
  for (; k + 2 * kBlock <= total; k += 2 * kBlock, counter += 2 * kGroups) {
    write_blocks<2>(out + k - skip, seed, counter, threshold, scale);
  }
  for (; k + kBlock <= total; k += kBlock, counter += kGroups) {
    write_blocks<1>(out + k - skip, seed, counter, threshold, scale);
  }
  if (k < total) partial(0, total - k);
}

}  // namespace fastformer
