"""The common eager call of an op, checked once.

Each op's Python checks word its errors before any work (``internal.validation``). Most of them the
C++ op repeats before it touches memory (csrc/checks), so for the call a model makes every step
(plain tensors, no autocast, eager, arguments of the usual types) an op takes its C++ differentiable
op at once, doing exactly what its checked path does with those inputs (the same reshapes, the same
kernel, the same draw) and checking in Python only what the C++ op cannot see (a shape before the
reshape to rows, a default it fills in). If the C++ op rejects the call, the checked path runs: it
raises the op's own error, worded as always (the hostile-input suites read them); an error it has no
words for is the kernel's, raised again.

Where the op's C++ library has a direct entry for it (``fastformer._C.<op>_eager``, csrc/eager.h:
:data:`DIRECT`), the fast path calls that instead of the registered op: the same C++ function and
backward node, without the boxed dispatcher call, the philox pair drawn in C++ (the same bits as
``philox.draw``'s). Every op's fast path is ``attempt(_fast, ...)``: None where it declines the
call or anything in it (the backend choice, the C++ op) raises a RuntimeError, and then the checked
path runs; ``_fast`` ends in :func:`call`, the entry or the registered op. An entry answers None
where its op raised a RuntimeError, as attempt does, and where the call is not eager or not what it
takes (the thread-local half of :func:`ready`, the classes of the tensors, the types of the numbers
and flags, the devices: csrc/eager.h), so an op may leave those checks to it: add_layer_norm's fast
path asks only :data:`compiling` and its backend, then calls its entry.

A call the fast path does not take (autocast, a tensor subclass, a traced call, a mask to convert,
a Triton or reference backend) is the checked path's, unchanged.
"""
import torch

from .. import philox
from .eager import eager

# the classes whose calls need no __torch_function__ handling (Parameter disables its own)
PLAIN = (torch.Tensor, torch.nn.Parameter)
_any_autocast = torch._C._is_any_autocast_enabled
_function_mode = torch._C._is_torch_function_mode_enabled
# ready()'s half a direct entry cannot answer: while dynamo traces Python, it answers True (dynamo
# folds it to True as it folds is_compiling). One Python call where is_compiling() makes two
# (torch.jit.is_scripting, then the flag); what it does not see, is_compiling's flag set while
# export or a compile session runs Python eagerly, comes with a dispatch mode or fake tensors,
# which the entry declines (ff_eager_tls, FFArgs): the checked path runs there as before.
compiling = torch.compiler.is_dynamo_compiling


def plain(*tensors) -> bool:
    """Every argument is a plain tensor or None."""
    for t in tensors:
        if t is not None and t.__class__ not in PLAIN:
            return False
    return True


def on(device: torch.device, *tensors) -> bool:
    """Every tensor given (None aside) is on ``device``. The one check a C++ op cannot make for
    itself: the dispatcher picks the kernel from all its tensors' devices, so a tensor on another
    device can send the call to that device's kernel before any check runs."""
    for t in tensors:
        if t is not None and t.device != device:
            return False
    return True


def ready() -> bool:
    """Whether this call may take a fast path: eager (not traced, no dispatch mode, no saved-tensor
    hooks) with autocast off everywhere (a cast is the checked path's)."""
    return not _any_autocast() and eager()


# The direct eager entries of the C++ differentiable ops (csrc/eager.h), keyed by the op as the
# backends' Kernels hold it (``Kernels.<op>``: the callable behind ``torch.ops.fastformer.<op>.default``);
# filled when the extension loads (_ext.load_error). A Kernels whose op is another library's, or is
# None (a replaced kernel, Triton), finds no entry here.
DIRECT = {}


def call(op, args: tuple, draw_at: int, dropout_p: float, device: torch.device):
    """The fast path's C++ call of ``op`` (``Kernels.<op>``): its direct entry (:data:`DIRECT`) on
    ``args`` where it has one and no TorchFunctionMode is on (a mode sees the registered op's call,
    as it sees torch's ops; an entry's it would not), else ``op`` with ``philox.draw_eager``'s pair
    inserted at ``args[draw_at]``. None where a tensor of ``args`` is on another device than ``device`` (:func:`on`;
    an entry checks against ``args[0]``'s) or where an entry's op raised a RuntimeError; the registered
    op's RuntimeError reaches the caller's :func:`attempt`, which answers None for it alike."""
    direct = DIRECT.get(op)
    if direct is not None and not _function_mode():
        return direct(*args)
    for t in args:  # on(): the entry's own check
        if t.__class__ in PLAIN and t.device != device:
            return None
    return op(*args[:draw_at], philox.draw_eager(dropout_p, device), *args[draw_at:])


def attempt(fast_call, *args, errors=(RuntimeError,)):
    """``fast_call(*args)``: the op's output, or None where the call is the checked path's (the fast
    path declined it, or the C++ op refused it with one of ``errors``: the checked path words why)."""
    try:
        return fast_call(*args)
    except errors:
        return None


def number(x) -> bool:
    """A Python float or int (not a bool): what an op's float arguments take as they are."""
    c = x.__class__
    return c is float or c is int
