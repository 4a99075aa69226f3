"""The dropout random numbers every backend shares: Philox 4x32-10.

Element ``i`` of an op's dropout tensor (its row-major index) draws the first
32-bit word of Philox-4x32-10 with counter ``(lo32(offset + i), hi32(offset + i), 0, 0)``
and key ``(lo32(seed), hi32(seed))`` -- exactly what ``triton.language.randint(seed,
offset + i)`` returns. The element is kept iff ``(bits >> 8) >= round(p * 2**24)``
and kept values are scaled by ``1 / (1 - p)``. The C++ kernels (``csrc/cpu/philox.h``)
and the Triton kernels produce the same bits, so the reference ops here regenerate
the very mask a kernel used, and backward passes regenerate it instead of storing it.

``seed`` and ``offset`` come from torch's default generator (:func:`next_seed`), so
``torch.manual_seed`` makes a run repeatable.
"""
from typing import Sequence, Tuple

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of a * b for uint32 values held in int64 (wrapping product)."""
    prod = b * a  # int64 wraps mod 2**64: the low 64 bits of the exact product are kept
    return (prod >> 32) & _M32, prod & _M32


def philox_bits(n: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """uint32 Philox words for counters ``offset .. offset + n - 1``, as int64 ``(n,)``."""
    ctr = torch.arange(n, dtype=torch.int64, device=device) + offset
    c0, c1 = ctr & _M32, (ctr >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def drop_threshold(p: float) -> int:
    """The 24-bit threshold: an element is kept iff ``(bits >> 8) >= drop_threshold(p)``."""
    return int(p * (1 << 24) + 0.5)  # round half up, as llround in csrc/cpu/philox.h


def keep_mask(shape: Sequence[int], p: float, seed: int, offset: int, device=None) -> torch.Tensor:
    """Bool keep-mask of ``shape`` (row-major element order) for dropout probability ``p``."""
    n = 1
    for s in shape:
        n *= int(s)
    bits = philox_bits(n, seed, offset, device=device)
    return ((bits >> 8) >= drop_threshold(p)).reshape(tuple(shape))


def dropout(x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """Reference dropout of ``x`` with the shared Philox mask (differentiable in ``x``)."""
    if p == 0.0:
        return x
    keep = keep_mask(x.shape, p, seed, offset, device=x.device)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def next_seed() -> Tuple[int, int]:
    """A fresh ``(seed, offset)`` pair drawn from torch's default CPU generator."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    return seed, 0
