from typing import Optional

import torch

from .. import backends, philox
from ..autograd import FeedForwardFunction
from ..internal import fast, validation
from ..internal.eager import eager
from ..internal.rows import as_rows, as_shape
from . import reference

ACTIVATIONS = ("relu", "gelu", "silu", "gelu_tanh")


def feed_forward(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                 b2: Optional[torch.Tensor], *, activation: str = "relu", dropout_p: float = 0.0,
                 w3: Optional[torch.Tensor] = None, b3: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The position-wise FFN ``linear(dropout(act(linear(x, w1, b1))), w2, b2)``, or with ``w3`` the
    gated one ``linear(dropout(act(linear(x, w1, b1)) * linear(x, w3, b3)), w2, b2)``.

    Args:
        x: ``(..., E)``.
        w1: ``(F, E)`` and b1 ``(F,)`` or None: the first ``nn.Linear``'s weight and bias (gated:
            the gate, the activated one; T5's ``wi_0``, LLaMA's ``w1`` / ``gate_proj``).
        w2: ``(E, F)`` and b2 ``(E,)`` or None: the second ``nn.Linear``'s weight and bias (T5's
            ``wo``, LLaMA's ``w2`` / ``down_proj``).
        activation: ``"relu"``, ``"gelu"`` (the exact erf form, as ``F.gelu``), ``"silu"``
            (``x * sigmoid(x)``, as ``F.silu``; transformers' ``"swish"``) or ``"gelu_tanh"`` (the
            tanh approximation, as ``F.gelu(approximate="tanh")``; transformers' ``"gelu_new"`` and
            ``"gelu_pytorch_tanh"``).
        dropout_p: dropout probability after the activation (gated: after the product; pass 0 in eval).
        w3: ``(F, E)`` or None: the gated form's linear "up" projection (T5's ``wi_1``, LLaMA's
            ``w3`` / ``up_proj``). With ``gelu_tanh`` that is T5 v1.1's GeGLU, with ``silu`` SwiGLU,
            with ``relu`` ReGLU.
        b3: ``(F,)`` or None: w3's bias (only with w3).

    Bias, activation (and the gated product) and dropout are fused into one pass after the first
    GEMM (CPU) or into its epilogue (Triton); backward regenerates the dropout mask and only the
    ``(..., F)`` pre-activation (gated: the two, gate and up) is kept between forward and backward.
    """
    if (fast.plain(x, w1, b1, w2, b2, w3, b3) and activation.__class__ is str and fast.number(dropout_p)
            and fast.ready()):
        out = fast.attempt(_fast, x, w1, b1, w2, b2, activation, dropout_p, w3, b3)
        if out is not None:
            return out
    return _checked(x, w1, b1, w2, b2, activation, dropout_p, w3, b3)


def _fast(x, w1, b1, w2, b2, activation, dropout_p, w3=None, b3=None):
    """The checked path's kernel call without the checks the C++ op makes (internal/fast.py), or
    None where the call is the checked path's."""
    shape = x.shape
    E = shape[-1] if shape else 0
    if not E:
        return None
    kernels = backends.select_cached("feed_forward", x.device, x.dtype)
    op = kernels.feed_forward if kernels is not None else None
    if op is None:
        return None
    if w3 is None and b3 is not None:
        return None  # the checked path says what is wrong
    # x as it is: the C++ op takes its rows and returns x's shape without a view node; every tensor on
    # x's device (fast.call's check); w3 and b3 always passed (the entry takes all nine arguments)
    return fast.call(op, (x, w1.contiguous(), b1, w2.contiguous(), b2, activation, dropout_p,
                          w3 if w3 is None else w3.contiguous(), b3), 7, dropout_p, x.device)


def _checked(x, w1, b1, w2, b2, activation, dropout_p, w3=None, b3=None):
    validation.tensor("x", x, min_ndim=1, floating=True)
    validation.tensor("w1", w1, ndim=2, floating=True)
    validation.tensor("w2", w2, ndim=2, floating=True)
    validation.nonempty_dim("x", x, -1, "the model width E")
    E = x.shape[-1]
    F_ = w1.shape[0]
    validation.shape("w1", w1, (F_, E), "(dim_feedforward, E) with E = x.shape[-1]")
    validation.shape("w2", w2, (E, F_), "(E, dim_feedforward), the transpose of w1's shape")
    if b1 is not None:
        validation.tensor("b1", b1, ndim=1, floating=True)
        validation.shape("b1", b1, (F_,), "(dim_feedforward,)")
    if b2 is not None:
        validation.tensor("b2", b2, ndim=1, floating=True)
        validation.shape("b2", b2, (E,), "(E,)")
    if w3 is not None:
        validation.tensor("w3", w3, ndim=2, floating=True)
        validation.shape("w3", w3, (F_, E), "(dim_feedforward, E), the shape of w1")
    if b3 is not None:
        if w3 is None:
            raise ValueError("b3 was given without w3: b3 is the bias of the gated form's up projection w3")
        validation.tensor("b3", b3, ndim=1, floating=True)
        validation.shape("b3", b3, (F_,), "(dim_feedforward,)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    validation.same_device(x=x, w1=w1, b1=b1, w2=w2, b2=b2, w3=w3, b3=b3)
    dropout_p = validation.probability("dropout_p", dropout_p)

    lowp = validation.autocast_dtype(x.device)
    x, w1, b1, w2, b2, w3, b3 = (validation.cast(t, lowp) for t in (x, w1, b1, w2, b2, w3, b3))
    validation.same_dtype(x=x, w1=w1, b1=b1, w2=w2, b2=b2, w3=w3, b3=b3)

    kernels = backends.select_cached("feed_forward", x.device, x.dtype)
    if kernels is None:
        return reference.feed_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, w3=w3, b3=b3)
    shape = x.shape
    gated = () if w3 is None else (w3.contiguous(), b3)  # the plain call's arguments as before
    with validation.autocast_off(x.device):
        if kernels.feed_forward is not None and eager():  # the backward in C++; it takes x's rows itself
            out = kernels.feed_forward(x, w1.contiguous(), b1, w2.contiguous(), b2, activation, dropout_p,
                                       philox.draw(dropout_p, x.device), *gated)
        else:
            out = FeedForwardFunction.apply(as_rows(x, E), w1.contiguous(), b1, w2.contiguous(), b2, activation,
                                            dropout_p, kernels, *gated)
    return as_shape(out, shape)
