// The SIMT test harness: CUDA's execution model on the host, so that the kernels of csrc/cuda/*.cu,
// compiled as host C++ with -DFF_SIMT (common.cuh includes this header instead of the CUDA
// headers), run on CPU tensors in the ordinary test suite. Built by tests/simt/build.py.
//
// What it models
//   * Launches (FF_LAUNCH -> ff_simt::launch): grid and block up to 3-D, CUDA's limits on their
//     sizes (1024 threads a block, block.z <= 64, grid.y / grid.z <= 65535) and on dynamic shared
//     memory: 48 KiB a block unless the kernel opted in to more with
//     cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), which takes
//     at most kMaxDynamicSmemOptIn = 232448 bytes (227 KiB, sm_90's per-block opt-in maximum; sm_80
//     allows 163 KiB). The opt-in is per kernel function and lasts for the process, as on a GPU. A bad
//     configuration is reported as CUDA reports it, through cudaGetLastError(). Blocks run one at a
//     time in blockIdx order (x fastest).
//   * The threads of a block are cooperative fibers on the launching OS thread (a hand-written
//     context switch on x86-64, ucontext elsewhere): thread 0 runs until it blocks at a barrier or a
//     warp intrinsic, then thread 1, ... in linear thread order (FF_SIMT_SCHEDULE and
//     ff_simt::set_schedule choose other orders: see "Schedules" below). Deterministic: the same
//     launch always interleaves the same way. threadIdx / blockIdx / blockDim / gridDim are set for
//     the running fiber; local variables live on its own stack (128 KiB, guard page below).
//   * __shared__ is `static` (blocks run one at a time, launches are serialised by a mutex), the
//     dynamic shared memory (FF_DYNAMIC_SMEM) a 16-byte aligned buffer refilled with 0xFF bytes
//     (NaN as float) before every block, so a read before any write shows.
//   * __syncthreads (and __syncthreads_count/_and/_or): every thread of the block must arrive. A
//     barrier that some threads reach after others have exited, or that cannot complete because
//     other threads wait at a warp intrinsic, stops the launch with an error naming the threads.
//   * Warp intrinsics (__shfl_sync, __shfl_xor_sync, __shfl_up_sync, __shfl_down_sync,
//     __ballot_sync, __any_sync, __all_sync, __syncwarp): lanes are linear thread ids / 32. The
//     intrinsic completes when every existing, non-exited lane named in the mask has reached it;
//     all of them must call the same intrinsic with the same mask and width, every caller must be
//     in its mask, and a shuffle may only read a lane that takes part (not exited, existing, in
//     the mask). Anything else (part of a warp at a shuffle while the rest waits at __syncthreads
//     or has exited, mismatched masks, reads of missing lanes) stops the launch with an error.
//     Results are computed from every lane's value at once, as the hardware exchanges them.
//   * Warp-collective instructions (the tensor-core wrappers of csrc/cuda/mma.cuh: mma.sync,
//     ldmatrix): ff_simt::warp_collective(name) is a warp barrier that all 32 lanes must reach under
//     the same instruction name; the wrappers exchange fragments through ff_simt::warp_scratch(), the
//     running warp's scratch words, between two such barriers.
//   * cp.async (ff_simt::cp_async, through mma.cuh's ff_cp_async_*): the source is read when the copy
//     is issued, the destination written only when cp.async.wait_group completes its group, so a
//     read before the wait (a missing or too lax wait_group) sees the old bytes (0xFF in fresh
//     dynamic shared memory) instead of passing by luck. Under the warp_ahead schedules (below) a
//     thread's copies still pending when it reaches __syncthreads land there, before the other
//     warps run: a copy may land any time after it is issued, so a stage refilled while another
//     warp may still read it shows. Copies still pending when a thread exits are dropped.
//   * A stopped launch skips its remaining blocks; cudaGetLastError() then returns
//     cudaErrorLaunchFailure and cudaGetErrorString() the harness's message (the launchers return
//     it, FF_CHECK_LAUNCH raises it as a RuntimeError). Nothing hangs, nothing aborts the process.
//   * Integer atomics (int, unsigned, unsigned long long: atomicAdd/Sub/Exch/Min/Max/CAS/And/Or/Xor)
//     as plain read-modify-write: fibers never interleave inside one. There is deliberately no
//     float atomicAdd, so a kernel that would need one fails to compile here.
//   * __half and __nv_bfloat16 (16-bit storage, fp32 arithmetic) with __float2half_rn,
//     __half2float, __float2bfloat16_rn, __bfloat162float, ...: round to nearest even, equal bit
//     for bit to torch's CPU conversions (NaN becomes torch's 0x7E00 / 0x7FC0 pattern).
//   * The math functions of CUDA.md from the C library (expf, logf, exp2f, log2f, erff, rsqrtf,
//     fmaxf, fminf, __expf, ...): correctly rounded where glibc is, so fast-math intrinsics
//     (__expf) are MORE accurate here than on a GPU; tolerances must allow the GPU's error.
//   * A spin on another block's flag (ff_simt::spin_until_at_least): the flag must be set by a
//     block that ran before (blocks run in blockIdx order), else the launch stops with an error.
//   * __ldg, __ldcg, __stcg, dim3, uint3, the vector types (float2/float4, int2/int4, uint2/uint4) with their
//     CUDA alignment, min / max overloads, __popc, __clz, __ffs, __umulhi, bit casts.
//   * One device (cudaGetDevice gives 0) with a modelled SM count for cudaDeviceGetAttribute(
//     cudaDevAttrMultiProcessorCount): 4 unless ff_simt::set_sm_count says otherwise, so kernels
//     that size their grid from the SM count run their multi-block paths on small inputs. Any
//     other attribute is cudaErrorInvalidValue: the harness has no other device properties.
//
// Schedules (FF_SIMT_SCHEDULE=forward|reverse|warp_ahead|warp_ahead_reverse, unset: forward, any
// other value fails every launch; or ff_simt::set_schedule. One per launch, the same for every block)
//   A race gives one fixed answer under each schedule, so a missing barrier shows only under one
//   that runs the other side first: the read before the write it needs, or an overwrite before a
//   read of the old value. Run a kernel's tests under all four.
//   * forward (the default): thread 0 runs until it blocks at a barrier or warp intrinsic, then
//     thread 1, ...; when every thread is blocked, the warps whose lanes have all arrived at an
//     intrinsic are released, or else the block barrier. A missing __syncthreads shows when an
//     earlier thread reads what a later one writes (or writes what a later one reads) with no
//     warp intrinsic between the two accesses.
//   * reverse: the same, the last thread first: the other half of those races.
//   * warp_ahead: between two block barriers each warp runs ALONE until all its lanes have reached
//     the next __syncthreads (or exited), warp 0 first, then warp 1, ...; warp intrinsics and
//     warp-collectives (mma, ldmatrix) synchronise the lanes of that one warp, and cp.async copies
//     land at the latest when their thread reaches __syncthreads (see cp.async above). Under
//     forward and reverse every warp intrinsic is a point where all the block's threads catch up
//     with each other, which keeps warps that execute the same intrinsics in lockstep, so a
//     missing __syncthreads between one warp's shared-memory write (or cp.async) and another
//     warp's read, with a shuffle / mma / ldmatrix in between, passes there by luck. Here, without
//     the barrier, warp 0 reads what the later warps have not written yet, and overwrites (a
//     store, a refill by cp.async) what they have not read yet: one half of the cross-warp races.
//   * warp_ahead_reverse: the same, the last warp first (its lanes last to first): the other half.
//
// What it does NOT model (write kernels that never depend on any of it)
//   * Memory ordering without a barrier: between barriers a thread runs to completion before the
//     next one starts (forward, reverse) or a warp runs to its next barrier before the next warp
//     starts (warp_ahead, warp_ahead_reverse), so a race on shared or global memory gives one fixed
//     answer per schedule here and another on a GPU; no schedule interleaves two warps at finer
//     grain than their intrinsics, nor reorders one thread's memory accesses.
//   * Warp-synchronous code without *_sync: lanes are not in lockstep between intrinsics;
//     implicit warp synchrony (volatile shared-memory reductions) gives wrong answers or passes by
//     luck. __activemask, __match_*_sync, __reduce_*_sync and cooperative groups are absent.
//   * Independent thread scheduling hazards (divergent lanes reconverging in another order, a
//     lane spinning on another's progress: a spin loop never yields and hangs the harness).
//   * Occupancy, registers, the real shared-memory limits of a block of a given size (only the
//     dynamic limits above are checked; static __shared__ is not counted against them, nor is it
//     against the opt-in maximum, which on a GPU holds static + dynamic), launch latency, streams
//     (every launch runs to completion at once), asynchrony, timing, float atomics, texture and
//     constant memory, printf buffering, out-of-bounds accesses (plain host memory: use ASan).
//   * Poison in static __shared__: it keeps what the last block or launch wrote, so a read of a
//     tile that was never written there (a cp.async not waited for) can pass by luck; stage tiles
//     in dynamic shared memory, which is refilled with 0xFF before every block. Nor do ldmatrix and
//     cp.async check that their shared-memory addresses are in shared memory.
//   * The GPU's floating-point details: no FTZ/DAZ, host libm accuracy, FMA contraction as the host
//     compiler decides.
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------- CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
// No __noinline__: libstdc++ writes __attribute__((__noinline__)), which such a macro breaks
// (<memory> included after this header); no kernel uses it.
#define __shared__ static
#define __constant__
#define __managed__
#define __grid_constant__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// __restrict__ is GCC's and Clang's own.

// ---------------------------------------------------------------- index and vector types
struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

#define FF_SIMT_VEC2(name, T, align)                                                      \
  struct __attribute__((aligned(align))) name {                                           \
    T x, y;                                                                               \
  };                                                                                      \
  inline name make_##name(T x, T y) { return name{x, y}; }
#define FF_SIMT_VEC4(name, T, align)                                                      \
  struct __attribute__((aligned(align))) name {                                           \
    T x, y, z, w;                                                                         \
  };                                                                                      \
  inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }
FF_SIMT_VEC2(float2, float, 8)
FF_SIMT_VEC4(float4, float, 16)
FF_SIMT_VEC2(int2, int, 8)
FF_SIMT_VEC4(int4, int, 16)
FF_SIMT_VEC2(uint2, unsigned, 8)
FF_SIMT_VEC4(uint4, unsigned, 16)
FF_SIMT_VEC2(double2, double, 16)
#undef FF_SIMT_VEC2
#undef FF_SIMT_VEC4

// The running fiber's indices (launches are serialised, so plain globals suffice).
inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

// ---------------------------------------------------------------- runtime API subset
typedef void* cudaStream_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t err);
// The function attributes a kernel may set (CUDA's enumerator values).
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,  // accepted (-1 .. 100) and ignored
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
};
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);

// ---------------------------------------------------------------- the scheduler's interface
namespace ff_simt {

enum WarpOp : int { kShflIdx, kShflXor, kShflUp, kShflDown, kBallot, kAny, kAll, kSyncWarp, kCollective };
enum BlockOp : int { kSync, kSyncCount, kSyncAnd, kSyncOr };

// Dynamic shared memory a block may have: without opt-in, and at most with
// cudaFuncAttributeMaxDynamicSharedMemorySize (sm_90's cudaDevAttrMaxSharedMemoryPerBlockOptin).
constexpr size_t kMaxDynamicSmemDefault = 48 * 1024;
constexpr size_t kMaxDynamicSmemOptIn = 232448;  // 227 KiB

// Runs body(ctx) as every thread of every block of the grid (see the top of this file); kernel
// identifies the kernel function whose attributes (cudaFuncSetAttribute) apply.
void run_grid(const char* name, const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
              void (*body)(void*), void* ctx);
// cudaFuncSetAttribute for the kernel function `kernel`.
cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value);
// Waits at a block barrier; returns the reduction of pred for kSyncCount / And / Or.
int block_barrier(BlockOp op, int pred);
// Waits at a warp intrinsic; returns this lane's result (a shuffled value's bits, a ballot).
uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int param, int width);
// The running block's dynamic shared memory.
void* dynamic_smem();
// The running thread's lane: its linear thread id (x fastest) % 32.
int lane();
// A warp barrier for the warp-collective instruction `instruction` (a string literal naming it in
// messages): returns when all 32 lanes of the warp have reached a warp_collective with the same
// name. A warp with fewer than 32 threads, lanes that have exited, or lanes at another intrinsic
// stop the launch with an error.
void warp_collective(const char* instruction);
// The running warp's kWarpScratchWords words of scratch (blocks run one at a time, so one set of
// per-warp buffers serves every block). Its contents are meaningful only between two
// warp_collective barriers of the same instruction.
constexpr int kWarpScratchWords = 512;
uint32_t* warp_scratch();
// cp.async of `bytes` bytes from src (global) to dst (shared), both `bytes`-aligned: the first
// src_bytes (0 .. bytes) are copied, the rest of dst zero-filled. The source is read now, dst is
// written when cp_async_wait completes the copy's group (see the top of this file).
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
// cp.async.commit_group: the thread's copies issued since the last commit form a group.
void cp_async_commit();
// cp.async.wait_group n: completes every committed group but the n most recent.
void cp_async_wait(int n);
// The order in which the threads of a block run (see the top of this file); the environment
// variable FF_SIMT_SCHEDULE names the one launches start with (forward when unset or empty; a
// value that names none makes every launch fail with cudaErrorInvalidValue).
enum Schedule : int {
  kForward,           // "forward": thread 0, 1, 2, ... to each barrier or warp intrinsic in turn
  kReverse,           // "reverse": the same, last thread first
  kWarpAhead,         // "warp_ahead": each warp alone to its next __syncthreads, warp 0 first
  kWarpAheadReverse,  // "warp_ahead_reverse": the same, the last warp (and lane) first
};
// Every following launch runs under `schedule`; returns the schedule it replaces.
Schedule set_schedule(Schedule schedule);
// set_schedule(reverse ? kReverse : kForward).
void set_reverse_schedule(bool reverse);
// The launches of a scope under `schedule` (0 .. 3, a Schedule; < 0: the one in force), the one
// before restored at its end.
struct ScopedSchedule {
  int previous = -1;
  explicit ScopedSchedule(int schedule) {
    if (schedule >= 0) previous = set_schedule(static_cast<Schedule>(schedule));
  }
  ~ScopedSchedule() {
    if (previous >= 0) set_schedule(static_cast<Schedule>(previous));
  }
  ScopedSchedule(const ScopedSchedule&) = delete;
  ScopedSchedule& operator=(const ScopedSchedule&) = delete;
};
// The SM count cudaDeviceGetAttribute reports from now on (n >= 1); returns the previous one.
int set_sm_count(int n);
// Stops the launch with message (called from kernel code: never returns).
[[noreturn]] void fail(const char* message);

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
            cudaStream_t /*stream: every launch completes at once*/, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "FF_LAUNCH: wrong number of kernel arguments");
  using Params = std::tuple<std::decay_t<P>...>;
  struct Ctx {
    void (*kernel)(P...);
    Params params;
  } ctx{kernel, Params(std::forward<A>(args)...)};
  run_grid(name, reinterpret_cast<const void*>(kernel), grid, block, smem_bytes,
           [](void* c) {
             Ctx* x = static_cast<Ctx*>(c);
             std::apply(x->kernel, x->params);  // by value: every thread gets its own copies
           },
           &ctx);
}

}  // namespace ff_simt

// cudaFuncSetAttribute(kernel, attr, value), as the CUDA runtime's template overload takes it.
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ff_simt::set_func_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}

namespace ff_simt {

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp intrinsics move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace ff_simt

// ---------------------------------------------------------------- barriers and warp intrinsics
inline void __syncthreads() { ff_simt::block_barrier(ff_simt::kSync, 0); }
inline int __syncthreads_count(int pred) { return ff_simt::block_barrier(ff_simt::kSyncCount, pred); }
inline int __syncthreads_and(int pred) { return ff_simt::block_barrier(ff_simt::kSyncAnd, pred); }
inline int __syncthreads_or(int pred) { return ff_simt::block_barrier(ff_simt::kSyncOr, pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ff_simt::warp_op(ff_simt::kSyncWarp, mask, 0, 0, 32);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ff_simt::from_bits<T>(
      ff_simt::warp_op(ff_simt::kShflIdx, mask, ff_simt::to_bits(var), src_lane, width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ff_simt::from_bits<T>(
      ff_simt::warp_op(ff_simt::kShflXor, mask, ff_simt::to_bits(var), lane_mask, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ff_simt::from_bits<T>(ff_simt::warp_op(ff_simt::kShflUp, mask, ff_simt::to_bits(var),
                                                static_cast<int>(delta), width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ff_simt::from_bits<T>(ff_simt::warp_op(ff_simt::kShflDown, mask, ff_simt::to_bits(var),
                                                static_cast<int>(delta), width));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(ff_simt::warp_op(ff_simt::kBallot, mask, pred != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(ff_simt::warp_op(ff_simt::kAny, mask, pred != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(ff_simt::warp_op(ff_simt::kAll, mask, pred != 0, 0, 32));
}

// Fences: every thread sees every earlier write here (one OS thread); a compiler barrier.
inline void __threadfence() { __asm__ __volatile__("" ::: "memory"); }
inline void __threadfence_block() { __asm__ __volatile__("" ::: "memory"); }

// ---------------------------------------------------------------- integer atomics
#define FF_SIMT_ATOMICS(T)                                                                   \
  inline T atomicAdd(T* a, T v) { T o = *a; *a = o + v; return o; }                          \
  inline T atomicExch(T* a, T v) { T o = *a; *a = v; return o; }                             \
  inline T atomicMin(T* a, T v) { T o = *a; *a = v < o ? v : o; return o; }                  \
  inline T atomicMax(T* a, T v) { T o = *a; *a = v > o ? v : o; return o; }                  \
  inline T atomicCAS(T* a, T cmp, T v) { T o = *a; *a = o == cmp ? v : o; return o; }        \
  inline T atomicAnd(T* a, T v) { T o = *a; *a = o & v; return o; }                          \
  inline T atomicOr(T* a, T v) { T o = *a; *a = o | v; return o; }                           \
  inline T atomicXor(T* a, T v) { T o = *a; *a = o ^ v; return o; }
FF_SIMT_ATOMICS(int)
FF_SIMT_ATOMICS(unsigned)
FF_SIMT_ATOMICS(unsigned long long)
#undef FF_SIMT_ATOMICS
inline int atomicSub(int* a, int v) { int o = *a; *a = o - v; return o; }
inline unsigned atomicSub(unsigned* a, unsigned v) { unsigned o = *a; *a = o - v; return o; }

// ---------------------------------------------------------------- __half and __nv_bfloat16
namespace ff_simt {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 from binary32, round to nearest even (c10::Half's rule; NaN -> sign | 0x7E00).
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (x >= 0x38800000u) {  // a normal half (>= 2^-14): rebias the exponent, round 13 bits off
    const uint32_t r = x - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 (or the tie 2^-25): 0
  // a subnormal half: value = m * 2^-24, m = M * 2^(e - 126), M the 24-bit significand
  const uint32_t e = x >> 23, M = (x & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14 .. 24
  uint32_t m = M >> shift;
  const uint32_t rem = M & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return static_cast<uint16_t>(sign | m);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_float(sign | 0x7F800000u | (m << 13));  // inf / NaN
  if (e == 0) {  // zero or subnormal: m * 2^-24 is exact in float
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

// bfloat16 from binary32, round to nearest even (c10::BFloat16's rule; NaN -> 0x7FC0).
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_bits(f);
  if (std::isnan(f)) return 0x7FC0u;
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// A 16-bit float of the CUDA headers: its bits, and conversions through `from` / `to` (float).
template <uint16_t (*from)(float), float (*to)(uint16_t)>
struct __attribute__((aligned(2))) Float16 {
  uint16_t __x;
  Float16() = default;
  Float16(float f) : __x(from(f)) {}
  Float16(double d) : __x(from(static_cast<float>(d))) {}
  Float16(int i) : __x(from(static_cast<float>(i))) {}
  Float16(unsigned i) : __x(from(static_cast<float>(i))) {}
  operator float() const { return to(__x); }
};

}  // namespace ff_simt

// Distinct types (the kernels overload on them), one layout.
struct __half : ff_simt::Float16<ff_simt::float_to_half_bits, ff_simt::half_bits_to_float> {
  using Float16::Float16;
};
struct __nv_bfloat16 : ff_simt::Float16<ff_simt::float_to_bf16_bits, ff_simt::bf16_bits_to_float> {
  using Float16::Float16;
};

struct __attribute__((aligned(4))) __half2 {
  __half x, y;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.__x = u; return b; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return float2{float(b.x), float(b.y)}; }

// ---------------------------------------------------------------- math and bit intrinsics
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __exp2f(float x) { return exp2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }

#define FF_SIMT_MINMAX(T)                              \
  inline T min(T a, T b) { return b < a ? b : a; }    \
  inline T max(T a, T b) { return a < b ? b : a; }
FF_SIMT_MINMAX(int)
FF_SIMT_MINMAX(unsigned)
FF_SIMT_MINMAX(long)
FF_SIMT_MINMAX(unsigned long)
FF_SIMT_MINMAX(long long)
FF_SIMT_MINMAX(unsigned long long)
#undef FF_SIMT_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) {
  return static_cast<int>((static_cast<long long>(a) * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline unsigned __float_as_uint(float f) { return ff_simt::float_bits(f); }
inline float __uint_as_float(unsigned u) { return ff_simt::bits_float(u); }
inline int __float_as_int(float f) { return static_cast<int>(ff_simt::float_bits(f)); }
inline float __int_as_float(int i) { return ff_simt::bits_float(static_cast<uint32_t>(i)); }

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
// ld.global.cg / st.global.cg (L2 only, past a possibly stale L1): plain accesses here.
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
template <typename T>
inline void __stcg(T* p, T v) {
  *p = v;
}

namespace ff_simt {
// A block's spin until *flag >= target, set by an EARLIER block (an ordered accumulation across
// blocks: csrc/cuda/flash_bwd_mma.cu's dQ). Blocks run one at a time in blockIdx order, so the
// flag is already set, or no block will set it while this one spins: stop the launch instead of
// hanging (on a GPU such a spin waits on a block that may never be scheduled).
inline void spin_until_at_least(const int* flag, int target) {
  if (*static_cast<const volatile int*>(flag) < target) {
    fail("a block spins on a flag that no earlier block set (blocks run one at a time in blockIdx "
         "order): it would wait forever");
  }
}
}  // namespace ff_simt
