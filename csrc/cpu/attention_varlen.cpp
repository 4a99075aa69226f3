// attention_varlen_fwd / attention_varlen_bwd on CPU: the argument checks (csrc/checks/
// attention_varlen.h) and the op registration. The math is attention's own kernels
// (attention_kernel_fwd.cpp, attention_kernel_bwd.cpp) reading the packed rows per sequence
// through cu_seqlens, run at the ISA level isa.h chose: no padded position is computed and no
// operand is copied (but one whose rows the GEMMs cannot take).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "attention.h"
#include "large_buffers.h"
#include "../checks/attention_varlen.h"
#include "../philox_arg.h"

namespace fastformer {
namespace {

// The checks both ops share, cu_seqlens' values included (the host reads them before any row is
// addressed through them); returns what the kernels need of the lengths.
Varlen check_varlen(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                    int64_t max_seqlen_k, double scale, double dropout_p, checks::VarlenDims& dims) {
  dims = checks::check_varlen_qkv(checks::kCpu, op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, scale, dropout_p);
  checks::check_cu_seqlens_values(op, "cu_seqlens_q", cu_seqlens_q, dims.total_q, max_seqlen_q, "total_q",
                                  "max_seqlen_q");
  checks::check_cu_seqlens_values(op, "cu_seqlens_k", cu_seqlens_k, dims.total_k, max_seqlen_k, "total_k",
                                  "max_seqlen_k");
  return {cu_seqlens_q.const_data_ptr<int32_t>(), cu_seqlens_k.const_data_ptr<int32_t>(), dims.B, dims.H,
          dims.D, max_seqlen_q, max_seqlen_k};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias) {
  const char* op = "attention_varlen_fwd";
  const auto [seed, offset] = read_philox(op, philox);
  checks::VarlenDims dims;
  const Varlen lens = check_varlen(op, q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, scale, dropout_p, dims);
  const int64_t R = checks::check_rel_bias(checks::kCpu, op, q_in, rel_bias, dims.H);
  const RelBias rel = R < 0 ? RelBias{} : RelBias{rel_bias->data_ptr(), R, 0};
  at::Tensor out = empty_large({dims.total_q, dims.H, dims.D}, q_in.options());  // pooled when large
  at::Tensor lse = at::empty({dims.H, dims.total_q}, q_in.options().dtype(checks::stat_dtype(q_in)));
  if (out.numel() == 0) return {out, lse};
  const at::Tensor q = as_blas_rows(q_in, 0), k = as_blas_rows(k_in, 0), v = as_blas_rows(v_in, 0);
  FF_ISA(attention_varlen_fwd_impl)(lens, q, k, v, is_causal, rel, scale, dropout_p, static_cast<uint64_t>(seed),
                                    static_cast<uint64_t>(offset), out, lse);
  return {out, lse};
}

// The backward into dq, dk, dv (checked by the caller); every element of them is written. Returns
// rel_bias's gradient (checks::rel_bias_grad).
at::Tensor attention_varlen_bwd_into(const char* op, const at::Tensor& dout_in, const at::Tensor& q_in,
                               const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
                               const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
                               const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                               bool is_causal, double scale, double dropout_p, const at::Tensor& philox,
                               const std::optional<at::Tensor>& rel_bias, at::Tensor& dq, at::Tensor& dk,
                               at::Tensor& dv) {
  const auto [seed, offset] = read_philox(op, philox);
  checks::VarlenDims dims;
  const Varlen lens = check_varlen(op, q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, scale, dropout_p, dims);
  checks::check_varlen_bwd_tensors(checks::kCpu, op, dout_in, out_in, lse_in, q_in, dims);
  const int64_t R = checks::check_rel_bias(checks::kCpu, op, q_in, rel_bias, dims.H);
  const RelBias rel = R < 0 ? RelBias{} : RelBias{rel_bias->data_ptr(), R, 0};
  at::Tensor drel = checks::rel_bias_grad(q_in, dims.H, R);
  if (dq.numel() == 0 && dk.numel() == 0) return drel;  // (a sequence without queries: dk = 0)
  const at::Tensor q = as_blas_rows(q_in, 0), k = as_blas_rows(k_in, 0), v = as_blas_rows(v_in, 0);
  const at::Tensor dout = as_blas_rows(dout_in, 0), lse = lse_in.contiguous();
  at::Tensor delta = at::empty({dims.H, dims.total_q}, q.options().dtype(checks::stat_dtype(q)));
  const bool grouped = k_in.size(1) != dims.H;  // grouped-query: per query head, then each group summed
  at::Tensor dk_h = grouped ? kv_grad_per_query_head(k_in, dims.H) : dk;
  at::Tensor dv_h = grouped ? kv_grad_per_query_head(v_in, dims.H) : dv;
  FF_ISA(attention_varlen_bwd_impl)(lens, dout, q, k, v, out_in, lse, is_causal, rel, scale, dropout_p,
                                    static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), delta, dq,
                                    dk_h, dv_h, drel);
  if (grouped) {
    sum_kv_groups(dk_h, dk);
    sum_kv_groups(dv_h, dv);
  }
  return drel;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias) {
  const char* op = "attention_varlen_bwd";
  checks::check_varlen_qkv(checks::kCpu, op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, scale, dropout_p);  // before grad_like reads q, k, v
  at::Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  at::Tensor drel = attention_varlen_bwd_into(op, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p, philox,
                                              rel_bias, dq, dk, dv);
  return {dq, dk, dv, drel};
}

at::Tensor attention_varlen_bwd_into_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    double dropout_p, const at::Tensor& philox, const std::optional<at::Tensor>& rel_bias, at::Tensor& dq,
    at::Tensor& dk, at::Tensor& dv) {
  const char* op = "attention_varlen_bwd.into";
  checks::check_varlen_bwd_into(checks::kCpu, op, dout, q, k, v, out, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, scale, dropout_p, dq, dk, dv);
  return attention_varlen_bwd_into(op, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, is_causal, scale, dropout_p, philox, rel_bias, dq, dk, dv);
}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("attention_varlen_fwd", &fastformer::attention_varlen_fwd_cpu);
  m.impl("attention_varlen_bwd", &fastformer::attention_varlen_bwd_cpu);
  m.impl("attention_varlen_bwd.into", &fastformer::attention_varlen_bwd_into_cpu);
}
