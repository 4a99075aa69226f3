"""The dropout random numbers every backend shares: Philox 4x32-10, eight decisions a call.

An op's dropout tensor is viewed as rows of length ``C``, its last dimension (attention's
probabilities ``(B, H, Sq, Sk)``: ``C = Sk`` and a row per query; add_layer_norm ``(N, C)``;
the feed-forward activation ``(N, F)``). Row ``r`` (row-major over the leading dimensions) is
split into ``G = ceil(C / 8)`` groups of eight columns, and group ``g`` makes ONE Philox-4x32-10
call with counter ``(lo32(n), hi32(n), 0, 0)``, ``n = offset + r * G + g``, and key
``(lo32(seed), hi32(seed))`` -- exactly ``triton.language.randint4x(seed, n)``. Its four 32-bit
words ``w0..w3`` give the eight columns 16 random bits each, in memory order: column
``8g + j`` takes ``u = (w[j // 2] >> (16 * (j % 2))) & 0xFFFF``. The element is kept iff
``u >= drop_threshold(p) = round(p * 2**16)`` (half up), so the keep probability is within
2**-17 of ``1 - p``; kept values are scaled by ``1 / (1 - p)``. An op call consumes
``rows * G`` counters.

The C++ kernels (``csrc/cpu/philox.h``) and the Triton kernels (``triton_kernels/utils.py``)
produce the same bits, so the reference ops here regenerate the very mask a kernel used, and
backward passes regenerate it instead of storing it. ``seed`` and ``offset`` come from torch's
default generator (:func:`next_seed`), so ``torch.manual_seed`` makes a run repeatable.
"""
import math
from typing import Sequence, Tuple

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of a * b for uint32 values held in int64 (wrapping product)."""
    prod = b * a  # int64 wraps mod 2**64: the low 64 bits of the exact product are kept
    return (prod >> 32) & _M32, prod & _M32


def philox4x32(n: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """All four uint32 Philox words for counters ``offset .. offset + n - 1``: int64 ``(n, 4)``."""
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
    return torch.stack((c0, c1, c2, c3), dim=-1)


def philox_bits(n: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """The first Philox word for counters ``offset .. offset + n - 1``, as int64 ``(n,)``
    (what ``tl.randint`` returns and the C++ ``philox_bits`` op gives)."""
    return philox4x32(n, seed, offset, device=device)[:, 0].contiguous()


def groups_per_row(C: int) -> int:
    """Philox calls per row of ``C`` columns: one per eight columns."""
    return (int(C) + 7) // 8


def counters_used(shape: Sequence[int]) -> int:
    """How many Philox counters dropout over a tensor of ``shape`` consumes."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1
    rows = math.prod(shape[:-1])
    return rows * groups_per_row(shape[-1])


def random16(shape: Sequence[int], seed: int, offset: int, device=None) -> torch.Tensor:
    """The 16 random bits of every element of ``shape`` (int64, values in [0, 65536))."""
    shape = tuple(int(s) for s in shape)
    C = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    G = groups_per_row(C)
    words = philox4x32(rows * G, seed, offset, device=device)  # (rows * G, 4)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (rows * G, 4, 2): j = 2 * word + half
    return halves.reshape(rows, G * 8)[:, :C].reshape(shape)


def drop_threshold(p: float) -> int:
    """The 16-bit threshold: an element is kept iff its 16 bits are ``>= drop_threshold(p)``."""
    return int(p * (1 << 16) + 0.5)  # round half up, as csrc/cpu/philox.h and triton_kernels/utils.py


def keep_mask(shape: Sequence[int], p: float, seed: int, offset: int, device=None) -> torch.Tensor:
    """Bool keep-mask of ``shape`` (rows of its last dimension) for dropout probability ``p``."""
    return random16(shape, seed, offset, device=device) >= drop_threshold(p)


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
