// The run-time ISA level of the CPU kernels (isa.h) and the op fastformer::cpu_capability() that
// reports it, so a user (python -m fastformer check, the bench's machine info) sees which build ran.
#include "isa.h"

#include <ATen/Version.h>
#include <torch/library.h>

namespace fastformer {
namespace isa {
namespace {

// The widest level this CPU (and its OS, which must save the vector registers) runs.
Level cpu_best() {
#if FF_ISA_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2")) {
    return Level::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")) {
    return Level::kAvx2;
  }
#endif
  return Level::kDefault;
}

Level compute() {
  const std::string aten = at::get_cpu_capability();  // "DEFAULT", "AVX2", "AVX512", "VSX", ...
  Level want = Level::kDefault;
#if FF_ISA_X86
  if (aten == "AVX512") want = Level::kAvx512;
  if (aten == "AVX2") want = Level::kAvx2;
#endif
  const Level best = cpu_best();
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

}  // namespace

Level chosen() {
  static const Level level = compute();
  return level;
}

const char* name(Level level) {
  switch (level) {
    case Level::kAvx512: return "AVX512";
    case Level::kAvx2: return "AVX2";
    default: return "DEFAULT";
  }
}

std::string cpu_capability() { return name(chosen()); }

}  // namespace isa
}  // namespace fastformer

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  // The ISA level the CPU kernels run at: "DEFAULT", "AVX2" or "AVX512".
  m.def("cpu_capability() -> str", &fastformer::isa::cpu_capability);
}
