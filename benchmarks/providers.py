"""pytest parameters for the benchmark suite, drawn from :mod:`fastformer.jobs.bench` (the same
providers, shapes and callables ``python -m fastformer bench`` times; nothing is duplicated).

Environment knobs:
    FASTFORMER_BENCH_SWEEP      smoke | quick | full (default full): the shape sweep
    FASTFORMER_BENCH_PROVIDERS  comma-separated provider names (default: all that can run here)
    FASTFORMER_BENCH_DTYPE      fp32 | bf16 | fp16 (default fp32 on CPU, bf16 on CUDA)
"""
import os
from typing import Dict, List

import pytest
import torch

from fastformer.jobs.bench import ops as bench_ops
from fastformer.jobs.bench import providers as registry
from fastformer.jobs.bench import train_step
from fastformer.jobs.devices import pick_device

SWEEP = os.environ.get("FASTFORMER_BENCH_SWEEP", "full")
DEVICE = pick_device("auto")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE = _DTYPES[os.environ["FASTFORMER_BENCH_DTYPE"]] if os.environ.get("FASTFORMER_BENCH_DTYPE") \
    else registry.default_dtypes(DEVICE)[0]
DTYPE_NAME = {v: k for k, v in _DTYPES.items()}[DTYPE]


def _chosen() -> List[str]:
    names = os.environ.get("FASTFORMER_BENCH_PROVIDERS")
    if names:
        return [n.strip() for n in names.split(",") if n.strip()]
    if SWEEP == "smoke":  # the suite's self-test: no compile, no slow reference
        return [n for n, p in registry.REGISTRY.items() if "compile" not in p.tags and "slow" not in p.tags]
    return list(registry.REGISTRY)


def op_params(op: str) -> List:
    """pytest params ``(provider, shape)`` for ``op``: every chosen provider x every shape of the
    sweep; a provider that cannot run here is a skipped param that says why."""
    spec = bench_ops.OPS[op]
    params = []
    for provider, reason in registry.providers_for(op, DEVICE, DTYPE, _chosen()):
        for shape in spec.sweep(DEVICE.type, SWEEP):
            if not provider.supports(spec, shape):
                continue
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(provider.name, shape, marks=marks,
                                       id=f"{provider.name}-{spec.label(shape).replace(' ', '_')}"))
    return params


def run_op(benchmark, op: str, mode: str, provider: str, shape: Dict) -> None:
    """Benchmark one call of ``op`` in ``mode`` (fwd, bwd or fwd_bwd) by ``provider``."""
    spec = bench_ops.OPS[op]
    case = registry.build_case(op, provider, shape, DEVICE, DTYPE, modes=(mode,))
    label = spec.label(shape)
    benchmark.group = f"{op} {mode} {label} {DTYPE_NAME}"
    benchmark.extra_info.update(op=op, mode=mode, provider=provider, shape=label, dtype=DTYPE_NAME,
                                tokens=spec.tokens(shape))
    benchmark(case.calls[mode])


def op_benchmark(op: str):
    """The benchmark test of ``op``, for a ``bench_<op>.py`` file to bind to a ``test_`` name:
    one case per mode x chosen provider x shape (ids ``<mode>-<provider>-<shape>``), each mode
    its own pytest-benchmark group."""
    @pytest.mark.parametrize("provider, shape", op_params(op))
    @pytest.mark.parametrize("mode", bench_ops.MODES)
    def test(benchmark, mode, provider, shape):
        run_op(benchmark, op, mode, provider, shape)
    return test


def train_step_params() -> List:
    """pytest params ``(provider, dtype, shape)`` of the end-to-end training step."""
    names = os.environ.get("FASTFORMER_BENCH_PROVIDERS")
    chosen = [n.strip() for n in names.split(",")] if names else train_step.providers_for(DEVICE)
    if not names and SWEEP == "smoke":
        chosen = [n for n in chosen if n not in ("torch-compile", "fastformer-reference")]
    params = []
    for provider in chosen:
        if provider not in train_step.providers_for(DEVICE):
            continue
        reason = train_step.why_not(provider, DEVICE)
        for dtype in train_step.DTYPES:
            for shape in train_step.sweep(DEVICE.type, SWEEP):
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(provider, dtype, shape, marks=marks, id=f"{provider}-{dtype}"))
    return params


def run_train_step(benchmark, provider: str, dtype: str, shape: Dict) -> None:
    step = train_step.build_step(provider, shape, DEVICE, dtype)
    benchmark.group = f"train_step {train_step.label(shape)} {dtype}"
    benchmark.extra_info.update(provider=provider, dtype=dtype, tokens=step.tokens, shape=train_step.label(shape))
    benchmark(step.run)
