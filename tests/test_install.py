"""Installed, the Triton kernels are ``fastformer.triton_kernels``: a top-level ``import
triton_kernels`` keeps meaning the Triton project's own package (issue 18, item 4).

Each check runs a fresh interpreter from a folder outside the repository (the repository root on
sys.path would make its ``triton_kernels/`` folder importable by that name, as in any checkout),
next to a stand-in for the Triton project's ``triton_kernels`` package.
"""
import os
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


def _probe(tmp_path, extra_path):
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(extra_path))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_readmes_install_keeps_the_name_triton_kernels_free(tmp_path):
    # `make build` installed this checkout in editable mode into the interpreter running the tests
    found = _probe(tmp_path, [str(_stand_in(tmp_path))])
    assert found["marker"], f"import triton_kernels found {found['top']}, not the Triton project's package"
    assert found["ours"] == os.path.join(ROOT, "triton_kernels", "__init__.py")


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
