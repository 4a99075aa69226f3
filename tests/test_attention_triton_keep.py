"""The Triton attention kernels drop exactly ``philox.attention_keep_mask`` (attention dropout v3,
fastformer/philox.py): the keep tile itself (attention_tiles.keep_tile) for every tile shape the
configs use, both orientations, and the elements the forward, dK/dV and dQ kernels keep, read off
their outputs, at odd shapes and with packed sequences.

Reading the pattern off a kernel: with q = 0 every visible key of a row gets P = 1 / Sk whatever
k is, so with v's rows one-hot over a chunk of keys (v[j, d] = [j == c + d]) the forward's
out[i, d] = keep[i, c + d] * s / Sk (s = attention_keep_scale(p)); with dO[i, d] = [i == d],
dV[j, i] = keep[i, j] * s / Sk; with v's and dO's rows all e_0 (dP = 1) and k one-hot over a
chunk, dQ[i, d] = scale * P * (keep[i, c + d] * s - delta_i).

Without a GPU everything runs in Triton's interpreter on CPU tensors (tests/conftest.py)."""
import os

import pytest
import torch

from fastformer import philox
from utils import device_for, kernel_backends, run_jit_script

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")
T = pytest.importorskip("fastformer.triton_kernels.attention_tiles", reason="triton is not installed")
AV = pytest.importorskip("fastformer.triton_kernels.attention_varlen", reason="triton is not installed")
triton = pytest.importorskip("triton", reason="triton is not installed")
tl = triton.language
DEVICE = device_for("triton")

P, SEED, OFFSET = 0.3, 2**40 + 7, 2**32 - 100  # the counters cross 2**32 inside the tensors


@triton.jit
def _keep_kernel(Out, seed, offset, H, Sq, Sk, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KEYS_FIRST: tl.constexpr, LATE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    bh = tl.program_id(2)
    rng_base = T.dropout_rng_base(offset, (bh // H).to(tl.int64), H, bh % H, Sq, Sk)
    keep = T.keep_tile(seed, rng_base, start_m, start_n, Sk, threshold, BLOCK_M, BLOCK_N, KEYS_FIRST, LATE)
    i = start_m + tl.arange(0, BLOCK_M)
    j = start_n + tl.arange(0, BLOCK_N)
    if KEYS_FIRST:  # (BLOCK_N, BLOCK_M)
        tl.store(Out + bh * Sq * Sk + i[None, :] * Sk + j[:, None], keep.to(tl.int8),
                 mask=(i[None, :] < Sq) & (j[:, None] < Sk))
    else:
        tl.store(Out + bh * Sq * Sk + i[:, None] * Sk + j[None, :], keep.to(tl.int8),
                 mask=(i[:, None] < Sq) & (j[None, :] < Sk))


def _keep_tile(shape, p, block_m, block_n, keys_first, late=True):
    B, H, Sq, Sk = shape
    out = torch.full((B * H, Sq, Sk), -1, dtype=torch.int8, device=DEVICE)
    _keep_kernel[(triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), B * H)](
        out, SEED, OFFSET, H, Sq, Sk, philox.attention_threshold(p), BLOCK_M=block_m, BLOCK_N=block_n,
        KEYS_FIRST=keys_first, LATE=late)
    assert (out >= 0).all(), "some element was not written"
    return out.bool().reshape(shape)


# every (BLOCK_M, BLOCK_N) kind the configs use: BLOCK_N 16 (half a 32-key tile), 32, 64 and 128,
# BLOCK_M 16 .. 128; lengths not multiples of 16 / 32, a single query of a long row, two batch entries
_TILES = [(16, 16), (64, 16), (16, 32), (32, 64), (128, 32), (16, 128)]
_CASES = ([((2, 3, 37, 50), bm, bn) for bm, bn in _TILES]
          + [((1, 1, 1, 1023), 16, 16), ((1, 1, 1, 1023), 32, 128), ((1, 2, 16, 32), 64, 16)])


@pytest.mark.parametrize("late", [True, False], ids=["late", "early"])  # tensor-core / fp32 FMA launches
@pytest.mark.parametrize("keys_first", [False, True], ids=["queries_first", "keys_first"])
@pytest.mark.parametrize("shape, block_m, block_n", _CASES, ids=str)
def test_keep_tile_is_attention_keep_mask(shape, block_m, block_n, keys_first, late):
    got = _keep_tile(shape, P, block_m, block_n, keys_first, late)
    want = philox.attention_keep_mask(shape, P, SEED, OFFSET, device=DEVICE)
    assert torch.equal(got, want)


@pytest.mark.parametrize("p, kept", [(0.001, "all"), (0.999, "none"), (0.5, "some")])
def test_keep_tile_threshold_edges(p, kept):
    """round(256 p): 0 keeps every element (p < 1/512), 256 none; 128 keeps the bytes >= 128."""
    shape = (1, 1, 20, 70)
    got = _keep_tile(shape, p, 16, 32, False)
    assert torch.equal(got, philox.attention_keep_mask(shape, p, SEED, OFFSET, device=DEVICE))
    assert {"all": got.all(), "none": not got.any(), "some": 0.4 < got.float().mean() < 0.6}[kept]


def _one_hot_rows(n, D, first):
    """(n, D) with row j = e_{j - first} (zero outside [first, first + D))."""
    j = torch.arange(n)[:, None] - first
    return (j == torch.arange(D)[None, :]).to(DEVICE, torch.float32)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 32), (16, 64)])
@pytest.mark.parametrize("B, H, Sq, Sk", [(1, 1, 1, 301), (2, 1, 19, 45)], ids=str)
def test_kernels_drop_the_attention_keep_mask(B, H, Sq, Sk, block_m, block_n, monkeypatch):
    """The forward, dK/dV and dQ kernels keep exactly attention_keep_mask's elements."""
    if not A.INTERPRET:
        pytest.skip("the tile size is only fixed in the interpreter")
    if Sk > 256 and (block_m, block_n) != (16, 64):
        pytest.skip("one tiling for the long row: the interpreter is slow (the others run the short rows)")
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", block_m)
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_N", block_n)
    D = 256 if Sk > 64 else 64
    s = philox.attention_keep_scale(P)
    want = philox.attention_keep_mask((B, H, Sq, Sk), P, SEED, OFFSET, device=DEVICE)
    rng = philox.pack(SEED, OFFSET)
    q = torch.zeros(B, H, Sq, D, device=DEVICE)
    k = torch.randn(B, H, Sk, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kept = torch.empty(B, H, Sq, Sk, dtype=torch.bool, device=DEVICE)
    for c in range(0, Sk, D):
        v = _one_hot_rows(Sk, D, c).expand(B, H, Sk, D).contiguous()
        out, _ = A.attention_fwd(q, k, v, None, None, False, 1.0, P, rng)
        n = min(D, Sk - c)
        torch.testing.assert_close(out[..., :n], want[..., c:c + n] * (s / Sk), rtol=1e-5, atol=0)
        kept[..., c:c + n] = out[..., :n] != 0
    assert torch.equal(kept, want)

    # dK/dV: the keep tile transposed (keys first); dO one-hot over the queries
    v = _one_hot_rows(Sk, D, 0).expand(B, H, Sk, D).contiguous()
    out, lse = A.attention_fwd(q, k, v, None, None, False, 1.0, P, rng)
    dout = _one_hot_rows(Sq, D, 0).expand(B, H, Sq, D).contiguous()
    _, _, dv, _ = A.attention_bwd(dout, q, k, v, out, lse, None, None, False, 1.0, P, rng)
    torch.testing.assert_close(dv[..., :Sq], want.transpose(-2, -1) * (s / Sk), rtol=1e-5, atol=0)

    # dQ: dP = 1 (v's and dO's rows e_0), k one-hot over a chunk of keys
    e0 = _one_hot_rows(1, D, 0)
    v0, do0 = e0.expand(B, H, Sk, D).contiguous(), e0.expand(B, H, Sq, D).contiguous()
    for c in range(0, Sk, D):
        kc = _one_hot_rows(Sk, D, c).expand(B, H, Sk, D).contiguous()
        out, lse = A.attention_fwd(q, kc, v0, None, None, False, 1.0, P, rng)
        dq, _, _, _ = A.attention_bwd(do0, q, kc, v0, out, lse, None, None, False, 1.0, P, rng)
        n = min(D, Sk - c)
        delta = out[..., :1]  # rowsum(dO * out)
        expect = (want[..., c:c + n] * s - delta) / Sk
        torch.testing.assert_close(dq[..., :n], expect, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (32, 32), (16, 64)])
def test_varlen_kernels_drop_the_padded_ops_keep_mask(block_m, block_n, monkeypatch):
    """Packed sequences take the padded op's (B, H, max_seqlen_q, max_seqlen_k) mask: sequence b's
    query i and key j keep mask[b, h, i, j] (max_seqlen above the longest lengths)."""
    if not A.INTERPRET:
        pytest.skip("the tile size is only fixed in the interpreter")
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_M", block_m)
    monkeypatch.setitem(A.INTERPRET_BLOCKS, "BLOCK_N", block_n)
    lq, lk, H, D = [5, 17, 1], [33, 7, 20], 2, 64
    max_q, max_k = 19, 40
    cu_q = torch.tensor([0, 5, 22, 23], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 33, 40, 60], dtype=torch.int32, device=DEVICE)
    want = philox.attention_keep_mask((len(lq), H, max_q, max_k), P, SEED, OFFSET, device=DEVICE)
    s = philox.attention_keep_scale(P)
    q = torch.zeros(sum(lq), H, D, device=DEVICE)
    k = torch.randn(sum(lk), H, D, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    # each sequence's keys one-hot from its first row
    v = torch.cat([_one_hot_rows(n, D, 0) for n in lk])[:, None, :].expand(sum(lk), H, D).contiguous()
    out, _ = AV.attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, False, 1.0, P, philox.pack(SEED, OFFSET))
    for b in range(len(lq)):
        got = out[cu_q[b]:cu_q[b + 1], :, :lk[b]].transpose(0, 1)  # (H, Lq, Lk)
        torch.testing.assert_close(got, want[b, :, :lq[b], :lk[b]] * (s / lk[b]), rtol=1e-5, atol=0)
        assert (out[cu_q[b]:cu_q[b + 1], :, lk[b]:] == 0).all()


# The first-choice fused dK/dV + dQ kernel of the heavy class (dropout, masks) at d64, compiled
# ahead of time for sm_80 as test_attention_triton_fused_dq.py's PTX test compiles it (Triton's
# cache serves both); its TTGIR read back.
_TTGIR_SCRIPT = r"""
import json, re
from fastformer.triton_kernels import aot, attention as A
specs = A.aot_specs()
[spec] = [specs[i] for i in aot.first_choice_indices(specs)
          if re.fullmatch(r"attention_dkdvdq_fp16_d64_heavy_m\d+_n\d+_w\d+_s\d+", specs[i]["name"])]
kernel, _ = aot._compile(spec, 80)
ttgir = kernel.asm["ttgir"]
print(json.dumps({"name": spec["name"], "convert_layout": ttgir.count("ttg.convert_layout"),
                  "keep": len(re.findall(r"%(?:keep|words|shifts)\w* = ttg\.convert_layout", ttgir))}))
"""
_DKDV_CONVERSIONS = 27  # DROPOUT.md, "dK/dV: the transposed scores": 19 of them the keep tile's


def test_dkdv_keep_conversions_do_not_grow():
    """The dK/dV kernel's layout conversions (its keep tile, made in S's layout for S^T, moves
    through shared memory: DROPOUT.md) stay at most today's count: a change to keep_tile or to the
    kernel that adds conversions fails here; one that removes some should lower the count."""
    got = run_jit_script(_TTGIR_SCRIPT, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert got["keep"] > 0, f"{got}: no keep-tile conversion found (did the names change?)"
    assert got["convert_layout"] <= _DKDV_CONVERSIONS, f"{got}: more layout conversions than {_DKDV_CONVERSIONS}"
