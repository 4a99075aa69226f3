"""Build a private copy of the C++ extension from csrc/ops.cpp and chosen kernel files.

For kernel development: several people can each build their own op without one
half-written file breaking everybody's build. Prints the library path; run the tests
against it with FASTFORMER_EXT_LIBRARY=<path> (fastformer loads it instead of _C).

    python tools/dev_build.py attention            # csrc/ops.cpp, isa.cpp, philox.cpp + attention
    python tools/dev_build.py add_layer_norm feed_forward
    python tools/dev_build.py all                  # every op

An op is csrc/cpu/<op>.cpp (checks, registration) and csrc/cpu/<op>_kernel.cpp (the math, built
once per ISA level). The build is setup.py's own (its extension() and BuildExtension), CPU only,
incremental (the pip package's ninja >= 1.12, tools/pip_ninja.py), in /tmp/<name>/; MAX_JOBS limits the parallel compile jobs as for setup.py.

FF_DEV_TAG=<name> gives the build its own directory and library name, so builds of the same
ops from different checkouts never overwrite each other.
"""
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import setup as ff_setup  # noqa: E402

from setuptools import setup  # noqa: E402


def main(ops):
    if not ops:
        sys.exit(__doc__)
    tag = os.environ.get("FF_DEV_TAG", "")
    name = "ff_dev_" + (tag + "_" if tag else "") + ("all" if ops == ["all"] or len(ops) > 4 else "_".join(ops))
    build = os.path.join("/tmp", name)
    ext = ff_setup.extension(name, ops=None if ops == ["all"] else ops, cuda=False)
    os.chdir(ROOT)  # the extension's sources are relative to the checkout
    stdout = os.dup(1)
    os.dup2(2, 1)  # the compilers' output goes to stderr: stdout is only the library's path
    try:
        setup(name=name, ext_modules=[ext], script_args=[
            "--quiet", "build_ext", "--build-temp", os.path.join(build, "tmp"), "--build-lib", build],
            cmdclass={"build_ext": ff_setup.BuildExtension.with_options(use_ninja=True)})
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    print(max(glob.glob(os.path.join(build, name + "*.so")), key=os.path.getmtime))


if __name__ == "__main__":
    main(sys.argv[1:])
