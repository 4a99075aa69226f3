"""The backend decision, made once per distinct call and kept (fastformer/backends/__init__.py):
what the key holds, what clears it, errors raised anew from it. A GPU is declared, not needed:
``fake_gpu`` gives the triton and cuda backends a working CUDA device whose kernels never run
(the tests only select)."""
import threading

import pytest
import torch

from fastformer import backends, op_table
from fastformer.backends import builtin, declaration

CUDA = torch.device("cuda")  # a device object needs no GPU; nothing here allocates on it


class NeverRun:
    """A kernel source that finds every op's functions, as placeholders that are never called."""
    what = "placeholder kernels"

    def find(self, op):
        return {fn: (lambda *args, fn=fn: fn) for fn in op_table.BY_NAME[op].functions}


def declare_gpu(monkeypatch, names=("triton", "cuda"), needs=()):
    """Give each backend of ``names`` a working, not emulated, CUDA device (undone by monkeypatch)."""
    for name in names:
        backend = backends.BACKENDS[name]
        gpu = backends.Device("cuda", builtin.GPU_DTYPES, NeverRun(), needs=needs)
        monkeypatch.setattr(backend, "devices", (gpu,) + tuple(d for d in backend.devices if d.type != "cuda"))
        monkeypatch.setattr(backend, "limits", ())  # the Triton limits would import the kernel modules


@pytest.fixture
def fake_gpu(monkeypatch):
    declare_gpu(monkeypatch)
    yield CUDA
    backends.clear_cache()


@pytest.fixture
def count_choices(monkeypatch):
    """The number of times the registry decided (called _choose) so far."""
    calls = []
    real = backends._choose

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(backends, "_choose", counted)
    return calls


def test_a_repeated_call_is_decided_once(fake_gpu, count_choices):
    first = backends.select("attention", CUDA, torch.bfloat16, head_dim=64)
    assert first.name == "triton" and first.device_type == "cuda"
    for _ in range(3):
        assert backends.select("attention", CUDA, torch.bfloat16, head_dim=64) is first
    assert len(count_choices) == 1
    backends.select("attention", CUDA, torch.bfloat16, head_dim=80)  # another fact value: another decision
    backends.select("attention", CUDA, torch.float16, head_dim=64)  # another dtype
    backends.select("attention", CUDA, torch.bfloat16, "mask needs grad", head_dim=64)  # a limitation
    assert len(count_choices) == 4


def test_select_cached_is_select_with_the_facts_as_tuples(fake_gpu, count_choices):
    kernels = backends.select("add_layer_norm", CUDA, torch.float32, hidden_size=512, rows=64)
    names = ("hidden_size", "rows")
    assert backends.select_cached("add_layer_norm", CUDA, torch.float32, None, names, (512, 64)) is kernels
    assert backends.select_cached("add_layer_norm", CUDA, torch.float32, None, names, (512.0, True + 63)) is kernels
    assert len(count_choices) == 1  # one entry: equal values hash alike
    assert backends.select_cached("feed_forward", "cuda", torch.float32).name == "triton"  # a device type works too
    with pytest.raises(ValueError, match=r"2 fact names \('hidden_size', 'rows'\) for 1 values"):
        backends.select_cached("add_layer_norm", CUDA, torch.float32, None, names, (512,))


def test_the_requested_name_is_part_of_the_key(fake_gpu, monkeypatch):
    assert backends.resolve("attention", CUDA, torch.bfloat16) == "triton"
    with backends.use_backend("cuda"):
        assert backends.resolve("attention", CUDA, torch.bfloat16) == "cuda"
        with backends.use_backend("reference"):
            assert backends.select("attention", CUDA, torch.bfloat16) is None
    backends.set_backend("cuda")
    assert backends.resolve("attention", CUDA, torch.bfloat16) == "cuda"
    # the environment variable, read on every call when nothing else chose
    monkeypatch.setattr(backends._state, "name", None)
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    assert backends.get_backend() == "reference" and backends.select("attention", CUDA, torch.bfloat16) is None
    monkeypatch.setenv("FASTFORMER_BACKEND", "cuda")
    assert backends.resolve("attention", CUDA, torch.bfloat16) == "cuda"
    monkeypatch.delenv("FASTFORMER_BACKEND")
    assert backends.resolve("attention", CUDA, torch.bfloat16) == "triton"
    monkeypatch.setenv("FASTFORMER_BACKEND", "gpu")  # a bad name is never kept: it fails every time
    for _ in range(2):
        with pytest.raises(ValueError, match="backend must be 'auto' or one of .* got 'gpu'"):
            backends.select("attention", CUDA, torch.bfloat16)


def test_errors_are_kept_as_messages_and_raised_every_time(fake_gpu, monkeypatch, count_choices):
    forced = ("fastformer backend 'cuda' was forced but cannot run attention: "
              "the cuda backend does not support dtype torch.float64 on cuda")
    with backends.use_backend("cuda"):
        for _ in range(2):
            with pytest.raises(RuntimeError) as err:
                backends.select("attention", CUDA, torch.float64, head_dim=64)
            assert str(err.value) == forced
    monkeypatch.setitem(backends.AUTO_ORDER, "cuda", ("cuda",))
    nothing = ("no fastformer backend can run attention on cuda torch.float64: "
               "cuda: the cuda backend does not support dtype torch.float64 on cuda")
    for _ in range(2):
        with pytest.raises(RuntimeError) as err:
            backends.select("attention", CUDA, torch.float64, head_dim=64)
        assert str(err.value) == nothing
    assert len(count_choices) == 2


def test_declaring_a_device_clears_the_cache(monkeypatch):
    meta = torch.device("meta")
    cuda = backends.BACKENDS["cuda"]
    monkeypatch.setattr(cuda, "devices", cuda.devices)  # add_device is undone with the attribute
    with backends.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="the cuda backend runs CUDA tensors, not meta tensors"):
            backends.select("attention", meta, torch.float32)
        cuda.add_device(backends.Device("meta", (torch.float32,), NeverRun(), emulated=True))
        assert backends.resolve("attention", meta, torch.float32) == "cuda"
    monkeypatch.undo()
    with backends.use_backend("cuda"):
        with pytest.raises(RuntimeError, match="the cuda backend runs CUDA tensors, not meta tensors"):
            backends.select("attention", meta, torch.float32)


def test_replaced_kernels_are_the_ones_selected(fake_gpu, monkeypatch):
    """tests/test_check.py swaps a device's bound Kernels for wrapped ones: select hands those out."""
    device = backends.BACKENDS["triton"].device("cuda")
    bound = backends.select("attention", CUDA, torch.bfloat16)
    replaced = backends.Kernels("triton", "cuda")
    with monkeypatch.context() as patch:
        patch.setattr(device, "_kernels", replaced)
        assert backends.select("attention", CUDA, torch.bfloat16) is replaced
    assert backends.select("attention", CUDA, torch.bfloat16) is bound


def test_auto_order_and_registration_clear_the_cache(fake_gpu, monkeypatch):
    assert backends.resolve("feed_forward", CUDA, torch.float32) == "triton"
    monkeypatch.setitem(backends.AUTO_ORDER, "cuda", ("cuda", "reference"))
    assert backends.resolve("feed_forward", CUDA, torch.float32) == "cuda"
    assert backends._CACHE
    extra = backends.Backend("extra-for-test")
    try:
        declaration.register(extra)
        assert not backends._CACHE
    finally:
        del declaration._REGISTRY["extra-for-test"]
        backends.clear_cache()


def test_a_changed_requirement_needs_clear_cache(monkeypatch):
    """What a decision reads from the process (here TRITON_INTERPRET) is read once: clear_cache()."""
    x = torch.randn(2, 3)
    with backends.use_backend("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        backends.clear_cache()
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|not installed"):
            backends.select("add_layer_norm", x.device, x.dtype)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|not installed"):
            backends.select("add_layer_norm", x.device, x.dtype)  # still the kept decision
        backends.clear_cache()
        if backends.availability("triton", "cpu"):
            assert backends.resolve("add_layer_norm", x.device, x.dtype) == "triton"
    backends.clear_cache()


def test_the_cache_is_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(backends, "_CACHE_SIZE", 8)
    for rows in range(20):
        backends.select("add_layer_norm", CUDA, torch.float32, rows=rows)
    assert 0 < len(backends._CACHE) <= 8


def test_select_eager_is_select_cached_without_a_limitation(fake_gpu, monkeypatch, count_choices):
    """The fast paths' lookup (no compile check): the same entry, and what is requested read on every
    call, as select_cached's (use_backend, set_backend in this thread only, the variable)."""
    names, values = ("hidden_size",), (512,)
    kernels = backends.select_cached("add_layer_norm", CUDA, torch.float32, None, names, values)
    assert kernels.name == "triton"
    assert backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values) is kernels
    assert len(count_choices) == 1
    with backends.use_backend("cuda"):
        assert backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values).name == "cuda"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(
            backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values)))
        thread.start()
        thread.join()
        assert seen == [kernels]  # another thread: its own request (none: auto)
    assert backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values) is kernels
    monkeypatch.setattr(backends._state, "name", None)
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    assert backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values) is None
    monkeypatch.setenv("FASTFORMER_BACKEND", "cuda")
    assert backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values).name == "cuda"
    monkeypatch.setenv("FASTFORMER_BACKEND", "gpu")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of .* got 'gpu'"):
        backends.select_eager("add_layer_norm", CUDA, torch.float32, names, values)
    monkeypatch.delenv("FASTFORMER_BACKEND")
    with pytest.raises(RuntimeError, match="'cuda' was forced but cannot run add_layer_norm"):
        with backends.use_backend("cuda"):  # a forced backend that cannot take the call: raised every time
            backends.select_eager("add_layer_norm", CUDA, torch.float64, names, values)
