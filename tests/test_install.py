"""The Triton kernels are ``fastformer.triton_kernels`` (source: ``fastformer/triton_kernels/``):
a top-level ``import triton_kernels`` keeps meaning the Triton project's own package (issue 18,
item 4), in a checkout as installed.

Each check runs a fresh interpreter next to a stand-in for the Triton project's
``triton_kernels`` package; the first from the repository root, as a contributor's shell would.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import importlib.util, json, sys
import triton_kernels
spec = importlib.util.find_spec("fastformer.triton_kernels")
print(json.dumps({"top": triton_kernels.__file__, "ours": spec.origin if spec else None,
                  "marker": getattr(triton_kernels, "THE_TRITON_PROJECTS", False)}))
"""


def _stand_in(tmp_path):
    """A folder holding a package ``triton_kernels`` as the Triton project would install it."""
    other = tmp_path / "site"
    (other / "triton_kernels").mkdir(parents=True)
    (other / "triton_kernels" / "__init__.py").write_text("THE_TRITON_PROJECTS = True\n")
    return other


def _probe(cwd, extra_path):
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(extra_path))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_readmes_install_keeps_the_name_triton_kernels_free(tmp_path):
    # `make build` installed this checkout in editable mode into the interpreter running the tests
    found = _probe(ROOT, [str(_stand_in(tmp_path))])
    assert found["marker"], f"import triton_kernels found {found['top']}, not the Triton project's package"
    assert found["ours"] == os.path.join(ROOT, "fastformer", "triton_kernels", "__init__.py")


@pytest.mark.slow
def test_a_wheel_install_puts_the_kernels_inside_fastformer(tmp_path):
    target = tmp_path / "installed"
    env = dict(os.environ, FASTFORMER_BUILD_EXTENSION="0")
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                            "--no-compile", "--target", str(target), ROOT], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    assert not (target / "triton_kernels").exists(), "the wheel installs a top-level triton_kernels package"
    kernels = target / "fastformer" / "triton_kernels"
    assert {"__init__.py", "attention.py", "registration.py"} <= {p.name for p in kernels.iterdir()}
    found = _probe(tmp_path, [str(target), str(_stand_in(tmp_path))])
    assert found["marker"]
    assert found["ours"] == str(kernels / "__init__.py")


def test_the_transformers_version_is_written_once():
    """fastformer/hf/_version.py's TESTED is what `make setup` installs and what setup.py's hf extra
    allows (the Makefile and setup.py read it; neither writes a version of its own)."""
    sys.path.insert(0, ROOT)
    try:
        import setup as ff_setup
    finally:
        sys.path.remove(ROOT)
    from fastformer.hf import _version

    make = subprocess.run(["make", "-pn", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    deps = next(line for line in make.stdout.splitlines() if line.startswith("DEPS :="))
    assert f"transformers=={_version.TESTED}" in deps.split()
    req = ff_setup._transformers_requirement()
    assert req == _version.requirement()
    lo, hi = re.fullmatch(r"transformers>=(\d+\.\d+),<(\d+\.\d+)", req).groups()
    tested = tuple(int(p) for p in _version.TESTED.split(".")[:2])
    assert tuple(map(int, lo.split("."))) <= tested < tuple(map(int, hi.split(".")))
    for path in ("Makefile", "setup.py"):
        with open(os.path.join(ROOT, path)) as f:
            assert _version.TESTED not in f.read(), f"{path} writes the transformers version itself"
