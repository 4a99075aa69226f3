// The SIMT harness library's registrations: the fastformer op schemas under the namespace
// fastformer_simt (implemented for CPU tensors by the CUDA glue, csrc/cuda/*.cpp, compiled with
// -DFF_SIMT), and the harness's own test ops fastformer_simt_selftest::* (tests/test_simt.py, and
// tests/test_cuda_mma.py for the tensor-core wrappers of csrc/cuda/mma.cuh).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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

// linear_cross_entropy's rows per chunk on a GPU (csrc/checks/cross_entropy.h), for its tests.
int64_t lce_device_chunk_rows(int64_t n, int64_t V, int64_t elem_size, int64_t free_bytes) {
  return fastformer::checks::linear_cross_entropy_device_chunk_rows(n, V, elem_size, free_bytes);
}

// ---- the tensor-core flash attention forward (csrc/cuda/flash_fwd_mma.cu), before the attention
// op's glue calls it: tests/test_flash_mma.py. q / k / v keep their strides (unit last stride).
std::tuple<at::Tensor, at::Tensor> flash_fwd_mma(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& key_padding_mask,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 bool is_causal, double scale, double dropout_p,
                                                 int64_t seed, int64_t offset) {
  const char* op = "flash_fwd_mma";
  const int dtype = ff_dtype_code(q, "q", op);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be 4-D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(), op,
              ": want k and v (B, H, Sk, D) with q's B, H, D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, op,
              ": q, k, v need a unit last stride");
  at::Tensor kpm, am;
  if (key_padding_mask.has_value()) {
    kpm = key_padding_mask->contiguous();
    TORCH_CHECK(kpm.scalar_type() == at::kBool && kpm.dim() == 2 && kpm.size(0) == B &&
                    kpm.size(1) == Sk, op, ": key_padding_mask must be (B, Sk) bool");
  }
  if (attn_mask.has_value()) {
    TORCH_CHECK(attn_mask->scalar_type() == at::kFloat && attn_mask->dim() == 4, op,
                ": attn_mask must be 4-D fp32 additive (broadcast by 0 strides)");
    am = attn_mask->expand({B, H, Sq, Sk});
    if (am.stride(3) != 1) am = am.contiguous();  // the kernel wants a unit key stride
  }
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  FfFlashFwdArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_sb = q.stride(0), a.q_sh = q.stride(1), a.q_ss = q.stride(2);
  a.k_sb = k.stride(0), a.k_sh = k.stride(1), a.k_ss = k.stride(2);
  a.v_sb = v.stride(0), a.v_sh = v.stride(1), a.v_ss = v.stride(2);
  a.B = B, a.H = H, a.Sq = Sq, a.Sk = Sk, a.D = D;
  a.dtype = dtype;
  a.causal = is_causal;
  a.scale = scale;
  a.kpm = kpm.defined() ? kpm.const_data_ptr<bool>() : nullptr;
  a.kpm_sb = Sk;
  if (am.defined()) {
    a.am = am.const_data_ptr<float>();
    a.am_sb = am.stride(0), a.am_sh = am.stride(1), a.am_sq = am.stride(2), a.am_sk = am.stride(3);
  }
  a.dropout_p = dropout_p;
  a.seed = static_cast<uint64_t>(seed);
  a.offset = static_cast<uint64_t>(offset);
  FF_CHECK_LAUNCH(launch_flash_fwd_mma(a, out.data_ptr(), lse.data_ptr<float>(), nullptr));
  return {out, lse};
}

// ---- the tensor-core flash attention backward (csrc/cuda/flash_bwd_mma.cu), called directly:
// tests/test_flash_bwd_mma.py. out / lse are the forward's; the gradients come back contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_mma(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed, int64_t offset) {
  const char* op = "flash_bwd_mma";
  const int dtype = ff_dtype_code(q, "q", op);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be 4-D");
  for (const at::Tensor* t : {&k, &v, &dout, &out}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": q, k, v, dout, out must share a dtype");
  }
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), D = q.size(3), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(), op,
              ": want k and v (B, H, Sk, D) with q's B, H, D");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), op, ": dout and out must be q's shape");
  for (const at::Tensor* t : {&q, &k, &v, &dout, &out}) {
    TORCH_CHECK(t->stride(3) == 1, op, ": q, k, v, dout, out need a unit last stride");
  }
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 3 && lse_in.size(0) == B &&
                  lse_in.size(1) == H && lse_in.size(2) == Sq, op, ": lse must be (B, H, Sq) fp32");
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor kpm, am;
  if (key_padding_mask.has_value()) {
    kpm = key_padding_mask->contiguous();
    TORCH_CHECK(kpm.scalar_type() == at::kBool && kpm.dim() == 2 && kpm.size(0) == B &&
                    kpm.size(1) == Sk, op, ": key_padding_mask must be (B, Sk) bool");
  }
  if (attn_mask.has_value()) {
    TORCH_CHECK(attn_mask->scalar_type() == at::kFloat && attn_mask->dim() == 4, op,
                ": attn_mask must be 4-D fp32 additive (broadcast by 0 strides)");
    am = attn_mask->expand({B, H, Sq, Sk});
    if (am.stride(3) != 1) am = am.contiguous();  // the kernels want a unit key stride
  }
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  at::Tensor delta = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  FfFlashBwdArgs a{};
  FfFlashFwdArgs& f = a.f;
  f.q = q.data_ptr();
  f.k = k.data_ptr();
  f.v = v.data_ptr();
  f.q_sb = q.stride(0), f.q_sh = q.stride(1), f.q_ss = q.stride(2);
  f.k_sb = k.stride(0), f.k_sh = k.stride(1), f.k_ss = k.stride(2);
  f.v_sb = v.stride(0), f.v_sh = v.stride(1), f.v_ss = v.stride(2);
  f.B = B, f.H = H, f.Sq = Sq, f.Sk = Sk, f.D = D;
  f.dtype = dtype;
  f.causal = is_causal;
  f.scale = scale;
  f.kpm = kpm.defined() ? kpm.const_data_ptr<bool>() : nullptr;
  f.kpm_sb = Sk;
  if (am.defined()) {
    f.am = am.const_data_ptr<float>();
    f.am_sb = am.stride(0), f.am_sh = am.stride(1), f.am_sq = am.stride(2), f.am_sk = am.stride(3);
  }
  f.dropout_p = dropout_p;
  f.seed = static_cast<uint64_t>(seed);
  f.offset = static_cast<uint64_t>(offset);
  a.dout = dout.data_ptr();
  a.do_sb = dout.stride(0), a.do_sh = dout.stride(1), a.do_ss = dout.stride(2);
  a.out = out.data_ptr();
  a.o_sb = out.stride(0), a.o_sh = out.stride(1), a.o_ss = out.stride(2);
  a.lse = lse.const_data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  a.dq = dq.data_ptr();
  a.dq_sb = dq.stride(0), a.dq_sh = dq.stride(1), a.dq_ss = dq.stride(2);
  a.dk = dk.data_ptr();
  a.dk_sb = dk.stride(0), a.dk_sh = dk.stride(1), a.dk_ss = dk.stride(2);
  a.dv = dv.data_ptr();
  a.dv_sb = dv.stride(0), a.dv_sh = dv.stride(1), a.dv_ss = dv.stride(2);
  FF_CHECK_LAUNCH(launch_flash_bwd_mma(a, nullptr));
  return {dq, dk, dv};
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
  m.def("lce_device_chunk_rows(int n, int V, int elem_size, int free_bytes) -> int");
  m.def("flash_fwd_mma(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_mask, "
        "bool is_causal, float scale, float dropout_p, int seed, int offset) -> (Tensor, Tensor)");
  m.def("flash_bwd_mma(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? attn_mask, bool is_causal, float scale, float dropout_p, "
        "int seed, int offset) -> (Tensor, Tensor, Tensor)");
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
  m.impl("lce_device_chunk_rows", &lce_device_chunk_rows);
}
