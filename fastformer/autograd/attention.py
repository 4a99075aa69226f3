import torch

from .. import philox


class AttentionFunction(torch.autograd.Function):
    """Flash-style attention: saves q, k, v, out and the per-row log-sum-exp, never P.

    ``rel``: a relative position bias by distance ``(H, 2R + 1)`` (ops/relative_position.py) or
    None, ``rel_shift`` the queries' position past ``Sk - Sq``; its gradient comes from the
    backward kernel."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, kernels, rel=None,
                rel_shift=0):
        rng = philox.draw(dropout_p, q.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        extra = () if rel is None else (rel, rel_shift)  # (a backend without the argument is never given one)
        out, lse = kernels.attention_fwd(q, k, v, key_padding_mask, attn_mask, is_causal, scale,
                                         dropout_p, rng, *extra)  # (B, H, Sq, D), (B, H, Sq)
        ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, attn_mask, rng, rel)
        ctx.config = (is_causal, scale, dropout_p)
        ctx.rel_shift = rel_shift
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_padding_mask, attn_mask, rng, rel = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        extra = () if rel is None else (rel, ctx.rel_shift)
        dq, dk, dv, drel = ctx.kernels.attention_bwd(dout, q, k, v, out, lse, key_padding_mask, attn_mask,
                                                     *ctx.config, rng, *extra)
        return dq, dk, dv, None, None, None, None, None, None, (drel if rel is not None else None), None
