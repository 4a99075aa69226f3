"""The Triton kernels' two forms of ``philox`` (triton_kernels/utils.py, philox_args / load_philox):
an int64 (2,) = (seed, offset) tensor on the op's device, which each program loads through its
pointer (so a captured CUDA graph replays with a fresh mask), or an int64 CPU tensor read on the
host and passed as scalars (the op on a GPU).

Under ``TRITON_INTERPRET=1`` the op's device is the CPU, so a CPU philox takes the device form;
``utils.HOST_PHILOX`` makes it take the host form. Both forms of the same (seed, offset) must give
bit-equal outputs and gradients on every kernel with dropout: attention (forward, dK/dV, dQ),
attention_varlen, add_layer_norm (the row and the chunked backward), feed_forward (the fused GEMM
epilogues and the split-K reduce) and embedding. The device form passes zeros as the scalars, so a
kernel that ignored the pointer would drop other elements. A malformed philox fails with an error
naming ``philox``; with dropout_p == 0 nothing is read."""
import math

import pytest
import torch

from fastformer import backends, philox
from utils import device_for

if not backends.availability("triton", device_for("triton")):
    pytest.skip(f"triton cannot run here: {backends.availability('triton', device_for('triton')).reason}",
                allow_module_level=True)

from fastformer.triton_kernels import add_layer_norm as aln  # noqa: E402
from fastformer.triton_kernels import attention as A  # noqa: E402
from fastformer.triton_kernels import attention_varlen as AV  # noqa: E402
from fastformer.triton_kernels import embedding as emb  # noqa: E402
from fastformer.triton_kernels import feed_forward as ff  # noqa: E402
from fastformer.triton_kernels import matmul, utils  # noqa: E402

DEVICE = device_for("triton")
SEED, OFFSET = 0x123456789AB, 977  # both nonzero: the device form's scalar zeros would give other bits
P = 0.3


def _philox():
    return philox.pack(SEED, OFFSET).to(DEVICE)


def _both_forms(monkeypatch, run):
    """run() with the philox by pointer, then read on the host: the two results, each a tuple of tensors."""
    by_pointer = run()
    monkeypatch.setattr(utils, "HOST_PHILOX", True)
    on_host = run()
    monkeypatch.setattr(utils, "HOST_PHILOX", False)
    return by_pointer, on_host


def _assert_bit_equal(by_pointer, on_host):
    assert len(by_pointer) == len(on_host)
    for i, (a, b) in enumerate(zip(by_pointer, on_host)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"output {i} differs between the philox forms"


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


# ---------------------------------------------------------------- bit-equal forms, every op with dropout


@pytest.mark.parametrize("masks", [False, True], ids=["plain", "masks"])
def test_attention(monkeypatch, masks):
    B, H, Sq, Sk, D = 2, 2, 19, 23, 16
    q, k, v, dout = _rand(B, H, Sq, D), _rand(B, H, Sk, D), _rand(B, H, Sk, D), _rand(B, H, Sq, D)
    kpm = torch.zeros(B, Sk, dtype=torch.bool, device=DEVICE)
    kpm[1, -4:] = True
    am = _rand(1, H, Sq, Sk) if masks else None
    kpm = kpm if masks else None

    def run():
        out, lse = A.attention_fwd(q, k, v, kpm, am, True, 0.25, P, _philox())
        return (out, lse) + A.attention_bwd(dout, q, k, v, out, lse, kpm, am, True, 0.25, P, _philox())

    by_pointer, on_host = _both_forms(monkeypatch, run)
    _assert_bit_equal(by_pointer, on_host)
    assert (by_pointer[0] != A.attention_fwd(q, k, v, kpm, am, True, 0.25, 0.0, _philox())[0]).any()


def test_attention_varlen(monkeypatch):
    H, D = 2, 16
    cu_q = torch.tensor([0, 5, 17, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 12, 31], dtype=torch.int32, device=DEVICE)
    q, k, v = _rand(30, H, D), _rand(31, H, D), _rand(31, H, D)
    dout = _rand(30, H, D)

    def run():
        out, lse = AV.attention_varlen_fwd(q, k, v, cu_q, cu_k, 13, 19, False, 0.25, P, _philox())
        return (out, lse) + AV.attention_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, 13, 19, False, 0.25, P,
                                                    _philox())

    _assert_bit_equal(*_both_forms(monkeypatch, run))


@pytest.mark.parametrize("chunked", [False, True], ids=["rows", "chunked"])
def test_add_layer_norm(monkeypatch, chunked):
    N, C = 7, 100
    if chunked:  # the wide-row backward on a narrow row: column chunks of 32
        monkeypatch.setattr(aln, "SPLIT_BLOCK_C", 64)
        monkeypatch.setattr(aln, "_CHUNK_C", 32)
    x, r, w, b, dy, dh = _rand(N, C), _rand(N, C), _rand(C), _rand(C), _rand(N, C), _rand(N, C)

    def run():
        y, h, mean, rstd = aln.add_layer_norm_fwd(x, r, w, b, 1e-5, P, _philox())
        return (y, h, mean, rstd) + aln.add_layer_norm_bwd(dy, dh, h, w, mean, rstd, P, _philox(), True)

    by_pointer, on_host = _both_forms(monkeypatch, run)
    _assert_bit_equal(by_pointer, on_host)
    h = by_pointer[1]
    assert torch.equal(h - r == 0, ~philox.keep_mask((N, C), P, SEED, OFFSET, device=DEVICE) | (x == 0))


@pytest.mark.parametrize("split_k", [None, 2], ids=["fused", "split_k"])
def test_feed_forward(monkeypatch, split_k):
    monkeypatch.setattr(matmul, "FORCE_SPLIT_K", split_k)
    N, E, F = 9, 40, 72
    x, w1, b1 = _rand(N, E), _rand(F, E) / math.sqrt(E), _rand(F)
    w2, b2, dout = _rand(E, F) / math.sqrt(F), _rand(E), _rand(N, E)

    def run():
        out, pre = ff.feed_forward_fwd(x, w1, b1, w2, b2, "gelu", P, _philox())
        return (out, pre) + ff.feed_forward_bwd(dout, x, w1, w2, pre, True, True, "gelu", P, _philox())

    _assert_bit_equal(*_both_forms(monkeypatch, run))


def test_embedding(monkeypatch):
    V, Pn, D, N = 11, 13, 40, 17
    ids = torch.randint(0, V, (N,), device=DEVICE)
    positions = torch.randint(0, Pn, (N,), device=DEVICE)
    w, pt, grad = _rand(V, D), _rand(Pn, D), _rand(N, D)

    def run():
        out = emb.embedding_fwd(ids, w, pt, positions, 2.0, P, _philox())
        return (out,) + emb.embedding_bwd(grad, ids, positions, V, Pn, True, True, 1, 2.0, P, _philox())

    by_pointer, on_host = _both_forms(monkeypatch, run)
    _assert_bit_equal(by_pointer, on_host)
    keep = philox.keep_mask((N, D), P, SEED, OFFSET, device=DEVICE)
    assert torch.equal(by_pointer[0] == 0, ~keep)


def test_device_form_reaches_the_kernels(monkeypatch):
    """The device form hands the kernels the philox tensor itself and zero scalars; without
    dropout nothing (None) goes to the kernels and the philox is never read."""
    t = _philox()
    assert utils.philox_args(t, t.device, "op", True)[0] is t
    assert utils.philox_args(t, t.device, "op", True)[1:] == (0, 0)
    assert utils.philox_args(t, torch.device("meta"), "op", True) == (None, SEED, OFFSET)
    assert utils.philox_args(torch.zeros(3), t.device, "op", False) == (None, 0, 0)
    monkeypatch.setattr(utils, "HOST_PHILOX", True)
    assert utils.philox_args(t, t.device, "op", True) == (None, SEED, OFFSET)


# ---------------------------------------------------------------- malformed philox


BAD = {
    "int32": (torch.zeros(2, dtype=torch.int32), TypeError, "philox must be an int64 CPU tensor"),
    "float": (torch.zeros(2), TypeError, "philox must be an int64 CPU tensor"),
    "other_device": (torch.zeros(2, dtype=torch.int64, device="meta"), TypeError,
                     r"philox must be .*on the op.s device \(cpu\), got torch.int64 on meta"),
    "not_a_tensor": ((1, 2), TypeError, "philox must be .* got tuple"),
    "shape_3": (torch.zeros(3, dtype=torch.int64), ValueError, r"philox must have shape \(2,\) = \(seed, offset\)"),
    "shape_1x2": (torch.zeros(1, 2, dtype=torch.int64), ValueError, r"philox must have shape \(2,\)"),
    "strided": (torch.zeros(4, dtype=torch.int64)[::2], ValueError, "philox must be contiguous"),
    "seed_negative": (torch.tensor([-1, 0]), ValueError, r"the philox seed philox\[0\] must be >= 0, got -1"),
    "offset_negative": (torch.tensor([0, -3]), ValueError, r"the philox offset philox\[1\] must be >= 0, got -3"),
}


def _calls(bad):
    """Each op with dropout, called with ``bad`` as its philox: (op name, thunk)."""
    x, w = _rand(4, 16), _rand(16)
    q = _rand(1, 1, 5, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    qv = _rand(5, 1, 16)
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    _, h, mean, rstd = aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 0.0, _philox())
    out, lse = A.attention_fwd(q, q, q, None, None, False, 0.25, 0.0, _philox())
    _, pre = ff.feed_forward_fwd(x, x, None, x.t().contiguous(), None, "relu", 0.0, _philox())
    return {
        "add_layer_norm_fwd": lambda: aln.add_layer_norm_fwd(x, None, w, w, 1e-5, P, bad),
        "add_layer_norm_bwd": lambda: aln.add_layer_norm_bwd(x, None, h, w, mean, rstd, P, bad, False),
        "attention_fwd": lambda: A.attention_fwd(q, q, q, None, None, False, 0.25, P, bad),
        "attention_bwd": lambda: A.attention_bwd(q, q, q, q, out, lse, None, None, False, 0.25, P, bad),
        "attention_varlen_fwd": lambda: AV.attention_varlen_fwd(qv, qv, qv, cu, cu, 5, 5, False, 0.25, P, bad),
        "feed_forward_fwd": lambda: ff.feed_forward_fwd(x, x, None, x.t().contiguous(), None, "relu", P, bad),
        "feed_forward_bwd": lambda: ff.feed_forward_bwd(x, x, x, x.t().contiguous(), pre, False, False, "relu", P,
                                                        bad),
        "embedding_fwd": lambda: emb.embedding_fwd(ids, x, None, None, 1.0, P, bad),
        "embedding_bwd": lambda: emb.embedding_bwd(x, ids, None, 4, 0, True, False, -1, 1.0, P, bad),
    }


@pytest.mark.parametrize("case", list(BAD))
def test_bad_philox_names_it(case):
    bad, error, message = BAD[case]
    for op, call in _calls(bad).items():
        with pytest.raises(error, match=f"{op}: {message}"):
            call()


def test_no_dropout_reads_nothing():
    """dropout_p == 0: the philox is neither checked nor read (not even a malformed one)."""
    x, w = _rand(4, 16), _rand(16)
    bad = torch.tensor([-1.5, 2.0, 3.0])
    y = aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 0.0, bad)[0]
    assert torch.equal(y, aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 0.0, _philox())[0])
    q = _rand(1, 1, 5, 16)
    assert torch.equal(A.attention_fwd(q, q, q, None, None, False, 0.25, 0.0, bad)[0],
                       A.attention_fwd(q, q, q, None, None, False, 0.25, 0.0, _philox())[0])
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    assert torch.equal(emb.embedding_fwd(ids, x, None, None, 1.0, 0.0, bad), x[ids])
