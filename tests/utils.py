"""Helpers shared by the kernel tests: which backends to run, where, and how close is close."""
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


ALL_OPS = ("attention", "add_layer_norm", "feed_forward", "cross_entropy", "linear_cross_entropy")


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
