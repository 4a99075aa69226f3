// Philox 4x32-10 for the CUDA kernels, host and device ("Philox v2", defined in
// fastformer/philox.py; the same bits as csrc/cpu/philox.h and fastformer/triton_kernels/utils.py).
//
// An op's dropout tensor is viewed as rows of C columns (its last dimension). Row r is split into
// G = ceil(C / 8) groups of eight columns; group g makes ONE Philox call with counter
// (lo32(n), hi32(n), 0, 0), n = offset + r * G + g, and key (lo32(seed), hi32(seed)). Column
// 8 g + j takes the 16 bits u = (w[j / 2] >> (16 * (j % 2))) & 0xFFFF and is kept iff u >= T,
// T = round(p * 2^16) half up (T = 0 keeps everything, T = 65536 nothing); kept values are
// scaled by 1 / (1 - p).
//
//   FfPhilox4 w = ff_philox4x32_10(seed, n);          the four words of counter n
//   uint32_t u = ff_philox_u16(w, j);                  column j's 16 bits
//   uint32_t keep = ff_dropout_keep8(seed, n, T);      bit j set iff column j of group n is kept
//   uint32_t T = ff_dropout_threshold(p);              host side, once per launch
//   uint64_t n = ff_dropout_counter(offset, r, C, g);  the counter of group g of row r
//   ff_philox_resolve(philox, seed, offset);            (seed, offset) from a device philox pointer
#pragma once

#include "../philox_constants.h"
#include "common.cuh"

// The constants of csrc/philox_constants.h, under the names the CUDA sources use.
constexpr uint32_t kFfPhiloxRoundA = fastformer::kPhiloxRoundA, kFfPhiloxRoundB = fastformer::kPhiloxRoundB;
constexpr uint32_t kFfPhiloxKeyA = fastformer::kPhiloxKeyA, kFfPhiloxKeyB = fastformer::kPhiloxKeyB;
constexpr int kFfDropoutGroup = fastformer::kDropoutGroup;
constexpr int kAttnDropRowsCu = fastformer::kAttnDropRows, kAttnDropColsCu = fastformer::kAttnDropCols;
constexpr int kAttnDropLanesCu = fastformer::kAttnDropLanes;

struct FfPhilox4 {
  uint32_t w[4];
};

// (hi, lo) 32-bit halves of a * b.
FF_HOST_DEVICE uint32_t ff_mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
#endif
}

// The four output words of Philox-4x32-10 for counter (lo32(counter), hi32(counter), 0, 0) and
// key (lo32(seed), hi32(seed)).
FF_HOST_DEVICE FfPhilox4 ff_philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0u, c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi_b, hi_a;
    const uint32_t lo_b = ff_mulhilo32(kFfPhiloxRoundB, c2, &hi_b);
    const uint32_t lo_a = ff_mulhilo32(kFfPhiloxRoundA, c0, &hi_a);
    c0 = hi_b ^ c1 ^ k0;
    c2 = hi_a ^ c3 ^ k1;
    c1 = lo_b;
    c3 = lo_a;
    k0 += kFfPhiloxKeyA;
    k1 += kFfPhiloxKeyB;
  }
  FfPhilox4 out;
  out.w[0] = c0;
  out.w[1] = c1;
  out.w[2] = c2;
  out.w[3] = c3;
  return out;
}

// The 16 random bits of column j (0..7) of a group.
FF_HOST_DEVICE uint32_t ff_philox_u16(const FfPhilox4& w, int j) {
  return (w.w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
}

// The eight 16-bit values of group counter n, in column order.
FF_HOST_DEVICE void ff_philox_group_u16(uint64_t seed, uint64_t n, uint32_t (&u)[8]) {
  const FfPhilox4 w = ff_philox4x32_10(seed, n);
#pragma unroll
  for (int j = 0; j < 8; ++j) u[j] = ff_philox_u16(w, j);
}

// The keep decisions of the eight columns of group counter n: bit j set iff column j is kept
// (u >= threshold). threshold 0 keeps all eight without a Philox call.
FF_HOST_DEVICE uint32_t ff_dropout_keep8(uint64_t seed, uint64_t n, uint32_t threshold) {
  if (threshold == 0u) return 0xFFu;
  const FfPhilox4 w = ff_philox4x32_10(seed, n);
  uint32_t keep = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) keep |= (ff_philox_u16(w, j) >= threshold ? 1u : 0u) << j;
  return keep;
}

// The (seed, offset) of a launch: the op's `philox` may live on the device (a (2,) int64 tensor
// drawn there by torch's CUDA generator, so that a captured CUDA graph draws a new mask on every
// replay), and then the launcher passes its pointer: seed = philox[0], offset = philox[1] are read
// here. The elementwise kernels (add_layer_norm, feed_forward, embedding) call it once per thread
// where the kernel starts, before their loops; the attention kernels, whose parameters stay in
// parameter space (see ff_attn_dropout_keep_tile), per tile (attention.cu, flash_bwd_mma.cu) or per
// Philox call (flash_fwd_mma.cu): an L1-cached 16-byte read against ten Philox rounds. nullptr:
// the values the launcher passed (a CPU philox, read on the host) stay. The glue passes nullptr
// when p == 0, so nothing is read then.
// On the device the two words come through volatile loads, which the compiler neither hoists out
// of a caller's loop nor merges across unrolled Philox calls (their round keys would then stay
// live in registers across the loop).
FF_HOST_DEVICE void ff_philox_resolve(const int64_t* philox, uint64_t& seed, uint64_t& offset) {
  if (philox != nullptr) {
#if defined(__CUDA_ARCH__)
    unsigned long long s, o;
    asm volatile("ld.global.u64 %0, [%2];\n\tld.global.u64 %1, [%2+8];" : "=l"(s), "=l"(o) : "l"(philox));
    seed = s;
    offset = o;
#else
    seed = static_cast<uint64_t>(philox[0]);
    offset = static_cast<uint64_t>(philox[1]);
#endif
  }
}

// Philox calls (groups) per row of C columns.
FF_HOST_DEVICE int64_t ff_dropout_groups(int64_t C) {
  return (C + kFfDropoutGroup - 1) / kFfDropoutGroup;
}

// The counter of group g of row r of a dropout tensor with C columns: offset + r * G + g.
FF_HOST_DEVICE uint64_t ff_dropout_counter(uint64_t offset, int64_t r, int64_t C, int64_t g) {
  return offset + static_cast<uint64_t>(r) * static_cast<uint64_t>(ff_dropout_groups(C)) +
         static_cast<uint64_t>(g);
}

// ---------------------------------------------------------------- attention's dropout (v3)
// Defined in fastformer/philox.py (attention_random8): the probabilities of head-row bh = b H + h
// (padded (B, H, Sq, Sk); varlen: the padded op's (B, H, max_seqlen_q, max_seqlen_k)) in 16 x 32
// tiles, tile (bh, qb, kb) of QB = ceil(Sq / 16) x KB = ceil(Sk / 32) making 32 Philox calls
// (lanes l), counter offset + ((bh QB + qb) KB + kb) 32 + l. Element (r, c) of a tile is lane
// 4 (r % 8) + (c % 8) / 2, byte 4 (c / 8) + 2 (r / 8) + c % 2 of that call: a warp lane's own
// accumulator elements of an m16 x n32 mma.sync product (n8 tile t = c / 8, register 2 (r / 8) +
// c % 2), so lane l's call makes its 16 decisions. Kept iff the byte >= T8 = round(p 256) (half
// up); kept values are scaled by 256 / (256 - T8) (the realised keep probability).
//
//   uint64_t n = ff_attn_dropout_counter(offset, bh, qb, kb, QB, KB) + lane;
//   uint32_t keep = ff_attn_dropout_keep16(seed, n, T8);   bit 4 t + 2 hi + e: n8 tile t, row
//                                                           group hi (rows 8 hi + lane / 4), column
//                                                           8 t + 2 (lane % 4) + e
//   ff_attn_dropout_lane(r, c), ff_attn_dropout_byte(r, c)  where element (r, c) of a tile lives
//   ff_attn_dropout_threshold(p), ff_attn_dropout_scale(p)  host side, once per launch
//   ff_attn_dropout_keep_tile<kRows, kCols, kThreads>(...)   a region's keep bits, by a whole block

FF_HOST_DEVICE uint64_t ff_attn_dropout_counter(uint64_t offset, int64_t bh, int64_t qb, int64_t kb, int64_t QB,
                                                int64_t KB) {
  return offset + ((static_cast<uint64_t>(bh) * static_cast<uint64_t>(QB) + static_cast<uint64_t>(qb)) *
                       static_cast<uint64_t>(KB) +
                   static_cast<uint64_t>(kb)) *
                      static_cast<uint64_t>(kAttnDropLanesCu);
}

FF_HOST_DEVICE int ff_attn_dropout_lane(int r, int c) { return 4 * (r % 8) + (c % 8) / 2; }
FF_HOST_DEVICE int ff_attn_dropout_byte(int r, int c) { return 4 * (c / 8) + 2 * (r / 8) + c % 2; }

// The 16 keep decisions of counter n: bit b set iff byte b (w[b / 4] >> 8 (b % 4)) >= T8. T8 = 0
// keeps all 16 without a Philox call.
FF_HOST_DEVICE uint32_t ff_attn_dropout_keep16(uint64_t seed, uint64_t n, uint32_t T8) {
  if (T8 == 0u) return 0xFFFFu;
  const FfPhilox4 w = ff_philox4x32_10(seed, n);
  uint32_t keep = 0u;
#pragma unroll
  for (int b = 0; b < 16; ++b) keep |= (((w.w[b >> 2] >> (8 * (b & 3))) & 0xFFu) >= T8 ? 1u : 0u) << b;
  return keep;
}

// The keep bits of a region of attention probabilities (v3), into (shared) memory:
// keep[i (kCols / 8) + c], bit e, for key k0 + 8 c + e of query q0 + i, i < kRows (0 for a query
// >= q_len or a key group past k_len), k0 a multiple of 8, the counters those of head-row b H + h
// of (Sq, Sk) probabilities (varlen: the maxima). The region need not be tile-aligned (a causal
// dK dV kernel streams queries from n0 - (Sk - Sq)): a unit of work is one row pair (a, a + 8) of
// a covering 16 x 32 tile, its 4 lanes' calls (a quad of an mma accumulator), which decide those
// two rows' 32 columns wholly, so each byte of the region is written once, by one thread, without
// atomics; units outside the region's bytes are skipped. Aligned regions (16-row, 32-column
// multiples) make exactly the tiles' 32 calls each. Every thread of the block calls it. I: the
// caller's index type. The kernel parameters come by reference, so they stay loads from parameter
// space where used: by value they were loaded at the call and kept live across the kernel's loops
// (attention.cu on sm_80: up to +41 registers, and spills). For the same reason a device `philox`
// (ff_philox_resolve) is read here, into registers before the tile's loop, once per thread and
// tile (a 16-byte cached load against the tile's Philox calls), not at the kernel's start.
template <int kRows, int kCols, int kThreads, typename I>
FF_DEVICE void ff_attn_dropout_keep_tile(uint8_t* keep, const uint64_t& seed, const uint64_t& offset,
                                         const int64_t* const& philox, const uint32_t& T8, int64_t b, int64_t h,
                                         const int64_t& H, const int64_t& Sq, const int64_t& Sk, I q0, I q_len,
                                         I k0, I k_len) {
  static_assert(kCols % kFfDropoutGroup == 0, "whole bytes of 8 keys a row");
  constexpr int kR = kAttnDropRowsCu, kC = kAttnDropColsCu, kGC = kCols / 8;
  const int64_t QB = (Sq + kR - 1) / kR, KB = (Sk + kC - 1) / kC, bh = b * H + h;
  uint64_t key = seed, first = offset;
  ff_philox_resolve(philox, key, first);
  const I qb0 = q0 / kR, kb0 = k0 / kC;
  const int nq = static_cast<int>((q0 + kRows - 1) / kR - qb0) + 1;
  const int nk = static_cast<int>((k0 + kCols - 1) / kC - kb0) + 1;
  for (int u = threadIdx.x; u < nq * 8 * nk; u += kThreads) {
    const int kbi = u % nk, a = (u / nk) % 8, qbi = u / (8 * nk);
    const I qb = qb0 + qbi, kb = kb0 + kbi;
    const I row0 = qb * kR + a, col0 = kb * kC;  // rows row0, row0 + 8; columns col0 + 8 t + ...
    bool live = false;                             // a byte of the region this unit decides
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const I row = row0 + 8 * hi;
      live |= row >= q0 && row < q0 + kRows && row < q_len;
    }
    live = live && col0 < k_len;
    uint64_t bytes = 0u;  // byte 4 hi + t: row row0 + 8 hi, columns col0 + 8 t .. + 7
    if (live) {
      const uint64_t n0 = ff_attn_dropout_counter(first, bh, qb, kb, QB, KB) + 4u * static_cast<uint64_t>(a);
#pragma unroll 1
      for (int q = 0; q < 4; ++q) {  // lane 4 a + q: columns 8 t + 2 q + e
        const uint32_t bits = ff_attn_dropout_keep16(key, n0 + static_cast<uint64_t>(q), T8);
#pragma unroll
        for (int x = 0; x < 16; ++x) {  // bit x = 4 t + 2 hi + e
          const int t = x / 4, hi = (x / 2) % 2, e = x % 2;
          bytes |= static_cast<uint64_t>((bits >> x) & 1u) << (8 * (4 * hi + t) + 2 * q + e);
        }
      }
    }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const I row = row0 + 8 * hi;
      if (row < q0 || row >= q0 + kRows) continue;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const I col = col0 + 8 * t;
        if (col < k0 || col >= k0 + kCols) continue;
        const bool in = row < q_len && col < k_len;
        keep[(row - q0) * kGC + (col - k0) / 8] = in ? static_cast<uint8_t>(bytes >> (8 * (4 * hi + t))) : 0u;
      }
    }
  }
}

// T8 = round(p * 256), half up, in [0, 256] (p * 256 is exact in double), for p in [0, 1).
inline uint32_t ff_attn_dropout_threshold(double p) {
  const double t = p * 256.0 + 0.5;
  if (!(t >= 1.0)) return 0u;
  return t >= 256.0 ? 256u : static_cast<uint32_t>(t);
}

// What a kept probability is multiplied by: 256 / (256 - T8), 0 when nothing is kept.
inline float ff_attn_dropout_scale(double p) {
  const uint32_t t = ff_attn_dropout_threshold(p);
  return t >= 256u ? 0.0f : static_cast<float>(256.0 / (256.0 - t));
}

// T = round(p * 2^16), half up, in [0, 65536] (p * 2^16 is exact in double), for p in [0, 1).
inline uint32_t ff_dropout_threshold(double p) {
  const double t = p * 65536.0 + 0.5;
  if (!(t >= 1.0)) return 0u;  // also p = nan: the glue rejects it before
  return t >= 65536.0 ? 65536u : static_cast<uint32_t>(t);
}
