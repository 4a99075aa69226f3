// Torch-side helpers for the CUDA glue files csrc/cuda/<op>.cpp. No CUDA header is included:
// the glue compiles against a CPU-only torch too, and with -DFF_SIMT (the SIMT test harness,
// tests/simt/) it registers the same functions for CPU tensors under the namespace
// fastformer_simt.
//
//   FF_CUDA_IMPL(m) { m.impl("op", &fn); }   TORCH_LIBRARY_IMPL(fastformer, CUDA, m), or
//                                            TORCH_LIBRARY_IMPL(fastformer_simt, CPU, m)
//   kFfBackend                               what the kernels take (device, dtypes), for the
//                                            shared argument checks of csrc/checks/
//   ff_check_tensor(t, "name"[, op])         defined and on the kernel device (CUDA / CPU)
//   ff_dtype_code(t, "name"[, op])           0 float32, 1 float16, 2 bfloat16, else TORCH_CHECK
//   ff_stream(t)                             the current stream of t's device as void*
//   FF_CHECK_LAUNCH(launch_xxx(...))         TORCH_CHECK on a launcher's returned error string
//   ff_philox_args(philox, op, like, p)      the (seed, offset) the launchers take, from `Tensor philox`
//                                            (a CPU tensor read here, or a device pointer)
//   ff_check_aligned(t, "name", bytes, op)   the data pointer is a multiple of bytes
//   ff_device_free_bytes(t)                  memory t's device has to spare (-1: unknown)
#pragma once

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include "../checks/common.h"
#include "../philox_arg.h"

#include <cmath>
#include <cstdint>

#ifdef FF_SIMT
#define FF_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(fastformer_simt, CPU, m)
constexpr c10::DeviceType kFfKernelDevice = c10::DeviceType::CPU;
constexpr const char* kFfKernelDeviceName = "CPU (the SIMT harness)";
#else
#define FF_CUDA_IMPL(m) TORCH_LIBRARY_IMPL(fastformer, CUDA, m)
constexpr c10::DeviceType kFfKernelDevice = c10::DeviceType::CUDA;
constexpr const char* kFfKernelDeviceName = "CUDA";
#endif

// The CUDA kernels take fp32, fp16 and bf16 tensors on the kernel device.
constexpr fastformer::checks::Backend kFfBackend{kFfKernelDevice, kFfKernelDeviceName,
                                                 {at::kFloat, at::kHalf, at::kBFloat16},
                                                 "float32, float16 or bfloat16"};

#define FF_CHECK_LAUNCH(call)                                                          \
  do {                                                                                 \
    const char* ff_launch_error_ = (call);                                             \
    TORCH_CHECK(ff_launch_error_ == nullptr, "fastformer CUDA kernel launch failed: ", \
                ff_launch_error_, " (", __FILE__, ":", __LINE__, ")");                \
  } while (0)

inline void ff_check_tensor(const at::Tensor& t, const char* name, const char* op = nullptr) {
  fastformer::checks::check_device(kFfBackend, op ? op : "fastformer", name, t);
}

// The launchers' dtype code of t: 0 float32, 1 float16, 2 bfloat16.
inline int ff_dtype_code(const at::Tensor& t, const char* name, const char* op = nullptr) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default:
      fastformer::checks::check_float_dtype(kFfBackend, op ? op : "fastformer", name, t);  // throws
  }
  return -1;
}

// The current stream of t's device (nullptr under the harness, which has no streams), through
// c10's device-agnostic guard interface: no CUDA header needed.
inline void* ff_stream(const at::Tensor& t) {
#ifdef FF_SIMT
  (void)t;
  return nullptr;
#else
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  return impl.getStreamNativeHandle(impl.getStream(t.device()));
#endif
}

// The dropout RNG state the launchers take, from the op's `Tensor philox` = (seed, offset), int64
// of shape (2,), in one of two forms:
//   * on the CPU: read here on the host (fastformer::read_philox, its checks and messages) and
//     passed by value; ptr is null;
//   * on the op's device (drawn there by torch's CUDA generator, which a captured CUDA graph
//     replays with new values): checked (dtype, shape, contiguity, device) but never read on the
//     host; the kernels read seed = ptr[0], offset = ptr[1] on the device (ff_philox_resolve,
//     philox.cuh). Its values must be >= 0, as a CPU philox's; they cannot be checked here.
// With dropout_p == 0 the kernels read nothing: ptr is null whatever the form (a CPU philox is
// still checked and read, as before).
// Under the SIMT harness the "device" is the CPU too: a CPU philox takes the device form while
// ff_simt_philox_on_device() is set (fastformer_simt_selftest::set_philox_on_device), so the
// tests run the pointer path on the CPU.
struct FfPhiloxArgs {
  uint64_t seed;
  uint64_t offset;
  const int64_t* ptr;  // the device (seed, offset) the kernels read instead of seed / offset, or null
};

#ifdef FF_SIMT
inline bool& ff_simt_philox_on_device() {
  static bool on = false;
  return on;
}
#endif

// Whether `philox` takes the host form (read on the CPU).
inline bool ff_philox_on_host(const at::Tensor& philox) {
#ifdef FF_SIMT
  return philox.device().is_cpu() && !ff_simt_philox_on_device();
#else
  return philox.device().is_cpu();
#endif
}

// `like`: a tensor of the op on its device (the device a device philox must be on).
inline FfPhiloxArgs ff_philox_args(const at::Tensor& philox, const char* op, const at::Tensor& like,
                                   double dropout_p) {
  if (!philox.defined() || ff_philox_on_host(philox)) {
    const auto [seed, offset] = fastformer::read_philox(op, philox);
    return {static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), nullptr};
  }
  TORCH_CHECK(philox.device() == like.device(), op, ": philox must be an int64 CPU tensor or on the op's "
              "device ", like.device(), " (shape (2,) = (seed, offset)), got a philox on device ",
              philox.device(), " for tensors on ", like.device());
  TORCH_CHECK(philox.scalar_type() == at::kLong, op, ": philox must be int64 (shape (2,) = (seed, offset)), got ",
              philox.scalar_type());
  TORCH_CHECK(philox.dim() == 1 && philox.size(0) == 2, op,
              ": philox must have shape (2,) = (seed, offset), got ", philox.sizes());
  TORCH_CHECK(philox.is_contiguous(), op, ": philox must be contiguous, got strides ", philox.strides());
  return {0, 0, dropout_p > 0.0 ? philox.const_data_ptr<int64_t>() : nullptr};
}

inline void ff_check_aligned(const at::Tensor& t, const char* name, int64_t bytes, const char* op) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % static_cast<uintptr_t>(bytes) == 0,
              op, ": ", name, " must be ", bytes, "-byte aligned (its data pointer is not)");
}

#ifdef FF_SIMT
// The harness's modelled free device memory in bytes, -1 (the default) for none: the tests set it
// (fastformer_simt_selftest::set_free_memory) to run the device-sized paths on small inputs.
inline int64_t& ff_simt_free_bytes() {
  static int64_t bytes = -1;
  return bytes;
}
#endif

// The memory t's device has to spare, in bytes: the driver's free memory plus what the caching
// allocator holds reserved but unallocated (it hands that out first); the driver's alone when the
// allocator keeps no statistics (a pluggable one), -1 when not even that can be read. Under the
// harness the modelled amount, -1 when none is modelled.
inline int64_t ff_device_free_bytes(const at::Tensor& t) {
#ifdef FF_SIMT
  (void)t;
  return ff_simt_free_bytes();
#else
  const c10::DeviceIndex device = t.device().index();
  c10::DeviceAllocator* alloc = nullptr;
  int64_t driver_free = -1;
  try {
    alloc = c10::getDeviceAllocator(t.device().type());
    driver_free = static_cast<int64_t>(alloc->getMemoryInfo(device).first);
  } catch (const c10::Error&) {
    return -1;
  }
  try {
    const auto stats = alloc->getDeviceStats(device);
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const int64_t cached = stats.reserved_bytes[all].current - stats.allocated_bytes[all].current;
    return driver_free + (cached > 0 ? cached : 0);
  } catch (const c10::Error&) {
    return driver_free;
  }
#endif
}
