"""attention_varlen's 16-bit backward on the tensor-core kernels (csrc/cuda/flash_bwd_mma.cu with
varlen rows through cu_seqlens), run by the cuda backend's glue (csrc/cuda/attention_varlen.cpp) on
the SIMT harness, against the gradients of fastformer/ops/reference.py::attention_varlen by
FlashAttention's low-precision rule (test_flash_mma.check: the error against the fp32 reference at
most twice that of the reference computed in the 16-bit dtype, plus a small floor).

bf16 and fp16; sequences of 0, 1, 7 and 113 rows with Lq != Lk per sequence (both ways, and a
sequence with queries but no keys); every head-dim bucket (40, 64, 111, 128, 256); causal
(bottom-right per sequence); dropout with the forward's bits (the padded op's counters on
max_seqlen, also with max_seqlen above the longest sequence); rows of q / k that no sequence owns
(cu_seqlens ending early, a length cut by max_seqlen) come back 0; the routing: with equal lengths
the op's gradients are bit for bit those of fastformer_simt_selftest::flash_bwd_mma on the padded
view of the same memory.

Mutations tried by hand (each fails this file): the per-sequence causal shift taken from the
maxima (p.Sk - p.Sq) in the dQ kernel fails test_lengths_and_head_dims (causal); the dK dV
kernel's K rows not offset by the sequence's start fails it in every case; fill_keep's row counter
from the sequence's length instead of p.Sq fails test_dropout_bits_are_the_forwards; leaving out
the glue's zeroing of dq / dk / dv fails test_rows_no_sequence_owns_are_zero; the glue's FMA
kernels instead of flash_bwd_mma fail test_the_op_runs_varlen_16_bit_backwards_here."""
import math
import os

import pytest
import torch

from fastformer import backends, philox
from simt import plugin
from test_attention_varlen_cuda import _inputs, _kernel, _reference, cu_seqlens
from test_flash_mma import DT_IDS, DTYPES, check
from utils import skip_without_kernels

pytestmark = pytest.mark.skipif(plugin.load_error() is not None or torch.cuda.is_available(),
                                reason=str(plugin.load_error() or "the SIMT harness's tests (a GPU is here)"))


@pytest.fixture(autouse=True)
def _needs_the_kernels():
    skip_without_kernels("cuda", "attention_varlen")


def _grads(fn, *args, **kwargs):
    return fn(*args, **kwargs)[1:]  # dq, dk, dv (the helpers also return out)


def run_case(dtype, H, D, lq, lk, causal, p=0.0, extra=0, seed=1234, atol=2e-3):
    qkv, dout, lengths = _inputs(H, D, lq, lk, "cpu", dtype, seed=D)
    lengths.update(max_seqlen_q=max(lq) + extra, max_seqlen_k=max(lk) + extra)
    got = _grads(_kernel, qkv, dout, lengths, causal, p, seed)  # the forward's dropout bits are v3's too
    want32 = _grads(_reference, qkv, dout, lengths, causal, p, seed)
    want16 = _grads(_reference, qkv, dout, lengths, causal, p, seed, dtype=dtype)
    for name, g, w32, w16 in zip(("dq", "dk", "dv"), got, want32, want16):
        assert g.dtype == dtype
        check(name, g, w32, w16, atol=atol)
    return got


# (query lengths, key lengths): 0, 1, 7 and 113 rows, Lq != Lk both ways, queries without keys
# (dq 0) and keys without queries (dk, dv 0); 113 spans two or four owned tiles and several
# streamed ones
LQ, LK = [7, 0, 113, 1, 20], [113, 9, 7, 1, 0]
HEAD_DIMS = [40, 64, 111, 128, 256]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_lengths_and_head_dims(dtype, causal, D):
    dq, dk, dv = run_case(dtype, 1 if D > 128 else 2, D, LQ, LK, causal)
    # sequence 4 has no keys: its dq is 0; sequence 1 no queries: its dk, dv 0
    assert (dq[-20:] == 0).all() and (dk[113:122] == 0).all() and (dv[113:122] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("D,causal,extra", [(64, True, 0), (111, False, 5), (256, True, 9)],
                         ids=["d64-causal", "d111-full-longer-max", "d256-causal-longer-max"])
def test_dropout_bits_are_the_forwards(dtype, D, causal, extra):
    """The padded op's counters on (B, H, max_seqlen_q, max_seqlen_k), as the varlen forward's: the
    reference given the same (seed, offset) agrees, and one with another seed is far off."""
    run_case(dtype, 2 if D <= 128 else 1, D, LQ, LK, causal, p=0.3, extra=extra, seed=77)
    qkv, dout, lengths = _inputs(2, 64, LQ, LK, "cpu", dtype, seed=1)
    got = _grads(_kernel, qkv, dout, lengths, causal, 0.3, seed=77)
    other = _grads(_reference, qkv, dout, lengths, causal, 0.3, seed=78)
    assert (got[2].float() - other[2]).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=[*DT_IDS, "fp32"])
def test_rows_no_sequence_owns_are_zero(dtype):
    """cu_seqlens ending before the tensors' rows, and a sequence cut to max_seqlen (its last rows
    then belong to none): those rows of dq, dk, dv come back 0 (the `.into` overload, into buffers
    full of NaN), the owned ones as the reference's on the owned rows alone. fp32 runs the FMA
    kernels, which write only owned rows too (they left NaN there before the glue zeroed)."""
    H, D = 2, 64
    q, k, v, dout = (torch.randn(n, H, D).to(dtype) for n in (40, 50, 50, 40))
    cu_q = torch.tensor([0, 12, 30], dtype=torch.int32)  # seq 0: rows [0, 10) (max 10), seq 1: [12, 22)
    cu_k = torch.tensor([0, 20, 33], dtype=torch.int32)  # seq 0: [0, 20), seq 1: [20, 33)
    owned_q = torch.cat([torch.arange(0, 10), torch.arange(12, 22)])
    owned_k = torch.arange(0, 33)
    kern = backends.Kernels("cuda")
    args = (cu_q, cu_k, 10, 20, True, D ** -0.5, 0.0, philox.pack(0, 0))
    out, lse = kern.attention_varlen_fwd(q, k, v, *args)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    kern.attention_varlen_bwd_into(dout, q, k, v, out, lse, *args, dq=dq, dk=dk, dv=dv)
    for name, g, owned in (("dq", dq, owned_q), ("dk", dk, owned_k), ("dv", dv, owned_k)):
        rest = torch.ones(g.shape[0], dtype=torch.bool)
        rest[owned] = False
        assert (g[rest] == 0).all(), f"{name}: rows no sequence owns are not 0"
    lengths = dict(cu_seqlens_q=cu_seqlens([10, 10]), cu_seqlens_k=cu_seqlens([20, 13]), max_seqlen_q=10,
                   max_seqlen_k=20)
    qkv, do = [q[owned_q], k[owned_k], v[owned_k]], dout[owned_q]
    want32 = _grads(_reference, qkv, do, lengths, True)
    want16 = _grads(_reference, qkv, do, lengths, True, dtype=dtype)
    for name, g, w32, w16 in zip(("dq", "dk", "dv"), (dq[owned_q], dk[owned_k], dv[owned_k]), want32, want16):
        check(name, g, w32, w16, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("p", [0.0, 0.25], ids=["p0", "dropout"])
def test_the_op_runs_varlen_16_bit_backwards_here(dtype, p):
    """B sequences of one length L = max_seqlen are the padded (B, H, L, D) problem on the same
    memory, with the same dropout counters: the op's gradients on the cuda backend are bit for bit
    fastformer_simt_selftest::flash_bwd_mma's on that view (the FMA kernels' would differ)."""
    B, H, L, D = 3, 2, 70, 40
    qkv, dout, lengths = _inputs(H, D, [L] * B, [L] * B, "cpu", dtype, seed=5)
    got = _grads(_kernel, qkv, dout, lengths, True, p, seed=11)
    torch.manual_seed(11)
    seed, offset = philox.next_seed() if p > 0 else (0, 0)

    def padded(t):  # (B L, H, D) -> (B, H, L, D), a view
        return t.view(B, L, H, D).transpose(1, 2)

    scale = 1.0 / math.sqrt(D)
    q, k, v = (padded(t) for t in qkv)
    out, lse = torch.ops.fastformer_simt_selftest.flash_fwd_mma(q, k, v, None, None, True, scale, p, seed, offset)
    want = torch.ops.fastformer_simt_selftest.flash_bwd_mma(padded(dout), q, k, v, out, lse, None, None, True,
                                                            scale, p, seed, offset)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(padded(a), b), f"{name}: the op's varlen backward is not the tensor-core kernel's"


_OTHER_SCHEDULE = os.environ.get("FF_SIMT_SCHEDULE", "") not in ("", "forward")


@pytest.mark.skipif(_OTHER_SCHEDULE, reason="another schedule already, not from within it")
@pytest.mark.parametrize("schedule", ["reverse", "warp_ahead"])
def test_other_thread_schedules(schedule):
    """The blocks past a sequence's end leave before any barrier, the others meet every one: the
    subset under the harness's threads last to first and warp by warp."""
    plugin.rerun_under(os.path.abspath(__file__), schedule,
                       "(test_lengths_and_head_dims and bf16 and causal and (d40 or d256)) or "
                       "(test_dropout and bf16 and d64) or test_rows_no_sequence_owns")
