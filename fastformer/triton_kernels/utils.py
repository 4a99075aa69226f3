"""Pieces every Triton kernel shares: the dropout keep-mask on the shared Philox stream, the
ops' ``philox`` argument (by pointer on the op's device, read on the host from the CPU), the CUDA
device guard of the host functions, and the switch that runs autotuned kernels at their first config."""
import contextlib
import functools
import os
from typing import Tuple

import torch
import triton
import triton.language as tl

# Read once, at import: the kernels specialise on it (triton_kernels/aot.py unsets it before importing).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_first_configs = 0  # how many first_configs() blocks are open


def first_config_only() -> bool:
    """Whether the autotuned kernels (attention's, the feed-forward's matmul) run their first,
    best-guess config instead of autotuning: inside :func:`first_configs`, and under
    ``torch.use_deterministic_algorithms(True)`` (the autotuner's pick may differ between
    processes, and a tile size changes the summation order)."""
    return _first_configs > 0 or torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def first_configs():
    """Within the block, the autotuned kernels run their first config: one compile per kernel
    specialisation instead of one per candidate config and shape bucket. For correctness checks
    on small shapes (``python -m fastformer check``), which a fresh Triton cache otherwise spends
    compiling configs that only the timing runs of autotuning use."""
    global _first_configs
    _first_configs += 1
    try:
        yield
    finally:
        _first_configs -= 1


@triton.jit
def dropout_keep_tile(seed, offset, rows, G, c0, threshold, BLOCK_C: tl.constexpr):
    """Keep-mask (R, BLOCK_C) of rows ``rows`` (R,) and columns ``c0 + arange(BLOCK_C)`` of a
    dropout tensor viewed as rows of ``G = ceil(C / 8)`` Philox groups (fastformer/philox.py):
    ``c0`` and ``BLOCK_C`` are multiples of 8, so the tile spans whole groups. Group ``g`` of row
    ``r`` makes one ``randint4x`` call on counter ``offset + r * G + g`` (int64); its words
    ``w0..w3`` give columns ``8g .. 8g + 7`` the 16-bit values ``w0 lo, w0 hi, w1 lo, ..., w3 hi``,
    and an element is kept iff its value is ``>= threshold = round(p * 2**16)``.
    Columns at or past ``C`` (and rows past the last) get bits of other counters: callers mask them.
    """
    tl.static_assert(BLOCK_C % 8 == 0, "dropout_keep_tile: BLOCK_C must be a multiple of 8")
    GROUPS: tl.constexpr = BLOCK_C // 8
    groups = c0 // 8 + tl.arange(0, GROUPS)  # (GROUPS,)
    ctr = offset + rows.to(tl.int64)[:, None] * G + groups.to(tl.int64)[None, :]  # (R, GROUPS)
    w0, w1, w2, w3 = tl.randint4x(seed, ctr)  # uint32 (R, GROUPS) each
    # The 16-bit halves as int32 (values < 2**16, so the signed compare below is exact).
    u0 = (w0 & 0xFFFF).to(tl.int32)
    u1 = (w0 >> 16).to(tl.int32)
    u2 = (w1 & 0xFFFF).to(tl.int32)
    u3 = (w1 >> 16).to(tl.int32)
    u4 = (w2 & 0xFFFF).to(tl.int32)
    u5 = (w2 >> 16).to(tl.int32)
    u6 = (w3 & 0xFFFF).to(tl.int32)
    u7 = (w3 >> 16).to(tl.int32)
    # join appends a trailing axis, so index [a, b, c] of the (R, GROUPS, 2, 2, 2) result is
    # u_{4a + 2b + c}: flattening the last three axes lists u0..u7 in column order.
    u = tl.join(tl.join(tl.join(u0, u4), tl.join(u2, u6)), tl.join(tl.join(u1, u5), tl.join(u3, u7)))
    u = tl.reshape(u, (rows.shape[0], BLOCK_C))  # (R, BLOCK_C)
    return u >= threshold


def dropout_threshold(p: float) -> int:
    """The 16-bit keep threshold of dropout probability ``p``: round(p * 2**16), half up
    (fastformer.philox.drop_threshold)."""
    return int(p * (1 << 16) + 0.5)


def check_tensor(name: str, t: torch.Tensor, shape, dtype=None) -> None:
    """Host-side check of a kernel argument: its shape, its dtype (if given), contiguous."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the activations' dtypes the kernels take


def check_float(name: str, t: torch.Tensor, ndim: int, dims: str) -> None:
    """Host-side check of a floating-point input: ``ndim`` dimensions (``dims`` words the error,
    ``"{name} must {dims}"``), a dtype of FLOAT_DTYPES, contiguous."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must {dims}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be fp16, bf16 or fp32 for the triton backend, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def dropout_args(dropout_p: float) -> Tuple[bool, int, float]:
    """(HAS_DROPOUT, threshold, scale) of a dropout probability in [0, 1) (a ValueError otherwise)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    has_dropout = dropout_p > 0.0
    return has_dropout, dropout_threshold(dropout_p), (1.0 / (1.0 - dropout_p) if has_dropout else 1.0)


# Host-side integer helpers in plain Python: triton.cdiv and triton.next_power_of_2 are
# ConstexprFunctions, ~2 us a call on the host (matmul.launch made 23 calls of them per GEMM).
def cdiv(a, b):
    """ceil(a / b) of non-negative ints (SymInts too)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


# Tests only: read a philox tensor on the host even where the kernels could load it (under the
# interpreter the op's device is the CPU, so both forms of the argument are CPU tensors there).
HOST_PHILOX = False

_PHILOX_WANT = "an int64 CPU tensor of shape (2,) = (seed, offset), or one on the op's device"


def philox_args(philox: torch.Tensor, device: torch.device, op: str, dropout: bool):
    """The kernels' ``(Philox, seed, offset)`` arguments of an op's ``philox`` tensor (int64, (2,)
    = (seed, offset), contiguous), for kernels on ``device``.

    * ``dropout`` False: ``(None, 0, 0)``; nothing is read or checked.
    * ``philox`` on ``device``: ``(philox, 0, 0)``: each program loads the pair (:func:`load_philox`),
      so nothing is read on the host (no sync) and a CUDA graph replays a pair drawn on the device
      anew. On a GPU its values are not checked (that would synchronise).
    * ``philox`` on the CPU (the op on a GPU): ``(None, seed, offset)``, read on the host (no sync)
      and passed as scalars: cheaper than a host-to-device copy and an allocation per call.

    A CPU tensor's values are checked either way (``torch._check_value``: traced inside a
    ``triton_op`` by torch.compile the reads are unbacked SymInts, a ``ValueError`` in eager)."""
    if not dropout:
        return None, 0, 0
    if not isinstance(philox, torch.Tensor):
        raise TypeError(f"{op}: philox must be {_PHILOX_WANT}, got {type(philox).__name__}")
    on_device = philox.device == device
    if philox.dtype != torch.int64 or not (on_device or philox.device.type == "cpu"):
        raise TypeError(f"{op}: philox must be {_PHILOX_WANT} ({device}), got {philox.dtype} on {philox.device}")
    if philox.shape != (2,):
        raise ValueError(f"{op}: philox must have shape (2,) = (seed, offset), got {list(philox.shape)}")
    if not philox.is_contiguous():
        raise ValueError(f"{op}: philox must be contiguous, got strides {philox.stride()}")
    if philox.device.type == "cpu":
        seed, offset = philox.tolist()
        if type(seed) is not int or type(offset) is not int or seed < 0 or offset < 0:  # else: valid ints, eager
            torch._check_value(seed >= 0, lambda: f"{op}: the philox seed philox[0] must be >= 0, got {seed}")
            torch._check_value(offset >= 0, lambda: f"{op}: the philox offset philox[1] must be >= 0, got {offset}")
        if not on_device or HOST_PHILOX:
            return None, seed, offset
    return philox, 0, 0


@triton.jit
def load_philox(Philox, seed, offset):
    """The dropout stream's ``(seed, offset)``: loaded from ``Philox`` (int64 (2,)) when it is
    given, else the scalars. Called once per program, before its loops."""
    if Philox is not None:
        seed = tl.load(Philox)
        offset = tl.load(Philox + 1)
    return seed, offset


@triton.jit
def reload_philox(Philox, seed, offset):
    """:func:`load_philox` at the point of use inside a loop that stores (the row loops of
    add_layer_norm's backward): the loads stay in the loop (an L1 hit each), so no register holds
    the pair across it; loading it once per program spilled there (sm_80, 16 warps)."""
    if Philox is not None:
        seed = tl.load(Philox)
        offset = tl.load(Philox + 1)
    return seed, offset


def device_guard(t):
    """``torch.cuda.device(t.device)`` for a tensor on a CUDA device: Triton launches on the
    *current* device, which need not be the tensor's. A no-op otherwise (CPU tensors under the
    interpreter)."""
    device = getattr(t, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def on_device_of_first_tensor(fn):
    """Decorator for a Triton host function: runs it under :func:`device_guard` of its first
    argument (a tensor every other tensor argument shares a device with) where that is a CUDA
    device other than the current one; otherwise calls it directly (no context manager)."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        device = getattr(args[0] if args else next(iter(kwargs.values()), None), "device", None)
        if (isinstance(device, torch.device) and device.type == "cuda"
                and device.index is not None and device.index != torch.cuda.current_device()):
            with torch.cuda.device(device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    guarded.device_guarded = True
    return guarded
