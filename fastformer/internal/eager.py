"""Whether an op call runs eagerly: then it may take its backend's C++ differentiable op (its
backward in C++, no Python per call); traced (torch.compile, make_fx, a dispatch mode such as
FakeTensorMode) it takes the Python ``autograd.Function``, which those tracers see through.

Under saved-tensor hooks (activation checkpointing: ``torch.utils.checkpoint``, Hugging Face's
gradient checkpointing) the Function runs too: there the C++ ops' recomputation saved another
number of tensors than their forward (tests/test_hf_training.py, BART and Whisper), which the
Function does not."""
import torch


def eager() -> bool:
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
