"""tools/libstdcxx.py: a C++ compiler that links libstdc++ statically is noticed and swapped for the
system's (its private streams and locale crashed the first GPU build's error messages), and the
extension built here carries no such copy."""
import os
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import libstdcxx  # noqa: E402

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("g++", "nm")), reason="needs g++ and nm (binutils)")


def _static_gxx(tmp_path):
    """A g++ that links libstdc++ statically, as the first GPU machine's CXX did."""
    path = tmp_path / "static-g++"
    path.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -static-libstdc++ "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_private_libstdcxx_copy_is_recognised(tmp_path):
    (tmp_path / "f.cpp").write_text(libstdcxx._PROBE)
    for name, cxx in (("shared", shutil.which("g++")), ("static", _static_gxx(tmp_path))):
        subprocess.run([cxx, "-shared", "-fPIC", "-O1", str(tmp_path / "f.cpp"), "-o", str(tmp_path / f"{name}.so")],
                       check=True, timeout=120)
    assert libstdcxx.defined_markers(str(tmp_path / "shared.so")) == []
    assert libstdcxx.defined_markers(str(tmp_path / "static.so")) == list(libstdcxx.MARKERS)


def test_a_static_cxx_is_swapped_for_the_systems(tmp_path):
    static = _static_gxx(tmp_path)
    assert libstdcxx.links_libstdcxx_statically(static) is True
    assert libstdcxx.links_libstdcxx_statically(shutil.which("g++")) is False
    compilers, why = libstdcxx.choose({"CXX": static, "CC": "gcc", "PATH": os.environ["PATH"]})
    assert os.path.realpath(compilers["CXX"]) == os.path.realpath(shutil.which("g++"))
    assert static in why and compilers["CXX"] in why
    assert libstdcxx.choose({"CXX": "g++", "PATH": os.environ["PATH"]}) == ({}, "")
    assert libstdcxx.choose({"PATH": os.environ["PATH"]}) == ({}, "")  # no CXX: nothing to check


def test_with_no_other_compiler_it_says_so_and_changes_nothing(tmp_path):
    static = _static_gxx(tmp_path)
    compilers, why = libstdcxx.choose({"CXX": static, "PATH": str(tmp_path)})
    assert compilers == {} and "no other g++/c++" in why


def test_this_builds_extension_has_no_private_libstdcxx():
    from fastformer import _ext

    if _ext.load_error():
        pytest.skip(f"the extension is not built here: {_ext.load_error()}")
    import fastformer._C as ext

    assert libstdcxx.defined_markers(ext.__file__) == []
