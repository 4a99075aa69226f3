"""The instruction mix of the tensor-core attention backward (csrc/cuda/flash_bwd_mma.cu) as
nvcc compiles it for sm_90 (tests/cuda_build.py: one compile per session, shared with
tests/test_cuda_compile.py; no GPU needed), bf16 at head dims 64, 128 and 256:

* HMMA.16816 per streamed tile (the tile loop is not unrolled, so a kernel's static count is one
  tile's), in units of one product (owned rows x one streamed tile x the head dim) shared by the
  block's 4 warps: (own x stream x kD) / (16 x 8 x 16) / 4 mma.sync m16n8k16 a warp (32 at every
  bucket). The one-kernel backward (the dK dV kernel with kFused, what aligned 16-bit backwards
  run) does 5 products a tile at every head dim, as FlashAttention-2: S^T, dP^T, dV, dK and dQ
  (dS K over the block's keys, 16 queries x half the head dim a warp at D 128 and 256); at D 256
  the two warps of a key group each do S^T and dP^T over their half of the head dim (split-K,
  the partial sums exchanged through shared memory), so still 1 + 1 + 1 + 1 + 1; the two-kernel
  backward (the plain-load variant at D 64, and where the glue gives no workspace) 4 + 3 = 7, at
  D 256 4 + 5 = 9 (its dK dV kernel splits S^T and dP^T as the one kernel; its dQ kernel's two
  warps of a 16-query group each do S and dP over the full head dim: 2 + 2 + 1);
* lse and Dsum come by cp.async with the tile (4-byte LDGSTS, beside the 16-byte ones of the Q /
  dO tiles), not through a load the block waits on each tile;
* barriers a tile: two in the two kernels (after the cp.async wait, before a stage is refilled),
  four in the one kernel (also after dS^T is in shared memory, and after the wait for the
  previous key block's dQ adds), none elsewhere; plus one at D 256 in the dK dV kernel and the
  one kernel (the key group's partial S^T and dP^T exchanged);
* the ordered dQ adds: an acquire load of the counter (LDG.STRONG.GPU, then CCTL.IVALL), a
  fence after the adds (MEMBAR.SC.GPU), a release store of the counter (MEMBAR.ALL.GPU +
  STG.STRONG.GPU), the accumulator read and written past L1 (LDG / STG .64.STRONG.GPU: .cg);
* no local memory (LDL / STL: spills, or a register array indexed at run time: the K / V and Q /
  dO fragments kept across tiles at kD = 64 must stay in registers).

The tile shapes below are flash_bwd_mma.cu's Cfg, restated: a change there must be a change here.
Skipped, with the reason, where nvcc or cuobjdump is missing.

Mutations tried by hand: the lse / Dsum copy back to a plain load-and-store fails
test_lse_and_dsum_come_by_cp_async; the K / V fragments indexed by a run-time tile number fails
test_no_local_memory; the one kernel's dQ product left out (dS^T still stored) fails
test_products_per_tile; its __threadfence left out fails test_ordered_dq_adds. The D 256 code
from before the key group's split of S^T / dP^T (one kernel 224 HMMA = 7 products, 4 barriers;
dK dV 192 HMMA = 6, 2 barriers: flash_bwd_mma.md) fails test_products_per_tile[256] and
test_barriers_a_tile at 256 (fused, dkdv)."""
import os

import pytest

from cuda_build import CUOBJDUMP, NO_NVCC, NVCC, opcode_counts, sass

pytestmark = [pytest.mark.skipif(NVCC is None, reason=NO_NVCC),
              pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump is not installed (not on PATH, not in "
                                                           "triton's bundled CUDA tools)")]

CU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda", "flash_bwd_mma.cu")
# head dim -> rows a streamed tile (Cfg::kStream) and rows a block owns (Cfg::kOwn: 16 a warp at
# kD 64 and 128, 16 a pair of warps at 256)
STREAM = {64: 64, 128: 32, 256: 32}
OWN = {64: 64, 128: 64, 256: 32}
# head dim -> products a tile: the one kernel, the two kernels' dK dV and dQ
PRODUCTS = {64: (5, 4, 3), 128: (5, 4, 3), 256: (5, 4, 5)}
# head dim -> warps sharing a block's 16 owned rows (Cfg::kSplit): 2 exchange partial S^T, dP^T
SPLIT = {64: 1, 128: 1, 256: 2}


def _kernel(kind, D):
    """kind: "fused" (the one-kernel backward), "dkdv" or "dq" (the two kernels)."""
    args = {"fused": ", true", "dkdv": ", false", "dq": ""}[kind]
    name = f"flash_bwd_{'dq' if kind == 'dq' else 'dkdv'}_kernel<__nv_bfloat16, {D}, true{args}>"
    code = sass(CU, "90")
    assert name in code, f"{name} not in the SASS; kernels: {sorted(code)}"
    return code[name]


def _products(code, D):
    """HMMA count a warp in units of one product (a block's owned rows x a streamed tile x the
    head dim, over 4 warps)."""
    per_product = OWN[D] * STREAM[D] * D // (16 * 8 * 16) // 4
    hmma = opcode_counts(code)["HMMA"]
    assert hmma % per_product == 0, f"{hmma} HMMA is not a whole number of {per_product}-HMMA products"
    return hmma // per_product


@pytest.mark.parametrize("D", sorted(STREAM))
def test_products_per_tile(D):
    want_fused, want_dkdv, want_dq = PRODUCTS[D]
    fused = _products(_kernel("fused", D), D)
    assert fused == want_fused, f"the one-kernel backward: {fused} products a tile ({want_fused} expected)"
    dkdv, dq = _products(_kernel("dkdv", D), D), _products(_kernel("dq", D), D)
    assert (dkdv, dq) == (want_dkdv, want_dq), f"dK dV {dkdv} and dQ {dq} products a tile"


@pytest.mark.parametrize("kind", ["fused", "dkdv"])
@pytest.mark.parametrize("D", sorted(STREAM))
def test_lse_and_dsum_come_by_cp_async(kind, D):
    code = _kernel(kind, D)
    small = [i for i in code if "LDGSTS" in i and ".128" not in i]
    assert small, "no 4-byte LDGSTS: lse / Dsum are not copied by cp.async"
    wide = [i for i in code if "LDGSTS" in i and ".128" in i]
    assert wide, "no 16-byte LDGSTS: the Q / dO tiles are not copied by cp.async"


@pytest.mark.parametrize("kind", ["fused", "dkdv", "dq"])
@pytest.mark.parametrize("D", sorted(STREAM))
def test_barriers_a_tile(kind, D):
    exchange = kind != "dq" and SPLIT[D] == 2
    want = (4 if kind == "fused" else 2) + exchange
    counts = opcode_counts(_kernel(kind, D))
    assert counts["BAR"] == want, (f"{counts['BAR']} barriers ({want} a tile expected: after the wait, "
                                   + ("the partial S^T / dP^T exchanged, " if exchange else "")
                                   + ("dS^T in, the previous key block's dQ adds seen, " if kind == "fused" else "")
                                   + "before a refill)")


@pytest.mark.parametrize("D", sorted(STREAM))
def test_ordered_dq_adds(D):
    """The one kernel's dQ: the counter read with acquire, the adds fenced, the counter released;
    the two kernels have none of it."""
    code = _kernel("fused", D)

    def has(*words):
        return any(all(w in i for w in words) for i in code)

    assert has("LDG", "STRONG.GPU") and has("CCTL.IVALL"), "no acquire load of the counter"
    assert has("MEMBAR.SC.GPU"), "no __threadfence after the dQ adds"
    assert has("MEMBAR.ALL.GPU") and has("STG", "STRONG.GPU"), "no release store of the counter"
    assert has("LDG", ".64.STRONG.GPU") and has("STG", ".64.STRONG.GPU"), "the accumulator not read / written .cg"
    assert not any("MEMBAR" in i for i in _kernel("dkdv", D)), "the two-kernel dK dV kernel has a fence"


@pytest.mark.parametrize("kind", ["fused", "dkdv", "dq"])
@pytest.mark.parametrize("D", sorted(STREAM))
def test_no_local_memory(kind, D):
    counts = opcode_counts(_kernel(kind, D))
    assert counts["LDL"] == 0 and counts["STL"] == 0, f"local memory: {counts['LDL']} LDL, {counts['STL']} STL"
