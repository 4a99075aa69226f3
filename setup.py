"""Builds fastformer and its C++ extension fastformer._C.

Build without build isolation so the installed torch is used, never a second one:
    pip install --no-build-isolation -e .
The CPU kernels are compiled for the ISA levels DEFAULT, AVX2 and AVX512 (x86-64; DEFAULT only
elsewhere) and the level is chosen at run time (csrc/cpu/isa.h; ATEN_CPU_CAPABILITY forces one).
The CUDA sources in csrc/cuda/ are added only when the installed torch has CUDA.
"""
import glob
import os
import platform
import re
import sys

from setuptools import find_packages, setup
from torch.utils import cpp_extension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import libstdcxx  # noqa: E402  (tools/, not a package)
import pip_ninja  # noqa: E402


# The ISA levels the CPU kernels (csrc/cpu/*_kernel*.cpp) are compiled for, each from the same
# source into its own namespace fastformer::<level>; csrc/cpu/isa.h picks one at run time. The
# flags are ATen's for the same CPU_CAPABILITY, so at::vec::Vectorized has the same width there.
ISA_FLAGS = {
    "DEFAULT": ["-O2"],  # x86-64 baseline (or the only level off x86); the fallback, built smaller
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
               "-mbmi2"],
}


def isa_levels():
    """The levels this build compiles: all three on x86-64, DEFAULT elsewhere (isa.h agrees)."""
    return list(ISA_FLAGS) if platform.machine().lower() in ("x86_64", "amd64") else ["DEFAULT"]


def isa_flags(level):
    """The extra compiler flags of one ISA level's kernel objects (after cpu_flags())."""
    return ISA_FLAGS[level] + [f"-DCPU_CAPABILITY={level}", f"-DCPU_CAPABILITY_{level}"]


def cpu_flags():
    """Compiler flags of every CPU object: OpenMP, -O3, no -march (the build runs on any x86-64
    CPU; the vector code is in the ISA levels' objects, see isa_flags), and -g0: no debug info
    (Python's own CFLAGS ask for -g, which costs build time the three ISA copies cannot spare)."""
    return ["-O3", "-std=c++17", "-fopenmp", "-DNDEBUG", "-g0"]


def cpu_sources(ops=None):
    """(baseline sources, per-ISA kernel sources) of the CPU extension, paths relative to ROOT:
    csrc/ops.cpp, csrc/cpu/isa.cpp, large_buffers.cpp, philox.cpp, each op's <op>.cpp and
    csrc/autograd/<op>.cpp are compiled once,
    csrc/cpu/<op>_kernel.cpp (or an op's several <op>_kernel_<part>.cpp) once per ISA level. ops: op
    file names to take (None: all); the RNG's test ops (philox_bits, dropout_fill) come with every
    selection."""
    cpu = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    autograd = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "csrc", "autograd", "*.cpp")))
    always = {"isa.cpp", "large_buffers.cpp", "philox.cpp", "dropout_fill.cpp", "dropout_fill_kernel.cpp"}
    # linear_cross_entropy runs the cross_entropy row kernel
    wanted = None if ops is None else set(ops) | ({"cross_entropy"} if "linear_cross_entropy" in ops else set())

    def kernel_op(name):
        """The op of a per-ISA kernel file (<op>_kernel.cpp, <op>_kernel_<part>.cpp), else None."""
        m = re.fullmatch(r"(.+)_kernel(_[a-z0-9]+)?\.cpp", name)
        return m.group(1) if m else None

    def take(name):
        op = kernel_op(name) or name[:-len(".cpp")]
        return wanted is None or name in always or op in wanted

    base = [os.path.join("csrc", "ops.cpp")] + [os.path.join("csrc", "cpu", f) for f in cpu
                                                 if kernel_op(f) is None and take(f)]
    # csrc/autograd/<op>.cpp: the op's eager training path with its backward in C++ (any device)
    base += [os.path.join("csrc", "autograd", f) for f in autograd if take(f)]
    kernels = [os.path.join("csrc", "cpu", f) for f in cpu if kernel_op(f) is not None and take(f)]
    return base, kernels


def build_cuda():
    """Whether fastformer._C gets the CUDA kernels: torch was built with CUDA and the CUDA toolkit
    (nvcc, found by torch as CUDA_HOME) is installed. FASTFORMER_BUILD_CUDA=0 opts out."""
    return (bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None
            and os.environ.get("FASTFORMER_BUILD_CUDA", "1") == "1")


def pip_toolkit_dirs(cuda_home, link_dir):
    """(include dirs, library dirs) that a CUDA toolkit installed from NVIDIA's pip wheels lacks
    (tools/find_nvcc.py installs one when the system's nvcc is of another major than torch's CUDA):
    CUDA 12's nvcc wheel (site-packages/nvidia/cuda_nvcc) keeps cuda_runtime.h and libcudart in
    its sibling nvidia/cuda_runtime; and a wheel ships libcudart.so.<major> only, never the
    unversioned libcudart.so that `-lcudart` links, so link_dir gets that symlink. Nothing for an
    ordinary toolkit (/usr/local/cuda has both)."""
    if not cuda_home:
        return [], []
    cuda_home = os.path.normpath(cuda_home)
    include_dirs, library_dirs = [], []
    lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib")]
    runtime = os.path.join(os.path.dirname(cuda_home), "cuda_runtime")
    if os.path.basename(os.path.normpath(cuda_home)) == "cuda_nvcc" and os.path.isdir(runtime):
        include_dirs.append(os.path.join(runtime, "include"))
        library_dirs.append(os.path.join(runtime, "lib"))
        lib_dirs.append(os.path.join(runtime, "lib"))
    lib_dirs = [d for d in lib_dirs if os.path.isdir(d)]
    if lib_dirs and not any(os.path.exists(os.path.join(d, "libcudart.so")) for d in lib_dirs):
        versioned = [f for d in lib_dirs for f in sorted(glob.glob(os.path.join(d, "libcudart.so.*")))]
        if versioned:
            os.makedirs(link_dir, exist_ok=True)
            link = os.path.join(link_dir, "libcudart.so")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(versioned[0], link)
            library_dirs.append(link_dir)
    return include_dirs, library_dirs


def extension(name="fastformer._C", ops=None, cuda=None):
    """The extension: the CPU sources of cpu_sources(ops) and, when cuda (default: build_cuda()),
    csrc/cuda. The per-ISA kernel sources ride along as ext.isa_sources (BuildExtension builds them)."""
    sources, isa_sources = cpu_sources(ops)
    include_dirs = [os.path.join(ROOT, "csrc")]
    # every header, so an incremental build (tools/dev_build.py) recompiles what includes an edited one
    depends = sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)
                     + glob.glob(os.path.join("csrc", "**", "*.cuh"), recursive=True))
    # torch's own C++ ABI, said explicitly: torch 2.11 and 2.13 no longer pass it and leave it to the
    # compiler's default, which a GCC configured --with-default-libstdcxx-abi=gcc4-compatible (as
    # RHEL's toolsets are) gets wrong, and the extension then fails to load on undefined symbols.
    abi = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    extra = {"cxx": cpu_flags() + abi}
    if build_cuda() if cuda is None else cuda:
        # csrc/cuda/*.cu through nvcc, the glue csrc/cuda/*.cpp through the C++ compiler (cxx flags).
        # No --use_fast_math: the kernels use fast intrinsics (__expf) only where they chose to,
        # so the GPU's results stay within the tolerances the tests check on the SIMT harness.
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        extra["nvcc"] = ["-O3", "-std=c++17", "-lineinfo"] + abi
        more_includes, library_dirs = pip_toolkit_dirs(cpp_extension.CUDA_HOME,
                                                       os.path.join(ROOT, "build", "cuda-link"))
        ext = cpp_extension.CUDAExtension(name, sources, include_dirs=include_dirs + more_includes,
                                          library_dirs=library_dirs, depends=depends,
                                          extra_compile_args=extra, extra_link_args=["-fopenmp"])
    else:
        ext = cpp_extension.CppExtension(name, sources, include_dirs=include_dirs, depends=depends,
                                         extra_compile_args=extra, extra_link_args=["-fopenmp"])
    ext.isa_sources = isa_sources
    return ext


def distinct_cu_objects(object_filenames):
    """Wraps a compiler's object_filenames so that csrc/cuda/<op>.cu (the kernels) and
    csrc/cuda/<op>.cpp (their glue) give two objects, <op>.cu.o and <op>.o, not one <op>.o."""
    def names(sources, strip_dir=0, output_dir=""):
        objects = object_filenames(sources, strip_dir=strip_dir, output_dir=output_dir)
        return [os.path.splitext(obj)[0] + ".cu" + os.path.splitext(obj)[1] if src.endswith(".cu") else obj
                for src, obj in zip(sources, objects)]
    return names


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension with distinct object names for <op>.cu and <op>.cpp, run with the pip
    package's ninja (tools/pip_ninja.py), which also
    compiles ext.isa_sources once per ISA level (isa_flags) into <build_temp>/isa_<level>/ and
    links those objects after the baseline ones, DEFAULT first (so that where two objects hold one
    inline function, the linker keeps a baseline copy)."""

    def build_extensions(self):
        self.compiler.object_filenames = distinct_cu_objects(self.compiler.object_filenames)
        # the pip package's ninja (>= 1.12), not PATH's 1.11, which keeps an object whose header
        # was edited during its compile (tools/pip_ninja.py); tools/dev_build.py builds through here
        with pip_ninja.first_on_path():
            super().build_extensions()

    def build_extension(self, ext):
        isa_sources = getattr(ext, "isa_sources", [])
        if isa_sources:
            cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
            objects = []
            for level in isa_levels():
                out = os.path.join(self.build_temp, f"isa_{level}")
                os.makedirs(out, exist_ok=True)
                objects += self.compiler.compile(isa_sources, output_dir=out, macros=ext.define_macros,
                                                 include_dirs=ext.include_dirs, debug=self.debug,
                                                 extra_postargs={"cxx": list(cxx) + isa_flags(level)},
                                                 depends=ext.depends)
            ext.extra_objects = [o for o in ext.extra_objects or [] if o not in objects] + objects
        super().build_extension(ext)


def _transformers_requirement() -> str:
    """The hf extra's requirement, from fastformer/hf/_version.py (run alone: it imports only re)."""
    scope = {}
    with open(os.path.join(ROOT, "fastformer", "hf", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["requirement"]()


if __name__ == "__main__":
    libstdcxx.use_shared("fastformer setup")  # never a CXX that links libstdc++ statically
    setup(
        name="fastformer",
        version="0.1.0",
        description="Fused Triton / C++ / CUDA kernels for encoder-decoder Transformer training",
        packages=find_packages(include=["fastformer", "fastformer.*"]),
        python_requires=">=3.10",
        install_requires=["torch", "tqdm", "matplotlib", "sacrebleu", "tokenizers"],
        extras_require={"triton": ["triton"], "hf": [_transformers_requirement()],
                        "test": ["pytest", "pytest-benchmark", "hypothesis"]},
        # FASTFORMER_BUILD_EXTENSION=0: the Python package alone (the backends then say the
        # extension is not built); tests/test_install.py installs it so, in seconds.
        ext_modules=[extension()] if os.environ.get("FASTFORMER_BUILD_EXTENSION", "1") == "1" else [],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        entry_points={"console_scripts": ["fastformer=fastformer.jobs.cli:main"]},
    )
