from typing import Optional, Tuple, Union

import torch

from .. import backends, philox
from ..autograd import AddLayerNormFunction
from ..internal import validation
from ..internal.eager import eager
from ..internal.rows import as_rows, as_shape
from . import reference

# what the backend choice reads of a call: the hidden size bounds the Triton kernels; on a GPU the
# rest places the call in a class of the measured table (fastformer/backends/measured.py)
_FACTS = ("hidden_size",)
_GPU_FACTS = ("hidden_size", "rows", "dropout")


def add_layer_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], eps: float = 1e-5, dropout_p: float = 0.0, *,
                   prenorm: bool = False,
                   x_bias: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Fused dropout + residual add + LayerNorm over the last dimension.

    Post-LN (default): returns ``LayerNorm(residual + dropout(x))``.
    Pre-LN (``prenorm=True``): returns ``(LayerNorm(h), h)`` with ``h = residual + dropout(x)``,
    so the block can carry ``h`` on as its next residual without a second pass.

    Args:
        x: ``(..., C)``, any hidden size C.
        residual: same shape as x, or None (then ``h = dropout(x)``).
        weight, bias: ``(C,)`` LayerNorm affine parameters, or None for no affine.
        eps: added to the variance.
        dropout_p: dropout probability applied to x before the add (pass 0 in eval).
        x_bias: ``(C,)`` or None: the bias of the linear layer that produced x, added to x before
            the dropout. Passing it instead of adding it in the layer spares the layer's own bias
            pass (``nn.Linear`` copies its bias over the output, and sums its gradient).

    Statistics are computed in fp32 for every input dtype; under ``torch.autocast`` the
    inputs are cast to the autocast dtype.
    """
    validation.tensor("x", x, min_ndim=1, floating=True)
    validation.nonempty_dim("x", x, -1, "the hidden size C normalised over")
    C = x.shape[-1]
    if residual is not None:
        validation.tensor("residual", residual, floating=True)
        validation.shape("residual", residual, x.shape, "the shape of x")
    for name, p in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if p is not None:
            validation.tensor(name, p, ndim=1, floating=True)
            validation.shape(name, p, (C,), "(C,) with C = x.shape[-1]")
    validation.same_device(x=x, residual=residual, weight=weight, bias=bias, x_bias=x_bias)
    prenorm = validation.flag("prenorm", prenorm)
    dropout_p = validation.probability("dropout_p", dropout_p)
    eps = validation.positive("eps", eps)

    lowp = validation.autocast_dtype(x.device)
    x, residual = validation.cast(x, lowp), validation.cast(residual, lowp)
    validation.same_dtype(x=x, residual=residual)

    if x.is_cuda:
        kernels = backends.select_cached("add_layer_norm", x.device, x.dtype, None, _GPU_FACTS,
                                         (C, x.numel() // C, dropout_p > 0.0))
    else:
        kernels = backends.select_cached("add_layer_norm", x.device, x.dtype, None, _FACTS, (C,))
    if kernels is None:
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, prenorm=prenorm, x_bias=x_bias)
    shape = x.shape
    x2 = as_rows(x, C)  # (N, C)
    r2 = as_rows(residual, C) if residual is not None else None
    w = weight if weight is not None else torch.ones(C, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else torch.zeros(C, dtype=x.dtype, device=x.device)
    w, b, xb = validation.cast(w, x.dtype), validation.cast(b, x.dtype), validation.cast(x_bias, x.dtype)
    xb = xb.contiguous() if xb is not None else None
    with validation.autocast_off(x.device):
        if kernels.add_layer_norm is not None and eager():  # the backward in C++
            y, h = kernels.add_layer_norm(x2, r2, w, b, eps, dropout_p, prenorm, philox.draw(dropout_p, x.device), xb)
        else:
            y, h = AddLayerNormFunction.apply(x2, r2, w, b, eps, dropout_p, bool(prenorm), kernels, xb)
    if prenorm:
        return as_shape(y, shape), as_shape(h, shape)
    return as_shape(y, shape)
