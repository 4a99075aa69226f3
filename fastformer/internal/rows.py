"""(N, C) row views of the ops' inputs and the outputs' shapes back, without a view where the shape is
already right: a no-op ``reshape`` still adds a ViewBackward node, and a gradient arriving through
one is a view, which autograd cannot accumulate in place (the residual stream's two gradients then
cost an out-of-place add each)."""
from typing import Sequence

import torch


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as contiguous ``(N, width)`` rows."""
    return (t if t.dim() == 2 else t.reshape(-1, width)).contiguous()


def as_shape(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` reshaped to ``shape``, itself where it has that shape already."""
    return t if t.shape == tuple(shape) else t.reshape(shape)
