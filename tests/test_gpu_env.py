"""tools/gpu_env.py, which prepares `make gpu-check`'s venv: it refuses at once without a GPU,
takes a CUDA torch that is here already, and names what it could not install. No GPU, no
network: the GPU probe, the Pythons and pip are stand-ins, but for one real venv."""
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("gpu_env", os.path.join(ROOT, "tools", "gpu_env.py"))
gpu_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_env)


class _Proc:
    def __init__(self, returncode):
        self.returncode = returncode


def test_gpu_is_seen_in_proc_or_through_nvidia_smi(tmp_path):
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    no_smi = lambda *a, **k: _Proc(1)  # noqa: E731
    reason = gpu_env.why_no_gpu(str(gpus), run=no_smi)
    assert reason is not None and "no CUDA GPU here" in reason and "\n" not in reason
    assert gpu_env.why_no_gpu(str(gpus), run=lambda *a, **k: _Proc(0)) is None
    (gpus / "0000:01:00.0").mkdir()
    assert gpu_env.why_no_gpu(str(gpus), run=no_smi) is None


def test_no_gpu_fails_in_one_line_before_anything_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_env, "why_no_gpu", lambda: "no CUDA GPU here (test)")
    monkeypatch.setattr(gpu_env, "pick_torch_python", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert gpu_env.main(["--venv", str(tmp_path / "v"), "pytest"]) == 1
    assert capsys.readouterr().err == "gpu-check: no CUDA GPU here (test)\n"
    assert not (tmp_path / "v").exists()


def test_the_first_python_with_a_cuda_torch_is_taken(tmp_path):
    cpu, cuda, later = (str(tmp_path / n) for n in ("cpu", "cuda", "later"))
    for p in (cpu, cuda, later):
        open(p, "w").close()
    infos = {cpu: {"torch": "2.13.0+cpu", "cuda": None}, cuda: {"torch": "2.11.0+cu130", "cuda": "13.0"},
             later: {"torch": "2.13.0", "cuda": "12.8"}}
    chosen, others = gpu_env.pick_torch_python([str(tmp_path / "absent"), cpu, cuda, later], probe=infos.get)
    assert chosen is infos[cuda]
    assert others == [f"{cpu}: torch 2.13.0+cpu (CPU build)"]
    chosen, others = gpu_env.pick_torch_python([cpu], probe=infos.get)
    assert chosen is None and len(others) == 1


def test_missing_requirements_honour_pins():
    assert gpu_env.requirement_name("transformers==5.24.0") == ("transformers", "5.24.0")
    assert gpu_env.requirement_name("pytest_benchmark") == ("pytest-benchmark", None)
    installed = {"pytest": "9.1.1", "transformers": "5.20.0", "pytest-benchmark": "5.2.3"}
    assert gpu_env.missing(["pytest", "pytest-benchmark", "hypothesis", "transformers==5.24.0", "Pytest"],
                           installed) == ["hypothesis", "transformers==5.24.0"]


def test_missing_requirements_honour_ranges():
    # the Makefile's DEPS has ninja>=1.12: an older ninja must be installed over, a newer one kept
    installed = {"ninja": "1.11.1.4", "torch": "2.13.0+cu130", "numpy": "2.3.0", "tqdm": "4.67.0rc1"}
    assert gpu_env.missing(["ninja>=1.12", "torch==2.13.0", "numpy>=2,<3", "numpy<2", "tqdm>=4"],
                           installed) == ["ninja>=1.12", "numpy<2", "tqdm>=4"]  # tqdm: a pre-release, pip decides
    assert gpu_env.missing(["ninja>=1.12", "ninja!=1.13", "ninja>1.13"], {"ninja": "1.13"}) == [
        "ninja!=1.13", "ninja>1.13"]


def test_offline_pip_is_one_line_and_not_a_failure(tmp_path, monkeypatch, capsys):
    venv = tmp_path / "v"
    monkeypatch.setattr(gpu_env, "why_no_gpu", lambda: None)
    py = gpu_env.venv_python(str(venv))
    monkeypatch.setattr(gpu_env, "pick_torch_python",
                        lambda candidates: ({"executable": py, "torch": "2.11.0", "cuda": "13.0"}, []))
    monkeypatch.setattr(gpu_env, "installed_distributions", lambda python: {"pytest": "9.1.1"})
    monkeypatch.setattr(gpu_env, "pip_install", lambda python, reqs: (False, "No matching distribution found"))
    assert gpu_env.main(["--venv", str(venv), "pytest", "hypothesis", "pytest-benchmark"]) == 0
    err = capsys.readouterr().err
    assert err == ("gpu-check: pip could not install hypothesis pytest-benchmark (No matching distribution found): "
                   "running without them\n")


def test_no_cuda_torch_anywhere_and_offline_says_what_to_give(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_env, "why_no_gpu", lambda: None)
    monkeypatch.setattr(gpu_env, "pick_torch_python", lambda candidates: (None, ["/usr/bin/python3: no torch"]))
    monkeypatch.setattr(gpu_env, "make_venv", lambda *a, **k: None)
    installs = []
    monkeypatch.setattr(gpu_env, "pip_install", lambda python, reqs: (installs.append(reqs), (False, "offline"))[1])
    assert gpu_env.main(["--venv", str(tmp_path / "v")]) == 1
    assert installs == [["torch==2.13.0"]]  # pinned, never the latest
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "could not install a CUDA build of torch==2.13.0 (offline)" in last and "PYTHON=" in last


def test_the_venv_sees_the_other_pythons_packages(tmp_path):
    """The .pth: the venv imports what another Python's site-packages holds (its torch, there)."""
    site = tmp_path / "other-site-packages"
    site.mkdir()
    (site / "only_there.py").write_text("VALUE = 42\n")
    venv = tmp_path / "v"
    gpu_env.make_venv(str(venv), sys.executable, [str(site)], with_pip=False)
    out = subprocess.run([gpu_env.venv_python(str(venv)), "-c", "import only_there, sys; print(only_there.VALUE, sys.prefix)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["42", str(venv)]
