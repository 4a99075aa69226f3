"""attention's determinism (the harness: tests/determinism.py): forward and backward are
bit-identical from run to run on every backend, with key padding, float and bool masks, causal
and dropout, also under ``torch.use_deterministic_algorithms(True)``; the cpu kernel's result does
not depend on which thread runs a task; on a GPU, deterministic mode runs the Triton attention's
first tile config instead of autotuning."""
import contextlib

import pytest
import torch

import fastformer
from fastformer import ops
import determinism
from utils import kernel_backends, num_threads


def _attention_masks(g, dev, big):
    b, h, sq, sk = (2, 2, 70, 150) if big else (1, 1, 37, 45)
    q, k, v = (torch.randn(b, h, s, 24, generator=g).to(dev) for s in (sq, sk, sk))
    kpm = torch.rand(b, sk, generator=g) < 0.3
    kpm[:, 0] = False  # every query sees a key
    mask = torch.randn(sq, sk, generator=g).to(dev)  # additive float mask, broadcast over (B, H)
    return (q, k, v), lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm.to(dev), attn_mask=mask,
                                                    dropout_p=0.1)


def _attention_causal(g, dev, big):
    b, h, sq, sk = (2, 2, 70, 150) if big else (1, 1, 37, 45)
    q, k, v = (torch.randn(b, h, s, 24, generator=g).to(dev) for s in (sq, sk, sk))
    kpm = torch.rand(b, sk, generator=g) < 0.3
    kpm[:, 0] = False
    bool_mask = torch.rand(sq, sk, generator=g) < 0.2  # True = hidden
    bool_mask[:, 0] = False
    return (q, k, v), lambda q, k, v: ops.attention(q, k, v, key_padding_mask=kpm.to(dev),
                                                    attn_mask=bool_mask.to(dev), is_causal=True, dropout_p=0.1)


CASES = {"attention_masks": _attention_masks, "attention_causal": _attention_causal}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("attention", CASES, dropout=CASES))


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_cpu_attention_does_not_depend_on_which_thread_runs_a_task(backend):
    """The cpu attention's threads take (batch, head, block) tasks from a shared counter, so
    that rows of different lengths balance; each task writes only its rows, so 1 and 2 threads
    (which split the tasks differently, and differently from run to run) give the same bits."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(8, 2, 150, 24, generator=g) for _ in range(4))
    kpm = torch.arange(150)[None] >= torch.tensor([150, 140, 130, 120, 40, 30, 20, 10])[:, None]
    results = []
    for threads in (1, 2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(determinism.SEED)
        with num_threads(threads), fastformer.use_backend(backend):
            out = ops.attention(*leaves, key_padding_mask=kpm, dropout_p=0.1)
            results.append([out.detach()] + list(torch.autograd.grad(out, leaves, dout)))
    determinism.assert_identical(results[0], results[1], "attention on 1 and on 2 threads")


@pytest.mark.parametrize("deterministic_mode", [False, True], ids=["autotuned", "deterministic"])
def test_triton_attention_on_gpu_runs_a_fixed_config_under_deterministic_mode(monkeypatch, deterministic_mode):
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from fastformer.triton_kernels import attention as tk

    record = determinism.RecordLaunch()
    monkeypatch.setattr(tk, "INTERPRET", False)  # take the GPU branch of the launcher
    monkeypatch.setattr(torch.library, "wrap_triton", record)
    monkeypatch.setattr(tk, "_tuned", lambda kind, fn, *rest: ("autotuner", kind, fn))
    kernel = object()
    with determinism.deterministic_algorithms() if deterministic_mode else contextlib.nullcontext():
        tk._launch("fwd", kernel, lambda meta: (meta["BLOCK_M"], 1, 1), 64, 2, ("arg",),
                   {"HAS_MASK": True, "HAS_DROPOUT": True})
        first = tk._configs("fwd", 64, 2, True)[0]
    (launched, grid, kwargs), = record.calls
    if not deterministic_mode:
        assert launched == ("autotuner", "fwd", kernel)
        return
    assert launched is kernel, "deterministic mode must not autotune"
    assert grid == (first.kwargs["BLOCK_M"], 1, 1)
    assert kwargs == dict(first.kwargs, HAS_MASK=True, HAS_DROPOUT=True, num_warps=first.num_warps,
                          num_stages=first.num_stages)
