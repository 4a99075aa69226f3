import torch

from .. import philox


class EmbeddingFunction(torch.autograd.Function):
    """``dropout(weight[ids] * scale + positional[positions])`` on (N,) ids -> (N, D) rows."""

    @staticmethod
    def forward(ctx, ids, weight, positional, positions, scale, dropout_p, padding_idx, kernels):
        rng = philox.draw(dropout_p, weight.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        out = kernels.embedding_fwd(ids, weight, positional, positions, scale, dropout_p, rng)  # (N, D)
        ctx.save_for_backward(ids, positions, rng)  # the ids, never the rows or a mask
        ctx.config = (weight.shape[0], 0 if positional is None else positional.shape[0], padding_idx, scale,
                      dropout_p)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        ids, positions, rng = ctx.saved_tensors
        V, P, padding_idx, scale, dropout_p = ctx.config
        need_w, need_p = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dweight, dpositional = ctx.kernels.embedding_bwd(dout.contiguous(), ids, positions, V, P, need_w, need_p,
                                                         padding_idx, scale, dropout_p, rng)
        return (None, dweight if need_w else None, dpositional if need_p else None, None, None, None, None, None)
