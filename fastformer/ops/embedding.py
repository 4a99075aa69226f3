import math
from typing import Dict, Optional, Tuple

import torch

from .. import backends, philox
from ..autograd import EmbeddingFunction
from ..internal import fast, validation
from ..internal.eager import eager
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


_POSITIONS: Dict[Tuple, torch.Tensor] = {}  # eager calls' default positions, per (shape, device)


def _default_positions(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """``arange(S)`` along the last dimension of ``shape``, flattened to ``(N,)`` int64: made once per
    (shape, device) for eager calls (a batch's shapes repeat; the kernels only read it), afresh when
    traced."""
    key, keep = (shape, device), eager()
    pos = _POSITIONS.get(key) if keep else None
    if pos is None:
        pos = (torch.arange(shape[-1], device=device).expand(shape).reshape(-1).contiguous() if len(shape)
               else torch.zeros(1, dtype=torch.int64, device=device))  # (a length-1 S expands to stride 0)
        if keep:
            if len(_POSITIONS) >= 256:  # many shapes (generation's growing length): start over
                _POSITIONS.clear()
            _POSITIONS[key] = pos
    return pos


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
    if (fast.plain(input, weight, positional, positions) and fast.number(scale) and fast.number(dropout_p)
            and (padding_idx is None or padding_idx.__class__ is int) and fast.ready()):
        out = fast.attempt(_fast, input, weight, scale, positional, positions, dropout_p, padding_idx)
        if out is not None:
            return out
    return _checked(input, weight, scale, positional, positions, dropout_p, padding_idx)


def _fast(input, weight, scale, positional, positions, dropout_p, padding_idx):
    """The checked path's kernel call without the checks the C++ op makes (internal/fast.py), or
    None where the call is the checked path's (a backend that does not check id values is)."""
    if input.dtype not in ID_DTYPES or weight.dim() != 2 or not math.isfinite(scale):
        return None
    V, D = weight.shape
    if padding_idx is not None and not 0 <= padding_idx < V:
        return None  # (a negative one counts from the end: the checked path's)
    if positions is not None and (positional is None or positions.dtype not in ID_DTYPES
                                  or positions.shape != input.shape):
        return None
    kernels = backends.select_cached("embedding", weight.device, weight.dtype)
    if kernels is None or kernels.embedding is None or kernels.name not in validation.CHECK_VALUES:
        return None
    # _embedding's eager call (autocast is off and the call eager: fast.ready()); every tensor on the
    # weight's device (fast.call's check)
    return fast.call(kernels.embedding, _op_args(input, weight, scale, positional, positions, dropout_p, padding_idx),
                     7, dropout_p, weight.device)


def _op_args(input, weight, scale, positional, positions, dropout_p, padding_idx):
    """The C++ op's arguments but philox (its eager call, from both paths): the ids (and positions)
    as they are (it takes them as (N,) int64 rows and returns input.shape + (D,) without a view
    node), the default positions where a table is given without them."""
    pos = None
    if positional is not None:
        pos = positions
        if pos is None:
            pos = _POSITIONS.get((input.shape, input.device))  # (_default_positions' cache, looked up inline)
            if pos is None:
                pos = _default_positions(input.shape, input.device)
        positional = positional.contiguous()
    return input, weight.contiguous(), positional, pos, scale, dropout_p, -1 if padding_idx is None else padding_idx


def _checked(input, weight, scale, positional, positions, dropout_p, padding_idx):
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
    if positional is not None and positions is None:
        P, S = positional.shape[0], input.shape[-1] if input.dim() else 1
        if input.numel() and S > P:
            raise ValueError(f"positional has {P} rows but input's last dimension needs positions 0 .. {S - 1} "
                             f"(S = {S}); pass a longer table")

    def check_values():
        _in_range("input", input, V, "rows of weight")
        if positions is not None:
            _in_range("positions", positions, positional.shape[0], "rows of positional")

    kernels = backends.select_cached("embedding", weight.device, weight.dtype)
    return validation.values_checked(kernels, check_values, lambda: _embedding(
        kernels, input, weight, scale, positional, positions, dropout_p, padding_idx, D))


def _embedding(kernels, input, weight, scale, positional, positions, dropout_p, padding_idx, D):
    if kernels is None:
        return reference.embedding(input, weight, scale=scale, positional=positional, positions=positions,
                                   dropout_p=dropout_p, padding_idx=padding_idx)
    with validation.autocast_off(weight.device):
        if kernels.embedding is not None and eager():  # the backward in C++
            return kernels.embedding(*_op_args(input, weight, scale, positional, positions, dropout_p, padding_idx),
                                     philox.draw(dropout_p, weight.device))
        pos = None  # traced, or no C++ op: the Function on (N,) rows
        if positional is not None:
            pos = _default_positions(input.shape, input.device) if positions is None else positions
            positional = positional.contiguous()
        padding_idx = -1 if padding_idx is None else padding_idx
        ids = input.reshape(-1).long().contiguous()  # (N,)
        pos = pos.reshape(-1).long().contiguous() if pos is not None else None  # (N,)
        out = EmbeddingFunction.apply(ids, weight.contiguous(), positional, pos, scale, dropout_p, padding_idx,
                                      kernels)
    return as_shape(out, (*input.shape, D))
