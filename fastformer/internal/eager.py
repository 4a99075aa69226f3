"""Whether an op call runs eagerly: then it may take its backend's C++ differentiable op (its
backward in C++, no Python per call); traced (torch.compile, make_fx, a dispatch mode such as
FakeTensorMode) it takes the Python ``autograd.Function``, which those tracers see through.

Saved-tensor hooks (activation checkpointing) do not matter: the C++ ops unpack their saved tensors
before anything else in their backward, so a checkpoint's recomputation runs with autograd on and
saves what the forward saved (tests/test_activation_checkpointing.py)."""
import torch


def eager() -> bool:
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())
