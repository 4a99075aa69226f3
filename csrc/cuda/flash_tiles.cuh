// The tile helpers both tensor-core attention kernels share (flash_fwd_mma.cu, flash_bwd_mma.cu):
// the swizzled shared-memory tile layout, the row copies into it (cp.async or plain loads),
// ldmatrix row addresses, the 16-bit packing of two floats and a varlen sequence's rows; on the
// host, the device's compute capability both why_not checks ask for. kThreads is the block size
// both kernels launch (4 warps).
#pragma once
#include <atomic>
#include <cstdint>
#include <cstring>

#include "common.cuh"
#include "mma.cuh"

namespace ff_flash {

constexpr int kThreads = 4 * kFfWarpSize;

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of kD columns.
template <int kD>
FF_DEVICE int swz(int row, int chunk) {
  return row * kD + ((chunk ^ (row & 7)) << 3);
}

// Copies rows [0, kRows) of the matrix at src (row stride `stride`, unit column stride) into the
// swizzled tile dst; rows >= valid (>= 1) and columns >= D are zeros. Every thread calls it; with
// kAligned the copies are cp.async (not committed here), else plain loads and stores. A thread
// copies the same chunk column of rows r0, r0 + kStep, ...: one source pointer and one step.
template <int kD, int kRows, bool kAligned>
FF_DEVICE void load_tile(uint16_t* dst, const uint16_t* src, int64_t stride, int64_t valid64,
                         int D) {
  constexpr int kChunks = kD / 8, kStep = kThreads / kChunks, kPer = kRows / kStep;
  static_assert(kThreads % kChunks == 0 && kRows % kStep == 0, "chunks spread evenly");
  const int valid = valid64 < kRows ? static_cast<int>(valid64) : kRows;
  const int r0 = threadIdx.x / kChunks, ch = threadIdx.x % kChunks;
  const int cols = D - 8 * ch;  // this thread's columns of a row that exist (<= 0: none)
  const uint16_t* const s0 = src + r0 * stride + 8 * ch;
  if constexpr (kAligned) {
#pragma unroll
    for (int it = 0; it < kPer; ++it) {
      const int r = r0 + it * kStep, left = r < valid ? cols : 0;
      const int bytes = left <= 0 ? 0 : (left >= 8 ? 16 : left * 2);
      // src-size 0 reads nothing: name the tile's first row, which exists
      ff_cp_async_16_zfill(dst + swz<kD>(r, ch), bytes ? s0 + it * kStep * stride : src, bytes);
    }
  } else {
    // not unrolled: the loads of every chunk in flight at once would need registers that the
    // 256 bucket's accumulators hold (ptxas spilled)
#pragma unroll 1
    for (int it = 0; it < kPer; ++it) {
      const int r = r0 + it * kStep, left = r < valid ? cols : 0;
      const uint16_t* const s = s0 + it * kStep * stride;
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t lo = 2 * e < left ? s[2 * e] : 0u;
        const uint32_t hi = 2 * e + 1 < left ? s[2 * e + 1] : 0u;
        w[e] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(dst + swz<kD>(r, ch)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ldmatrix row addresses without a register per (tile, k-step): for a matrix whose 8 rows are
// rows 8 q + (lane % 8) of a swizzled tile and whose chunk column is 2 c + h (h = 0, 1),
//   swz(row, 2 c + h) = row kD + 8 ((h ^ row) & 1) + 16 ((c % 4) ^ (row % 8 / 2)) + 64 (c / 4),
// since row % 8 = lane % 8 flips only the low three bits of the chunk. So a lane keeps
// base + 16 ((c % 4) ^ (lane % 8 / 2)) for c % 4 = 0 .. 3 and adds constants for the rest.
template <int kD>
struct LdOffsets {
  int at[4];
  // row: the lane's row (any multiple of 8 added later is a constant), h: its chunk parity
  FF_DEVICE LdOffsets(int row, int h) {
    const int r = row & 7, base = row * kD + 8 * ((h ^ r) & 1);
#pragma unroll
    for (int c = 0; c < 4; ++c) at[c] = base + 16 * (c ^ (r >> 1));
  }
  // the element offset of chunk column pair c (chunks 2 c + h), rows `plus_rows` further on
  // (a multiple of 8)
  FF_DEVICE int operator()(int c, int plus_rows) const { return at[c & 3] + 64 * (c >> 2) + plus_rows * kD; }
};

// Two floats as the 16-bit pair of one register (lo in the low half), round to nearest even.
FF_DEVICE uint32_t pack2(float lo, float hi, __nv_bfloat16*) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
FF_DEVICE uint32_t pack2(float lo, float hi, __half*) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

#ifndef FF_SIMT
// The current device's compute-capability major, read once per device (the glue and the launcher
// ask on every call); nullptr on success, else the CUDA error string.
inline const char* current_device_major(int* major) {
  constexpr int kMaxDevices = 64;  // devices whose compute capability is cached
  static std::atomic<int> majors[kMaxDevices];  // 0: not read yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return ff_last_error();
  *major = dev < kMaxDevices ? majors[dev].load(std::memory_order_relaxed) : 0;
  if (*major == 0) {
    if (cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      return ff_last_error();
    }
    if (dev < kMaxDevices) majors[dev].store(*major, std::memory_order_relaxed);
  }
  return nullptr;
}
#endif

// Sequence b of a varlen operand: its first row and length, clamped to the tensor's rows and to
// max_len as attention.cu's seq_of does (any cu_seqlens values are memory-safe); the padded op's
// [0, max_len) where cu is null. Both kernels address the same rows through it.
struct SeqRows {
  int64_t start;
  int len;
};
FF_DEVICE SeqRows seq_rows(const int32_t* cu, int64_t b, int64_t total, int64_t max_len) {
  if (cu == nullptr) return {0, static_cast<int>(max_len)};
  int64_t s = cu[b], e = cu[b + 1];
  s = s < 0 ? 0 : (s > total ? total : s);
  e = e < s ? s : (e > total ? total : e);
  const int64_t len = e - s;
  return {s, static_cast<int>(len > max_len ? max_len : len)};
}

// Row `row` of head (b, h) of a 16-bit operand, through its (batch, head, row) strides.
FF_DEVICE const uint16_t* head_row(const void* base, int64_t b, int64_t h, int64_t row, int64_t sb,
                                   int64_t sh, int64_t ss) {
  return static_cast<const uint16_t*>(base) + b * sb + h * sh + row * ss;
}

}  // namespace ff_flash
