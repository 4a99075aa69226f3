// Launchers of the harness's own test kernels (tests/simt/selftest.cu), called by the
// fastformer_simt_selftest ops of simt_lib.cpp and exercised by tests/test_simt.py. Plain C++, the
// same shape as csrc/cuda/launchers.h: nullptr on success, else the error string.
#pragma once
#include <cstdint>

// Per warp of n (a multiple of 32) floats: the sum by __shfl_xor_sync butterfly and by
// __shfl_down_sync (lane 0's value, broadcast with __shfl_sync), the inclusive prefix sum by
// __shfl_up_sync, and __ballot_sync(x > 0); block (threads,), grid-stride over the warps.
const char* launch_selftest_warp(const float* x, float* xor_sum, float* down_sum, float* scan,
                                 int32_t* ballot, int64_t n, int threads, void* stream);
// out (C, R) = x (R, C)^T through 32 x 33 tiles of static shared memory, block (32, 8).
const char* launch_selftest_transpose(const float* x, float* out, int64_t R, int64_t C,
                                      void* stream);
// Each block reverses its `threads` consecutive elements of x (n a multiple of threads) through
// dynamic shared memory; count (one int32) gets the number of positive elements by atomicAdd.
const char* launch_selftest_reverse(const float* x, float* out, int32_t* count, int64_t n,
                                    int threads, void* stream);
// A kernel that breaks the model in the way `mode` says (see selftest.cu); returns the error.
const char* launch_selftest_broken(int mode, float* scratch, void* stream);
// bits (int16) = __float2half_rn(x) / __float2bfloat16_rn(x) (kind 0 / 1); back: floats from bits.
const char* launch_selftest_to_bits(const float* x, int16_t* bits, int64_t n, int kind, void* stream);
const char* launch_selftest_from_bits(const int16_t* bits, float* x, int64_t n, int kind,
                                      void* stream);
// blocks x 128 threads, three barriers each: out[b] = b + 127.
const char* launch_selftest_many_blocks(int32_t* out, int64_t blocks, void* stream);
// A racy kernel (no barrier between a shared-memory write and another thread's read): out[t] =
// what thread t read of thread (t + 1) % n's value t + 1, under the given schedule.
const char* launch_selftest_racy(float* out, int n, bool reverse, void* stream);
// The same under ff_simt::Schedule `schedule` (0 forward, 1 reverse, 2 warp_ahead,
// 3 warp_ahead_reverse, -1 the one in force); the schedule before it is restored after the launch.
const char* launch_selftest_racy_under(float* out, int n, int schedule, void* stream);
// A cross-warp race (tests/test_simt.py): one block of two warps, each stores its lanes' values
// to shared memory, meets at __syncwarp, then (with `barrier` after __syncthreads) reads the
// other warp's: out[t] = what thread t read of thread t ^ 32's value t ^ 32 + 1, under schedule
// `schedule` (as above; restored after the launch).
const char* launch_selftest_cross_warp(float* out, int schedule, bool barrier, void* stream);
