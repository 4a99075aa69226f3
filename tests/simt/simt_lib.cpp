// The SIMT harness library's registrations: the fastformer op schemas under the namespace
// fastformer_simt (implemented for CPU tensors by the CUDA glue, csrc/cuda/*.cpp, compiled with
// -DFF_SIMT), and the harness's own test ops fastformer_simt_selftest::* (tests/test_simt.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "checks/cross_entropy.h"
#include "glue.h"
#include "schemas.h"
#include "selftest.h"

TORCH_LIBRARY(fastformer_simt, m) { ff_define_schemas(m); }

namespace ff_simt {
int set_sm_count(int n);  // simt.h (not included here: its CUDA keywords are for kernel code)
}

namespace {

at::Tensor checked(const at::Tensor& t, const char* name, at::ScalarType dtype, const char* op) {
  ff_check_tensor(t, name, op);
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  return t.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> warp(const at::Tensor& x_in,
                                                                int64_t threads) {
  const at::Tensor x = checked(x_in, "x", at::kFloat, "warp");
  TORCH_CHECK(x.dim() == 1 && x.numel() % 32 == 0, "warp: x must be 1-D with a multiple of 32 elements");
  at::Tensor a = at::empty_like(x), b = at::empty_like(x), c = at::empty_like(x);
  at::Tensor ballot = at::empty(x.sizes(), x.options().dtype(at::kInt));
  FF_CHECK_LAUNCH(launch_selftest_warp(x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                                       c.data_ptr<float>(), ballot.data_ptr<int32_t>(), x.numel(),
                                       static_cast<int>(threads), ff_stream(x)));
  return {a, b, c, ballot};
}

at::Tensor transpose(const at::Tensor& x_in) {
  const at::Tensor x = checked(x_in, "x", at::kFloat, "transpose");
  TORCH_CHECK(x.dim() == 2, "transpose: x must be 2-D");
  at::Tensor out = at::empty({x.size(1), x.size(0)}, x.options());
  FF_CHECK_LAUNCH(launch_selftest_transpose(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                                            x.size(1), ff_stream(x)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> reverse(const at::Tensor& x_in, int64_t threads) {
  const at::Tensor x = checked(x_in, "x", at::kFloat, "reverse");
  TORCH_CHECK(threads > 0 && x.numel() % threads == 0, "reverse: numel must be a multiple of threads");
  at::Tensor out = at::empty_like(x);
  at::Tensor count = at::zeros({1}, x.options().dtype(at::kInt));
  FF_CHECK_LAUNCH(launch_selftest_reverse(x.data_ptr<float>(), out.data_ptr<float>(),
                                          count.data_ptr<int32_t>(), x.numel(),
                                          static_cast<int>(threads), ff_stream(x)));
  return {out, count};
}

at::Tensor broken(int64_t mode) {
  at::Tensor scratch = at::zeros({64}, at::kFloat);
  FF_CHECK_LAUNCH(launch_selftest_broken(static_cast<int>(mode), scratch.data_ptr<float>(), nullptr));
  return scratch;
}

at::Tensor to_bits(const at::Tensor& x_in, int64_t kind) {
  const at::Tensor x = checked(x_in, "x", at::kFloat, "to_bits");
  at::Tensor bits = at::empty(x.sizes(), x.options().dtype(at::kShort));
  FF_CHECK_LAUNCH(launch_selftest_to_bits(x.data_ptr<float>(), bits.data_ptr<int16_t>(), x.numel(),
                                          static_cast<int>(kind), ff_stream(x)));
  return bits;
}

at::Tensor from_bits(const at::Tensor& bits_in, int64_t kind) {
  const at::Tensor bits = checked(bits_in, "bits", at::kShort, "from_bits");
  at::Tensor x = at::empty(bits.sizes(), bits.options().dtype(at::kFloat));
  FF_CHECK_LAUNCH(launch_selftest_from_bits(bits.data_ptr<int16_t>(), x.data_ptr<float>(),
                                            bits.numel(), static_cast<int>(kind), ff_stream(bits)));
  return x;
}

at::Tensor many_blocks(int64_t blocks) {
  at::Tensor out = at::empty({blocks}, at::kInt);
  FF_CHECK_LAUNCH(launch_selftest_many_blocks(out.data_ptr<int32_t>(), blocks, nullptr));
  return out;
}

at::Tensor racy(int64_t n, bool reverse) {
  at::Tensor out = at::empty({n}, at::kFloat);
  FF_CHECK_LAUNCH(launch_selftest_racy(out.data_ptr<float>(), static_cast<int>(n), reverse, nullptr));
  return out;
}

// The harness's modelled SM count from now on (n >= 1; 0 only reads it): returns the previous one.
int64_t set_sm_count(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= 1 << 20, "set_sm_count: n must be in [0, 2^20], got ", n);
  const int previous = ff_simt::set_sm_count(n == 0 ? -1 : static_cast<int>(n));
  return previous;
}

// The harness's modelled free device memory from now on (bytes; -1: none, the glue's CPU-rule
// fallbacks): returns the previous amount.
int64_t set_free_memory(int64_t bytes) {
  TORCH_CHECK(bytes >= -1, "set_free_memory: bytes must be >= -1 (-1: none modelled), got ", bytes);
  const int64_t previous = ff_simt_free_bytes();
  ff_simt_free_bytes() = bytes;
  return previous;
}

// linear_cross_entropy's rows per chunk on a GPU (csrc/checks/cross_entropy.h), for its tests.
int64_t lce_device_chunk_rows(int64_t n, int64_t V, int64_t elem_size, int64_t free_bytes) {
  return fastformer::checks::linear_cross_entropy_device_chunk_rows(n, V, elem_size, free_bytes);
}

}  // namespace

TORCH_LIBRARY(fastformer_simt_selftest, m) {
  m.def("warp(Tensor x, int threads) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("transpose(Tensor x) -> Tensor");
  m.def("reverse(Tensor x, int threads) -> (Tensor, Tensor)");
  m.def("broken(int mode) -> Tensor");
  m.def("to_bits(Tensor x, int kind) -> Tensor");
  m.def("from_bits(Tensor bits, int kind) -> Tensor");
  m.def("many_blocks(int blocks) -> Tensor");
  m.def("racy(int n, bool reverse) -> Tensor");
  m.def("set_sm_count(int n) -> int");
  m.def("set_free_memory(int bytes) -> int");
  m.def("lce_device_chunk_rows(int n, int V, int elem_size, int free_bytes) -> int");
}

TORCH_LIBRARY_IMPL(fastformer_simt_selftest, CPU, m) {
  m.impl("warp", &warp);
  m.impl("transpose", &transpose);
  m.impl("reverse", &reverse);
  m.impl("to_bits", &to_bits);
  m.impl("from_bits", &from_bits);
}

// Ops without a tensor argument dispatch through CompositeExplicitAutograd.
TORCH_LIBRARY_IMPL(fastformer_simt_selftest, CompositeExplicitAutograd, m) {
  m.impl("broken", &broken);
  m.impl("many_blocks", &many_blocks);
  m.impl("racy", &racy);
  m.impl("set_sm_count", &set_sm_count);
  m.impl("set_free_memory", &set_free_memory);
  m.impl("lce_device_chunk_rows", &lce_device_chunk_rows);
}
