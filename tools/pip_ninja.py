"""The ninja that the extension builds run: the pip package's (>= 1.12), not the one on PATH.

torch.utils.cpp_extension runs the `ninja` it finds on PATH. Before 1.12 (this machine's system
ninja is 1.11) ninja takes an object's mtime at the end of its compile for the time it was
built, so a header or .cu edited while the files including it compile counts as built into them,
and they are never rebuilt; 1.12+ records the compile's start. The pip package (pinned
``ninja>=1.12`` with the build dependencies in the Makefile) is used wherever it is installed;
setup.py's BuildExtension (so `pip install -e .` and tools/dev_build.py) and the SIMT harness's
build (tests/simt/build.py) put it first on PATH. Standard library only.
"""
import contextlib
import os
from typing import Iterator, Optional


def ninja_dir() -> Optional[str]:
    """The folder of the pip package's ninja binary, or None without the package (then the
    one on PATH runs)."""
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR


@contextlib.contextmanager
def first_on_path() -> Iterator[Optional[str]]:
    """PATH with ninja_dir() in front for the block (unchanged without the package); yields it."""
    found = ninja_dir()
    path = os.environ.get("PATH", "")
    if found is not None:
        os.environ["PATH"] = found + os.pathsep + path
    try:
        yield found
    finally:
        os.environ["PATH"] = path
