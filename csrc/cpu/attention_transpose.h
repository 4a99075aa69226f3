// Tile transposes for the CPU attention kernels: dst (cols, rows) = src (rows, cols)^T, both
// row-major with their own leading dimensions. The tile products take plain row-major operands,
// so K^T, V^T, (P Z)^T and dS^T are built with these.
//
// fp32 with AVX-512: every 16 x 16 block, ragged edges included (masked), goes through registers
// (16 loads, four rounds of 16 shuffles, 16 stores); at::vec::transpose_mxn, which round-trips its
// block through memory, was measured 3-4x slower. fp32 with AVX2: the same in 8 x 8 blocks (for a
// run-time block size at::vec has only its scalar loop, which took more of the attention backward
// than its tile products on AMD EPYC). Other types / ISAs use at::vec throughout.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fastformer {
namespace CPU_CAPABILITY {
namespace attn {

#if defined(__AVX512F__)
// One fp32 block of nr <= 16 rows and nc <= 16 columns (16 x 16 by default): the rows and
// columns past the block are neither read nor written (masked loads and stores), so a ragged
// edge runs the same shuffles as a full block (at::vec::transpose_mxn, which the edges of
// attention's tiles of 32..64 rows used to take, was as slow as all the full blocks together).
__attribute__((always_inline)) inline void transpose16x16(const float* src, int64_t ld_src, float* dst,
                                                          int64_t ld_dst, int nr = 16, int nc = 16) {
  __m512 a[16], b[16];
  const __mmask16 col_mask = static_cast<__mmask16>((1u << nc) - 1);
  const __mmask16 row_mask = static_cast<__mmask16>((1u << nr) - 1);
  for (int i = 0; i < 16; ++i) {
    a[i] = i < nr ? _mm512_maskz_loadu_ps(col_mask, src + i * ld_src) : _mm512_setzero_ps();
  }
  // 32-bit interleave of row pairs
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  // 64-bit interleave within groups of four rows
  for (int i = 0; i < 16; i += 4) {
    const __m512d b0 = _mm512_castps_pd(b[i]), b1 = _mm512_castps_pd(b[i + 1]);
    const __m512d b2 = _mm512_castps_pd(b[i + 2]), b3 = _mm512_castps_pd(b[i + 3]);
    a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(b0, b2));
    a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(b0, b2));
    a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b1, b3));
    a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b1, b3));
  }
  // 128-bit lanes: pair groups g and g + 4 within each half
  for (int h = 0; h < 16; h += 8) {
    for (int j = 0; j < 4; ++j) {
      b[h + j] = _mm512_shuffle_f32x4(a[h + j], a[h + j + 4], 0x88);
      b[h + j + 4] = _mm512_shuffle_f32x4(a[h + j], a[h + j + 4], 0xdd);
    }
  }
  // 128-bit lanes across the halves
  for (int j = 0; j < 8; ++j) {
    if (j < nc) _mm512_mask_storeu_ps(dst + j * ld_dst, row_mask, _mm512_shuffle_f32x4(b[j], b[j + 8], 0x88));
    if (j + 8 < nc) {
      _mm512_mask_storeu_ps(dst + (j + 8) * ld_dst, row_mask, _mm512_shuffle_f32x4(b[j], b[j + 8], 0xdd));
    }
  }
}
#elif defined(__AVX2__)
// One fp32 block of nr <= 8 rows and nc <= 8 columns, as transpose16x16: masked loads and stores
// keep the rows and columns past a ragged edge unread and unwritten.
__attribute__((always_inline)) inline void transpose8x8(const float* src, int64_t ld_src, float* dst,
                                                        int64_t ld_dst, int nr = 8, int nc = 8) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i col_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lane);
  const __m256i row_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane);
  __m256 a[8], b[8];
  for (int i = 0; i < 8; ++i) {
    if (nc == 8) {
      a[i] = i < nr ? _mm256_loadu_ps(src + i * ld_src) : _mm256_setzero_ps();
    } else {
      a[i] = i < nr ? _mm256_maskload_ps(src + i * ld_src, col_mask) : _mm256_setzero_ps();
    }
  }
  for (int i = 0; i < 8; i += 2) {  // 32-bit interleave of row pairs
    b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // 64-bit interleave within groups of four rows
    a[i] = _mm256_shuffle_ps(b[i], b[i + 2], 0x44);
    a[i + 1] = _mm256_shuffle_ps(b[i], b[i + 2], 0xee);
    a[i + 2] = _mm256_shuffle_ps(b[i + 1], b[i + 3], 0x44);
    a[i + 3] = _mm256_shuffle_ps(b[i + 1], b[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit halves across the groups
    b[j] = _mm256_permute2f128_ps(a[j], a[j + 4], 0x20);
    b[j + 4] = _mm256_permute2f128_ps(a[j], a[j + 4], 0x31);
  }
  for (int j = 0; j < nc; ++j) {
    if (nr == 8) {
      _mm256_storeu_ps(dst + j * ld_dst, b[j]);
    } else {
      _mm256_maskstore_ps(dst + j * ld_dst, row_mask, b[j]);
    }
  }
}
#endif

template <typename T>
void transpose(const T* src, int64_t ld_src, int64_t rows, int64_t cols, T* dst, int64_t ld_dst) {
#if !defined(__AVX512F__) && defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; r += 8) {
      const int nr = static_cast<int>(std::min<int64_t>(8, rows - r));
      for (int64_t c = 0; c < cols; c += 8) {
        const int nc = static_cast<int>(std::min<int64_t>(8, cols - c));
        if (nr == 8 && nc == 8) {  // inlined with constant bounds: no masks
          transpose8x8(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
        } else {
          transpose8x8(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst, nr, nc);
        }
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r);
    for (int64_t c = 0; c < cols; c += 16) {
      const int64_t nc = std::min<int64_t>(16, cols - c);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (nr == 16 && nc == 16) {  // inlined with constant bounds: no masks, no row tests
          transpose16x16(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
        } else {
          transpose16x16(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst, static_cast<int>(nr),
                         static_cast<int>(nc));
        }
        continue;
      }
#endif
      at::vec::transpose_mxn<T>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst,
                                static_cast<int>(nr), static_cast<int>(nc));
    }
  }
}

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace fastformer
