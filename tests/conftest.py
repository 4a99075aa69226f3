"""Test set-up. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors,
so TRITON_INTERPRET must be set before anything imports triton; the CUDA kernels run on the SIMT
harness (tests/simt/), built once per session here (incrementally, into build/simt) and named by
FASTFORMER_CUDA_SIMT before the test modules ask which backends are available.
FASTFORMER_CUDA_SIMT=off skips the harness (the cuda backend's CPU tests are then skipped)."""
import os
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    if os.environ.get("FASTFORMER_CUDA_SIMT"):
        return  # a given path, or "off"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "simt"))
    import build as simt_build

    start = time.perf_counter()
    os.environ["FASTFORMER_CUDA_SIMT"] = simt_build.build()
    config._ff_simt_build_s = time.perf_counter() - start


def pytest_report_header(config):
    took = getattr(config, "_ff_simt_build_s", None)
    path = os.environ.get("FASTFORMER_CUDA_SIMT", "")
    return f"fastformer SIMT harness: {path}" + (f" (built or checked in {took:.1f} s)" if took else "")


def pytest_collection_modifyitems(config, items):
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
