"""One way to register a Triton host function as the torch op ``fastformer_triton::<name>``, and
the thin eager path around it.

Compiled kernels: ``torch.library.triton_op``, so torch.compile sees the kernels inside the op.
Under ``TRITON_INTERPRET=1`` ``wrap_triton`` hands back the interpreted kernel, which runs real
CPU tensors but cannot trace fake ones, so the op is a ``custom_op`` whose fake is the shared
schema's (``fastformer/fake_ops.py``, the C++ ops' fakes too).

What :func:`register_op` returns (the module attribute ``<op>_fwd`` the backend registry hands to
``fastformer/autograd``) calls the host function itself in plain eager mode, with ``wrap_triton``
switched off (it then hands back the kernel itself: no higher-order-op dispatch per launch, as
``triton_op``'s own eager path does). The op is the one layer left, and only for what traces
(torch.compile, fake tensors, dispatch modes, functorch transforms): there it gives torch.compile
one opaque op with a fake (interpreter) or the kernels themselves (``triton_op``).
"""
import functools

import torch

from fastformer.fake_ops import FAKES

from .utils import INTERPRET

try:  # the thread-local switch behind torch._library.triton.set_wrap_triton_enabled
    from torch._library.triton import wrap_triton_enabled as _WRAP_TRITON
except ImportError:  # pragma: no cover - an older torch: eager calls keep wrap_triton's dispatch
    _WRAP_TRITON = None

NAMESPACE = "fastformer_triton"
_UNSET = object()


def _eager() -> bool:
    """Plain eager mode: nothing traces or intercepts the call (no torch.compile, no dispatch mode
    such as FakeTensorMode or make_fx's, no functorch transform)."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._are_functorch_transforms_active())


def register_op(name: str, impl):
    """Register ``impl`` (type-annotated, the C++ schema's arguments) as ``fastformer_triton::<name>``
    and return the function that calls it: ``impl`` directly in plain eager mode, else the op
    (also its ``.op`` attribute, for ``torch.library.opcheck``)."""
    qualname = f"{NAMESPACE}::{name}"
    if INTERPRET:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(FAKES[name])
    else:
        op = torch.library.triton_op(qualname, impl, mutates_args=())

    @functools.wraps(impl)
    def call(*args, **kwargs):
        if not _eager():
            return op(*args, **kwargs)
        if _WRAP_TRITON is None:
            return impl(*args, **kwargs)
        outer = getattr(_WRAP_TRITON, "value", _UNSET)
        _WRAP_TRITON.value = False
        try:
            return impl(*args, **kwargs)
        finally:
            if outer is _UNSET:
                del _WRAP_TRITON.value
            else:
                _WRAP_TRITON.value = outer

    call.op = op
    return call


def launcher():
    """What host code launches kernels through: ``torch.library.wrap_triton`` (so a ``triton_op``
    shows torch.compile the kernel; on the eager path it hands back the kernel itself), or None
    under the interpreter (launch directly)."""
    return None if INTERPRET else torch.library.wrap_triton


def kernel(fn):
    """``torch.library.wrap_triton(fn)``: ``fn`` as host code launches it (see :func:`launcher`)."""
    return torch.library.wrap_triton(fn)
