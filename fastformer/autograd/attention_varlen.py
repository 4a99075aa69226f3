import torch

from .. import philox


class AttentionVarlenFunction(torch.autograd.Function):
    """Attention over packed sequences: saves q, k, v, out, the log-sum-exp and the lengths, never P."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                dropout_p, kernels):
        rng = philox.draw(dropout_p)  # (2,) int64 CPU (seed, offset); nothing drawn for p == 0
        out, lse = kernels.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                is_causal, scale, dropout_p, rng)  # (total_q, H, D), (H, total_q)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng)
        ctx.config = (max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = ctx.kernels.attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                      *ctx.config, rng)
        return dq, dk, dv, None, None, None, None, None, None, None, None
