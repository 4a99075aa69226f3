"""``python -m fastformer check``: passes on the kernels of this machine, and fails (non-zero exit,
a FAIL line naming the op, backend and dtype) when a kernel computes a wrong value, forward or
backward."""
import pytest
import torch

from fastformer import backends
from fastformer.jobs import check
from fastformer.jobs.cli import main

CPU = pytest.mark.skipif(not backends.availability("cpu", "cpu"),
                         reason=backends.availability("cpu", "cpu").reason or "")


@CPU
@pytest.mark.parametrize("op", sorted(check.OPS))
def test_check_passes_on_this_machine(op, capsys):
    code = main(["check", "--backend", "cpu", "--op", op])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split()[:4] for line in lines] == [
        ["PASS", op, "cpu", "fp32"], ["PASS", op, "cpu", "bf16"]], out
    assert code == 0, out


def test_check_lists_every_backend_and_why(capsys):
    main(["check", "--op", "cross_entropy"])
    out = capsys.readouterr().out
    for name, avail in backends.available_backends().items():
        assert f"  {name}" in out
        if not avail:
            assert avail.reason in out


def _use_cpu_kernels(monkeypatch, replace):
    """Make the cpu backend run its own kernels but with ``replace`` (name -> function taking
    the real kernel) swapped in, for this test only."""
    kernels = backends.Kernels("cpu")
    for name, wrap in replace.items():
        setattr(kernels, name, wrap(getattr(kernels, name)))
    monkeypatch.setattr(backends.BACKENDS["cpu"].device("cpu"), "_kernels", kernels)


def _scaled_first_result(real):
    """The kernel with its first result scaled by 1.01."""
    def wrong(*args, **kwargs):
        first, *rest = real(*args, **kwargs)
        return (first * 1.01, *rest)
    return wrong


@CPU
@pytest.mark.parametrize("op, fn", [("cross_entropy", "cross_entropy_fwd"),        # the loss
                                    ("attention", "attention_bwd"),                # dq only
                                    ("add_layer_norm", "add_layer_norm_bwd")])     # dx only
def test_check_fails_on_a_wrong_kernel(op, fn, monkeypatch, capsys):
    _use_cpu_kernels(monkeypatch, {fn: _scaled_first_result})
    code = main(["check", "--backend", "cpu", "--op", op])
    out = capsys.readouterr().out
    assert code == 1, out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert any(line.split()[1:4] == [op, "cpu", "fp32"] for line in fails), out


@CPU
def test_check_fails_on_a_kernel_that_raises(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    _use_cpu_kernels(monkeypatch, {"feed_forward_fwd": lambda real: boom})
    assert main(["check", "--backend", "cpu", "--op", "feed_forward"]) == 1
    out = capsys.readouterr().out
    assert "FAIL feed_forward" in out and "kernel exploded" in out


def test_check_fails_when_nothing_can_run(monkeypatch, capsys):
    monkeypatch.setattr(check, "targets", lambda names=None: [("cuda", "cuda", "no GPU here")])
    assert main(["check"]) == 1
    assert "no kernel backend could run here" in capsys.readouterr().out


def test_fp16_is_checked_on_cuda_only(monkeypatch):
    """The dtypes per device: fp32 and bf16 everywhere, fp16 on CUDA (DESIGN.md's contract)."""
    seen = []
    monkeypatch.setattr(check, "targets", lambda names=None: [("cpu", "cpu", None), ("cuda", "cuda", None)])
    monkeypatch.setattr(check, "check_case",
                        lambda op, case, backend, device, dtype: seen.append((backend, dtype)) or (0.0, 1.0))
    assert check.run(op_names=["cross_entropy"], print_fn=lambda *a: None) == 0
    assert sorted(set(seen), key=str) == sorted({("cpu", torch.float32), ("cpu", torch.bfloat16),
                                                 ("cuda", torch.float32), ("cuda", torch.bfloat16),
                                                 ("cuda", torch.float16)}, key=str)


@pytest.mark.parametrize("args, first", [([], True), (["--autotune"], False)], ids=["default", "autotune"])
def test_triton_runs_its_first_configs_unless_autotune(monkeypatch, args, first):
    """check runs Triton's autotuned kernels at their first config (autotuning every small shape
    compiles every candidate), the other backends untouched; --autotune lets Triton tune."""
    utils = pytest.importorskip("fastformer.triton_kernels.utils", reason="triton is not installed")
    seen = []
    monkeypatch.setattr(check, "targets", lambda names=None: [("triton", "cpu", None), ("cpu", "cpu", None)])
    monkeypatch.setattr(check, "check_case", lambda op, case, backend, device, dtype:
                        seen.append((backend, utils.first_config_only())) or (0.0, 1.0))
    assert main(["check", "--op", "cross_entropy", *args]) == 0
    assert set(seen) == {("triton", first), ("cpu", False)}
    assert not utils.first_config_only()  # restored once check is done
