// Philox 4x32-10, the counter-based RNG every fastformer backend shares for dropout ("Philox v2",
// defined in fastformer/philox.py).
//
// An op's dropout tensor is viewed as rows of C columns (its last dimension). Row r is split into
// G = ceil(C / 8) groups of eight columns; group g makes ONE Philox call with counter
// (lo32(n), hi32(n), 0, 0), n = offset + r * G + g, and key (lo32(seed), hi32(seed)) -- the words
// triton.language.randint4x(seed, n) returns. Column 8 g + j takes the 16 bits
// u = (w[j / 2] >> (16 * (j % 2))) & 0xFFFF, so the four words stored little-endian are the group's
// eight uint16 values in column order. The element is kept iff u >= T, T = round(p * 2^16) (half up).
// This file is the scalar definition (the constants are in csrc/philox_constants.h);
// dropout_scales.h is the vectorised one the kernels use. The functions are static: this header
// is compiled into every ISA level's kernels (isa.h) and into baseline code, and each must keep
// its own copy (one shared inline copy would be taken from whichever object the linker saw first).
#pragma once
#include <algorithm>
#include <cstdint>

#include "../philox_constants.h"

namespace fastformer {

struct PhiloxWords {
  uint32_t w[4];
};

// The four output words of Philox-4x32-10 for counter (lo32(counter), hi32(counter), 0, 0).
static inline PhiloxWords philox4x32(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t pb = static_cast<uint64_t>(kPhiloxRoundB) * c2;
    const uint64_t pa = static_cast<uint64_t>(kPhiloxRoundA) * c0;
    const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(pb);
    c3 = static_cast<uint32_t>(pa);
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  return {{c0, c1, c2, c3}};
}

// The first word (the philox_bits op and triton.language.randint).
static inline uint32_t philox_bits(uint64_t seed, uint64_t counter) {
  return philox4x32(seed, counter).w[0];
}

// Philox calls per row of C columns.
static inline int64_t dropout_groups(int64_t C) { return (C + kDropoutGroup - 1) / kDropoutGroup; }

// The first counter of row r of a dropout tensor with C columns: offset + r * G.
static inline uint64_t dropout_row_counter(uint64_t offset, int64_t row, int64_t C) {
  return offset + static_cast<uint64_t>(row) * static_cast<uint64_t>(dropout_groups(C));
}

// The 16-bit keep threshold T = round(p * 2^16), half up, in [0, 65536]: kept iff u >= T
// (T = 65536 keeps nothing). p * 2^16 is exact, so this equals fastformer.philox.drop_threshold.
static inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(p * 65536.0 + 0.5); }

// What a kernel needs of dropout probability p: whether it drops at all, T and the kept value
// 1 / (1 - p) (double; the kernels cast it to their accumulation type).
struct DropoutParams {
  bool drop;
  uint32_t threshold;
  double scale;
};

static inline DropoutParams dropout_params(double p) {
  return {p > 0.0, dropout_threshold(p), 1.0 / (1.0 - p)};
}

// The 16 random bits of column j (0..7) of a group.
static inline uint32_t group_random16(const PhiloxWords& w, int64_t j) {
  return (w.w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
}

// The 16 random bits of column c of the row whose first counter is row_counter.
static inline uint32_t dropout_random16(uint64_t seed, uint64_t row_counter, int64_t c) {
  const PhiloxWords w = philox4x32(seed, row_counter + static_cast<uint64_t>(c / kDropoutGroup));
  return group_random16(w, c % kDropoutGroup);
}

static inline bool dropout_keep(uint64_t seed, uint64_t row_counter, int64_t c, uint32_t threshold) {
  return dropout_random16(seed, row_counter, c) >= threshold;
}


// ---------------------------------------------------------------- attention's dropout (v3)
// Defined in fastformer/philox.py (attention_random8; csrc/cuda/philox.cuh has the CUDA copy):
// the probabilities of head-row bh = b H + h (padded (B, H, Sq, Sk); varlen: the padded op's
// (B, H, max_seqlen_q, max_seqlen_k)) in 16 x 32 tiles, tile (bh, qb, kb) of QB = ceil(Sq / 16) x
// KB = ceil(Sk / 32) making 32 Philox calls (lanes l), counter offset + ((bh QB + qb) KB + kb) 32 + l.
// Element (r, c) of a tile is byte 4 (c / 8) + 2 (r / 8) + c % 2 of lane 4 (r % 8) + (c % 8) / 2's
// call; it is kept iff that byte >= T8 = round(p 256) (half up), and kept values are scaled by
// 256 / (256 - T8). The CPU kernels hold a tile as 16 row masks of 32 bits (bit c: column c kept);
// attention_tile_keep is the scalar definition of them, dropout_scales.h's AttentionTileBits the
// vector one.

// The first counter of tile (bh, qb, kb).
static inline uint64_t attention_tile_counter(uint64_t offset, int64_t bh, int64_t qb, int64_t kb, int64_t QB,
                                              int64_t KB) {
  return offset + ((static_cast<uint64_t>(bh) * static_cast<uint64_t>(QB) + static_cast<uint64_t>(qb)) *
                       static_cast<uint64_t>(KB) + static_cast<uint64_t>(kb)) * static_cast<uint64_t>(kAttnDropLanes);
}

// What attention needs of dropout probability p: whether it drops at all (T8 > 0), T8 in [0, 256]
// (256 keeps nothing) and the kept value 256 / (256 - T8) (0 when nothing is kept).
static inline DropoutParams attention_dropout_params(double p) {
  const uint32_t t = std::min<uint32_t>(static_cast<uint32_t>(p * 256.0 + 0.5), 256u);
  return {t > 0, t, t < 256 ? 256.0 / (256 - t) : 0.0};
}

// rows[r * stride] = the keep bits (bit c: column c) of row r of the tile whose first counter is n0.
static inline void attention_tile_keep(uint64_t seed, uint64_t n0, uint32_t threshold, uint32_t* rows,
                                       int64_t stride) {
  for (int r = 0; r < kAttnDropRows; ++r) rows[r * stride] = 0;
  for (int l = 0; l < kAttnDropLanes; ++l) {
    const PhiloxWords w = philox4x32(seed, n0 + static_cast<uint64_t>(l));
    for (int b = 0; b < 16; ++b) {  // byte b = 4 t + 2 hi + e: row 8 hi + l / 4, column 8 t + 2 (l % 4) + e
      const int t = b >> 2, hi = (b >> 1) & 1, e = b & 1;
      if (((w.w[t] >> (8 * (b & 3))) & 0xFFu) >= threshold) {
        rows[(8 * hi + l / 4) * stride] |= 1u << (8 * t + 2 * (l % 4) + e);
      }
    }
  }
}

}  // namespace fastformer
