"""attention_varlen's CPU kernel beyond the backend-generic tests (test_attention_varlen.py): the
thread schedules (one long sequence among many short ones, whole-head and split backward tasks),
sequences longer than one tile, float64 gradcheck, strided and expanded operands, the C++ checks
of the lengths' values, and that a loose max_seqlen bound costs nothing (no padded block is run)."""
import time

import pytest
import torch

import fastformer
from fastformer import backends, philox
from fastformer.ops import attention_varlen, reference
from utils import assert_close, assert_close_lowp, kernel_backends, skip_without_kernels

pytestmark = pytest.mark.parametrize("backend", kernel_backends("cpu"))


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cu_seqlens(lengths):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


def make(lq, lk, H, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    lengths = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max(lq),
                   max_seqlen_k=max(lk))
    return [t.to(dtype) for t in (q, k, v)], dout.to(dtype), lengths


def grads(backend, qkv, dout, lengths, causal, p=0.0, seed=7, rng=None):
    leaves = [t.detach().clone().requires_grad_() for t in qkv]
    torch.manual_seed(seed)
    if backend == "reference":
        rng = philox.next_seed() if p > 0 else None  # the pair the kernel's Function draws
        out = reference.attention_varlen(*leaves, **lengths, is_causal=causal, dropout_p=p, rng=rng)
    else:
        with fastformer.use_backend(backend):
            out = attention_varlen(*leaves, **lengths, is_causal=causal, dropout_p=p)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def check_against_reference(backend, qkv, dout, lengths, causal, p=0.0, atol=1e-5, rtol=1e-4):
    got = grads(backend, qkv, dout, lengths, causal, p)
    want = grads("reference", [t.double() for t in qkv], dout.double(), lengths, causal, p)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g.double(), w, atol=atol, rtol=rtol)
    return got


# one sequence of several query and key blocks (kBlockQ 64, kBlockK 128) among many short ones: its
# heads are split into key- and query-block tasks on two threads, the short ones are whole-head tasks
LONG_AMONG_SHORT = ([300] + [5, 1, 9, 0, 17] * 6, [260] + [7, 3, 9, 2, 0] * 6)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("causal,p", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_long_among_short_every_schedule(backend, threads, nthreads, causal, p):
    skip_without_kernels(backend, "attention_varlen")
    torch.set_num_threads(nthreads)
    qkv, dout, lengths = make(*LONG_AMONG_SHORT, H=2, D=48)
    check_against_reference(backend, qkv, dout, lengths, causal, p)


def test_forward_is_bitwise_the_same_on_any_thread_count(backend, threads):
    """Each forward task owns its rows and runs the same tiles whoever runs it."""
    skip_without_kernels(backend, "attention_varlen")
    qkv, _, lengths = make(*LONG_AMONG_SHORT, H=3, D=40)
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        torch.manual_seed(3)  # the same dropout draw
        with fastformer.use_backend(backend), torch.no_grad():
            outs.append(attention_varlen(*qkv, **lengths, is_causal=True, dropout_p=0.2))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.slow
def test_many_equal_heads_and_two_long_cross_sequences(backend, causal):
    """Many short heads (whole-head backward tasks only) and Lq != Lk sequences of several tiles each."""
    skip_without_kernels(backend, "attention_varlen")
    qkv, dout, lengths = make([33] * 24, [20] * 24, H=4, D=64)
    check_against_reference(backend, qkv, dout, lengths, causal)
    qkv, dout, lengths = make([200, 70], [129, 257], H=2, D=80)
    check_against_reference(backend, qkv, dout, lengths, causal, p=0.1)


# heads of one tile (Lq <= 64, Lk <= 128) run the single-tile backward (gradients written in place,
# delta computed in the task): odd and empty lengths, Lq != Lk both ways (causal: leading queries
# that see no key), a sequence with no keys, and one of several tiles (113) beside them
SINGLE_TILE = ([1, 7, 0, 64, 33, 5, 113, 40, 9], [1, 5, 3, 128, 20, 0, 113, 64, 9])


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("causal,p", [(False, 0.0), (True, 0.0), (False, 0.3), (True, 0.3)])
def test_single_tile_heads(backend, threads, nthreads, causal, p):
    skip_without_kernels(backend, "attention_varlen")
    torch.set_num_threads(nthreads)
    qkv, dout, lengths = make(*SINGLE_TILE, H=3, D=40)
    got = check_against_reference(backend, qkv, dout, lengths, causal, p)
    cq, ck = lengths["cu_seqlens_q"], lengths["cu_seqlens_k"]
    keys = slice(int(ck[2]), int(ck[3]))  # sequence 2 has keys but no queries: dk and dv are 0
    for name, g in zip(("dk", "dv"), got[2:]):
        assert torch.equal(g[keys], torch.zeros_like(g[keys])), f"{name}: keys of a sequence with Lq = 0"
    rows = slice(int(cq[5]), int(cq[6]))  # sequence 5 has queries but no keys: out and dq are 0
    assert torch.equal(got[0][rows], torch.zeros_like(got[0][rows]))
    assert torch.equal(got[1][rows], torch.zeros_like(got[1][rows]))


@pytest.mark.parametrize("causal", [False, True])
def test_single_tile_heads_non_finite(backend, causal):
    """A NaN key poisons its own sequence's gradients (as the reference's) and no other head's."""
    skip_without_kernels(backend, "attention_varlen")
    qkv, dout, lengths = make(*SINGLE_TILE, H=2, D=16)
    ck = lengths["cu_seqlens_k"]
    qkv[1][int(ck[4]) + 2, 1, 3] = float("nan")  # sequence 4, head 1, key 2
    got = grads(backend, qkv, dout, lengths, causal)
    want = grads("reference", [t.double() for t in qkv], dout.double(), lengths, causal)
    assert want[1].isnan().any(), "the probe must produce NaN"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(g.isnan(), w.isnan()), f"{name}: NaN at {g.isnan().sum()} places, want {w.isnan().sum()}"
        torch.testing.assert_close(g.double(), w, equal_nan=True, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_bf16_long_sequences(backend):
    skip_without_kernels(backend, "attention_varlen")
    qkv, dout, lengths = make(*LONG_AMONG_SHORT, H=2, D=64, dtype=torch.bfloat16)
    got = grads(backend, qkv, dout, lengths, True)
    want = grads("reference", [t.float() for t in qkv], dout.float(), lengths, True)
    lowp = grads("reference", qkv, dout, lengths, True)
    for name, g, w, lp in zip(("out", "dq", "dk", "dv"), got, want, lowp):
        assert g.dtype == torch.bfloat16, f"{name} must stay bf16, got {g.dtype}"
        assert_close_lowp(name, g.float(), w, lp.float(), factor=2.0, atol=1e-2)


@pytest.mark.parametrize("causal,p", [(False, 0.0), (True, 0.0), (True, 0.4)])
def test_float64_gradcheck(backend, causal, p):
    skip_without_kernels(backend, "attention_varlen")
    qkv, _, lengths = make([3, 0, 6, 1], [4, 2, 3, 0], H=2, D=5, dtype=torch.float64)

    def fn(q, k, v):
        torch.manual_seed(11)  # the same dropout mask on every call gradcheck makes
        with fastformer.use_backend(backend):
            return attention_varlen(q, k, v, **lengths, is_causal=causal, dropout_p=p)
    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in qkv], atol=1e-8, rtol=1e-6)


def test_strided_views_are_read_in_place(backend):
    """q, k, v as slices of one (total, 3, H, D) projection (row stride 3 H D, no copy), and k / v
    expanded along the rows (stride 0: copied for the GEMMs); gradients laid out like empty_like."""
    skip_without_kernels(backend, "attention_varlen")
    lq = [7, 70, 1]
    H, D = 2, 24
    qkv_proj = torch.randn(sum(lq), 3, H, D)
    qkv = [qkv_proj[:, i] for i in range(3)]
    dout = torch.randn(sum(lq), H, D)
    lengths = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lq), max_seqlen_q=70, max_seqlen_k=70)
    got = check_against_reference(backend, qkv, dout, lengths, True)
    contiguous = grads(backend, [t.contiguous() for t in qkv], dout, lengths, True)
    for name, g, c in zip(("out", "dq", "dk", "dv"), got, contiguous):
        assert_close(name, g, c, atol=1e-6, rtol=1e-6)

    k1 = torch.randn(1, H, D).expand(sum(lq), H, D)
    q = torch.randn(sum(lq), H, D)
    check_against_reference(backend, [q, k1, k1], dout, lengths, False)
    q_t = torch.randn(H, sum(lq), D).transpose(0, 1)  # head-major storage
    with fastformer.use_backend(backend):
        kernels = backends.select("attention_varlen", torch.device("cpu"), torch.float32)
    args = (q_t, qkv[1], qkv[2], *lengths.values(), True, 0.2, 0.0, philox.pack(0, 0))
    out, lse = kernels.attention_varlen_fwd(*args)
    dq, dk, dv, _ = kernels.attention_varlen_bwd(dout, q_t, qkv[1], qkv[2], out, lse, *args[3:])
    assert dq.stride() == torch.empty_like(q_t).stride() and dk.stride() == torch.empty_like(qkv[1]).stride()


def test_cpp_checks_read_the_lengths_before_any_row(backend):
    skip_without_kernels(backend, "attention_varlen")
    ops = torch.ops.fastformer
    q, k, v = (torch.randn(n, 2, 8) for n in (5, 7, 7))
    cq = cu_seqlens([2, 3])
    rng = philox.pack(0, 0)
    bad_k = [
        (torch.tensor([0, 8, 7], dtype=torch.int32), 8, r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 8"),
        (torch.tensor([0, 3, 9], dtype=torch.int32), 8, r"cu_seqlens_k\[-1\] must equal total_k \(7\), got 9"),
        (torch.tensor([2, 4, 7], dtype=torch.int32), 8, r"cu_seqlens_k\[0\] must be 0"),
        (cu_seqlens([4, 3]), 3, "sequence 0 has 4 rows by cu_seqlens_k but max_seqlen_k is 3"),
    ]
    for ck, max_k, message in bad_k:
        with pytest.raises(RuntimeError, match=message):
            ops.attention_varlen_fwd(q, k, v, cq, ck, 3, max_k, False, 0.3, 0.0, rng)
    ck = cu_seqlens([4, 3])
    out, lse = ops.attention_varlen_fwd(q, k, v, cq, ck, 3, 4, False, 0.3, 0.0, rng)
    with pytest.raises(RuntimeError, match=r"lse must have shape \(H, total_q\) = \(2, 5\)"):
        ops.attention_varlen_bwd(out, q, k, v, out, lse.t(), cq, ck, 3, 4, False, 0.3, 0.0, rng)
    with pytest.raises(RuntimeError, match="dout must have q's shape"):
        ops.attention_varlen_bwd(out[:4], q, k, v, out, lse, cq, ck, 3, 4, False, 0.3, 0.0, rng)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[-1\] must equal total_q"):
        ops.attention_varlen_bwd(out, q, k, v, out, lse, cu_seqlens([2, 2]), ck, 3, 4, False, 0.3, 0.0, rng)


def test_a_loose_max_seqlen_costs_nothing(backend, threads):
    """Tasks come from the sequences' own blocks, not from a (B, max_seqlen) grid: a bound 64 times
    the longest sequence leaves the time about where it was (a padded grid would be ~64x)."""
    skip_without_kernels(backend, "attention_varlen")
    torch.set_num_threads(1)
    lq = [16] * 64
    qkv, _, lengths = make(lq, lq, H=4, D=32)

    def best(max_seqlen):
        bounds = dict(lengths, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        times = []
        with fastformer.use_backend(backend), torch.no_grad():
            for _ in range(15):
                t0 = time.perf_counter()
                attention_varlen(*qkv, **bounds)
                times.append(time.perf_counter() - t0)
        return min(times)

    best(16)
    tight, loose = best(16), best(1024)
    assert loose < 4 * tight, f"max_seqlen 1024: {loose * 1e3:.2f} ms, 16: {tight * 1e3:.2f} ms"


ISA_CHILD = r"""
import json, torch
import fastformer
from fastformer import _ext, philox
from fastformer.ops import attention_varlen, reference
assert _ext.load_error() is None, _ext.load_error()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
lq, lk = [130, 3, 0, 21], [70, 9, 4, 150]
cq, ck = (torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32) for x in (lq, lk))
qkv = [torch.randn(sum(n), 2, 40, generator=g) for n in (lq, lk, lk)]
dout = torch.randn(sum(lq), 2, 40, generator=g)
res = {"level": torch.ops.fastformer.cpu_capability()}
for causal in (False, True):
    torch.manual_seed(5)
    rng = philox.next_seed()
    leaves = [t.clone().requires_grad_() for t in qkv]
    torch.manual_seed(5)
    with fastformer.use_backend("cpu"):
        out = attention_varlen(*leaves, cq, ck, 130, 150, is_causal=causal, dropout_p=0.3)
    ref_leaves = [t.double().requires_grad_() for t in qkv]
    ref = reference.attention_varlen(*ref_leaves, cq, ck, 130, 150, is_causal=causal, dropout_p=0.3, rng=rng)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    want = [ref, *torch.autograd.grad(ref, ref_leaves, dout.double())]
    res[str(causal)] = max((a.double() - b).abs().max().item() for a, b in zip(got, want))
print(json.dumps(res))
"""


@pytest.mark.slow
def test_every_isa_level_matches_the_reference(backend):
    """The varlen entry points exist at every ISA level the CPU runs (isa.h), dropout included."""
    skip_without_kernels(backend, "attention_varlen")
    from test_cpu_isa import LEVELS, _child, _supported
    levels = [lv for lv in LEVELS if _supported(lv)]
    for level in levels:
        res = _child(level, ISA_CHILD)
        assert res["level"] == level.upper()
        for causal in ("False", "True"):
            assert res[causal] < 1e-4, f"{level}, causal {causal}: max error {res[causal]:.2e} against the reference"
