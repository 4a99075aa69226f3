// The tile products of the CPU attention kernels: C (M, N) = A (M, K) B (K, N), or C += A B with
// accumulate, every matrix row-major with its own leading dimension.
//
// fp32 runs on at::native::cpublas::brgemm: oneDNN's JIT-compiled brgemm ukernel where the CPU
// has one (AVX2 and up; kernels cached per shape and thread), torch's MKL sgemm otherwise. At
// attention tile sizes the ukernel is ~3x faster than MKL's sgemm (64 x 64 x 64: 2.2 us against
// 5.7 us measured on AMD EPYC / AVX-512), which spends its time packing operands.
// fp64 (gradcheck) runs on MKL's dgemm_ when torch has MKL, else (or with -DFASTFORMER_NO_MKL) on
// at::mm over tile views.
//
// bf16 tiles are converted to fp32 by the caller: MKL's cblas_gemm_bf16bf16f32 was measured to
// take ~50 ms for one 64^3 product on AMD EPYC whenever torch ran more than one thread, and
// oneDNN's bf16 brgemm wants B in the VNNI layout (which torch packs only on AMX CPUs).
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <ATen/ATen.h>
#include <ATen/Config.h>
#include <ATen/native/CPUBlas.h>

#include <cstdint>

#if AT_MKL_ENABLED() && !defined(FASTFORMER_NO_MKL)
#define FASTFORMER_ATTENTION_MKL 1
extern "C" {
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
int MKL_Set_Num_Threads_Local(int nthreads);
}
#endif

namespace fastformer {
namespace CPU_CAPABILITY {
namespace attn {

inline void matmul(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

#ifdef FASTFORMER_ATTENTION_MKL

// Row-major C = A B is column-major C^T = B^T A^T: swap the operands (and M with N).
inline void matmul(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                   int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const double alpha = 1.0, beta = accumulate ? 1.0 : 0.0;
  dgemm_("N", "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// MKL (fp64, and fp32 where brgemm falls back to it) runs single-threaded inside each parallel
// task: the parallelism is over tasks.
class BlasSingleThread {
 public:
  BlasSingleThread() : previous_(MKL_Set_Num_Threads_Local(1)) {}
  ~BlasSingleThread() { MKL_Set_Num_Threads_Local(previous_); }
  BlasSingleThread(const BlasSingleThread&) = delete;
  BlasSingleThread& operator=(const BlasSingleThread&) = delete;

 private:
  int previous_;
};

#else  // torch without MKL

inline void matmul(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda, const double* B,
                   int64_t ldb, double* C, int64_t ldc, bool accumulate) {
  const auto options = at::dtype(at::kDouble);
  const at::Tensor a = at::from_blob(const_cast<double*>(A), {M, K}, {lda, 1}, options);
  const at::Tensor b = at::from_blob(const_cast<double*>(B), {K, N}, {ldb, 1}, options);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, options);
  if (accumulate) {
    c.add_(at::mm(a, b));
  } else {
    c.copy_(at::mm(a, b));
  }
}

class BlasSingleThread {};

#endif

}  // namespace attn
}  // namespace CPU_CAPABILITY
}  // namespace fastformer
