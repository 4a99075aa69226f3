"""Builds fastformer and its C++ extension fastformer._C.

Build without build isolation so the installed torch is used, never a second one:
    pip install --no-build-isolation -e .
The CUDA sources in csrc/cuda/ are added only when the installed torch has CUDA.
"""
import glob
import os
import platform
import subprocess

from setuptools import find_packages, setup
from torch.utils import cpp_extension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _compiler_defines(march):
    """The macros the C++ compiler predefines for -march=<march> (empty if it cannot say)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def cpu_flags():
    """Compiler flags for the CPU kernels: OpenMP, -O3 and the widest vector ISA at::vec knows.

    FASTFORMER_CPU_ARCH picks -march (default native; "generic" adds none)."""
    flags = ["-O3", "-std=c++17", "-fopenmp", "-DNDEBUG"]
    arch = os.environ.get("FASTFORMER_CPU_ARCH", "native")
    if platform.machine() in ("x86_64", "AMD64") and arch != "generic":
        flags.append(f"-march={arch}")
        defines = _compiler_defines(arch)
        # at::vec::Vectorized picks its width from CPU_CAPABILITY_*, not from -march.
        if "__AVX512F__" in defines and "__AVX512BW__" in defines:
            flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
        elif "__AVX2__" in defines:
            flags += ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def extension():
    sources = [os.path.join("csrc", "ops.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    extra = {"cxx": cpu_flags()}
    if torch.cuda.is_available() or (torch.version.cuda and os.environ.get("FASTFORMER_BUILD_CUDA", "1") == "1"):
        if torch.version.cuda:
            sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
            sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
            extra["nvcc"] = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
            return cpp_extension.CUDAExtension("fastformer._C", sources, extra_compile_args=extra,
                                               extra_link_args=["-fopenmp"])
    return cpp_extension.CppExtension("fastformer._C", sources, extra_compile_args=extra,
                                      extra_link_args=["-fopenmp"])


if __name__ == "__main__":
    setup(
        name="fastformer",
        version="0.1.0",
        description="Fused Triton / C++ / CUDA kernels for encoder-decoder Transformer training",
        packages=find_packages(include=["fastformer", "fastformer.*", "triton_kernels", "triton_kernels.*"]),
        python_requires=">=3.10",
        install_requires=["torch", "tqdm", "matplotlib", "sacrebleu", "tokenizers"],
        extras_require={"triton": ["triton"], "test": ["pytest", "pytest-benchmark", "hypothesis"]},
        ext_modules=[extension()],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
        entry_points={"console_scripts": ["fastformer=fastformer.__main__:main"]},
    )
