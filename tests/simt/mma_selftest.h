// Launchers of the tensor-core wrapper test kernels (tests/simt/mma_selftest.cu), called by the
// fastformer_simt_selftest ops of simt_lib.cpp and exercised by tests/test_cuda_mma.py. Plain C++,
// the same shape as csrc/cuda/launchers.h: nullptr on success, else the error string.
#pragma once
#include <cstdint>

// One mma per tile, from registers given per lane: a (tiles, 32, 4), b (tiles, 32, 2) as raw bits,
// c and d (tiles, 32, 4) fp32, d = a b + c. kind: 0 m16n8k16 bf16, 1 m16n8k16 f16, 2 m16n8k8 tf32.
// Blocks of two warps, a warp a tile.
const char* launch_selftest_mma_fragments(const uint32_t* a, const uint32_t* b, const float* c,
                                          float* d, int64_t tiles, int kind, void* stream);
// out = ff_float_to_tf32(x) (cvt.rna.tf32.f32), as bits.
const char* launch_selftest_tf32(const float* x, uint32_t* out, int64_t n, void* stream);
// tile (n 16-bit elements) copied to dynamic shared memory; lane l of a block of `threads` gives
// the row address tile + offsets[l] (elements) to ldmatrix .x`num` (.trans if trans); out
// (threads, num) gets every lane's registers.
const char* launch_selftest_ldmatrix(const uint16_t* tile, int64_t n, const int32_t* offsets,
                                     int threads, int num, bool trans, uint32_t* out, void* stream);
// d (M, N) fp32 = a (M, K) b + c (M, N) fp32 with ldmatrix + mma.sync m16n8k16 over 16 x 16 output
// tiles (a warp each, blocks of two warps), K in steps of 16 through a two-stage cp.async pipeline
// with zero-fill at the edges. b is (N, K) row-major (b_kmajor false: the plain ldmatrix gives its
// fragments) or (K, N) row-major (b_kmajor true: ldmatrix .trans). K, and N when b_kmajor, must be
// multiples of 8 (16-byte rows). dtype: 1 float16, 2 bfloat16. mistake (the tests that layouts
// and waits matter): 0 none, 1 B through the other ldmatrix form, 2 A's registers a[1] and a[2]
// swapped, 3 cp.async.wait_group 2 where 1 is needed.
const char* launch_selftest_mma_gemm(const void* a, const void* b, const float* c, float* d,
                                     int64_t M, int64_t N, int64_t K, int dtype, bool b_kmajor,
                                     int mistake, void* stream);
// Thread t of one block of chunks / 2 copies the 16-byte chunks 2t (group 0) and 2t + 1 (group 1)
// of src into dynamic shared memory by cp.async with src-size sizes[chunk] (16: the plain form);
// mid gets the thread's two chunks after cp.async.wait_group 1, out after wait_group 0.
const char* launch_selftest_cp_async(const uint8_t* src, const int32_t* sizes, int64_t chunks,
                                     uint8_t* mid, uint8_t* out, void* stream);
// When opt_in >= 0, cudaFuncSetAttribute(kernel `which` (0 or 1), MaxDynamicSharedMemorySize,
// opt_in) first; then kernel `which` with `bytes` of dynamic shared memory (256 threads) fills it
// with the float index of every element and writes it back reversed: out (bytes / 4) fp32.
const char* launch_selftest_big_smem(int which, int64_t bytes, int64_t opt_in, float* out,
                                     void* stream);
// A kernel misusing the wrappers as `mode` says (see mma_selftest.cu; src: 16 bytes of global
// memory, 16-byte aligned); returns the error.
const char* launch_selftest_mma_broken(int mode, const uint8_t* src, void* stream);
// A stage refilled by cp.async while (without `barrier`) the other warp may still read it: one
// block of two warps; src 512 floats (16-byte aligned); out (128): out[t] = the first float of
// chunk t ^ 32 of the stage before the refill (src[4 (t ^ 32)] unless the refill landed first),
// out[64 + t] the same after it (src[256 + 4 (t ^ 32)]), under ff_simt::Schedule `schedule`
// (0 forward, 1 reverse, 2 warp_ahead, 3 warp_ahead_reverse, -1 the one in force; restored
// after the launch).
const char* launch_selftest_refill(const float* src, float* out, int schedule, bool barrier,
                                   void* stream);
