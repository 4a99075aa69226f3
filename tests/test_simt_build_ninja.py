"""The SIMT harness's build (tests/simt/build.py) rebuilds a file whose header was edited while it
compiled: the ninja it runs (simt.build.ninja_dir, else PATH's) must not take the end of a compile
for the time its inputs were read (ninja < 1.12 does, and then keeps the stale object). A stand-in
compiler waits, after ninja starts it, until the test has edited the header, then writes the
object and a depfile naming the header; the next `ninja -n` must have work to do. A few seconds."""
import os
import shutil
import subprocess
import time

import pytest

from simt import build

RULE = """rule cc
  command = touch started && while [ ! -e go ]; do sleep 0.05; done && printf '%s: %s h.h\\n' $out $in > $out.d && touch $out
  depfile = $out.d
  deps = gcc
build a.o: cc a.cpp
"""


def _ninja():
    found = build.ninja_dir()
    return os.path.join(found, "ninja") if found is not None else shutil.which("ninja")


@pytest.mark.skipif(_ninja() is None, reason="no ninja installed (pip install ninja)")
def test_a_header_edited_during_its_compile_is_rebuilt(tmp_path):
    for name in ("a.cpp", "h.h"):
        (tmp_path / name).write_text("int x;\n")
    past = time.time() - 60
    for name in ("a.cpp", "h.h"):
        os.utime(tmp_path / name, (past, past))
    (tmp_path / "build.ninja").write_text(RULE)
    proc = subprocess.Popen([_ninja()], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 30
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.time() < deadline, "the stand-in compiler never started"
        time.sleep(0.02)
    time.sleep(0.05)  # a later mtime than the compile's start, whatever the clock's granularity
    (tmp_path / "h.h").write_text("int y;\n")  # the edit the compile did not see
    (tmp_path / "go").touch()
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    dry = subprocess.run([_ninja(), "-n"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "no work to do" not in dry.stdout, (
        f"{_ninja()} keeps a.o though h.h changed during its compile (ninja < 1.12?): {dry.stdout}")


def _version(ninja):
    out = subprocess.run([ninja, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    return tuple(int(x) for x in out.strip().split(".")[:2])


@pytest.mark.skipif(build.ninja_dir() is None, reason="the pip package ninja is not installed (pip install 'ninja>=1.12')")
def test_setup_and_dev_build_run_the_pip_ninja(monkeypatch):
    """setup.py's BuildExtension (pip install -e ., tools/dev_build.py) runs torch's build with
    the pip package's ninja (>= 1.12) first on PATH, even where PATH starts with an older one;
    PATH is restored after."""
    import importlib.util

    from setuptools.dist import Distribution
    from torch.utils import cpp_extension

    spec = importlib.util.spec_from_file_location("ff_setup_ninja_test", os.path.join(build.ROOT, "setup.py"))
    ff_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ff_setup)
    old = shutil.which("ninja", path="/usr/bin:/bin")
    if old is not None:  # the system's ninja first, as on the shared machine
        monkeypatch.setenv("PATH", os.path.dirname(old) + os.pathsep + os.environ.get("PATH", ""))
    before = os.environ["PATH"]
    seen = []
    monkeypatch.setattr(cpp_extension.BuildExtension, "build_extensions",
                        lambda self: seen.append(shutil.which("ninja")))
    ext = ff_setup.BuildExtension(Distribution())
    ext.compiler = type("Compiler", (), {"object_filenames": staticmethod(lambda *a, **k: [])})()
    ext.build_extensions()
    assert seen == [os.path.join(build.ninja_dir(), "ninja")]
    assert _version(seen[0]) >= (1, 12)
    assert os.environ["PATH"] == before
