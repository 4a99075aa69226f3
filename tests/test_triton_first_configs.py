"""The switch that runs Triton's autotuned kernels at their first config (fastformer/triton_kernels/utils.py::
first_configs), which ``python -m fastformer check`` uses: on a GPU path (INTERPRET off, the
kernels replaced by recorders, so nothing is compiled) attention's and the matmul's launchers
call the autotuner without it and the first config with it or in deterministic mode; the switch
nests and is restored after an exception."""
import pytest
import torch

from utils import kernel_backends

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
from fastformer.triton_kernels import matmul, utils  # noqa: E402


class Recorder:
    """Stands for a Triton kernel or autotuner: ``rec[grid](*args, **kw)`` records kw."""

    def __init__(self, name, calls, configs=None):
        self.name, self.calls, self.configs = name, calls, configs

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, kw))


@pytest.fixture
def deterministic_off():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(was)


def test_switch_nests_and_is_restored(deterministic_off):
    assert not utils.first_config_only()
    with utils.first_configs():
        with utils.first_configs():
            assert utils.first_config_only()
        assert utils.first_config_only()  # the outer block is still open
    assert not utils.first_config_only()
    with pytest.raises(KeyError):
        with utils.first_configs():
            raise KeyError("x")
    assert not utils.first_config_only()
    torch.use_deterministic_algorithms(True)
    assert utils.first_config_only()


def _attention_launch(monkeypatch, kind="fwd", heavy=False):
    """What attention._launch calls on a GPU for one launch: [(name, launch kwargs)]."""
    calls = []
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(torch.library, "wrap_triton", lambda fn: fn)
    monkeypatch.setattr(A, "_tuned", lambda *a: Recorder("autotuner", calls))
    meta = {"HAS_MASK": heavy, "HAS_DROPOUT": False}
    A._launch(kind, Recorder("kernel", calls), lambda blocks: (1,), 64, 2, (), meta)
    return calls


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq", "dkdv_dq"])
def test_attention_launch(monkeypatch, deterministic_off, kind):
    assert [name for name, _ in _attention_launch(monkeypatch, kind)] == ["autotuner"]
    first = A._configs(kind, 64, 2, True, False)[0]
    with utils.first_configs():
        [(name, kw)] = _attention_launch(monkeypatch, kind, heavy=True)
    assert name == "kernel"
    assert {key: kw[key] for key in first.kwargs} == first.kwargs
    assert (kw["num_warps"], kw["num_stages"]) == (first.num_warps, first.num_stages)
    torch.use_deterministic_algorithms(True)
    assert [name for name, _ in _attention_launch(monkeypatch, kind)] == ["kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matmul_launch(monkeypatch, deterministic_off, dtype):
    calls = []
    tuner = matmul.kernel_for(dtype)
    monkeypatch.setattr(matmul, "INTERPRET", False)
    monkeypatch.setattr(matmul, "kernel_for", lambda dt: Recorder("autotuner", calls, tuner.configs))
    monkeypatch.setattr(matmul, "_matmul", Recorder("kernel", calls))
    a, b = torch.zeros(4, 8, dtype=dtype), torch.zeros(8, 16, dtype=dtype)

    def launch():
        calls.clear()
        matmul.launch(a, b, torch.zeros(4, 16, dtype=dtype), split_k=1)
        return calls

    assert [name for name, _ in launch()] == ["autotuner"]
    with utils.first_configs():
        [(name, kw)] = launch()
    first = tuner.configs[0]
    assert name == "kernel" and {key: kw[key] for key in first.kwargs} == first.kwargs
    assert kw["num_warps"] == first.num_warps


def test_attention_tf32_launch_takes_its_own_configs(monkeypatch, deterministic_off):
    """fp32 launches with tf32 dots (INPUT_PRECISION) have their own first choices where no config compiles
    clean for both precisions (attention._CONFIGS_TF32): the launcher passes the precision on, to the first
    config and to the autotuner alike, and an ieee launch of the same kernel keeps the other tables' lead."""
    assert A._CONFIGS_TF32, "no tf32 lead to check"
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(torch.library, "wrap_triton", lambda fn: fn)
    tuned = []
    monkeypatch.setattr(A, "_tuned", lambda *a: tuned.append(a) or Recorder("autotuner", []))
    for kind, block_d, varlen, rel in A._CONFIGS_TF32:
        first = {}
        for precision in ("ieee", "tf32"):
            calls = []
            meta = {"HAS_MASK": False, "HAS_DROPOUT": True, "HAS_REL": rel, "VARLEN": varlen,
                    "INPUT_PRECISION": precision}
            with utils.first_configs():
                A._launch(kind, Recorder("kernel", calls), lambda blocks: (1,), block_d, 4, (), meta)
            [(_, kw)] = calls
            first[precision] = (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])
            A._launch(kind, Recorder("kernel", calls), lambda blocks: (1,), block_d, 4, (), meta)
            assert tuned[-1][9] is (precision == "tf32"), tuned[-1]  # _tuned's tf32: the autotuner's configs too
            want = A._configs(kind, block_d, 4, True, varlen, rel, 80, False, precision == "tf32")[0]
            assert first[precision] == (want.kwargs["BLOCK_M"], want.kwargs["BLOCK_N"], want.num_warps,
                                        want.num_stages)
        assert first["tf32"] != first["ieee"], (kind, block_d, varlen, rel, first)
