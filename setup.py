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


def build_cuda():
    """Whether fastformer._C gets the CUDA kernels: torch was built with CUDA and the CUDA toolkit
    (nvcc, found by torch as CUDA_HOME) is installed. FASTFORMER_BUILD_CUDA=0 opts out."""
    return (bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None
            and os.environ.get("FASTFORMER_BUILD_CUDA", "1") == "1")


def extension():
    sources = [os.path.join("csrc", "ops.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc")]
    extra = {"cxx": cpu_flags()}
    if build_cuda():
        # csrc/cuda/*.cu through nvcc, the glue csrc/cuda/*.cpp through the C++ compiler (cxx flags).
        # No --use_fast_math: the kernels use fast intrinsics (__expf) only where they chose to,
        # so the GPU's results stay within the tolerances the tests check on the SIMT harness.
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        extra["nvcc"] = ["-O3", "-std=c++17", "-lineinfo"]
        return cpp_extension.CUDAExtension("fastformer._C", sources, include_dirs=include_dirs,
                                           extra_compile_args=extra, extra_link_args=["-fopenmp"])
    return cpp_extension.CppExtension("fastformer._C", sources, include_dirs=include_dirs,
                                      extra_compile_args=extra, extra_link_args=["-fopenmp"])


def distinct_cu_objects(object_filenames):
    """Wraps a compiler's object_filenames so that csrc/cuda/<op>.cu (the kernels) and
    csrc/cuda/<op>.cpp (their glue) give two objects, <op>.cu.o and <op>.o, not one <op>.o."""
    def names(sources, strip_dir=0, output_dir=""):
        objects = object_filenames(sources, strip_dir=strip_dir, output_dir=output_dir)
        return [os.path.splitext(obj)[0] + ".cu" + os.path.splitext(obj)[1] if src.endswith(".cu") else obj
                for src, obj in zip(sources, objects)]
    return names


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension with distinct object names for <op>.cu and <op>.cpp."""

    def build_extensions(self):
        self.compiler.object_filenames = distinct_cu_objects(self.compiler.object_filenames)
        super().build_extensions()


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
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        entry_points={"console_scripts": ["fastformer=fastformer.__main__:main"]},
    )
