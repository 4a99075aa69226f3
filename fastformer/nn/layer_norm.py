"""``fastformer.nn.LayerNorm`` and ``RMSNorm``: ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` computed by
``fastformer.ops.add_layer_norm`` (``rms_norm=True`` for RMSNorm)."""
import math
import numbers

import torch

from .. import ops
from ..internal.twins import share_state, twin_of
from ..internal import validation


@twin_of(torch.nn.LayerNorm)
class LayerNorm(torch.nn.LayerNorm):
    """Drop-in twin of :class:`torch.nn.LayerNorm` (same arguments, parameters and state_dict).

    ``normalized_shape`` may span several trailing dimensions, as torch's; they are
    flattened into one for the fused op.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        dims = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
        if not dims:
            raise ValueError("normalized_shape must name at least one dimension, got ()")
        for d in dims:
            validation.positive_int("normalized_shape", d)
        validation.positive("eps", eps)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    def _check_twin(self) -> None:
        """A converted torch module's configuration (torch does not check eps)."""
        validation.positive("eps", self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x, weight = _rows(self, input, "LayerNorm")  # (..., C), (C,)
        bias = self.bias.reshape(-1) if self.bias is not None else None
        y = ops.add_layer_norm(x, None, weight, bias, self.eps)
        return y.reshape(input.shape)

    @classmethod
    def from_torch(cls, module: torch.nn.LayerNorm) -> "LayerNorm":
        """The twin of ``module``, sharing its parameter objects (see :func:`fastformer.convert`)."""
        return share_state(cls, module)


def _rows(module, input: torch.Tensor, kind: str):
    """(x as (..., C) rows, weight as (C,) or None) for a norm over ``module.normalized_shape``."""
    validation.tensor("input", input, floating=True)
    shape = tuple(module.normalized_shape)
    n = len(shape)
    if tuple(input.shape[input.dim() - n:]) != shape:
        raise ValueError(f"{kind} expects input ending in normalized_shape {shape}, "
                         f"got input of shape {tuple(input.shape)}")
    C = math.prod(shape)
    weight = module.weight.reshape(C) if module.weight is not None else None  # (C,)
    return input.reshape(*input.shape[:input.dim() - n], C), weight


@twin_of(torch.nn.RMSNorm)
class RMSNorm(torch.nn.RMSNorm):
    """Drop-in twin of :class:`torch.nn.RMSNorm` (same arguments, parameters and state_dict).

    ``eps=None`` is torch's default: ``torch.finfo(input.dtype).eps``. As torch's, the normalised
    value is rounded to the input's dtype before the weight multiply (T5LayerNorm's order)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine: bool = True, device=None,
                 dtype=None) -> None:
        dims = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else tuple(normalized_shape)
        if not dims:
            raise ValueError("normalized_shape must name at least one dimension, got ()")
        for d in dims:
            validation.positive_int("normalized_shape", d)
        if eps is not None:
            validation.positive("eps", eps)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def _check_twin(self) -> None:
        """A converted torch module's configuration (torch does not check eps)."""
        if self.eps is not None:
            validation.positive("eps", self.eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x, weight = _rows(self, input, "RMSNorm")
        eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps
        return ops.add_layer_norm(x, None, weight, None, eps, rms_norm=True).reshape(input.shape)

    @classmethod
    def from_torch(cls, module: torch.nn.RMSNorm) -> "RMSNorm":
        """The twin of ``module``, sharing its parameter objects (see :func:`fastformer.convert`)."""
        return share_state(cls, module)
