import torch

from .. import philox


class AddLayerNormFunction(torch.autograd.Function):
    """``y = LayerNorm(residual + dropout(x + x_bias))`` on (N, C) rows (RMSNorm with ``rms_norm``);
    also returns h for prenorm.

    ``x_bias`` (or None): the bias of the linear layer that produced x, which then runs without it.
    A backend with the ``x_bias`` overloads adds it in the kernel and sums its gradient beside
    dweight / dbias; for the others it is added here, and its gradient is ``dx.sum(0)``."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, dropout_p, prenorm, kernels, x_bias, rms_norm=False):
        rng = philox.draw(dropout_p, x.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        fused = x_bias is not None and getattr(kernels, "add_layer_norm_fwd_x_bias", None) is not None
        if fused:
            y, h, mean, rstd = kernels.add_layer_norm_fwd_x_bias(x, residual, weight, bias, eps, dropout_p, rng,
                                                                 x_bias, rms_norm)  # (N, C) x2, (N,) x2
        else:
            x_in = x if x_bias is None else x + x_bias
            y, h, mean, rstd = kernels.add_layer_norm_fwd(x_in, residual, weight, bias, eps, dropout_p, rng,
                                                          rms_norm)  # RMSNorm: mean returned as zeros
        ctx.save_for_backward(h, weight, mean, rstd, rng)
        ctx.config = (dropout_p, residual is not None, x_bias is not None, fused, rms_norm)
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
        dropout_p, has_residual, has_x_bias, fused, rms_norm = ctx.config
        dh = dh if ctx.prenorm else None
        if dy is None:  # prenorm with only h used
            dy = torch.zeros_like(h)
        args = (dy.contiguous(), None if dh is None else dh.contiguous(), h, weight, mean, rstd, dropout_p, rng,
                has_residual, rms_norm)
        if fused:
            dx, dres, dweight, dbias, dx_bias = ctx.kernels.add_layer_norm_bwd_x_bias(*args)
        else:
            dx, dres, dweight, dbias = ctx.kernels.add_layer_norm_bwd(*args)
            dx_bias = dx.sum(0) if has_x_bias else None
        if has_residual and dropout_p == 0.0:  # the kernels return dres empty then (no test of its size:
            dres = dx                          # under torch.compile the rows may be a data-dependent count)
        return dx, (dres if has_residual else None), dweight, dbias, None, None, None, None, dx_bias, None
