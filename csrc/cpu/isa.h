// Run-time choice of the CPU kernels' instruction set, as ATen's DispatchStub does it.
//
// The kernel math (csrc/cpu/*_kernel.cpp) is compiled once per level, from the same source, into
// the namespace fastformer::<level>: DEFAULT (x86-64 baseline, or the only level off x86),
// AVX2 (-mavx2 -mfma -mf16c -mbmi2) and AVX512 (-mavx512f -mavx512bw -mavx512vl -mavx512dq
// ...); the build defines CPU_CAPABILITY=<level> and CPU_CAPABILITY_<level> there, which also
// picks at::vec::Vectorized's width. Everything else (argument checks, op registration) is
// compiled once for the baseline and calls FF_ISA(fn)(args...), the `fn` of the chosen level.
//
// The level is at::get_cpu_capability() (ATen's choice, which honours ATEN_CPU_CAPABILITY=
// default|avx2|avx512, so one variable forces torch and fastformer alike), lowered to what this
// CPU runs: ATen takes ATEN_CPU_CAPABILITY=avx512 at its word, fastformer never does.
#pragma once
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define FF_ISA_X86 1
#else
#define FF_ISA_X86 0
#endif

namespace fastformer {
namespace isa {

enum class Level { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The level the kernels run at, decided on the first call (thread-safe) and then fixed.
Level chosen();

// "DEFAULT", "AVX2" or "AVX512" (ATen's spelling).
const char* name(Level level);

template <typename F>
F pick(F default_fn, F avx2_fn, F avx512_fn) {
  switch (chosen()) {
    case Level::kAvx512: return avx512_fn;
    case Level::kAvx2: return avx2_fn;
    default: return default_fn;
  }
}

}  // namespace isa
}  // namespace fastformer

// FF_ISA_DECLARE(decl) declares a kernel entry point in every level's namespace; use it inside
// namespace fastformer. FF_ISA(fn) is the chosen level's fastformer::<level>::fn.
#if FF_ISA_X86
#define FF_ISA_DECLARE(...)   \
  namespace DEFAULT {         \
  __VA_ARGS__;                \
  }                           \
  namespace AVX2 {            \
  __VA_ARGS__;                \
  }                           \
  namespace AVX512 {          \
  __VA_ARGS__;                \
  }
#define FF_ISA(fn) \
  ::fastformer::isa::pick(&::fastformer::DEFAULT::fn, &::fastformer::AVX2::fn, &::fastformer::AVX512::fn)
#else
#define FF_ISA_DECLARE(...) \
  namespace DEFAULT {       \
  __VA_ARGS__;              \
  }
#define FF_ISA(fn) (&::fastformer::DEFAULT::fn)
#endif

