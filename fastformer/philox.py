"""The dropout random numbers every backend shares: Philox 4x32-10, eight decisions a call
(the elementwise ops), sixteen for attention (its own layout, "v3", below: attention_keep_mask).

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

The C++ kernels (``csrc/cpu/philox.h``) and the Triton kernels (``fastformer/triton_kernels/utils.py``)
produce the same bits, so the reference ops here regenerate the very mask a kernel used, and
backward passes regenerate it instead of storing it. ``seed`` and ``offset`` come from torch's
default generator (:func:`next_seed`), so ``torch.manual_seed`` makes a run repeatable.

The ops take the pair as ONE int64 tensor ``philox = (seed, offset)`` of shape ``(2,)``
(:func:`pack`), drawn by :func:`draw` from torch's own generator of the op's device
(:func:`_draw_on`). On a CPU it is a CPU tensor ``(seed, 0)``, read on the host by the kernels. On a GPU it is a GPU tensor that the kernels read by pointer: drawing it
is one kernel of torch's graph-safe RNG on the op's stream, so a captured CUDA graph (or
``torch.compile(mode="reduce-overhead")``) draws a fresh pair on every replay, each the pair eager
would draw at that generator state, and the generator's state (``torch.cuda.get_rng_state``,
``torch.manual_seed``, activation checkpointing's save and restore) covers dropout as it covers
torch's own. A ``philox`` packed on the CPU (:func:`pack`) is taken by every backend.

Traced (``torch.compile``, ``make_fx``), the draw is the custom op
``torch.ops.fastformer.next_seed(device)``: an opaque op tagged ``nondeterministic_seeded``, so
``torch.compile`` keeps every draw, in order, inside one graph (no ``.item()``, no graph break)
and inductor never swaps in its own RNG. Eager and traced calls draw through :func:`_draw_on`, so
eager and compiled runs with the same ``torch.manual_seed`` drop the same elements. A call
without dropout draws nothing and allocates nothing (:data:`NO_DROPOUT`).
"""
import math
from typing import Optional, Sequence, Tuple

import torch

from .internal.eager import eager

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
    return (C + 7) // 8  # no int(): a SymInt C stays symbolic under torch.compile


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
    return int(p * (1 << 16) + 0.5)  # round half up, as csrc/cpu/philox.h and fastformer/triton_kernels/utils.py


def keep_mask(shape: Sequence[int], p: float, seed: int, offset: int, device=None) -> torch.Tensor:
    """Bool keep-mask of ``shape`` (rows of its last dimension) for dropout probability ``p``."""
    return random16(shape, seed, offset, device=device) >= drop_threshold(p)


def dropout(x: torch.Tensor, p: float, seed, offset) -> torch.Tensor:
    """Reference dropout of ``x`` with the shared Philox mask (differentiable in ``x``).

    ``seed`` and ``offset`` are ints or int64 0-d tensors (the two halves of a :func:`draw`n
    ``philox`` tensor: then no value leaves the tensor, so ``torch.compile`` traces it whole)."""
    if p == 0.0:
        return x
    keep = keep_mask(x.shape, p, seed, offset, device=x.device)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))



# ------------------------------------------------------------------ attention's dropout (v3)
# Attention drops probabilities at FlashAttention-2's price: 16 decisions a Philox call, each
# from one byte, made where a tensor-core kernel's scores live. The probabilities of head-row
# bh = b * H + h (a (B, H, Sq, Sk) op; a varlen op uses the padded op's (B, H, max_seqlen_q,
# max_seqlen_k)) are cut into 16 x 32 tiles (query block qb = i // 16, key block kb = j // 32;
# QB = ceil(Sq / 16), KB = ceil(Sk / 32) of them). Tile (bh, qb, kb) makes 32 Philox calls,
# lanes l = 0 .. 31, with counter n = offset + ((bh * QB + qb) * KB + kb) * 32 + l. Within the tile,
# element (r, c) = (i % 16, j % 32) is
#     lane l = 4 * (r % 8) + (c % 8) // 2,  byte  b = 4 * (c // 8) + 2 * (r // 8) + c % 2
# of its call's 16 bytes (w0's low byte first): exactly the elements lane l of a warp holds in
# the accumulators of an m16 x n32 product (mma.sync m16n8: n8 tile t = c // 8, accumulator
# 2 * (r // 8) + c % 2), so lane l's call makes its 16 decisions and nothing moves between lanes.
# The element is kept iff its byte >= T = round(p * 256) (half up), and kept values are scaled by
# 256 / (256 - T): the realised keep probability is (256 - T) / 256, so dropout stays unbiased,
# and the rate a user gets is T / 256 (0.1 -> 26 / 256 = 0.1015625; p < 1 / 512 drops nothing).
ATTN_TILE_ROWS, ATTN_TILE_COLS, ATTN_LANES = 16, 32, 32


def attention_threshold(p: float) -> int:
    """Attention's 8-bit threshold: a probability is kept iff its byte is ``>= attention_threshold(p)``."""
    return min(int(p * 256 + 0.5), 256)  # round half up (p * 256 is exact in binary floating point)


def attention_drop_rate(p: float) -> float:
    """The dropout rate attention applies for a requested ``p``: ``attention_threshold(p) / 256``."""
    return attention_threshold(p) / 256.0


def attention_keep_scale(p: float) -> float:
    """What a kept probability is multiplied by: 1 / the realised keep probability (0 if none is kept)."""
    t = attention_threshold(p)
    return 256.0 / (256 - t) if t < 256 else 0.0


def attention_counters_used(shape: Sequence[int]) -> int:
    """Philox counters attention dropout over probabilities of ``shape`` (..., Sq, Sk) consumes."""
    *lead, Sq, Sk = (int(s) for s in shape)
    return math.prod(lead) * (-(-Sq // ATTN_TILE_ROWS)) * (-(-Sk // ATTN_TILE_COLS)) * ATTN_LANES


def attention_random8(shape: Sequence[int], seed: int, offset: int, device=None) -> torch.Tensor:
    """The random byte of every attention probability of ``shape`` (..., Sq, Sk): int64 in [0, 256)."""
    *lead, Sq, Sk = (int(s) for s in shape)
    BH = math.prod(lead)
    QB, KB = -(-Sq // ATTN_TILE_ROWS), -(-Sk // ATTN_TILE_COLS)
    words = philox4x32(BH * QB * KB * ATTN_LANES, seed, offset, device=device)  # (calls, 4)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=words.device)
    bytes_ = (words[:, :, None] >> shifts) & 0xFF  # (calls, 4 words, 4 bytes): byte b = 4 * word + byte
    # (BH, QB, KB, lane = (a, q), byte = (t, hi, e)) with r = 8 hi + a, c = 8 t + 2 q + e
    x = bytes_.reshape(BH, QB, KB, 8, 4, 4, 2, 2)  # (bh, qb, kb, a, q, t, hi, e)
    x = x.permute(0, 1, 6, 3, 2, 5, 4, 7)  # (bh, qb, hi, a, kb, t, q, e)
    x = x.reshape(BH, QB * ATTN_TILE_ROWS, KB * ATTN_TILE_COLS)[:, :Sq, :Sk]
    return x.reshape(*lead, Sq, Sk)


def attention_keep_mask(shape: Sequence[int], p: float, seed: int, offset: int, device=None) -> torch.Tensor:
    """Bool keep-mask of attention probabilities of ``shape`` (..., Sq, Sk) for dropout ``p``."""
    return attention_random8(shape, seed, offset, device=device) >= attention_threshold(p)


def attention_dropout(probs: torch.Tensor, p: float, seed, offset) -> torch.Tensor:
    """Attention's dropout of probabilities ``probs`` (..., Sq, Sk), differentiable: exactly what
    the attention ops drop (seed and offset as :func:`dropout` takes them)."""
    if p == 0.0:
        return probs
    keep = attention_keep_mask(probs.shape, p, seed, offset, device=probs.device)
    return probs * keep.to(probs.dtype) * attention_keep_scale(p)


_CPU = torch.device("cpu")


def _draw_on(device: torch.device) -> torch.Tensor:
    """The one place a pair is drawn: int64 ``(2,)`` on ``device`` from torch's default generator
    of that device. On the CPU ``(seed, 0)``: the seed is ``torch.randint(0, 2**62, ())``'s draw, as
    it always was (the same masks for the same ``torch.manual_seed``). Elsewhere both values in
    ``[0, 2**62)`` from one ``random_``: one kernel on a GPU, captured by a CUDA graph as torch's
    own RNG ops are."""
    if device.type == "cpu":
        pair = torch.zeros(2, dtype=torch.int64)
        pair[0].random_(0, 2**62)  # one 64-bit draw, as random_ on a 0-d tensor (pair[0] is one)
        return pair
    return torch.empty(2, dtype=torch.int64, device=device).random_(0, 2**62)


def next_seed() -> Tuple[int, int]:
    """A fresh ``(seed, offset)`` pair drawn from torch's default CPU generator: the very pair
    :func:`draw` would give a CPU op at this generator state."""
    seed, offset = _draw_on(_CPU).tolist()
    return seed, offset


# ------------------------------------------------------------------ the (2,) philox tensor
def pack(seed: int, offset: int) -> torch.Tensor:
    """The ``philox`` argument of the ops for a chosen pair: int64 CPU ``(2,)`` = (seed, offset)."""
    for name, v in (("seed", seed), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not 0 <= v < 2**63:
            raise ValueError(f"{name} must be in [0, 2**63), got {v}")
    return torch.tensor([seed, offset], dtype=torch.int64, device="cpu")


def no_dropout() -> torch.Tensor:
    """The ``philox`` argument of a call without dropout: (0, 0), drawing nothing (a new tensor;
    eager op calls pass the shared :data:`NO_DROPOUT` instead)."""
    return torch.zeros(2, dtype=torch.int64, device="cpu")


# What an eager call without dropout passes: one read-only (0, 0) for every call (no kernel reads
# it when dropout_p == 0), so such a call allocates nothing.
NO_DROPOUT = no_dropout()


def _next_seed_impl(device: torch.device) -> torch.Tensor:
    return _draw_on(device)


def _keep_every_draw() -> None:
    """Keep AOTAutograd's common-subexpression elimination from merging the draws of a graph.

    Its CSE pass (``fx_graph_cse`` in torch/_functorch/compile_utils.py, torch 2.13) spares the
    aten random ops of a fixed list ``rand_ops`` but ignores the ``nondeterministic_seeded``
    tag, so the argument-less ``next_seed()`` calls of one graph would become ONE draw: every
    dropout of a compiled model would share a seed (measured: 1 draw instead of 10, a different
    loss from eager). Adding the op to that list is what the tag should do. Run from the fake
    implementation, i.e. only while torch.compile traces, before its CSE runs; a torch without
    the list leaves nothing to do here (the tests count the draws of a compiled model)."""
    try:
        from torch._functorch import compile_utils
    except ImportError:
        return
    rand_ops = getattr(compile_utils, "rand_ops", None)
    packet = torch.ops.fastformer.next_seed
    if isinstance(rand_ops, list) and not any(op is packet for op in rand_ops):
        rand_ops.append(packet)


def _next_seed_fake(device: torch.device) -> torch.Tensor:
    _keep_every_draw()
    return torch.empty(2, dtype=torch.int64, device=device)


# A Python-defined op beside the C++ ones (csrc/ops.cpp): it needs no extension, so every
# backend (the reference included) draws through it.
_next_seed_op = torch.library.custom_op("fastformer::next_seed", _next_seed_impl, mutates_args=(),
                                        schema="(Device device) -> Tensor",
                                        tags=(torch.Tag.nondeterministic_seeded,))
_next_seed_op.register_fake(_next_seed_fake)


def draw_eager(dropout_p: float, device: torch.device) -> torch.Tensor:
    """:func:`draw`'s answer for a call known to be eager (an op's fast path, internal/fast.py: its
    own check), without the tracing check. The C++ ops' direct entries (csrc/eager.h) draw the same
    pair in C++ instead (``ff_draw_philox``: the same bits, the same generator state after)."""
    return NO_DROPOUT if dropout_p == 0.0 else _draw_on(device)


def draw(dropout_p: float, device: Optional[torch.device] = None) -> torch.Tensor:
    """The ``philox`` tensor for an op call with dropout probability ``dropout_p`` on ``device``
    (default the CPU): a fresh (seed, offset) from that device's generator if ``dropout_p > 0``
    (on that device), else (0, 0) on the CPU, drawing nothing."""
    if not eager():
        # traced (compile, make_fx, fake): the op, one draw per call; a fresh (0, 0) of the mode
        return no_dropout() if dropout_p == 0.0 else torch.ops.fastformer.next_seed(device or _CPU)
    return draw_eager(dropout_p, device or _CPU)  # eager: the op's own implementation, without its dispatch
