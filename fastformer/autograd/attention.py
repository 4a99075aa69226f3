import torch

from .. import philox


class AttentionFunction(torch.autograd.Function):
    """Flash-style attention: saves q, k, v, out and the per-row log-sum-exp, never P."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, kernels):
        rng = philox.draw(dropout_p, q.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        out, lse = kernels.attention_fwd(q, k, v, key_padding_mask, attn_mask, is_causal, scale,
                                         dropout_p, rng)  # (B, H, Sq, D), (B, H, Sq)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, attn_mask, rng)
        ctx.config = (is_causal, scale, dropout_p)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_padding_mask, attn_mask, rng = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = ctx.kernels.attention_bwd(dout, q, k, v, out, lse, key_padding_mask, attn_mask,
                                               *ctx.config, rng)
        return dq, dk, dv, None, None, None, None, None, None
