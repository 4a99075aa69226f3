// Widening vector loads and narrowing stores for the CPU kernels.
//
// Every kernel computes in the accumulation type acc_t<T> (float for bf16 and fp32, double for
// fp64) with at::vec::Vectorized<acc_t<T>> registers: load(p) widens AccVec<T>::size()
// elements of T, load(p, n) the first n (the other lanes are 0), store(p, v[, n]) narrows back
// (round to nearest even), store_rounded also returns the value stored, widened again.
// vec_loop runs a body over a row in full vectors and one partial tail vector.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel.cpp (see isa.h)"
#endif
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <tuple>

namespace fastformer {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename T>
using acc_t = at::opmath_type<T>;  // float for bf16 / fp32, double for fp64
template <typename T>
using AccVec = Vectorized<acc_t<T>>;

inline Vectorized<float> load(const float* p, int64_t n = Vectorized<float>::size()) {
  return Vectorized<float>::loadu(p, n);
}
inline Vectorized<double> load(const double* p, int64_t n = Vectorized<double>::size()) {
  return Vectorized<double>::loadu(p, n);
}
inline Vectorized<float> load(const c10::BFloat16* p, int64_t n = Vectorized<float>::size()) {
  if (n == Vectorized<float>::size()) {
    Vectorized<float> out;
    at::vec::load_to_float(p, out);
    return out;
  }
  return std::get<0>(at::vec::convert_to_float(Vectorized<c10::BFloat16>::loadu(p, n)));
}

inline void store(float* p, const Vectorized<float>& v, int64_t n = Vectorized<float>::size()) {
  v.store(p, n);
}
inline void store(double* p, const Vectorized<double>& v, int64_t n = Vectorized<double>::size()) {
  v.store(p, n);
}
inline void store(c10::BFloat16* p, const Vectorized<float>& v,
                  int64_t n = Vectorized<float>::size()) {
  at::vec::convert_from_float<c10::BFloat16>(v, v).store(p, n);
}

// Stores v to p as T and returns what was stored, widened back (v rounded to T's precision).
inline Vectorized<float> store_rounded(float* p, const Vectorized<float>& v,
                                       int64_t n = Vectorized<float>::size()) {
  v.store(p, n);
  return v;
}
inline Vectorized<double> store_rounded(double* p, const Vectorized<double>& v,
                                        int64_t n = Vectorized<double>::size()) {
  v.store(p, n);
  return v;
}
inline Vectorized<float> store_rounded(c10::BFloat16* p, const Vectorized<float>& v,
                                       int64_t n = Vectorized<float>::size()) {
  const Vectorized<c10::BFloat16> r = at::vec::convert_from_float<c10::BFloat16>(v, v);
  r.store(p, n);
  return std::get<0>(at::vec::convert_to_float(r));
}

template <typename A>
inline A hsum(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>([](const Vectorized<A>& a, const Vectorized<A>& b) { return a + b; }, v);
}

// body(j, n) for j = 0, W, 2W, ... over [0, len): n == W for full vectors, n < W for the tail.
template <int64_t W, typename Body>
inline void vec_loop(int64_t len, Body&& body) {
  int64_t j = 0;
  for (; j + W <= len; j += W) body(j, W);
  if (j < len) body(j, len - j);
}

}  // namespace CPU_CAPABILITY
}  // namespace fastformer
