"""Helpers shared by the kernel tests: which backends to run, where, and how close is close."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import fastformer


def kernel_backends(*names):
    """pytest params for the kernel backends ("cpu", "triton", "cuda"), skipped with the reason
    when a backend cannot run here."""
    names = names or ("cpu", "triton", "cuda")
    params = []
    for name in names:
        avail = fastformer.backends.availability(name, device_for(name))
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(not avail, reason=avail.reason or "")))
    return params


ALL_OPS = fastformer.op_table.NAMES  # every fused op (fastformer/op_table.py)


def skip_without_kernels(backend: str, *ops: str) -> None:
    """Skip, with the backend's own reason, when forcing ``backend`` cannot run one of ``ops`` on
    its test device (the cuda backend on the SIMT harness carries only the ops whose csrc/cuda
    glue exists)."""
    if backend == "reference":
        return
    device = torch.device(device_for(backend))
    for op in ops:
        try:
            with fastformer.use_backend(backend):
                fastformer.backends.select(op, device, torch.float32)
        except RuntimeError as exc:
            pytest.skip(str(exc))


def device_for(backend: str) -> str:
    """The device a backend's tests use: CUDA for cuda and triton when a GPU exists, else CPU
    (triton under TRITON_INTERPRET=1, cuda on the SIMT harness, FASTFORMER_CUDA_SIMT)."""
    if backend in ("cuda", "triton") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_lowp(name, out, ref_fp32, ref_lowp, factor=2.0, atol=1e-5):
    """FlashAttention's rule: in low precision the kernel's error against the fp32 reference may
    be at most ``factor`` times the error of the reference itself computed in that precision."""
    assert out.shape == ref_fp32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref_fp32.shape)}"
    assert torch.isfinite(out).all() == torch.isfinite(ref_fp32).all(), f"{name}: non-finite values differ"
    err, ref_err = max_err(out, ref_fp32), max_err(ref_lowp, ref_fp32)
    assert err <= factor * ref_err + atol, (
        f"{name}: kernel error {err:.3e} > {factor} x reference low-precision error {ref_err:.3e} + {atol:.0e}")


def peak_allocated(run, device):
    """``run()``'s result and the most bytes it held at once (a CUDA device: the allocator's peak;
    the CPU: the largest single allocation the profiler saw, which is what a buffer of Sq x Sk
    elements would show)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = run()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    return result, max((e.cpu_memory_usage for e in prof.events() if e.name.startswith("aten::empty")), default=0)


def assert_close(name, out, ref, atol, rtol):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def forward_backward(fn, inputs, upstream, names):
    """``fn``'s outputs (detached) and the gradient of every given input, by name (``names`` in the
    order of ``inputs``; None inputs are left out), for the upstream gradients of its outputs (a
    None upstream: that output is unused)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    used = [(o, g) for o, g in zip(outs, upstream) if g is not None]
    present = [(n, leaf) for n, leaf in zip(names, leaves) if leaf is not None]
    grads = torch.autograd.grad([o for o, _ in used], [leaf for _, leaf in present], [g for _, g in used],
                                allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], {n: g for (n, _), g in zip(present, grads)}


def backend_cases(backends, cases, triton_cases):
    """pytest params ``(backend, case)``, ids ``<backend>-<case>``, for every case on every given
    backend but triton, which runs only ``triton_cases`` (its interpreter is slow)."""
    for backend in backends:
        name = backend.values[0]
        for case in cases:
            if name == "triton" and case not in triton_cases:
                continue
            yield pytest.param(name, case, marks=backend.marks, id=f"{backend.id}-{case}")


@contextlib.contextmanager
def recorded_draws(entries=False):
    """Every philox pair Python draws in the block (philox._draw_on, through which eager calls and the
    traced op ``next_seed(device)`` both draw), appended to the list yielded: ``(seed, offset)``, or
    None for a pair on the meta device. The C++ ops' direct eager entries draw in C++ (csrc/eager.h),
    unseen here: they are set aside (``fast.DIRECT`` emptied: their ops take the registered op, which
    draws in Python) unless ``entries``."""
    from fastformer import philox
    from fastformer.internal import fast

    drawn = []
    draw_on, direct = philox._draw_on, fast.DIRECT

    def recording(device):
        pair = draw_on(device)
        drawn.append(tuple(pair.tolist()) if pair.device.type != "meta" else None)
        return pair

    philox._draw_on = recording
    if not entries:
        fast.DIRECT = {}
    try:
        yield drawn
    finally:
        philox._draw_on, fast.DIRECT = draw_on, direct


@contextlib.contextmanager
def torch_setting(get, set_, value):
    """``set_(value)`` for the block; afterwards what ``get()`` gave before."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def num_threads(n):
    """torch's thread count set to ``n`` for the block."""
    return torch_setting(torch.get_num_threads, torch.set_num_threads, n)


# The SIMT harness's other thread schedules (FF_SIMT_SCHEDULE, tests/simt/simt.h), run from the
# default one only: a GPU runs its own schedule.
OUTSIDE_OTHER_SIMT_SCHEDULES = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("FF_SIMT_SCHEDULE", "") not in ("", "forward"),
    reason="the SIMT harness's schedules (a GPU runs its own), not from within one")


def rerun_under_simt_schedule(schedule, test_files, subset):
    """The tests of ``test_files`` (names in tests/) matching ``subset`` (pytest -k) in a fresh
    process on the already built harness, under FF_SIMT_SCHEDULE=schedule; asserts they ran and
    passed, none skipped."""
    from simt import plugin

    env = dict(os.environ, FF_SIMT_SCHEDULE=schedule, FASTFORMER_CUDA_SIMT=plugin._state["path"])
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           *(os.path.join(here, name) for name in test_files), "-k", subset]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def other_simt_schedules_test(test_files, subsets, doc):
    """A test ``test_other_thread_schedule[<backend>-<schedule>]`` that reruns, for each schedule of
    ``subsets`` ({schedule: pytest -k subset}), that subset of ``test_files`` on the cuda backend
    under that schedule of the SIMT harness (rerun_under_simt_schedule); ``doc``: what it shows."""
    @OUTSIDE_OTHER_SIMT_SCHEDULES
    @pytest.mark.parametrize("schedule", sorted(subsets))
    @pytest.mark.parametrize("backend", kernel_backends("cuda"))
    def test_other_thread_schedule(backend, schedule):
        rerun_under_simt_schedule(schedule, test_files, subsets[schedule])
    test_other_thread_schedule.__doc__ = doc
    return test_other_thread_schedule


def spy_launches(monkeypatch, module) -> list:
    """The kinds of the kernels ``module._launch`` (the Triton attention module's launcher) starts
    from now on, in order: a list the caller reads (and may clear)."""
    kinds = []
    launch = module._launch

    def spy(kind, *args, **kwargs):
        kinds.append(kind)
        return launch(kind, *args, **kwargs)

    monkeypatch.setattr(module, "_launch", spy)
    return kinds


def run_jit_script(script: str, cwd: str) -> dict:
    """Runs ``script`` in a fresh Python with Triton's real JIT functions (TRITON_INTERPRET unset:
    ahead-of-time compiles, no GPU needed) and the one-kernel attention backward on; returns the
    JSON its last line prints (a failed run fails the test with its output)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FASTFORMER_TRITON_FUSED_DQ="1", TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

