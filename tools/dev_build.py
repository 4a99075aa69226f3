"""Build a private copy of the C++ extension from csrc/ops.cpp and chosen kernel files.

For kernel development: several people can each build their own op without one
half-written file breaking everybody's build. Prints the library path; run the tests
against it with FASTFORMER_EXT_LIBRARY=<path> (fastformer loads it instead of _C).

    python tools/dev_build.py attention            # csrc/ops.cpp + csrc/cpu/attention.cpp + philox.cpp
    python tools/dev_build.py add_layer_norm feed_forward
    python tools/dev_build.py all                  # every csrc/cpu/*.cpp

FF_DEV_TAG=<name> gives the build its own directory and library name, so builds of the same
ops from different checkouts never overwrite each other.
"""
import glob
import os
import sys

from torch.utils.cpp_extension import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from setup import cpu_flags  # noqa: E402


def main(ops):
    if ops == ["all"]:
        ops = [os.path.splitext(os.path.basename(f))[0] for f in sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))]
    tag = os.environ.get("FF_DEV_TAG", "")
    name = "ff_dev_" + (tag + "_" if tag else "") + ("all" if len(ops) > 4 else "_".join(ops))
    build = os.path.join("/tmp", name)
    os.makedirs(build, exist_ok=True)
    sources = [os.path.join(ROOT, "csrc", "ops.cpp"), os.path.join(ROOT, "csrc", "cpu", "philox.cpp")]
    sources += [os.path.join(ROOT, "csrc", "cpu", f"{op}.cpp") for op in ops if op != "philox"]
    load(name=name, sources=sources, build_directory=build, extra_cflags=cpu_flags(),
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    print(os.path.join(build, name + ".so"))


if __name__ == "__main__":
    main(sys.argv[1:])
