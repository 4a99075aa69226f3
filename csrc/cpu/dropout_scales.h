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
// One vector Philox call runs several counters (groups of 8 columns) side by side, per ISA level
// (isa.h): AVX512 16 counters (128 columns), AVX2 8 (64 columns), DEFAULT the scalar definition
// of philox.h, one group a call. The four words of a group, stored little-endian, are its 8
// uint16 values in column order, so a 4 x 32-bit word transpose gives the columns' 16-bit values
// in order, and one unsigned 16-bit compare against T the keep masks. Every level gives exactly
// the bits of fastformer/philox.py (tests/test_dropout_fill.py checks each against it); these are
// the only vector Philox copies.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "philox.h"

#if defined(__AVX2__)  // the AVX512 level defines it too
#include <immintrin.h>
#endif

namespace fastformer {
namespace CPU_CAPABILITY {
namespace dropout_detail {

#if defined(__AVX512F__) && defined(__AVX512BW__)

constexpr int64_t kBlock = 128;  // columns per 16-lane Philox call
constexpr int64_t kMinFill = 64;  // fill() costs the same for n and round_up(n, kMinFill)

// The per-round keys, broadcast once per DropoutScales (the seed is the same for every group).
struct RoundKeys {
  __m512i k0[10], k1[10];
  explicit RoundKeys(uint64_t seed) {
    uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r, a += kPhiloxKeyA, b += kPhiloxKeyB) {
      k0[r] = _mm512_set1_epi32(static_cast<int>(a));
      k1[r] = _mm512_set1_epi32(static_cast<int>(b));
    }
  }
};

// The ten Philox rounds of the counters in the 64-bit lanes of n[0 .. kRegs): word t of lane l's
// counter ends in the low half of c[t][h]'s lane l (the high half is don't-care: _mm512_mul_epu32
// reads only the low halves and XOR is lane-wise, so one multiply gives both the high and the low
// word and no blends are needed); each three-way XOR is one vpternlog. The one AVX512 copy of the
// rounds: the v2 groups (keep_bits) and the v3 tiles (attention_detail::philox16) both call it.
template <int kRegs>
inline void philox_rounds(const RoundKeys& key, const __m512i (&n)[2], __m512i (&c)[4][2]) {
  const __m512i ma = _mm512_set1_epi64(kPhiloxRoundA);
  const __m512i mb = _mm512_set1_epi64(kPhiloxRoundB);
  for (int h = 0; h < kRegs; ++h) {  // round 0: c0 = lo32(n), c1 = hi32(n), c2 = c3 = 0: no B product
    const __m512i pa = _mm512_mul_epu32(n[h], ma);
    c[0][h] = _mm512_xor_si512(_mm512_srli_epi64(n[h], 32), key.k0[0]);
    c[1][h] = _mm512_setzero_si512();
    c[2][h] = _mm512_xor_si512(_mm512_srli_epi64(pa, 32), key.k1[0]);
    c[3][h] = pa;
  }
  for (int round = 1; round < 10; ++round) {
    for (int h = 0; h < kRegs; ++h) {
      const __m512i pb = _mm512_mul_epu32(c[2][h], mb);
      const __m512i pa = _mm512_mul_epu32(c[0][h], ma);
      // 0x96: a ^ b ^ c
      c[0][h] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(pb, 32), c[1][h], key.k0[round], 0x96);
      c[2][h] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(pa, 32), c[3][h], key.k1[round], 0x96);
      c[1][h] = pb;
      c[3][h] = pa;
    }
  }
}

// The keep bits (1: kept) of the 128 columns of groups n0 .. n0 + 15: bit j of keep[h] is column
// 64 h + j. kHalves = 1 runs only the first register's groups (columns 0 .. 63; keep[1] = 0): half
// the Philox work where a row needs no more (attention rows of up to 64 keys).
//
// Register h runs groups 8 h .. 8 h + 7 (philox_rounds). The lanes hold groups 0, 4, 1, 5, 2, 6,
// 3, 7 (+ 8 h) because a 64-bit unpack takes lanes 2 j and 2 j + 1 into 128-bit chunk j: the
// unpacks then give whole groups already in column order, and no shuffle crosses chunks.
template <int kHalves = 2>
inline void keep_bits(const RoundKeys& key, uint64_t n0, uint32_t threshold, uint64_t (&keep)[2]) {
  const __m512i base = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(n0)),
                                        _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7));
  // counters as 64-bit integers: the low word is lo32(n), the high word hi32(n), carry included
  const __m512i n[2] = {base, _mm512_add_epi64(base, _mm512_set1_epi64(8))};
  __m512i c[4][2];
  philox_rounds<kHalves>(key, n, c);
  // kept iff u >= T (unsigned 16-bit); DropoutScales::fill handles T = 0, 65536
  const __m512i t16 = _mm512_set1_epi16(static_cast<short>(threshold));
  if (kHalves == 1) keep[1] = 0;
  for (int h = 0; h < kHalves; ++h) {
    // each lane's (w0, w1) and (w2, w3): the low words of c1 / c3 moved into the odd dwords
    const __m512i w01 = _mm512_mask_shuffle_epi32(c[0][h], 0xAAAA, c[1][h], _MM_PERM_CDAB);
    const __m512i w23 = _mm512_mask_shuffle_epi32(c[2][h], 0xAAAA, c[3][h], _MM_PERM_CDAB);
    // groups 8 h .. 8 h + 3, then 8 h + 4 .. 8 h + 7
    const uint64_t first = _mm512_cmpge_epu16_mask(_mm512_unpacklo_epi64(w01, w23), t16);
    const uint64_t second = _mm512_cmpge_epu16_mask(_mm512_unpackhi_epi64(w01, w23), t16);
    keep[h] = first | second << 32;
  }
}

// out[0, len) = scale where the column's keep bit is set, else 0 (len <= 128): the bits select
// the lanes directly; the last vector's store is masked, so nothing past out[len) is touched.
inline void store(float* out, const uint64_t (&keep)[2], float scale, int64_t len) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; 16 * i < len; ++i) {
    const __m512 v = _mm512_maskz_mov_ps(static_cast<__mmask16>(keep[i / 4] >> (16 * (i % 4))), s);
    if (16 * i + 16 <= len) {
      _mm512_storeu_ps(out + 16 * i, v);
    } else {
      _mm512_mask_storeu_ps(out + 16 * i, static_cast<__mmask16>((1u << (len - 16 * i)) - 1), v);
    }
  }
}

inline void store(double* out, const uint64_t (&keep)[2], double scale, int64_t len) {
  const __m512d s = _mm512_set1_pd(scale);
  for (int64_t i = 0; 8 * i < len; ++i) {
    const __m512d v = _mm512_maskz_mov_pd(static_cast<__mmask8>(keep[i / 8] >> (8 * (i % 8))), s);
    if (8 * i + 8 <= len) {
      _mm512_storeu_pd(out + 8 * i, v);
    } else {
      _mm512_mask_storeu_pd(out + 8 * i, static_cast<__mmask8>((1u << (len - 8 * i)) - 1), v);
    }
  }
}

using Keys = RoundKeys;

// out[0, 128) = the multipliers of the 128 columns of groups n0 .. n0 + 15.
template <typename A>
inline void write_block(A* out, const Keys& key, uint64_t n0, uint32_t threshold, A scale) {
  uint64_t keep[2];
  keep_bits(key, n0, threshold, keep);
  store(out, keep, scale, kBlock);
}

// out[0, hi - lo) = the multipliers of columns [lo, hi) of that block (lo < 64): its bits shifted
// down by lo, then a shorter store; no buffer. Half the Philox calls when hi <= 64.
template <typename A>
inline void write_part(A* out, const Keys& key, uint64_t n0, uint32_t threshold, A scale, int64_t lo,
                       int64_t hi) {
  uint64_t keep[2];
  if (hi <= 64) {
    keep_bits<1>(key, n0, threshold, keep);
  } else {
    keep_bits(key, n0, threshold, keep);
  }
  if (lo > 0) {
    keep[0] = keep[0] >> lo | keep[1] << (64 - lo);
    keep[1] >>= lo;
  }
  store(out, keep, scale, hi - lo);
}

#elif defined(__AVX2__)

constexpr int64_t kBlock = 64;  // columns per 8-lane Philox call
constexpr int64_t kMinFill = kBlock;

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

// The ten Philox rounds of the counters in the 64-bit lanes of n[0] and n[1]: word t of lane l's
// counter ends in the low half of c[t][h]'s lane l (the high half is don't-care: _mm256_mul_epu32
// reads only the low halves and XOR is lane-wise, so one multiply gives both the high and the low
// word and no blends are needed), four independent multiply chains a round. The one AVX2 copy of
// the rounds: the v2 groups (keep_masks) and the v3 tiles (attention_detail::philox8) both call it.
inline void philox_rounds(const RoundKeys& key, const __m256i (&n)[2], __m256i (&c)[4][2]) {
  const __m256i ma = _mm256_set1_epi64x(kPhiloxRoundA);
  const __m256i mb = _mm256_set1_epi64x(kPhiloxRoundB);
  for (int h = 0; h < 2; ++h) {  // round 0: c0 = lo32(n), c1 = hi32(n), c2 = c3 = 0: no B product
    const __m256i pa = _mm256_mul_epu32(n[h], ma);
    c[0][h] = _mm256_xor_si256(_mm256_srli_epi64(n[h], 32), key.k0[0]);
    c[1][h] = _mm256_setzero_si256();
    c[2][h] = _mm256_xor_si256(_mm256_srli_epi64(pa, 32), key.k1[0]);
    c[3][h] = pa;
  }
  for (int round = 1; round < 10; ++round) {
    for (int h = 0; h < 2; ++h) {
      const __m256i pb = _mm256_mul_epu32(c[2][h], mb);
      const __m256i pa = _mm256_mul_epu32(c[0][h], ma);
      c[0][h] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb, 32), c[1][h]), key.k0[round]);
      c[2][h] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa, 32), c[3][h]), key.k1[round]);
      c[1][h] = pb;
      c[3][h] = pa;
    }
  }
}

// 16-bit keep masks (0xFFFF: kept) of the 64 columns of groups n0 .. n0 + 7: keep[k] holds groups
// 2 k and 2 k + 1, i.e. columns 16 k .. 16 k + 15 in order. Register "e" runs groups 0, 2, 4, 6
// and "o" groups 1, 3, 5, 7 (philox_rounds).
inline void keep_masks(const RoundKeys& key, uint64_t n0, uint32_t threshold, __m256i (&keep)[4]) {
  const __m256i base = _mm256_set1_epi64x(static_cast<long long>(n0));
  // counters as 64-bit integers: the low word is lo32(n), the high word hi32(n), carry included
  const __m256i n[2] = {_mm256_add_epi64(base, _mm256_setr_epi64x(0, 2, 4, 6)),
                        _mm256_add_epi64(base, _mm256_setr_epi64x(1, 3, 5, 7))};
  __m256i c[4][2];
  philox_rounds(key, n, c);
  // each group's four words side by side, in column order: (w0, w1) and (w2, w3) pairs per
  // 64-bit lane, then whole groups per 128-bit half
  __m256i g[2][2];  // g[h][0]: groups (h, h + 4), g[h][1]: groups (h + 2, h + 6) of "e" (h = 0) / "o"
  for (int h = 0; h < 2; ++h) {
    const __m256i w01 = _mm256_blend_epi32(c[0][h], _mm256_slli_epi64(c[1][h], 32), 0xAA);
    const __m256i w23 = _mm256_blend_epi32(c[2][h], _mm256_slli_epi64(c[3][h], 32), 0xAA);
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
constexpr int64_t kMinFill = kBlock;

using Keys = uint64_t;  // the seed

// out[0, 8) = the multipliers of the 8 columns of group n0.
template <typename A>
inline void write_block(A* out, Keys seed, uint64_t n0, uint32_t threshold, A scale) {
  const PhiloxWords w = philox4x32(seed, n0);
  for (int64_t j = 0; j < kDropoutGroup; ++j) out[j] = group_random16(w, j) >= threshold ? scale : A(0);
}

#endif

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
// out[0, hi - lo) = the multipliers of columns [lo, hi) of the block of groups n0 ...: the whole
// block into a buffer, then the copy.
template <typename A>
inline void write_part(A* out, const Keys& key, uint64_t n0, uint32_t threshold, A scale, int64_t lo,
                       int64_t hi) {
  alignas(32) A tmp[kBlock];
  write_block(tmp, key, n0, threshold, scale);
  std::copy(tmp + lo, tmp + hi, out);
}
#endif

}  // namespace dropout_detail

// The dropout of one op call: seed, threshold T and the kept value (1 / (1 - p), or 1 where the
// kernel scales later). Built once per thread (the vector paths broadcast the ten round keys then),
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
    if (n <= 0) return;
    if (threshold_ == 0 || threshold_ > 0xFFFFu) {  // every u >= 0; no u >= 65536
      std::fill(out, out + n, threshold_ == 0 ? scale_ : A(0));
      return;
    }
    constexpr uint64_t kGroups = kBlock / kDropoutGroup;  // counters per block
    uint64_t counter = row_counter + static_cast<uint64_t>(c0 / kDropoutGroup);
    int64_t lo = c0 % kDropoutGroup;  // columns of the first block before c0
    // out[k, k + m) = columns [lo, lo + m) of the block at counter: whole blocks but for the
    // first (lo > 0) and the last
    for (int64_t k = 0, m; k < n; k += m, counter += kGroups, lo = 0) {
      m = std::min(kBlock - lo, n - k);
      if (m == kBlock) {
        dropout_detail::write_block(out + k, key_, counter, threshold_, scale_);
      } else {
        dropout_detail::write_part(out + k, key_, counter, threshold_, scale_, lo, lo + m);
      }
    }
  }

 private:
  dropout_detail::Keys key_;
  uint32_t threshold_;
  A scale_;
};


// ---------------------------------------------------------------- attention's dropout (v3)
// The tiles of philox.h's attention section, vectorised: tile_keep(keys, n0, T8, rows, stride)
// writes rows[r * stride] = the 32 keep bits of row r of the 16 x 32 tile whose first counter is
// n0 (attention_tile_keep's values). AVX512: two batches of 16 lanes, AVX2: four of 8, DEFAULT:
// the scalar definition. Each batch's four words are regrouped so that one 128-bit chunk holds one
// n8 tile's word of lanes 4 a .. 4 a + 3 (rows a and 8 + a), a byte shuffle puts each row's 8
// bytes of that n8 tile together, a 64-bit permute each row's 32 bytes in column order, and one
// unsigned byte compare against T8 gives two rows' masks.
namespace attention_detail {

#if defined(__AVX512F__) && defined(__AVX512BW__)

// The four words of counters n0 .. n0 + 15, dword k of w[t] = word t of counter n0 + k.
inline void philox16(const dropout_detail::RoundKeys& key, uint64_t n0, __m512i (&w)[4]) {
  const __m512i base = _mm512_set1_epi64(static_cast<long long>(n0));
  // even counters in register 0, odd in register 1; each word in the low half of a 64-bit lane
  const __m512i n[2] = {_mm512_add_epi64(base, _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14)),
                        _mm512_add_epi64(base, _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15))};
  __m512i c[4][2];
  dropout_detail::philox_rounds<2>(key, n, c);
  for (int t = 0; t < 4; ++t) w[t] = _mm512_mask_blend_epi32(0xAAAA, c[t][0], _mm512_slli_epi64(c[t][1], 32));
}

inline void tile_keep(const dropout_detail::RoundKeys& key, uint64_t n0, uint32_t threshold, uint32_t* rows,
                      int64_t stride) {
  const __m512i t8 = _mm512_set1_epi8(static_cast<char>(threshold));
  // per 128-bit chunk: the bytes of rows a (bytes 0, 1 of each dword) and 8 + a (bytes 2, 3)
  const __m512i split = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  for (int batch = 0; batch < 2; ++batch) {  // lanes 16 batch .. 16 batch + 15: a = 4 batch + chunk
    __m512i w[4];
    philox16(key, n0 + 16 * batch, w);
    // x[a'] chunk t = w[t] chunk a': a 4 x 4 transpose of 128-bit chunks
    const __m512i lo01 = _mm512_shuffle_i32x4(w[0], w[1], 0x44), hi01 = _mm512_shuffle_i32x4(w[0], w[1], 0xEE);
    const __m512i lo23 = _mm512_shuffle_i32x4(w[2], w[3], 0x44), hi23 = _mm512_shuffle_i32x4(w[2], w[3], 0xEE);
    const __m512i x[4] = {_mm512_shuffle_i32x4(lo01, lo23, 0x88), _mm512_shuffle_i32x4(lo01, lo23, 0xDD),
                          _mm512_shuffle_i32x4(hi01, hi23, 0x88), _mm512_shuffle_i32x4(hi01, hi23, 0xDD)};
    for (int k = 0; k < 4; ++k) {
      const __m512i y = _mm512_permutexvar_epi64(order, _mm512_shuffle_epi8(x[k], split));
      const uint64_t m = _mm512_cmpge_epu8_mask(y, t8);  // low half row a, high half row 8 + a
      const int a = 4 * batch + k;
      rows[a * stride] = static_cast<uint32_t>(m);
      rows[(8 + a) * stride] = static_cast<uint32_t>(m >> 32);
    }
  }
}

#elif defined(__AVX2__)

// The four words of counters n0 .. n0 + 7, dword k of w[t] = word t of counter n0 + k.
inline void philox8(const dropout_detail::RoundKeys& key, uint64_t n0, __m256i (&w)[4]) {
  const __m256i base = _mm256_set1_epi64x(static_cast<long long>(n0));
  const __m256i n[2] = {_mm256_add_epi64(base, _mm256_setr_epi64x(0, 2, 4, 6)),
                        _mm256_add_epi64(base, _mm256_setr_epi64x(1, 3, 5, 7))};
  __m256i c[4][2];
  dropout_detail::philox_rounds(key, n, c);
  for (int t = 0; t < 4; ++t) w[t] = _mm256_blend_epi32(c[t][0], _mm256_slli_epi64(c[t][1], 32), 0xAA);
}

inline void tile_keep(const dropout_detail::RoundKeys& key, uint64_t n0, uint32_t threshold, uint32_t* rows,
                      int64_t stride) {
  const __m256i t8 = _mm256_set1_epi8(static_cast<char>(threshold));
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  // kept bytes of y as a 32-bit mask (x >= T8 unsigned: max(x, T8) == x)
  auto keep = [&](__m256i y) {
    y = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(y, split), 0xD8);  // qwords 0, 2, 1, 3
    return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(y, t8), y)));
  };
  for (int batch = 0; batch < 4; ++batch) {  // lanes 8 batch .. 8 batch + 7: a = 2 batch + chunk
    __m256i w[4];
    philox8(key, n0 + 8 * batch, w);
    for (int k = 0; k < 2; ++k) {
      const int sel = k == 0 ? 0x20 : 0x31;
      // n8 tiles 0, 1 and 2, 3: low 16 bits row a, high 16 bits row 8 + a
      const uint32_t m01 = keep(_mm256_permute2x128_si256(w[0], w[1], sel));
      const uint32_t m23 = keep(_mm256_permute2x128_si256(w[2], w[3], sel));
      const int a = 2 * batch + k;
      rows[a * stride] = (m01 & 0xFFFFu) | m23 << 16;
      rows[(8 + a) * stride] = m01 >> 16 | (m23 & 0xFFFF0000u);
    }
  }
}

#else

inline void tile_keep(uint64_t seed, uint64_t n0, uint32_t threshold, uint32_t* rows, int64_t stride) {
  attention_tile_keep(seed, n0, threshold, rows, stride);
}

#endif

// out[0, V) = value where bit k of bits is set, else 0 (V = Vectorized<A>::size()).
template <typename A>
inline void expand(A* out, uint32_t bits, A value) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    _mm512_storeu_ps(out, _mm512_maskz_mov_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(value)));
  } else {
    _mm512_storeu_pd(out, _mm512_maskz_mov_pd(static_cast<__mmask8>(bits), _mm512_set1_pd(value)));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<A, float>) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel);
    _mm256_storeu_ps(out, _mm256_and_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(value)));
  } else {
    const __m256i sel = _mm256_setr_epi64x(1, 2, 4, 8);
    const __m256i m = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(bits), sel), sel);
    _mm256_storeu_pd(out, _mm256_and_pd(_mm256_castsi256_pd(m), _mm256_set1_pd(value)));
  }
#else
  constexpr int kLanes = 16 / sizeof(A);  // SSE width, as at::vec's DEFAULT Vectorized
  for (int k = 0; k < kLanes; ++k) out[k] = (bits >> k) & 1u ? value : A(0);
#endif
}

#if defined(__AVX512F__)
template <typename A>
constexpr int64_t kExpandLanes = 64 / sizeof(A);
#elif defined(__AVX2__)
template <typename A>
constexpr int64_t kExpandLanes = 32 / sizeof(A);
#else
template <typename A>
constexpr int64_t kExpandLanes = 16 / sizeof(A);
#endif

}  // namespace attention_detail

// Attention's dropout multipliers for one thread: block() makes the keep bits of a block of
// queries [i0, i0 + mq) x keys [j0, j0 + nk) of one head-row (whole tiles: the 16-row groups and
// 32-column tiles the block touches; i0, j0 need not be aligned), row() expands a row of them
// into multipliers. Consecutive blocks of the same rows sharing a tile (a key block starting
// inside a tile, after key padding) take it from the previous block instead of making it again.
// save() and load() keep a block's bits in a head's bit map for a later block of other bounds
// (the split backward's second pass): row i of the map holds key 32 t + e of query i as bit e of
// word i ld + t, and a zero word after the head's last tile column.
template <typename A>
class AttentionDropout {
 public:
  static constexpr int64_t kMaxTiles = 16;  // 32-column tiles a block may touch (+ a zero word)

  // Sq, Sk: the tile grid's (padded) lengths; max_rows, max_cols: the largest block.
  AttentionDropout(const DropoutParams& dp, uint64_t seed, uint64_t offset, int64_t Sq, int64_t Sk, A value,
                   int64_t max_rows, int64_t max_cols)
      : key_(seed),
        threshold_(dp.threshold),
        value_(value),
        offset_(offset),
        QB_((Sq + kAttnDropRows - 1) / kAttnDropRows),
        KB_((Sk + kAttnDropCols - 1) / kAttnDropCols),
        words_((max_cols + kAttnDropCols - 1) / kAttnDropCols + 2),
        bits_(((max_rows + 2 * kAttnDropRows - 2) / kAttnDropRows * kAttnDropRows) * words_) {}

  void block(int64_t bh, int64_t i0, int64_t mq, int64_t j0, int64_t nk) {
    const int64_t qb0 = i0 / kAttnDropRows, qb1 = (i0 + mq + kAttnDropRows - 1) / kAttnDropRows;
    const int64_t kb0 = j0 / kAttnDropCols, kb1 = (j0 + nk + kAttnDropCols - 1) / kAttnDropCols;
    int64_t kb = kb0;  // the first tile column to make
    if (bh == bh_ && qb0 == qb0_ && qb1 == qb1_ && kb0 == kb1_ - 1 && kb0 > kb0_) {
      // the previous block's last tile column is this block's first
      for (int64_t r = 0; r < (qb1 - qb0) * kAttnDropRows; ++r) bits_[r * words_] = bits_[r * words_ + kb0 - kb0_];
      ++kb;
    }
    bh_ = bh, qb0_ = qb0, qb1_ = qb1, kb0_ = kb0, kb1_ = kb1, r0_ = i0 - qb0 * kAttnDropRows;
    shift_ = j0 - kb0 * kAttnDropCols;
    rows_ = bits_.data() + r0_ * words_, ld_ = words_;
    for (int64_t qb = qb0; qb < qb1; ++qb) {
      uint32_t* rows = bits_.data() + (qb - qb0) * kAttnDropRows * words_;
      for (int64_t t = kb; t < kb1; ++t) {
        if (threshold_ >= 256) {  // nothing kept
          for (int64_t r = 0; r < kAttnDropRows; ++r) rows[r * words_ + t - kb0] = 0;
          continue;
        }
        attention_detail::tile_keep(key_, attention_tile_counter(offset_, bh, qb, t, QB_, KB_), threshold_,
                                    rows + t - kb0, words_);
      }
      for (int64_t r = 0; r < kAttnDropRows; ++r) rows[r * words_ + kb1 - kb0] = 0;  // past the block
    }
  }

  // The last block()'s bits of its rows r < mq (queries i0 + r) into map: its tile columns' words
  // of rows i0 .. i0 + mq - 1 (each tile column is wholly the block's).
  void save(uint32_t* map, int64_t ld, int64_t mq) const {
    const int64_t i0 = qb0_ * kAttnDropRows + r0_;
    for (int64_t r = 0; r < mq; ++r) {
      std::copy(rows_ + r * ld_, rows_ + r * ld_ + (kb1_ - kb0_), map + (i0 + r) * ld + kb0_);
    }
  }

  // The block of queries i0 .. and keys j0 .. taken from map (save()'s): row() then reads it there.
  void load(const uint32_t* map, int64_t ld, int64_t i0, int64_t j0) {
    bh_ = -1;  // bits_ no longer holds the last block (block()'s reuse)
    rows_ = map + i0 * ld + j0 / kAttnDropCols, ld_ = ld;
    shift_ = j0 % kAttnDropCols;
  }

  // out[0, npad) = the multipliers of row r of the block (query i0 + r) against keys j0 .., value
  // or 0; 0 past column nk (npad: a multiple of the vector width).
  void row(int64_t r, int64_t nk, int64_t npad, A* out) const {
    constexpr int64_t V = attention_detail::kExpandLanes<A>;
    const uint32_t* w = rows_ + r * ld_;
    for (int64_t c = 0; c < npad; c += V) {
      uint32_t bits = 0;
      if (c < nk) {  // then bit / 32 + 1 is at most the zero word after the block's tiles
        const int64_t bit = shift_ + c;
        const uint64_t window = w[bit / 32] | static_cast<uint64_t>(w[bit / 32 + 1]) << 32;
        bits = static_cast<uint32_t>(window >> (bit % 32));
        if (c + V > nk) bits &= (1u << (nk - c)) - 1;
      }
      attention_detail::expand(out + c, bits, value_);
    }
  }

 private:
  dropout_detail::Keys key_;
  uint32_t threshold_;
  A value_;
  uint64_t offset_;
  int64_t QB_, KB_, words_;
  std::vector<uint32_t> bits_;  // rows of the block's 16-row groups, words_ 32-bit words each
  int64_t bh_ = -1, qb0_ = 0, qb1_ = 0, kb0_ = 0, kb1_ = 0, r0_ = 0, shift_ = 0;
  const uint32_t* rows_ = nullptr;  // row() reads row r at rows_ + r ld_: bits_ or a saved map
  int64_t ld_ = 0;
};

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
