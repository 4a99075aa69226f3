// Tile transposes for the CPU attention kernels: dst (cols, rows) = src (rows, cols)^T, both
// row-major with their own leading dimensions. The tile products take plain row-major operands,
// so K^T, V^T, (P Z)^T and dS^T are built with these.
//
// fp32 with AVX-512: whole 16 x 16 blocks go through registers (16 loads, four rounds of 16
// shuffles, 16 stores); at::vec::transpose_mxn, which round-trips its block through memory, was
// measured 3-4x slower and does the ragged edges here. Other types / ISAs use at::vec throughout.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fastformer {
namespace CPU_CAPABILITY {
namespace attn {

#if defined(__AVX512F__)
// One full 16 x 16 fp32 block.
inline void transpose16x16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(src + i * ld_src);
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
    _mm512_storeu_ps(dst + j * ld_dst, _mm512_shuffle_f32x4(b[j], b[j + 8], 0x88));
    _mm512_storeu_ps(dst + (j + 8) * ld_dst, _mm512_shuffle_f32x4(b[j], b[j + 8], 0xdd));
  }
}
#endif

template <typename T>
void transpose(const T* src, int64_t ld_src, int64_t rows, int64_t cols, T* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r);
    for (int64_t c = 0; c < cols; c += 16) {
      const int64_t nc = std::min<int64_t>(16, cols - c);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (nr == 16 && nc == 16) {
          transpose16x16(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
          continue;
        }
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
