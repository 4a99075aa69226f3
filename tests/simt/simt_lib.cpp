// The SIMT harness library's registrations: the fastformer op schemas under the namespace
// fastformer_simt (implemented for CPU tensors by the CUDA glue, csrc/cuda/*.cpp, compiled with
// -DFF_SIMT), and the harness's own test ops fastformer_simt_selftest::* (tests/test_simt.py, and
// tests/test_cuda_mma.py for the tensor-core wrappers of csrc/cuda/mma.cuh).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "attention_call.h"
#include "checks/cross_entropy.h"
#include "flash_mma.h"
#include "glue.h"
#include "mma_selftest.h"
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

void check_schedule(int64_t schedule, const char* op) {
  TORCH_CHECK(schedule >= -1 && schedule <= 3, op,
              ": schedule must be 0 (forward), 1 (reverse), 2 (warp_ahead), 3 "
              "(warp_ahead_reverse) or -1 (the one in force), got ", schedule);
}

at::Tensor racy_under(int64_t n, int64_t schedule) {
  check_schedule(schedule, "racy_under");
  at::Tensor out = at::empty({n}, at::kFloat);
  FF_CHECK_LAUNCH(launch_selftest_racy_under(out.data_ptr<float>(), static_cast<int>(n),
                                             static_cast<int>(schedule), nullptr));
  return out;
}

at::Tensor cross_warp(int64_t schedule, bool barrier) {
  check_schedule(schedule, "cross_warp");
  at::Tensor out = at::empty({64}, at::kFloat);
  FF_CHECK_LAUNCH(launch_selftest_cross_warp(out.data_ptr<float>(), static_cast<int>(schedule),
                                             barrier, nullptr));
  return out;
}

at::Tensor refill(const at::Tensor& src_in, int64_t schedule, bool barrier) {
  check_schedule(schedule, "refill");
  const at::Tensor src = checked(src_in, "src", at::kFloat, "refill");
  TORCH_CHECK(src.numel() == 512, "refill: src must have 512 elements");
  at::Tensor out = at::empty({128}, src.options());
  FF_CHECK_LAUNCH(launch_selftest_refill(src.data_ptr<float>(), out.data_ptr<float>(),
                                         static_cast<int>(schedule), barrier, nullptr));
  return out;
}

// ---- the tensor-core wrappers (mma_selftest.cu); 32-bit registers travel as int32 tensors
template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

at::Tensor mma_fragments(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& c_in,
                         int64_t kind) {
  const at::Tensor a = checked(a_in, "a", at::kInt, "mma_fragments");
  const at::Tensor b = checked(b_in, "b", at::kInt, "mma_fragments");
  const at::Tensor c = checked(c_in, "c", at::kFloat, "mma_fragments");
  TORCH_CHECK(a.dim() == 3 && a.size(1) == 32 && a.size(2) == 4 && b.dim() == 3 &&
                  b.size(0) == a.size(0) && b.size(1) == 32 && b.size(2) == 2 &&
                  c.sizes() == a.sizes(),
              "mma_fragments: want a (tiles, 32, 4), b (tiles, 32, 2), c (tiles, 32, 4)");
  at::Tensor d = at::empty_like(c);
  FF_CHECK_LAUNCH(launch_selftest_mma_fragments(ptr<uint32_t>(a), ptr<uint32_t>(b), ptr<float>(c),
                                                ptr<float>(d), a.size(0), static_cast<int>(kind),
                                                nullptr));
  return d;
}

at::Tensor tf32(const at::Tensor& x_in) {
  const at::Tensor x = checked(x_in, "x", at::kFloat, "tf32");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kInt));
  FF_CHECK_LAUNCH(launch_selftest_tf32(ptr<float>(x), ptr<uint32_t>(out), x.numel(), nullptr));
  return out;
}

at::Tensor ldmatrix(const at::Tensor& tile_in, const at::Tensor& offsets_in, int64_t num, bool trans) {
  const at::Tensor tile = checked(tile_in, "tile", at::kShort, "ldmatrix");
  const at::Tensor offsets = checked(offsets_in, "offsets", at::kInt, "ldmatrix");
  TORCH_CHECK(offsets.dim() == 1, "ldmatrix: offsets must be 1-D (one per thread)");
  at::Tensor out = at::empty({offsets.size(0), num}, offsets.options());
  FF_CHECK_LAUNCH(launch_selftest_ldmatrix(ptr<uint16_t>(tile), tile.numel(), ptr<int32_t>(offsets),
                                           static_cast<int>(offsets.size(0)), static_cast<int>(num),
                                           trans, ptr<uint32_t>(out), nullptr));
  return out;
}

at::Tensor mma_gemm(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& c_in,
                    bool b_kmajor, int64_t mistake) {
  const int dtype = ff_dtype_code(a_in, "a", "mma_gemm");
  const at::Tensor a = checked(a_in, "a", a_in.scalar_type(), "mma_gemm");
  const at::Tensor b = checked(b_in, "b", a_in.scalar_type(), "mma_gemm");
  const at::Tensor c = checked(c_in, "c", at::kFloat, "mma_gemm");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "mma_gemm: a, b, c must be 2-D");
  const int64_t M = a.size(0), K = a.size(1), N = b_kmajor ? b.size(1) : b.size(0);
  TORCH_CHECK(b.size(b_kmajor ? 0 : 1) == K && c.size(0) == M && c.size(1) == N,
              "mma_gemm: want a (M, K), b (K, N) or (N, K), c (M, N)");
  at::Tensor d = at::empty_like(c);
  FF_CHECK_LAUNCH(launch_selftest_mma_gemm(a.data_ptr(), b.data_ptr(), ptr<float>(c), ptr<float>(d),
                                           M, N, K, dtype, b_kmajor, static_cast<int>(mistake),
                                           nullptr));
  return d;
}

std::tuple<at::Tensor, at::Tensor> cp_async(const at::Tensor& src_in, const at::Tensor& sizes_in) {
  const at::Tensor src = checked(src_in, "src", at::kByte, "cp_async");
  const at::Tensor sizes = checked(sizes_in, "sizes", at::kInt, "cp_async");
  TORCH_CHECK(sizes.numel() % 2 == 0 && src.numel() == sizes.numel() * 16,
              "cp_async: want an even number of 16-byte chunks and a size for each");
  at::Tensor mid = at::empty_like(src), out = at::empty_like(src);
  FF_CHECK_LAUNCH(launch_selftest_cp_async(ptr<uint8_t>(src), ptr<int32_t>(sizes), sizes.numel(),
                                           ptr<uint8_t>(mid), ptr<uint8_t>(out), nullptr));
  return {mid, out};
}

at::Tensor big_smem(int64_t which, int64_t bytes, int64_t opt_in) {
  at::Tensor out = at::empty({bytes / 4}, at::kFloat);
  FF_CHECK_LAUNCH(launch_selftest_big_smem(static_cast<int>(which), bytes, opt_in, ptr<float>(out),
                                           nullptr));
  return out;
}

void mma_broken(int64_t mode) {
  const at::Tensor src = at::zeros({16}, at::kByte);
  FF_CHECK_LAUNCH(launch_selftest_mma_broken(static_cast<int>(mode), ptr<uint8_t>(src), nullptr));
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

// From now on (on = true) a CPU `philox` takes the CUDA glue's device form (ff_philox_args, glue.h):
// checked but not read on the host, the kernels read (seed, offset) through its pointer
// (ff_philox_resolve). The flash_fwd_mma / flash_bwd_mma test ops below then pass their seed and
// offset through a (2,) tensor too. Returns the previous setting.
bool set_philox_on_device(bool on) {
  const bool previous = ff_simt_philox_on_device();
  ff_simt_philox_on_device() = on;
  return previous;
}

// The CUDA glue's reading of an op's `philox` (ff_philox_args, glue.h), for its tests on any
// device pair (a meta philox stands for one on another device): (seed, offset, whether the
// kernels get the pointer).
std::vector<int64_t> philox_args(const at::Tensor& philox, const at::Tensor& like, double dropout_p) {
  const FfPhiloxArgs rng = ff_philox_args(philox, "philox_args", like, dropout_p);
  return {static_cast<int64_t>(rng.seed), static_cast<int64_t>(rng.offset), rng.ptr != nullptr ? 1 : 0};
}

// The test ops' (seed, offset): by value, or (set_philox_on_device) through `holder`, a (2,)
// int64 tensor the kernels read, with wrong values by value so that only the pointer can be right.
FfPhiloxArgs test_rng(int64_t seed, int64_t offset, at::Tensor& holder) {
  if (!ff_simt_philox_on_device()) return {static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), nullptr};
  holder = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  holder.data_ptr<int64_t>()[0] = seed;
  holder.data_ptr<int64_t>()[1] = offset;
  return {static_cast<uint64_t>(seed) ^ 0x9E3779B97F4A7C15ull, static_cast<uint64_t>(offset) + 12345u,
          holder.const_data_ptr<int64_t>()};
}

// linear_cross_entropy's rows per chunk on a GPU (csrc/checks/cross_entropy.h), for its tests.
int64_t lce_device_chunk_rows(int64_t n, int64_t V, int64_t elem_size, int64_t free_bytes) {
  return fastformer::checks::linear_cross_entropy_device_chunk_rows(n, V, elem_size, free_bytes);
}

// ---- the tensor-core flash attention kernels (csrc/cuda/flash_fwd_mma.cu, flash_bwd_mma.cu),
// called directly, before and beside the attention op's glue: tests/test_flash_mma.py,
// tests/test_flash_bwd_mma.py. q / k / v keep their strides (unit last stride).

// q, k, v (and `more`: the backward's dout, out) checked: 4-D, one dtype, k / v (B, H, Sk, D) with
// q's B, H, D, unit last strides. Returns (B, H, Sq, Sk, D).
std::array<int64_t, 5> flash_dims(const char* op, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, std::initializer_list<const at::Tensor*> more = {}) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be 4-D");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(), op,
              ": want k and v (B, H, Sk, D) with q's B, H, D");
  std::vector<const at::Tensor*> all{&q, &k, &v};
  all.insert(all.end(), more.begin(), more.end());
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": q, k, v (dout, out) must share a dtype");
    TORCH_CHECK(t->stride(3) == 1, op, ": q, k, v (dout, out) need a unit last stride");
  }
  return {B, H, Sq, Sk, D};
}

// The masks as the kernels take them: key_padding_mask (B, Sk) bool, attn_mask fp32 broadcast to
// (B, H, Sq, Sk) with a unit key stride (a contiguous copy where it has none).
fastformer::checks::AttentionMasks flash_masks(const char* op, const std::array<int64_t, 5>& dims,
                                               const std::optional<at::Tensor>& key_padding_mask,
                                               const std::optional<at::Tensor>& attn_mask) {
  const auto [B, H, Sq, Sk, D] = dims;
  fastformer::checks::AttentionMasks m;
  if (key_padding_mask.has_value()) {
    m.key_padding_mask = *key_padding_mask;
    TORCH_CHECK(m.key_padding_mask.scalar_type() == at::kBool && m.key_padding_mask.dim() == 2 &&
                    m.key_padding_mask.size(0) == B && m.key_padding_mask.size(1) == Sk,
                op, ": key_padding_mask must be (B, Sk) bool");
  }
  if (attn_mask.has_value()) {
    TORCH_CHECK(attn_mask->scalar_type() == at::kFloat && attn_mask->dim() == 4, op,
                ": attn_mask must be 4-D fp32 additive (broadcast by 0 strides)");
    m.attn_mask = attn_mask->expand({B, H, Sq, Sk});
    if (m.attn_mask.stride(3) != 1) m.attn_mask = m.attn_mask.contiguous();
    for (int d = 0; d < 4; ++d) m.attn_mask_strides[d] = m.attn_mask.stride(d);
  }
  return m;
}

// The kernels' description of the call, as the glue makes it (attention_call.h); fp32 never runs
// as tf32 here.
FfFlashFwdArgs flash_args(const FfAttentionCall& call) { return call.flash({}, {}, false); }

std::tuple<at::Tensor, at::Tensor> flash_fwd_mma(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 bool is_causal, double scale, double dropout_p,
                                                 int64_t seed, int64_t offset) {
  const char* op = "flash_fwd_mma";
  const int dtype = ff_dtype_code(q, "q", op);
  const auto dims = flash_dims(op, q, k, v);
  const auto masks = flash_masks(op, dims, key_padding_mask, attn_mask);
  const auto [B, H, Sq, Sk, D] = dims;
  at::Tensor holder;
  const FfAttentionCall call(q, k, v, masks, dims, is_causal, scale, dropout_p,
                             test_rng(seed, offset, holder), dtype);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  FF_CHECK_LAUNCH(launch_flash_fwd_mma(flash_args(call), out.data_ptr(), lse.data_ptr<float>(), nullptr));
  return {out, lse};
}

// out / lse are the forward's; the gradients come back contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_mma(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed, int64_t offset, bool two_kernels) {
  const char* op = "flash_bwd_mma";
  const int dtype = ff_dtype_code(q, "q", op);
  const auto dims = flash_dims(op, q, k, v, {&dout, &out});
  const auto [B, H, Sq, Sk, D] = dims;
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), op, ": dout and out must be q's shape");
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 3 && lse_in.size(0) == B &&
                  lse_in.size(1) == H && lse_in.size(2) == Sq, op, ": lse must be (B, H, Sq) fp32");
  const at::Tensor lse = lse_in.contiguous();
  const auto masks = flash_masks(op, dims, key_padding_mask, attn_mask);
  at::Tensor holder;
  const FfAttentionCall call(q, k, v, masks, dims, is_causal, scale, dropout_p,
                             test_rng(seed, offset, holder), dtype);
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  const FfAttentionGrads g{dout.const_data_ptr(), ff_heads_rows(dout), out.const_data_ptr(),
                           ff_heads_rows(out), lse.const_data_ptr<float>(), delta.data_ptr<float>(),
                           {H * Sq, 1, Sq}, dq.data_ptr(), ff_heads_rows(dq), dk.data_ptr(),
                           ff_heads_rows(dk), dv.data_ptr(), ff_heads_rows(dv)};
  if (two_kernels) {  // no dQ workspace: the two-kernel backward (dK dV kernel, dQ kernel) at any D
    FF_CHECK_LAUNCH(launch_flash_bwd_mma(ff_flash_bwd_args(flash_args(call), g), nullptr));
  } else {
    FF_CHECK_LAUNCH(ff_launch_flash_bwd_mma(flash_args(call), g, q, nullptr));
  }
  return {dq, dk, dv};
}

// The dQ workspace (fp32 floats, counters) that ff_launch_flash_bwd_mma allocates for this call
// (flash_bwd_mma_workspace): 0, 0 wherever the two-kernel backward runs. Unmasked, no dropout.
std::vector<int64_t> bwd_workspace(const at::Tensor& dout, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v, bool is_causal) {
  const char* op = "flash_bwd_mma_workspace";
  const int dtype = ff_dtype_code(q, "q", op);
  const auto dims = flash_dims(op, q, k, v, {&dout});
  const auto masks = flash_masks(op, dims, std::nullopt, std::nullopt);
  at::Tensor holder;
  const FfAttentionCall call(q, k, v, masks, dims, is_causal, 1.0, 0.0, test_rng(0, 0, holder), dtype);
  FfAttentionGrads g{};
  g.dout = dout.const_data_ptr();
  g.dout_s = ff_heads_rows(dout);
  int64_t acc_floats = 0, counters = 0;
  flash_bwd_mma_workspace(ff_flash_bwd_args(flash_args(call), g), &acc_floats, &counters);
  return {acc_floats, counters};
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
  m.def("racy_under(int n, int schedule) -> Tensor");
  m.def("cross_warp(int schedule, bool barrier) -> Tensor");
  m.def("refill(Tensor src, int schedule, bool barrier) -> Tensor");
  m.def("mma_fragments(Tensor a, Tensor b, Tensor c, int kind) -> Tensor");
  m.def("tf32(Tensor x) -> Tensor");
  m.def("ldmatrix(Tensor tile, Tensor offsets, int num, bool trans) -> Tensor");
  m.def("mma_gemm(Tensor a, Tensor b, Tensor c, bool b_kmajor, int mistake) -> Tensor");
  m.def("cp_async(Tensor src, Tensor sizes) -> (Tensor, Tensor)");
  m.def("big_smem(int which, int bytes, int opt_in) -> Tensor");
  m.def("mma_broken(int mode) -> ()");
  m.def("set_sm_count(int n) -> int");
  m.def("set_free_memory(int bytes) -> int");
  m.def("set_philox_on_device(bool on) -> bool");
  m.def("philox_args(Tensor philox, Tensor like, float dropout_p) -> int[]");
  m.def("lce_device_chunk_rows(int n, int V, int elem_size, int free_bytes) -> int");
  m.def("flash_fwd_mma(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, "
        "bool is_causal, float scale, float dropout_p, int seed, int offset) -> (Tensor, Tensor)");
  m.def("flash_bwd_mma(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? attn_mask, bool is_causal, float scale, float dropout_p, "
        "int seed, int offset, bool two_kernels=False) -> (Tensor, Tensor, Tensor)");
  m.def("flash_bwd_mma_workspace(Tensor dout, Tensor q, Tensor k, Tensor v, bool is_causal) -> int[]");
}

TORCH_LIBRARY_IMPL(fastformer_simt_selftest, CPU, m) {
  m.impl("warp", &warp);
  m.impl("transpose", &transpose);
  m.impl("reverse", &reverse);
  m.impl("to_bits", &to_bits);
  m.impl("from_bits", &from_bits);
  m.impl("mma_fragments", &mma_fragments);
  m.impl("tf32", &tf32);
  m.impl("ldmatrix", &ldmatrix);
  m.impl("mma_gemm", &mma_gemm);
  m.impl("cp_async", &cp_async);
  m.impl("refill", &refill);
  m.impl("flash_fwd_mma", &flash_fwd_mma);
  m.impl("flash_bwd_mma", &flash_bwd_mma);
  m.impl("flash_bwd_mma_workspace", &bwd_workspace);
}

// Ops without a tensor argument dispatch through CompositeExplicitAutograd.
TORCH_LIBRARY_IMPL(fastformer_simt_selftest, CompositeExplicitAutograd, m) {
  m.impl("broken", &broken);
  m.impl("many_blocks", &many_blocks);
  m.impl("racy", &racy);
  m.impl("racy_under", &racy_under);
  m.impl("cross_warp", &cross_warp);
  m.impl("big_smem", &big_smem);
  m.impl("mma_broken", &mma_broken);
  m.impl("set_sm_count", &set_sm_count);
  m.impl("set_free_memory", &set_free_memory);
  m.impl("set_philox_on_device", &set_philox_on_device);
  m.impl("philox_args", &philox_args);
  m.impl("lce_device_chunk_rows", &lce_device_chunk_rows);
}
