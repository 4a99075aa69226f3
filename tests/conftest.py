"""Test set-up. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors,
so TRITON_INTERPRET must be set before anything imports triton; the CUDA kernels run on the SIMT
harness, which the plugin tests/simt/plugin.py builds once per session and plugs into the cuda
backend (FASTFORMER_CUDA_SIMT=off skips it: the cuda backend's CPU tests are then skipped)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["simt.plugin"]


# The fast tier (`make test-fast`: -m "not slow") leaves out, besides the tests marked slow one by
# one (from a --durations run), whole suites: these files, and every case run on the emulated
# backends (triton under the interpreter, cuda on the SIMT harness). What stays: every op on the
# reference and cpu backends, the model and modules, hostile input, determinism.
SLOW_SUITES = ("test_hf_", "compile", "triton", "cuda", "simt", "flash_", "gpu_", "test_install", "test_distributed",
               "test_bench", "test_hypothesis_ops", "test_find_nvcc", "test_libstdcxx")
EMULATED_BACKENDS = ("triton", "cuda")


def _slow_suite(item) -> bool:
    if any(part in item.path.name for part in SLOW_SUITES):
        return True
    params = getattr(item, "callspec", None)
    return params is not None and any(
        "backend" in key and value in EMULATED_BACKENDS for key, value in params.params.items())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow_suite(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_and_backend():
    """Every test starts from seed 0 on the automatic backend choice."""
    import fastformer

    torch.manual_seed(0)
    fastformer.set_backend("auto")
    yield
    fastformer.set_backend("auto")


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module of tiny shapes (``pytestmark = pytest.mark.usefixtures(
    "one_thread_module")``): there, OpenMP start-up and stalls on the shared 2-core machine cost
    more than the work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def small_blocks(monkeypatch):
    """16 x 16 Triton attention tiles in the interpreter: sequences span several tiles, so tile
    skipping and edges get exercised (on a GPU the kernels keep their own tiles)."""
    tiles = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
    if tiles.INTERPRET:
        monkeypatch.setitem(tiles.INTERPRET_BLOCKS, "BLOCK_M", 16)
        monkeypatch.setitem(tiles.INTERPRET_BLOCKS, "BLOCK_N", 16)
