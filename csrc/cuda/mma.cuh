// Tensor-core and asynchronous-copy wrappers for sm_80+ kernels (the tensor-core flash attention):
// one C++ function per PTX instruction, inline PTX on the GPU, and under FF_SIMT (the SIMT harness,
// tests/simt/) an emulation that follows the PTX ISA's fragment layouts lane by lane, so a kernel
// that hands the wrong registers to an instruction computes the wrong answer in the tests too.
// Tested by tests/test_cuda_mma.py (kernels in tests/simt/mma_selftest.cu, which
// tests/test_cuda_compile.py also compiles with nvcc for sm_80 / sm_90).
//
//   ff_mma_m16n8k16<T>(d, a, b, c)   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d = a b + c
//                                    (T = __nv_bfloat16 or __half; d may be c)
//   ff_mma_m16n8k8_tf32(d, a, b, c)  mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
//   ff_float_to_tf32(x)              cvt.rna.tf32.f32: x rounded to tf32 (the mma's input bits)
//   ff_ldmatrix_x{1,2,4}[_trans](r, row)   ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16
//   ff_cp_async_16(dst, src)         cp.async.cg.shared.global, 16 bytes (dst shared, src global:
//                                    a shared src is wrong, and crashes CUDA 13.0's cicc outright)
//   ff_cp_async_16_zfill(dst, src, src_bytes)   the same with src-size: src_bytes (0 .. 16) bytes
//                                    copied, the rest zero-filled (out-of-bounds rows: 0)
//   ff_cp_async_commit()             cp.async.commit_group
//   ff_cp_async_wait<N>()            cp.async.wait_group N (N = 0: every committed group)
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"); in a warp,
// lane = groupID * 4 + tig (groupID = lane / 4, tig = threadID_in_group = lane % 4). A register
// holding two 16-bit elements has the lower-indexed one in its low half.
//   A (16 x 16, row): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
//                     a[3] = A[g+8][2t+8, 2t+9]            (g = groupID, t = tig)
//   B (16 x 8, col):  b[0] = B[2t, 2t+1][g],  b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8):    c[0], c[1] = C[g][2t, 2t+1],  c[2], c[3] = C[g+8][2t, 2t+1]
// m16n8k8 .tf32 ("Matrix Fragments for mma.m16n8k8", .tf32): one fp32-sized element a register,
//   A (16 x 8): a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4]
//   B (8 x 8):  b[0] = B[t][g], b[1] = B[t+4][g];  C, D as above.
// ldmatrix ("Warp-level matrix load instruction: ldmatrix"): matrix i of .x1 / .x2 / .x4 is the
//   8 x 8 block of 16-bit elements whose rows start at the addresses of lanes 8i .. 8i+7 (16 bytes
//   a row, 16-byte aligned, in shared memory); r[i] of lane (g, t) = row g, columns 2t and 2t+1, or
//   with .trans column g, rows 2t and 2t+1. So for a row-major 16 x 16 tile at T* s (ld elements a
//   row), lane l pointing at s + (l % 16) ld + (l / 16) 8 makes .x4 return A's fragment a[0..3];
//   a B stored as B^T (n rows, k contiguous) gives b[] through the plain form, a B stored k-major
//   (k rows, n contiguous) through .trans.
//
// Precision of the emulation: the products of 16-bit (or tf32) inputs are exact, summed with c in
// double and rounded once to fp32. A GPU adds in its own order and precision, so results agree to
// fp32 rounding of the sum, not bit for bit; tests compare with a tolerance.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "common.cuh"

#if !defined(FF_SIMT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// bf16 mma.sync and cp.async need sm_80: an older target gets wrappers that trap, so a file with
// these kernels still builds for every architecture of the extension; launchers must not pick them.
#define FF_MMA_UNSUPPORTED 1
#endif

// ---------------------------------------------------------------- the GPU: inline PTX
#ifndef FF_SIMT

template <typename T>
FF_DEVICE void ff_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                               const float (&c)[4]) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "ff_mma_m16n8k16: T must be __nv_bfloat16 or __half");
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  }
#endif
}

FF_DEVICE void ff_mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                   const float (&c)[4]) {
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
#endif
}

FF_DEVICE uint32_t ff_float_to_tf32(float x) {
  uint32_t r;
#ifdef FF_MMA_UNSUPPORTED
  r = __float_as_uint(x);
#else
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#endif
  return r;
}

// ldmatrix and cp.async take a 32-bit shared-state-space address, not a generic pointer.
FF_DEVICE uint32_t ff_smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The "memory" clobber keeps the compiler from moving this thread's shared-memory stores (the
// rows other lanes load after a __syncwarp / __syncthreads) across the load.
template <int kNum, bool kTrans>
FF_DEVICE void ff_ldmatrix(uint32_t (&r)[kNum], const void* row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  const uint32_t s = ff_smem_address(row);
  if constexpr (kNum == 1) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0]) : "r"(s) : "memory");
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0]) : "r"(s) : "memory");
    }
  } else if constexpr (kNum == 2) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
    }
  } else {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
    }
  }
#endif
}

// .cg: cached in L2 only (the tile is used once per block, from shared memory). The source is a
// global-state-space address. The "memory" clobbers order the copies against this thread's other
// shared-memory accesses (a stage is refilled only after its last read).
FF_DEVICE void ff_cp_async_16_zfill(void* dst, const void* src, int src_bytes) {
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ff_smem_address(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
               : "memory");
#endif
}

FF_DEVICE void ff_cp_async_16(void* dst, const void* src) {
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ff_smem_address(dst)),
               "l"(__cvta_generic_to_global(src))
               : "memory");
#endif
}

// 4 bytes (a row's lse or Dsum; .cg takes only 16, so .ca), the destination zero-filled past
// src_bytes (0 or 4).
FF_DEVICE void ff_cp_async_4_zfill(void* dst, const void* src, int src_bytes) {
#ifdef FF_MMA_UNSUPPORTED
  __trap();
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(ff_smem_address(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
               : "memory");
#endif
}

FF_DEVICE void ff_cp_async_commit() {
#ifndef FF_MMA_UNSUPPORTED
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
FF_DEVICE void ff_cp_async_wait() {
#ifndef FF_MMA_UNSUPPORTED
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---------------------------------------------------------------- the harness: the PTX layouts
#else  // FF_SIMT

namespace ff_mma_simt {

inline float bits16_to_float(uint16_t v, __nv_bfloat16*) { return ff_simt::bf16_bits_to_float(v); }
inline float bits16_to_float(uint16_t v, __half*) { return ff_simt::half_bits_to_float(v); }

// The 16-bit element `half` (0 low, 1 high) of a register, as float.
template <typename T>
inline float element(uint32_t reg, int half) {
  return bits16_to_float(static_cast<uint16_t>(reg >> (16 * half)), static_cast<T*>(nullptr));
}

// tf32: the sign, the 8 exponent bits and the top 10 mantissa bits of the register. Inputs should
// be tf32 already (ff_float_to_tf32); the low 13 bits of one that is not are ignored here, as tensor
// cores are described to do, so a missing conversion truncates instead of failing.
inline float tf32_element(uint32_t reg) { return ff_simt::bits_float(reg & 0xFFFFE000u); }

// Every lane scatters its A and B elements into full matrices in the warp's scratch at the places
// the PTX layout gives them (a_at / b_at: register i, half h -> row, column), then, after a warp
// barrier, computes the D elements the layout gives it from those matrices; a second barrier lets
// the next collective reuse the scratch. kM x kK A, kK x 8 B; each register holds kPer elements.
template <int kK, int kPer, typename Elem, typename AAt, typename BAt>
inline void mma(const char* name, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                const float (&c)[4], Elem elem, AAt a_at, BAt b_at) {
  constexpr int kM = 16, kN = 8;
  static_assert((kM * kK + kK * kN) <= ff_simt::kWarpScratchWords, "scratch too small");
  float* sa = reinterpret_cast<float*>(ff_simt::warp_scratch());  // A[row][k]
  float* sb = sa + kM * kK;                                        // B[k][col]
  const int lane = ff_simt::lane(), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    for (int h = 0; h < kPer; ++h) {
      int row, col;
      a_at(g, t, i, h, &row, &col);
      sa[row * kK + col] = elem(a[i], h);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int h = 0; h < kPer; ++h) {
      int row, col;
      b_at(g, t, i, h, &row, &col);
      sb[row * kN + col] = elem(b[i], h);
    }
  }
  ff_simt::warp_collective(name);
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);  // the C / D layout
    double acc = c[i];
    for (int k = 0; k < kK; ++k) {
      acc += static_cast<double>(sa[row * kK + k]) * static_cast<double>(sb[k * kN + col]);
    }
    out[i] = static_cast<float>(acc);
  }
  ff_simt::warp_collective(name);
  for (int i = 0; i < 4; ++i) d[i] = out[i];  // after reading c: d may alias it
}

// Lanes 0 .. 8 kNum - 1 give the row addresses of the kNum matrices; each lane then reads its two
// elements of every matrix from those rows, as the ldmatrix fragment layout says.
template <int kNum, bool kTrans>
inline void ldmatrix(const char* name, uint32_t (&r)[kNum], const void* row) {
  const int lane = ff_simt::lane();
  if (lane < 8 * kNum && reinterpret_cast<uintptr_t>(row) % 16 != 0) {
    char msg[160];
    std::snprintf(msg, sizeof(msg), "%s: lane %d's row address %p is not 16-byte aligned", name, lane,
                  row);
    ff_simt::fail(msg);
  }
  static_assert(32 * sizeof(const void*) <= ff_simt::kWarpScratchWords * 4, "scratch too small");
  const uint16_t** rows = reinterpret_cast<const uint16_t**>(ff_simt::warp_scratch());
  rows[lane] = static_cast<const uint16_t*>(row);  // lanes >= 8 kNum: given but never read
  ff_simt::warp_collective(name);
  const int g = lane / 4, t = lane % 4;
  uint32_t out[kNum];
  for (int i = 0; i < kNum; ++i) {
    const uint16_t* const* m = rows + 8 * i;  // the matrix's 8 row addresses
    const uint16_t lo = kTrans ? m[2 * t][g] : m[g][2 * t];
    const uint16_t hi = kTrans ? m[2 * t + 1][g] : m[g][2 * t + 1];
    out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  ff_simt::warp_collective(name);
  for (int i = 0; i < kNum; ++i) r[i] = out[i];
}

}  // namespace ff_mma_simt

template <typename T>
inline void ff_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                            const float (&c)[4]) {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value,
                "ff_mma_m16n8k16: T must be __nv_bfloat16 or __half");
  const char* name = std::is_same<T, __nv_bfloat16>::value
                         ? "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
                         : "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
  ff_mma_simt::mma<16, 2>(
      name, d, a, b, c, [](uint32_t reg, int h) { return ff_mma_simt::element<T>(reg, h); },
      [](int g, int t, int i, int h, int* row, int* col) {  // A: i = 0 .. 3 as a0a1 .. a6a7
        *row = g + 8 * (i % 2);
        *col = 2 * t + h + 8 * (i / 2);
      },
      [](int g, int t, int i, int h, int* row, int* col) {  // B: i = 0, 1 as b0b1, b2b3
        *row = 2 * t + h + 8 * i;
        *col = g;
      });
}

inline void ff_mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                const float (&c)[4]) {
  ff_mma_simt::mma<8, 1>(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", d, a, b, c,
      [](uint32_t reg, int) { return ff_mma_simt::tf32_element(reg); },
      [](int g, int t, int i, int, int* row, int* col) {
        *row = g + 8 * (i % 2);
        *col = t + 4 * (i / 2);
      },
      [](int g, int t, int i, int, int* row, int* col) {
        *row = t + 4 * i;
        *col = g;
      });
}

// cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits (low 13 bits 0);
// NaN and infinity pass through.
inline uint32_t ff_float_to_tf32(float x) {
  const uint32_t u = ff_simt::float_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return u;
  return (u + 0x1000u) & 0xFFFFE000u;
}

template <int kNum, bool kTrans>
inline void ff_ldmatrix(uint32_t (&r)[kNum], const void* row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
  static const char* const names[2][3] = {
      {"ldmatrix.sync.aligned.m8n8.x1.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
       "ldmatrix.sync.aligned.m8n8.x4.shared.b16"},
      {"ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16",
       "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
       "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"}};
  ff_mma_simt::ldmatrix<kNum, kTrans>(names[kTrans][kNum == 4 ? 2 : kNum - 1], r, row);
}

inline void ff_cp_async_16_zfill(void* dst, const void* src, int src_bytes) {
  ff_simt::cp_async(dst, src, 16, src_bytes);
}
inline void ff_cp_async_16(void* dst, const void* src) { ff_simt::cp_async(dst, src, 16, 16); }
inline void ff_cp_async_4_zfill(void* dst, const void* src, int src_bytes) {
  ff_simt::cp_async(dst, src, 4, src_bytes);
}
inline void ff_cp_async_commit() { ff_simt::cp_async_commit(); }
template <int N>
inline void ff_cp_async_wait() {
  ff_simt::cp_async_wait(N);
}

#endif  // FF_SIMT

// ---------------------------------------------------------------- both: the named forms
template <typename T>
FF_DEVICE void ff_mma_m16n8k16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  ff_mma_m16n8k16<T>(acc, a, b, acc);  // acc = a b + acc, the flash loop's form
}
FF_DEVICE void ff_ldmatrix_x1(uint32_t (&r)[1], const void* row) { ff_ldmatrix<1, false>(r, row); }
FF_DEVICE void ff_ldmatrix_x2(uint32_t (&r)[2], const void* row) { ff_ldmatrix<2, false>(r, row); }
FF_DEVICE void ff_ldmatrix_x4(uint32_t (&r)[4], const void* row) { ff_ldmatrix<4, false>(r, row); }
FF_DEVICE void ff_ldmatrix_x1_trans(uint32_t (&r)[1], const void* row) { ff_ldmatrix<1, true>(r, row); }
FF_DEVICE void ff_ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) { ff_ldmatrix<2, true>(r, row); }
FF_DEVICE void ff_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { ff_ldmatrix<4, true>(r, row); }
