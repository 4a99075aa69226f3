"""T5's learned relative position bias, as the attention kernels read it.

T5 (and mT5, UMT5, ByT5, Pix2Struct, Switch Transformers) adds ``table[bucket(j - i), h]`` to the
score of query ``i`` and key ``j`` in head ``h``: ``table`` is a learned ``(num_buckets, H)``
embedding and :func:`relative_position_bucket` maps a signed distance to one of ``num_buckets``
buckets (exact for small distances, logarithmic up to ``max_distance``, one bucket beyond).

Past ``max_distance`` every distance falls in the last bucket of its side, so the bias of a head
is a function of the distance clamped to ``[-R, R]`` with ``R = max_distance``: the kernels take it
as ``(H, 2R + 1)`` values by distance (:func:`bias_by_distance`, built on the host from the table
with one small product) and compute each score's clamped distance from the query's and key's
positions. No ``(Sq, Sk)`` bias exists. The kernels return the gradient by distance, reduced in a
fixed order; its way back to the table is the transpose of the same product (deterministic).
"""
import math
from typing import Dict, Tuple

import torch

_ONE_HOT: Dict[Tuple[torch.device, int, int, bool], torch.Tensor] = {}


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each ``relative_position = key position - query position`` (int64 tensor).

    Bidirectional (T5's encoder): half the buckets for keys after the query. Otherwise (the
    decoder) keys after the query share bucket 0. Of a side's ``n`` buckets, distances below
    ``n // 2`` get one bucket each; the rest grow logarithmically up to ``max_distance``, beyond
    which all share the side's last bucket. The same float32 arithmetic as transformers'
    ``T5Attention._relative_position_bucket``, so the same device gives the same buckets.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


def check_table(table: torch.Tensor, heads: int, bidirectional: bool, max_distance: int) -> Tuple[bool, int]:
    """The checks of a ``relative_attention_bias`` table and its settings, with clear errors; returns
    ``(bidirectional, max_distance)`` as plain values."""
    from ..internal import validation

    validation.tensor("relative_attention_bias", table, ndim=2, floating=True)
    if table.shape[1] != heads:
        raise ValueError(f"relative_attention_bias must have shape (num_buckets, H) with q's H = {heads}, "
                         f"got {tuple(table.shape)}")
    bidirectional = validation.flag("bidirectional", bidirectional)
    max_distance = validation.positive_int("relative_attention_max_distance", max_distance)
    side = table.shape[0] // 2 if bidirectional else table.shape[0]
    if side < 2:
        raise ValueError(f"relative_attention_bias has {table.shape[0]} buckets: "
                         f"{'bidirectional buckets need at least 4' if bidirectional else 'at least 2 are needed'}")
    if max_distance <= side // 2:
        raise ValueError(f"relative_attention_max_distance must exceed the exact buckets of a side "
                         f"({side // 2}), got {max_distance}: T5's logarithmic buckets are undefined below")
    return bidirectional, max_distance


def _one_hot(device: torch.device, num_buckets: int, max_distance: int, bidirectional: bool) -> torch.Tensor:
    """``(2R + 1, num_buckets)`` fp32: row ``r`` is the one-hot bucket of distance ``r - R``."""
    key = (device, num_buckets, max_distance, bidirectional)
    hot = _ONE_HOT.get(key)
    if hot is None:
        distance = torch.arange(-max_distance, max_distance + 1, device=device)
        bucket = relative_position_bucket(distance, bidirectional, num_buckets, max_distance)
        hot = torch.nn.functional.one_hot(bucket, num_buckets).to(torch.float32)
        if not torch.compiler.is_compiling():
            _ONE_HOT[key] = hot
    return hot


def bias_by_distance(table: torch.Tensor, bidirectional: bool, max_distance: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(H, 2R + 1)`` in ``dtype`` (``R = max_distance``): column ``r`` is each head's bias at the
    distance ``j - i = r - R``, distances beyond ``R`` sharing the last column of their side.
    Differentiable in ``table``; the gradient is a product with a fixed one-hot matrix."""
    hot = _one_hot(table.device, table.shape[0], max_distance, bidirectional)
    return torch.matmul(hot.to(dtype), table.to(dtype)).t().contiguous()  # (2R + 1, H) -> (H, 2R + 1)


def dense_bias(table: torch.Tensor, q_len: int, k_len: int, query_offset: int, bidirectional: bool,
               max_distance: int) -> torch.Tensor:
    """``(H, q_len, k_len)``: the bias T5 adds to each score, query ``i`` at position
    ``i + query_offset``, straight from the buckets (the reference; no kernel builds it)."""
    i = torch.arange(q_len, device=table.device)[:, None] + query_offset
    j = torch.arange(k_len, device=table.device)[None, :]
    bucket = relative_position_bucket(j - i, bidirectional, table.shape[0], max_distance)  # (q_len, k_len)
    return table[bucket].permute(2, 0, 1)
