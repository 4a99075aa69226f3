from typing import Sequence, Tuple

import torch

from .. import philox

# How the inputs hold q, k and v: three tensors (total, H, D), one packed qkv (total, 3, H, D), or q and
# one packed kv (total_k, 2, H, D) (FlashAttention's varlen, varlen_qkvpacked and varlen_kvpacked).
LAYOUTS = ("q,k,v", "qkv", "q,kv")


def split(layout: str, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (views, for the packed layouts) of one layout's tensors."""
    if layout == "qkv":
        return tensors[0].unbind(1)
    if layout == "q,kv":
        return (tensors[0], *tensors[1].unbind(1))
    return tuple(tensors)


class AttentionVarlenFunction(torch.autograd.Function):
    """Attention over packed sequences: saves the inputs, out, the log-sum-exp and the lengths, never P.

    A packed qkv or kv input gets one gradient buffer: the backend's ``attention_varlen_bwd_into``
    writes dq, dk, dv into its slices (no stack of three gradients); a backend without it returns
    them separately and they are copied in. ``rel``: a relative position bias by distance
    ``(H, 2R + 1)`` or None (ops/relative_position.py), its gradient from the backward kernel."""

    @staticmethod
    def forward(ctx, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p,
                kernels, rel, x0, x1=None, x2=None):  # the layout's 1-3 tensors; not *inputs, which dynamo
        inputs = tuple(t for t in (x0, x1, x2) if t is not None)  # (torch 2.13) binds wrongly in a no-grad trace
        q, k, v = split(layout, inputs)
        if cu_seqlens_k is None:  # the queries' (the same tensor twice would break torch.compile's trace)
            cu_seqlens_k = cu_seqlens_q
        rng = philox.draw(dropout_p, x0.device)  # (2,) int64 (seed, offset) on the op's device; nothing drawn for p == 0
        extra = () if rel is None else (rel,)  # (a backend without the argument is never given one)
        out, lse = kernels.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                is_causal, scale, dropout_p, rng, *extra)  # (total_q, H, D), (H, total_q)
        ctx.save_for_backward(out, lse, cu_seqlens_q, cu_seqlens_k, rng, rel, *inputs)
        ctx.layout = layout
        ctx.config = (max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        out, lse, cu_seqlens_q, cu_seqlens_k, rng, rel, *inputs = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q, k, v = split(ctx.layout, inputs)
        args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.config, rng) + (() if rel is None else (rel,))
        into = getattr(ctx.kernels, "attention_varlen_bwd_into", None)
        if ctx.layout == "q,k,v" or into is None:
            *grads, drel = ctx.kernels.attention_varlen_bwd(*args)
            if ctx.layout == "qkv":
                grads = [torch.stack(grads, dim=1)]
            elif ctx.layout == "q,kv":
                grads = [grads[0], torch.stack(grads[1:], dim=1)]
        else:
            grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
            dq, dk, dv = split(ctx.layout, grads)
            drel = into(*args, dq=dq, dk=dk, dv=dv)
        return (None,) * 9 + ((drel if rel is not None else None),) + tuple(grads)
