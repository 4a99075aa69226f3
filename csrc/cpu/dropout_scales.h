// Dropout multipliers from the shared Philox v2 stream (philox.h), vectorised: the one place the
// CPU kernels draw dropout bits.
//
// DropoutScales<A>(seed, threshold, scale).fill(out, c0, n, row_counter) writes, for k in [0, n),
//   out[k] = scale  if column c0 + k of the row whose first counter is row_counter is kept,
//          = 0      otherwise,
// i.e. the multiplier dropout applies to that element (row_counter = dropout_row_counter(offset,
// r, C)). The kernels fill one row (or part of one) into a small buffer that stays in L1 and
// multiply by it.
//
// With AVX2 one vector Philox call runs 8 counters (8 groups = 64 columns) side by side. The four
// words of a group, stored little-endian, are its 8 uint16 values in column order, so a 4 x 8 word
// transpose gives the 64 columns' 16-bit values in order, and one unsigned 16-bit compare against
// T the keep masks. Without AVX2 (the DEFAULT level of isa.h) the scalar definition of philox.h
// runs per group. Both give exactly the bits of fastformer/philox.py (the AVX512 level runs the
// AVX2 path; there is no separate AVX-512 code to keep in step). This is the only vector Philox.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <algorithm>
#include <cstdint>

#include "philox.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fastformer {
namespace CPU_CAPABILITY {
namespace dropout_detail {

#if defined(__AVX2__)

constexpr int64_t kBlock = 64;  // columns per 8-lane Philox call

// The per-round keys, broadcast once per DropoutScales (the seed is the same for every group).
struct RoundKeys {
  __m256i k0[10], k1[10];
  explicit RoundKeys(uint64_t seed) {
    uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r, a += kPhiloxKeyA, b += kPhiloxKeyB) {
      k0[r] = _mm256_set1_epi32(static_cast<int>(a));
      k1[r] = _mm256_set1_epi32(static_cast<int>(b));
    }
  }
};

// 16-bit keep masks (0xFFFF: kept) of the 64 columns of groups n0 .. n0 + 7: keep[k] holds groups
// 2 k and 2 k + 1, i.e. columns 16 k .. 16 k + 15 in order.
//
// The Philox state lives in 64-bit lanes, each word in the low half (the high half is don't-care:
// _mm256_mul_epu32 reads only the low halves and XOR is lane-wise), so one multiply gives both the
// high and the low word and no blends are needed: register "e" runs groups 0, 2, 4, 6 and "o"
// groups 1, 3, 5, 7, four independent multiply chains a round.
inline void keep_masks(const RoundKeys& key, uint64_t n0, uint32_t threshold, __m256i (&keep)[4]) {
  const __m256i ma = _mm256_set1_epi64x(kPhiloxRoundA);
  const __m256i mb = _mm256_set1_epi64x(kPhiloxRoundB);
  const __m256i base = _mm256_set1_epi64x(static_cast<long long>(n0));
  // counters as 64-bit integers: the low word is lo32(n), the high word hi32(n), carry included
  const __m256i ne = _mm256_add_epi64(base, _mm256_setr_epi64x(0, 2, 4, 6));
  const __m256i no = _mm256_add_epi64(base, _mm256_setr_epi64x(1, 3, 5, 7));
  __m256i c0[2], c1[2], c2[2], c3[2];
  // round 0: c0 = lo32(n), c1 = hi32(n), c2 = c3 = 0, so the B product vanishes
  {
    const __m256i n[2] = {ne, no};
    for (int h = 0; h < 2; ++h) {
      const __m256i pa = _mm256_mul_epu32(n[h], ma);
      c0[h] = _mm256_xor_si256(_mm256_srli_epi64(n[h], 32), key.k0[0]);
      c1[h] = _mm256_setzero_si256();
      c2[h] = _mm256_xor_si256(_mm256_srli_epi64(pa, 32), key.k1[0]);
      c3[h] = pa;
    }
  }
  for (int round = 1; round < 10; ++round) {
    for (int h = 0; h < 2; ++h) {
      const __m256i pb = _mm256_mul_epu32(c2[h], mb);
      const __m256i pa = _mm256_mul_epu32(c0[h], ma);
      c0[h] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb, 32), c1[h]), key.k0[round]);
      c2[h] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa, 32), c3[h]), key.k1[round]);
      c1[h] = pb;
      c3[h] = pa;
    }
  }
  // each group's four words side by side, in column order: (w0, w1) and (w2, w3) pairs per
  // 64-bit lane, then whole groups per 128-bit half
  __m256i g[2][2];  // g[h][0]: groups (h, h + 4), g[h][1]: groups (h + 2, h + 6) of "e" (h = 0) / "o"
  for (int h = 0; h < 2; ++h) {
    const __m256i w01 = _mm256_blend_epi32(c0[h], _mm256_slli_epi64(c1[h], 32), 0xAA);
    const __m256i w23 = _mm256_blend_epi32(c2[h], _mm256_slli_epi64(c3[h], 32), 0xAA);
    g[h][0] = _mm256_unpacklo_epi64(w01, w23);  // lanes 0 and 2 of the register
    g[h][1] = _mm256_unpackhi_epi64(w01, w23);  // lanes 1 and 3
  }
  const __m256i x[4] = {_mm256_permute2x128_si256(g[0][0], g[1][0], 0x20),   // groups 0 | 1
                        _mm256_permute2x128_si256(g[0][1], g[1][1], 0x20),   // groups 2 | 3
                        _mm256_permute2x128_si256(g[0][0], g[1][0], 0x31),   // groups 4 | 5
                        _mm256_permute2x128_si256(g[0][1], g[1][1], 0x31)};  // groups 6 | 7
  // kept iff u >= T (unsigned 16-bit): max(u, T) == u; DropoutScales::fill handles T = 0, 65536
  const __m256i t16 = _mm256_set1_epi16(static_cast<short>(threshold));
  for (int k = 0; k < 4; ++k) keep[k] = _mm256_cmpeq_epi16(_mm256_max_epu16(x[k], t16), x[k]);
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

using Keys = RoundKeys;

// out[0, 64) = the multipliers of the 64 columns of groups n0 .. n0 + 7.
template <typename A>
inline void write_block(A* out, const Keys& key, uint64_t n0, uint32_t threshold, A scale) {
  __m256i keep[4];
  keep_masks(key, n0, threshold, keep);
  for (int i = 0; i < 4; ++i) store16(out + 16 * i, keep[i], scale);
}

#else

constexpr int64_t kBlock = kDropoutGroup;  // columns per scalar Philox call

using Keys = uint64_t;  // the seed

// out[0, 8) = the multipliers of the 8 columns of group n0.
template <typename A>
inline void write_block(A* out, Keys seed, uint64_t n0, uint32_t threshold, A scale) {
  const PhiloxWords w = philox4x32(seed, n0);
  for (int64_t j = 0; j < kDropoutGroup; ++j) out[j] = group_random16(w, j) >= threshold ? scale : A(0);
}

#endif

}  // namespace dropout_detail

// The dropout of one op call: seed, threshold T and the kept value (1 / (1 - p), or 1 where the
// kernel scales later). Built once per thread (the AVX2 path broadcasts the ten round keys then),
// then fill() once per row or piece of a row.
template <typename A>
class DropoutScales {
 public:
  DropoutScales(uint64_t seed, uint32_t threshold, A scale)
      : key_(seed), threshold_(threshold), scale_(scale) {}

  // out[k] = scale if column c0 + k of the row whose first counter is row_counter is kept, else 0,
  // for k in [0, n). Any c0 >= 0 and n; only out[0, n) is written.
  void fill(A* out, int64_t c0, int64_t n, uint64_t row_counter) const {
    using dropout_detail::kBlock;
    using dropout_detail::write_block;
    if (n <= 0) return;
    if (threshold_ == 0 || threshold_ > 0xFFFFu) {  // every u >= 0; no u >= 65536
      std::fill(out, out + n, threshold_ == 0 ? scale_ : A(0));
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
      write_block(tmp, key_, counter, threshold_, scale_);
      std::copy(tmp + lo, tmp + hi, out + k + lo - skip);
    };
    if (skip != 0) {
      partial(skip, std::min(kBlock, total));
      k += kBlock;
      counter += kGroups;
    }
    for (; k + kBlock <= total; k += kBlock, counter += kGroups) {
      write_block(out + k - skip, key_, counter, threshold_, scale_);
    }
    if (k < total) partial(0, total - k);
  }

 private:
  dropout_detail::Keys key_;
  uint32_t threshold_;
  A scale_;
};

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
