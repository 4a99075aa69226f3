// Plain C++ declarations of every CUDA launcher (no CUDA headers), included by the glue .cpp files.
// Each returns nullptr on success, else the CUDA error string. dtype codes: 0 float32,
// 1 float16, 2 bfloat16. Pointers to element data are void*, sizes int64_t, stream a cudaStream_t.
#pragma once
#include <cstdint>

// ---- feed_forward (csrc/cuda/feed_forward.cu)
// pre (N, F): + b1 in place when b1 is not null; a (N, F) = dropout(act(pre)), Philox v2 with
// rows of C = F columns. activation: 0 relu, 1 gelu (exact erf).
const char* launch_feed_forward_act_fwd(void* pre, const void* b1, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream);
// a (N, F) = dropout(act(pre)); dpre (N, F) holds da on entry and dpre = da * keep * scale *
// act'(pre) on return (the same mask as the forward's).
const char* launch_feed_forward_act_bwd(const void* pre, void* dpre, void* a, int64_t N, int64_t F,
                                        int dtype, int activation, double dropout_p, uint64_t seed,
                                        uint64_t offset, void* stream);
// The number of row parts of launch_colsum's first stage for `rows` rows (its workspace is
// (parts, cols) fp32).
int64_t colsum_num_parts(int64_t rows);
// out (cols,) fp32 = (accumulate ? out : 0) + the column sums of x (rows, cols), two stages
// through partial (parts, cols) fp32, fixed order: deterministic, no atomics.
const char* launch_colsum(const void* x, int64_t rows, int64_t cols, int dtype, float* partial,
                          int64_t parts, float* out, int accumulate, void* stream);

// ---- cross_entropy (csrc/cuda/cross_entropy.cu), also used by linear_cross_entropy.cpp
// *count (int64) = the number of target values that are not ignore_index.
const char* launch_cross_entropy_count_valid(const int64_t* target, int64_t n, int64_t ignore_index,
                                             int64_t* count, void* stream);
// Per row of logits (n, V): loss_rows (n,) fp32 and, when grad is not null (it may alias
// logits), grad = (softmax - (1 - eps) onehot(t) - eps / V) * scale_i, where scale_i is
// row_scale[i] if given, else 1 / *mean_count if given (0 when it is 0), else scale; ignored
// rows get loss 0 and gradient 0. A target outside [0, V) that is not ignore_index gives nan and
// is never used as an address.
const char* launch_cross_entropy_fwd(const void* logits, const int64_t* target, void* grad,
                                     float* loss_rows, int64_t n, int64_t V, int dtype,
                                     double label_smoothing, int64_t ignore_index,
                                     const float* row_scale, const int64_t* mean_count,
                                     double scale, void* stream);
// out () in dtype = sum of loss_rows (n,) in a fixed order, / *mean_count when given.
const char* launch_cross_entropy_reduce(const float* loss_rows, int64_t n, const int64_t* mean_count,
                                        void* out, int dtype, void* stream);
