"""GPU smoke tests: every op, forward and every gradient, on each GPU kernel backend (triton,
cuda) against the reference, in fp32, bf16 and fp16, on the odd shapes of
``python -m fastformer check``. Marked ``gpu``: skipped with the reason where there is no CUDA
GPU (tests/conftest.py) or where the backend cannot run there (e.g. fastformer._C without CUDA
kernels). ``make gpu-check`` runs them with every other gpu-marked test."""
import pytest
import torch

from fastformer import backends
from fastformer.jobs import check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gpu_backends():
    for name in ("triton", "cuda"):
        avail = backends.availability(name, "cuda")
        yield pytest.param(name, id=name, marks=pytest.mark.skipif(not avail, reason=avail.reason or ""))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(check.OPS))
@pytest.mark.parametrize("backend", list(_gpu_backends()))
def test_gpu_op_matches_reference(backend, op, dtype):
    for case in check.OPS[op][2]:
        err, tol = check.check_case(op, case, backend, "cuda", DTYPES[dtype])
        assert err <= tol, f"{op} {backend} {dtype} {case.name}: max error {err:.3e} > tolerance {tol:.3e}"
