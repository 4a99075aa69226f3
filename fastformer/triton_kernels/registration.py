"""One way to register a Triton host function as the torch op ``fastformer_triton::<name>``.

Compiled kernels: ``torch.library.triton_op``, so torch.compile sees the kernels inside the op.
Under ``TRITON_INTERPRET=1`` ``wrap_triton`` hands back the interpreted kernel, which runs real
CPU tensors but cannot trace fake ones, so the op is a ``custom_op`` whose fake is the shared
schema's (``fastformer/fake_ops.py``, the C++ ops' fakes too).
"""
import torch

from fastformer.fake_ops import FAKES

from .utils import INTERPRET

NAMESPACE = "fastformer_triton"


def register_op(name: str, impl):
    """Register ``impl`` (type-annotated, the C++ schema's arguments) as ``fastformer_triton::<name>``."""
    qualname = f"{NAMESPACE}::{name}"
    if INTERPRET:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(FAKES[name])
        return op
    return torch.library.triton_op(qualname, impl, mutates_args=())


def launcher():
    """What host code launches kernels through: ``torch.library.wrap_triton`` (so a ``triton_op``
    shows torch.compile the kernel), or None under the interpreter (launch directly)."""
    return None if INTERPRET else torch.library.wrap_triton
