import torch

from .. import philox


class FeedForwardFunction(torch.autograd.Function):
    """``linear(dropout(act(linear(x, w1, b1))), w2, b2)`` on (N, E) rows; saves pre-activation.
    Gated (w3 given): ``linear(dropout(act(linear(x, w1, b1)) * linear(x, w3, b3)), w2, b2)``; the
    kernels keep both pre-activations as one (N, 2F) and return [dw1; dw3], [db1; db3]."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, dropout_p, kernels, w3=None, b3=None):
        rng = philox.draw(dropout_p, x.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        gated = () if w3 is None else (w3, b3)  # the plain call as before (kernels without the gated form work)
        out, pre = kernels.feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, rng, *gated)
        ctx.save_for_backward(x, w1, w2, pre, rng, w3)  # pre: (N, F), gated (N, 2F): the only activations kept
        ctx.config = (b1 is not None, b2 is not None, activation, dropout_p)
        ctx.has_b3 = b3 is not None
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w2, pre, rng, w3 = ctx.saved_tensors
        has_b1, has_b2 = ctx.config[:2]
        gated = () if w3 is None else (w3, ctx.has_b3)
        dx, dw1, db1, dw2, db2 = ctx.kernels.feed_forward_bwd(dout.contiguous(), x, w1, w2, pre, *ctx.config, rng,
                                                              *gated)
        dw3 = db3 = None
        if w3 is not None:  # [dw1; dw3] (2F, E) and [db1; db3]
            dw13, db13, F_ = dw1, db1, w1.shape[0]
            dw1, dw3 = dw13[:F_], dw13[F_:]
            db1, db3 = (db13[:F_], db13[F_:]) if has_b1 or ctx.has_b3 else (None, None)
        return (dx, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None, None, None, None, dw3,
                db3 if ctx.has_b3 else None)
