import math
from typing import Optional

import torch

from .. import backends
from ..autograd import EmbeddingFunction
from ..internal import validation
from ..internal.rows import as_shape
from . import reference

ID_DTYPES = (torch.int64, torch.int32)


def _ids(name: str, t) -> None:
    validation.tensor(name, t)
    if t.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must hold integer ids (int64 or int32), got dtype {t.dtype}")


def _in_range(name: str, t: torch.Tensor, size: int, what: str) -> None:
    """Every value of ``t`` in ``[0, size)``; skipped while torch.compile traces (a value check
    reads the data: a graph break) and for an empty ``t``."""
    if torch.compiler.is_compiling() or t.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(t))
    if lo < 0 or hi >= size:
        raise ValueError(f"{name} must be in [0, {size}) ({what}), got values in [{lo}, {hi}]")


def embedding(input: torch.Tensor, weight: torch.Tensor, *, scale: float = 1.0,
              positional: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, padding_idx: Optional[int] = None) -> torch.Tensor:
    """The fused input embedding ``dropout(weight[input] * scale + positional[positions])``.

    Args:
        input: integer ids (int64 or int32) of any shape ``(..., S)``, each in ``[0, V)``.
        weight: ``(V, D)`` embedding table (``nn.Embedding.weight``).
        scale: multiplies the looked-up rows (a Transformer's ``sqrt(d_model)``).
        positional: optional ``(P, D)`` table of the weight's dtype, added after the scaling
            (sinusoidal, or a learned one such as BART's: it gets its gradient).
        positions: integer rows of ``positional`` of ``input``'s shape, each in ``[0, P)``;
            default ``arange(S)`` along the last dimension (then ``S <= P``). Packed rows pass
            their own (restarting at 0 in each sequence); incremental decoding an offset one.
        dropout_p: dropout probability on the sum (pass 0 in eval).
        padding_idx: as ``F.embedding``'s: the row of ``weight`` that gets no gradient
            (negative counts from the end). The positional table's gradient is unaffected.

    The ids' and positions' values are checked against the tables (on a GPU that reads them: one
    sync; skipped while torch.compile traces). Returns ``input.shape + (D,)`` in the weight's dtype. One pass forward; backward regenerates
    the dropout mask and scatter-adds into ``weight``'s gradient (and ``positional``'s) without
    atomics, deterministically. Dropout views the output as rows of D columns, one per id.
    """
    _ids("input", input)
    validation.tensor("weight", weight, ndim=2, floating=True)
    V, D = weight.shape
    if not validation.is_number(scale) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    scale = float(scale)
    if positional is not None:
        validation.tensor("positional", positional, ndim=2, floating=True)
        if positional.shape[1] != D:
            raise ValueError(f"positional must have shape (P, {D}) (D = weight.shape[1]), got {tuple(positional.shape)}")
        validation.same_dtype(weight=weight, positional=positional)
    if positions is not None:
        if positional is None:
            raise ValueError("positions were given without a positional table to index")
        _ids("positions", positions)
        validation.shape("positions", positions, input.shape, "the shape of input")
    validation.same_device(input=input, weight=weight, positional=positional, positions=positions)
    dropout_p = validation.probability("dropout_p", dropout_p)
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
        if not -V <= padding_idx < V:
            raise ValueError(f"padding_idx must be in [-{V}, {V}) (weight has {V} rows), got {padding_idx}")
        padding_idx = padding_idx + V if padding_idx < 0 else padding_idx
    _in_range("input", input, V, "rows of weight")
    if positional is not None:
        P = positional.shape[0]
        if positions is None:
            S = input.shape[-1] if input.dim() else 1
            if input.numel() and S > P:
                raise ValueError(f"positional has {P} rows but input's last dimension needs positions 0 .. {S - 1} "
                                 f"(S = {S}); pass a longer table")
        else:
            _in_range("positions", positions, P, "rows of positional")

    kernels = backends.select("embedding", weight.device, weight.dtype)
    if kernels is None:
        return reference.embedding(input, weight, scale=scale, positional=positional, positions=positions,
                                   dropout_p=dropout_p, padding_idx=padding_idx)
    ids = input.reshape(-1).long().contiguous()  # (N,)
    pos = None
    if positional is not None:
        if positions is None:  # arange(S) along the last dimension
            positions = (torch.arange(input.shape[-1], device=input.device).expand(input.shape) if input.dim()
                         else torch.zeros((), dtype=torch.int64, device=input.device))
        pos = positions.reshape(-1).long().contiguous()  # (N,)
        positional = positional.contiguous()
    with validation.autocast_off(weight.device):
        out = EmbeddingFunction.apply(ids, weight.contiguous(), positional, pos, scale, dropout_p,
                                      -1 if padding_idx is None else padding_idx, kernels)
    return as_shape(out, (*input.shape, D))
