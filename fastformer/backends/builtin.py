"""The four backends fastformer ships, declared: devices, dtypes, requirements, limits, kernels.

Each limit is declared once, where it is checked: the C++ kernels' head-dim limit mirrors
``kMaxHeadDim`` of ``csrc/checks/attention.h`` (C++ cannot be read from here); the Triton kernels'
limits are read from the Triton modules that check them.
"""
import importlib.util
import os
import sys
from typing import Optional

import torch

from .. import _ext, op_table
from .declaration import Backend, Device, Limit, OpLibrary, PythonModules, Requirement, register

CPP_MAX_HEAD_DIM = 256  # kMaxHeadDim in csrc/checks/attention.h, checked by the cpu and cuda kernels
TRITON_PACKAGE = "fastformer.triton_kernels"
TRITON_MODULE_OF = {op.name: op.triton_module for op in op_table.TABLE}
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_missing() -> Optional[str]:
    """Why triton cannot be imported, found without importing it (import fastformer stays light)."""
    if "triton" in sys.modules and sys.modules["triton"] is None:  # import blocked on purpose
        return "the triton package is not installed (pip install triton)"
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    return None if spec is not None else "the triton package is not installed (pip install triton)"


EXTENSION = Requirement("the C++ extension fastformer._C", lambda: _ext.load_error())
CUDA_GPU = Requirement("a CUDA GPU", lambda: None if torch.cuda.is_available() else
                       "no CUDA GPU is available (torch.cuda.is_available() is False)")
CUDA_KERNELS = Requirement("fastformer._C built with its CUDA kernels", lambda: None
                           if _ext.has_kernel("attention_fwd", "CUDA") else
                           "fastformer._C was built without CUDA kernels (torch had no CUDA)")
TRITON = Requirement("the triton package", _triton_missing)
TRITON_INTERPRET = Requirement("TRITON_INTERPRET=1 (triton's interpreter)", lambda: None
                               if os.environ.get("TRITON_INTERPRET", "0") == "1" else
                               "triton runs CPU tensors only under TRITON_INTERPRET=1")


def _cpu_note() -> str:
    level = _ext.cpu_capability()
    return (f"C++ kernels at ISA level {level}, chosen at run time "
            "(ATEN_CPU_CAPABILITY=default|avx2|avx512 forces one)") if level else ""


_CPP_HEAD_DIM = [Limit(op, "head_dim", "head dim", lambda: CPP_MAX_HEAD_DIM) for op in ("attention", "attention_varlen")]
_triton_modules = PythonModules(TRITON_PACKAGE, TRITON_MODULE_OF)

REFERENCE = register(Backend("reference", anywhere=True))
CPU = register(Backend(
    "cpu",
    devices=[Device("cpu", (torch.float32, torch.float64, torch.bfloat16),
                    OpLibrary("fastformer", "CPU", "fastformer._C"), needs=(EXTENSION,))],
    limits=_CPP_HEAD_DIM,
    note=_cpu_note))
TRITON_BACKEND = register(Backend(
    "triton",
    devices=[Device("cuda", GPU_DTYPES, _triton_modules, needs=(TRITON, CUDA_GPU)),
             Device("cpu", GPU_DTYPES, _triton_modules, needs=(TRITON, TRITON_INTERPRET))],
    limits=[Limit(op, "head_dim", "head dim", lambda: _triton_modules.module("attention").MAX_HEAD_DIM)
            for op in ("attention", "attention_varlen")] + [
            Limit("add_layer_norm", "hidden_size", "hidden size",
                  lambda: _triton_modules.module("add_layer_norm").MAX_C)]))
CUDA = register(Backend(
    "cuda",
    devices=[Device("cuda", GPU_DTYPES, OpLibrary("fastformer", "CUDA", "fastformer._C"),
                    needs=(CUDA_GPU, EXTENSION, CUDA_KERNELS))],
    limits=_CPP_HEAD_DIM))
