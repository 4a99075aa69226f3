"""Whether an op call runs eagerly: then it may take its backend's C++ differentiable op (its
backward in C++, no Python per call); traced (torch.compile, make_fx, a dispatch mode such as
FakeTensorMode) it takes the Python ``autograd.Function``, which those tracers see through."""
import torch


def eager() -> bool:
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())
