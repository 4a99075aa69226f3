"""Backend choice: forcing, automatic fall-through, availability reasons, light imports."""
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from fastformer import _ext, backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXT_BUILT = _ext.load_error() is None


def _run_python(code, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=full_env, timeout=120)


def test_reference_always_available():
    assert fastformer.available_backends()["reference"].available


def test_available_backends_gives_a_reason_for_each_unavailable_one():
    for name, avail in fastformer.available_backends().items():
        assert name in backends.NAMES
        if not avail.available:
            assert avail.reason, f"{name} is unavailable without a reason"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU reason; this machine has a GPU")
def test_forcing_cuda_without_gpu_names_why(monkeypatch):
    # without the SIMT harness's emulated CPU device (tests/simt/plugin.py adds it), as on a user's machine
    cuda = backends.BACKENDS["cuda"]
    monkeypatch.setattr(cuda, "devices", tuple(d for d in cuda.devices if not d.emulated))
    x = torch.randn(4, 8)
    with fastformer.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="backend 'cuda' was forced but cannot run add_layer_norm: "
                                               "the cuda backend runs CUDA tensors, not cpu tensors"):
            fastformer.ops.add_layer_norm(x, None, None, None)
    assert "no CUDA GPU" in fastformer.available_backends()["cuda"].reason


def test_forcing_triton_on_cpu_without_interpreter_names_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    backends.clear_cache()  # the environment is read once per decision, and decisions are kept
    x = torch.randn(4, 8)
    try:
        with fastformer.use_backend("triton"):
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|not installed"):
                fastformer.ops.add_layer_norm(x, None, None, None)
    finally:
        backends.clear_cache()


def test_triton_reported_missing_when_it_cannot_be_imported():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import fastformer, torch\n"
            "a = fastformer.available_backends()['triton']\n"
            "assert not a.available and 'not installed' in a.reason, a\n"
            "y = fastformer.ops.add_layer_norm(torch.randn(3, 5), None, None, None)\n"
            "print('ok', tuple(y.shape))")
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ok (3, 5)" in res.stdout


def test_import_does_not_import_triton_or_touch_cuda():
    code = ("import sys, fastformer, torch\n"
            "fastformer.ops.attention(*(torch.randn(1, 2, 3, 4) for _ in range(3)))\n"
            "fastformer.available_backends()\n"
            "print('triton' in sys.modules, torch.cuda.is_initialized())")
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_environment_variable_chooses_backend():
    res = _run_python("import fastformer; print(fastformer.get_backend())", FASTFORMER_BACKEND="reference")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "reference"


def test_bad_backend_name_is_rejected():
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        fastformer.set_backend("fast")
    res = _run_python("import fastformer, torch; fastformer.ops.add_layer_norm(torch.randn(2, 3), None, None, None)",
                      FASTFORMER_BACKEND="gpu")
    assert res.returncode != 0 and "backend must be" in res.stderr


def test_use_backend_nests_and_restores():
    fastformer.set_backend("reference")
    with fastformer.use_backend("cpu"):
        assert fastformer.get_backend() == "cpu"
        with fastformer.use_backend("auto"):
            assert fastformer.get_backend() == "auto"
        assert fastformer.get_backend() == "cpu"
    assert fastformer.get_backend() == "reference"


@pytest.mark.skipif(not EXT_BUILT, reason="fastformer._C is not built here")
@pytest.mark.parametrize("op", ["attention", "add_layer_norm", "feed_forward", "cross_entropy",
                                "linear_cross_entropy"])
def test_auto_on_cpu_picks_the_cpu_backend(op):
    assert backends.resolve(op, torch.device("cpu"), torch.float32) == "cpu"
    assert backends.resolve(op, torch.device("cpu"), torch.bfloat16) == "cpu"


def test_auto_falls_through_to_reference_when_no_kernel_can_take_the_call():
    cpu = torch.device("cpu")
    assert backends.resolve("attention", cpu, torch.float16) == "reference"  # no CPU fp16 kernels
    assert backends.resolve("attention", cpu, torch.float32, limitation="mask needs grad") == "reference"


@pytest.mark.skipif(not EXT_BUILT, reason="fastformer._C is not built here")
def test_forced_backend_raises_with_the_limitation():
    cpu = torch.device("cpu")
    with fastformer.use_backend("cpu"):
        with pytest.raises(RuntimeError, match="forced but cannot run attention: .*dtype torch.float16"):
            backends.select("attention", cpu, torch.float16)
        with pytest.raises(RuntimeError, match="mask needs grad"):
            backends.select("attention", cpu, torch.float32, limitation="mask needs grad")


def test_attention_mask_with_grad_falls_back_to_reference_and_gets_its_gradient():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    bias = torch.randn(5, 5, requires_grad=True)
    out = fastformer.ops.attention(q, k, v, attn_mask=bias)
    out.sum().backward()
    assert bias.grad is not None and torch.isfinite(bias.grad).all() and bias.grad.abs().sum() > 0


def test_reference_backend_runs_every_op_when_forced():
    with fastformer.use_backend("reference"):
        x = torch.randn(6, 16)
        w = torch.randn(32, 16)
        assert fastformer.ops.add_layer_norm(x, x, None, None).shape == (6, 16)
        assert fastformer.ops.feed_forward(x, w, None, w.t().contiguous(), None).shape == (6, 16)
        assert fastformer.ops.cross_entropy(torch.randn(6, 10), torch.arange(6)).dim() == 0
