import torch

from .. import philox


class FeedForwardFunction(torch.autograd.Function):
    """``linear(dropout(act(linear(x, w1, b1))), w2, b2)`` on (N, E) rows; saves pre-activation."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, dropout_p, kernels):
        rng = philox.draw(dropout_p, x.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        out, pre = kernels.feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, rng)
        ctx.save_for_backward(x, w1, w2, pre, rng)  # pre: (N, F), the only activation kept
        ctx.config = (b1 is not None, b2 is not None, activation, dropout_p)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, pre, rng = ctx.saved_tensors
        has_b1, has_b2 = ctx.config[:2]
        dx, dw1, db1, dw2, db2 = ctx.kernels.feed_forward_bwd(dout.contiguous(), x, w1, w2, pre,
                                                              *ctx.config, rng)
        return (dx, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None, None, None, None)
