// The per-ISA entry points of feed_forward (feed_forward_kernel.cpp, one copy per level of isa.h):
// the one pass between the GEMMs each way, called by feed_forward.cpp.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"
#include "../checks/feed_forward.h"

namespace fastformer {

// Activation (relu / gelu / silu) is declared with the op's argument checks.

// a = dropout(act(pre + bias)); pre, a (N, F) contiguous (a may be pre: in place); bias (F,) or
// undefined (the GEMM added it); with a bias and a separate a, pre + bias is written back to pre.
FF_ISA_DECLARE(void act_dropout_fwd_kernel(at::Tensor& pre, const at::Tensor& bias, at::Tensor& a,
                                           Activation act, double dropout_p, uint64_t seed,
                                           uint64_t offset))

// dpre = da * keep * act'(pre) written over dpre (which holds da on entry); db1 (F,) = column sums
// of dpre, db2 (E,) = column sums of dout, each only when not empty. saved: what forward kept, a
// for relu (then a is not written and may be undefined), pre otherwise (then a = dropout(act(pre))
// is written for dw2).
FF_ISA_DECLARE(void act_dropout_bwd_kernel(const at::Tensor& saved, at::Tensor& dpre,
                                           const at::Tensor& dout, at::Tensor& a, at::Tensor& db1,
                                           at::Tensor& db2, Activation act, double dropout_p,
                                           uint64_t seed, uint64_t offset))

// The gated form: h = dropout(act(g + bg) * (u + bu)) (N, F) over pre (N, 2F) rows [g | u]; bias
// (2F,) [bg | bu] or undefined (the GEMM added it; else pre + bias is written back into pre).
FF_ISA_DECLARE(void glu_dropout_fwd_kernel(at::Tensor& pre, const at::Tensor& bias, at::Tensor& h,
                                           Activation act, double dropout_p, uint64_t seed,
                                           uint64_t offset))

// Its backward: from pre (N, 2F) and dh (N, F) = dout w2, writes dpre (N, 2F) = [dg | du], h (N, F)
// = dropout(act(g) u) for dw2, db1 (2F,) = column sums of dpre and db2 (E,) of dout, each only
// when not empty.
FF_ISA_DECLARE(void glu_dropout_bwd_kernel(const at::Tensor& pre, const at::Tensor& dh,
                                           at::Tensor& dpre, const at::Tensor& dout, at::Tensor& h,
                                           at::Tensor& db1, at::Tensor& db2, Activation act,
                                           double dropout_p, uint64_t seed, uint64_t offset))

}  // namespace fastformer
