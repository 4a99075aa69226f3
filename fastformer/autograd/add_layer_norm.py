import torch

from .. import philox


class AddLayerNormFunction(torch.autograd.Function):
    """``y = LayerNorm(residual + dropout(x))`` on (N, C) rows; also returns h for prenorm."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, dropout_p, prenorm, kernels):
        rng = philox.draw(dropout_p)  # (2,) int64 CPU (seed, offset); nothing drawn for p == 0
        y, h, mean, rstd = kernels.add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p,
                                                      rng)  # (N, C) x2, (N,) x2
        ctx.save_for_backward(h, weight, mean, rstd, rng)
        ctx.config = (dropout_p, residual is not None)
        ctx.prenorm = prenorm
        ctx.kernels = kernels
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not zeros
        if prenorm:
            return y, h
        ctx.mark_non_differentiable(h)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, mean, rstd, rng = ctx.saved_tensors
        dropout_p, has_residual = ctx.config
        dh = dh if ctx.prenorm else None
        if dy is None:  # prenorm with only h used
            dy = torch.zeros_like(h)
        dx, dres, dweight, dbias = ctx.kernels.add_layer_norm_bwd(
            dy.contiguous(), None if dh is None else dh.contiguous(), h, weight, mean, rstd,
            dropout_p, rng, has_residual)
        if has_residual and dres.numel() == 0:
            dres = dx  # no dropout: the residual's gradient is x's gradient
        return dx, (dres if has_residual else None), dweight, dbias, None, None, None, None
