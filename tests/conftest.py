"""Test set-up. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors,
so TRITON_INTERPRET must be set before anything imports triton."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
