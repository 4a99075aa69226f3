"""tools/find_nvcc.py (an nvcc of torch's CUDA major for the GPU build, pip-installed when the
machine's is of another) and setup.py's completion of a toolkit installed from NVIDIA's wheels.
No network and no CUDA here: the version strings, the nvcc binaries and pip are stand-ins."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


find_nvcc = _load("find_nvcc", "tools/find_nvcc.py")
Candidate = find_nvcc.Candidate

NVCC_13 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0"""


def test_versions_are_read_from_nvcc_and_torch():
    assert find_nvcc.parse_release(NVCC_13) == (13, 0)
    assert find_nvcc.parse_release("Cuda compilation tools, release 12.8, V12.8.93") == (12, 8)
    assert find_nvcc.parse_release("command not found") is None
    assert find_nvcc.parse_torch_cuda("12.8") == (12, 8)
    assert find_nvcc.parse_torch_cuda("13.0") == (13, 0)
    assert find_nvcc.parse_torch_cuda(None) is None  # a CPU build of torch


def test_package_names_per_cuda_major():
    # CUDA 12: the suffixed wheels (nvcc's has no cuda_runtime.h: the runtime wheel's has); CUDA 13 on:
    # the unsuffixed ones (nvidia-cuda-nvcc-cu13 is an empty placeholder) with nvcc's dependencies
    # named, each at torch's minor first, then any of the major
    assert find_nvcc.package(12, 8) == ([["nvidia-cuda-nvcc-cu12==12.8.*", "nvidia-cuda-runtime-cu12==12.8.*"],
                                         ["nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12"]], "nvidia/cuda_nvcc")
    attempts, folder = find_nvcc.package(13, 0)
    assert folder == "nvidia/cu13" and attempts == [
        ["nvidia-cuda-nvcc==13.0.*", "nvidia-cuda-runtime==13.0.*", "nvidia-cuda-crt==13.0.*", "nvidia-nvvm==13.0.*"],
        ["nvidia-cuda-nvcc==13.*", "nvidia-cuda-runtime==13.*", "nvidia-cuda-crt==13.*", "nvidia-nvvm==13.*"]]
    assert find_nvcc.package(14, 1)[1] == "nvidia/cu14"


def test_pick_prefers_torchs_exact_version_then_its_major():
    sys13 = Candidate("PATH", "/usr/local/cuda", (13, 0))
    pip12 = Candidate("pip package", "/venv/nvidia/cuda_nvcc", (12, 9))
    pip128 = Candidate("pip package", "/venv2/nvidia/cuda_nvcc", (12, 8))
    broken = Candidate("$CUDA_HOME", "/broken", None)
    assert find_nvcc.pick((13, 0), [broken, pip12, sys13]) is sys13
    assert find_nvcc.pick((12, 8), [sys13, pip12, pip128]) is pip128  # the exact one, though listed later
    assert find_nvcc.pick((12, 6), [sys13, pip12, pip128]) is pip12  # same major, first listed
    assert find_nvcc.pick((12, 8), [sys13, broken]) is None  # torch refuses another major


def test_a_matching_nvcc_is_used_without_installing():
    def installer(req):
        raise AssertionError("nothing should be installed")

    r = find_nvcc.find("13.0", install=True, installer=installer,
                       candidates=lambda: [Candidate("PATH", "/usr/local/cuda", (13, 0))])
    assert r.cuda_home == "/usr/local/cuda" and "nvcc 13.0" in r.message


def test_another_major_installs_nvidias_package_and_takes_it():
    """torch built with CUDA 12.8, the machine's nvcc is 13.0: the CUDA 12 wheel is installed and
    its nvcc, found under site-packages afterwards, is the one to build with."""
    installed, found = [], [Candidate("PATH", "/usr/local/cuda", (13, 0))]

    def installer(req):
        installed.append(req)
        found.append(Candidate("pip package", "/venv/site-packages/nvidia/cuda_nvcc", (12, 8)))
        return True, ""

    r = find_nvcc.find("12.8", install=True, installer=installer, candidates=lambda: list(found))
    assert installed == [["nvidia-cuda-nvcc-cu12==12.8.*", "nvidia-cuda-runtime-cu12==12.8.*"]]
    assert r.cuda_home == "/venv/site-packages/nvidia/cuda_nvcc"
    assert r.message.startswith("installed nvidia-cuda-nvcc-cu12==12.8.* nvidia-cuda-runtime-cu12==12.8.*: nvcc 12.8")


def test_offline_says_why_in_one_line_and_what_to_do():
    tried = []

    def offline(req):
        tried.append(req)
        return False, "ERROR: Could not find a version that satisfies the requirement (no network)"

    r = find_nvcc.find("12.8", install=True, installer=offline,
                       candidates=lambda: [Candidate("PATH", "/usr/local/cuda", (13, 0))])
    assert r.cuda_home is None
    assert [reqs[0] for reqs in tried] == ["nvidia-cuda-nvcc-cu12==12.8.*", "nvidia-cuda-nvcc-cu12"]  # exact, any
    assert "\n" not in r.message
    for part in ("CUDA 12.8", "13.0 at /usr/local/cuda", "no network", "set CUDA_HOME"):
        assert part in r.message


def test_an_install_that_brings_no_usable_nvcc_says_so():
    r = find_nvcc.find("13.0", install=True, installer=lambda reqs: (True, ""), candidates=lambda: [])
    assert r.cuda_home is None
    assert "nvidia-cuda-nvcc==13.0.* nvidia-cuda-runtime==13.0.* nvidia-cuda-crt==13.0.* nvidia-nvvm==13.0.* installed " \
           "but no nvcc of CUDA 13 with the runtime's headers appeared under nvidia/cu13" in r.message


def test_without_install_nothing_is_installed_and_the_package_is_named():
    r = find_nvcc.find("13.0", install=False, installer=None, candidates=lambda: [])
    assert r.cuda_home is None and "pip install nvidia-cuda-nvcc==13.0.*" in r.message and "no nvcc found" in r.message


def test_cpu_torch_has_nothing_to_build_for():
    r = find_nvcc.find(None, install=True, installer=None, candidates=lambda: [])
    assert r.cuda_home is None and "CPU build" in r.message


def _fake_nvcc(home, headers=True):
    os.makedirs(os.path.join(home, "bin"))
    path = os.path.join(home, "bin", "nvcc")
    open(path, "w").close()
    if headers:
        os.makedirs(os.path.join(home, "include"))
        open(os.path.join(home, "include", "cuda_runtime.h"), "w").close()
    return path


def test_locate_looks_at_cuda_home_path_and_pip_folders_once_each(tmp_path):
    env_home, pip_home = str(tmp_path / "env"), str(tmp_path / "site" / "nvidia" / "cu13")
    versions = {os.path.join(env_home, "bin", "nvcc"): (12, 4), os.path.join(pip_home, "bin", "nvcc"): (13, 0)}
    for home in (env_home, pip_home):
        _fake_nvcc(home)
    wrapper = _fake_nvcc(str(tmp_path / "usr-local"), headers=False)  # a script in /usr/local/bin, say
    found = find_nvcc.locate([pip_home, str(tmp_path / "absent")], env={"CUDA_HOME": env_home, "CUDA_PATH": env_home},
                             which=lambda name: wrapper,  # PATH: a wrapper whose folder is no toolkit
                             version=lambda nvcc: versions.get(nvcc))  # (and this machine's /usr/local/cuda)
    assert [(c.where, c.cuda_home, c.release) for c in found
            if c.cuda_home != "/usr/local/cuda"] == [("$CUDA_HOME", env_home, (12, 4)),
                                                     ("pip package", pip_home, (13, 0))]


def test_cuda12_wheels_headers_are_beside_its_nvcc(tmp_path):
    nvcc_home = tmp_path / "nvidia" / "cuda_nvcc"
    _fake_nvcc(str(nvcc_home), headers=False)
    assert not find_nvcc.has_runtime_headers(str(nvcc_home))
    (tmp_path / "nvidia" / "cuda_runtime" / "include").mkdir(parents=True)
    (tmp_path / "nvidia" / "cuda_runtime" / "include" / "cuda_runtime.h").write_text("")
    assert find_nvcc.has_runtime_headers(str(nvcc_home))


def test_cli_prints_cuda_home_or_one_line(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(find_nvcc, "locate", lambda folders, env=None: [Candidate("PATH", "/cuda13", (13, 0))])
    assert find_nvcc.main([]) == 0
    out = capsys.readouterr()
    assert out.out == "/cuda13\n"
    monkeypatch.setattr(find_nvcc, "locate", lambda folders, env=None: [])
    assert find_nvcc.main([]) == 1
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1


# -- setup.py: a toolkit from NVIDIA's wheels ------------------------------------------------------
@pytest.fixture(scope="module")
def setup_py():
    sys.path.insert(0, ROOT)
    try:
        yield _load("ff_setup_for_tests", "setup.py")
    finally:
        sys.path.remove(ROOT)


def test_cuda13_wheel_gets_the_unversioned_libcudart_link(tmp_path, setup_py):
    home = tmp_path / "nvidia" / "cu13"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "libcudart.so.13").write_text("")
    includes, libs = setup_py.pip_toolkit_dirs(str(home), str(tmp_path / "link"))
    assert includes == [] and libs == [str(tmp_path / "link")]
    assert os.readlink(tmp_path / "link" / "libcudart.so") == str(home / "lib" / "libcudart.so.13")


def test_cuda12_wheel_gets_the_runtime_wheels_headers_and_library(tmp_path, setup_py):
    nvidia = tmp_path / "nvidia"
    (nvidia / "cuda_nvcc" / "bin").mkdir(parents=True)
    (nvidia / "cuda_runtime" / "lib").mkdir(parents=True)
    (nvidia / "cuda_runtime" / "include").mkdir()
    (nvidia / "cuda_runtime" / "lib" / "libcudart.so.12").write_text("")
    includes, libs = setup_py.pip_toolkit_dirs(str(nvidia / "cuda_nvcc") + "/", str(tmp_path / "link"))
    assert includes == [str(nvidia / "cuda_runtime" / "include")]
    assert libs == [str(nvidia / "cuda_runtime" / "lib"), str(tmp_path / "link")]
    assert os.readlink(tmp_path / "link" / "libcudart.so").endswith("libcudart.so.12")


def test_an_ordinary_toolkit_is_left_alone(tmp_path, setup_py):
    (tmp_path / "cuda" / "lib64").mkdir(parents=True)
    (tmp_path / "cuda" / "lib64" / "libcudart.so").write_text("")
    assert setup_py.pip_toolkit_dirs(str(tmp_path / "cuda"), str(tmp_path / "link")) == ([], [])
    assert not (tmp_path / "link").exists()
    assert setup_py.pip_toolkit_dirs(None, str(tmp_path / "link")) == ([], [])


def test_extension_says_torchs_cxx_abi(setup_py):
    import torch

    flag = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    ext = setup_py.extension(cuda=False)
    assert flag in ext.extra_compile_args["cxx"]
