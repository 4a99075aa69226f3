"""The instruction mix of the tensor-core attention backward (csrc/cuda/flash_bwd_mma.cu) as
nvcc compiles it for sm_90 (tests/cuda_build.py: one compile per session, shared with
tests/test_cuda_compile.py; no GPU needed), bf16 at head dims 64 and 128:

* HMMA.16816 per streamed tile (the tile loop is not unrolled, so a kernel's static count is one
  tile's): each product over a warp's 16 owned rows, one streamed tile and the head dim is
  (stream / 8) x (kD / 16) mma.sync m16n8k16; the dK dV kernel does 4 products (S^T, dP^T, dV, dK),
  the dQ kernel 3 (S, dP, dQ): 7 a (query, key) tile pair where FlashAttention-2 does 5 (the
  numbers to change when the 5-product kernel of flash_bwd_mma.md lands);
* lse and Dsum come by cp.async with the tile (4-byte LDGSTS, beside the 16-byte ones of the Q /
  dO tiles), not through a load the block waits on each tile;
* two barriers a tile (after the cp.async wait, before a stage is refilled), none elsewhere;
* no local memory (LDL / STL: spills, or a register array indexed at run time: the K / V and Q /
  dO fragments kept across tiles at kD = 64 must stay in registers).

The tile shapes below are flash_bwd_mma.cu's Cfg, restated: a change there must be a change here.
Skipped, with the reason, where nvcc or cuobjdump is missing.

Mutations tried by hand: the lse / Dsum copy back to a plain load-and-store fails
test_lse_and_dsum_come_by_cp_async; the K / V fragments indexed by a run-time tile number fails
test_no_local_memory."""
import os

import pytest

from cuda_build import CUOBJDUMP, NO_NVCC, NVCC, opcode_counts, sass

pytestmark = [pytest.mark.skipif(NVCC is None, reason=NO_NVCC),
              pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump is not installed (not on PATH, not in "
                                                           "triton's bundled CUDA tools)")]

CU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda", "flash_bwd_mma.cu")
# head dim -> rows a streamed tile (Cfg::kStream); a warp owns 16 rows at kD 64 and 128
STREAM = {64: 64, 128: 32}


def _kernel(kind, D):
    name = f"flash_bwd_{kind}_kernel<__nv_bfloat16, {D}, true>"
    code = sass(CU, "90")
    assert name in code, f"{name} not in the SASS; kernels: {sorted(code)}"
    return code[name]


def _products(code, D):
    """HMMA count in units of one product (16 rows x a streamed tile x the head dim)."""
    per_product = (STREAM[D] // 8) * (D // 16)
    hmma = opcode_counts(code)["HMMA"]
    assert hmma % per_product == 0, f"{hmma} HMMA is not a whole number of {per_product}-HMMA products"
    return hmma // per_product


@pytest.mark.parametrize("D", sorted(STREAM))
def test_products_per_tile(D):
    dkdv, dq = _products(_kernel("dkdv", D), D), _products(_kernel("dq", D), D)
    assert (dkdv, dq) == (4, 3), f"dK dV {dkdv} and dQ {dq} products a tile (7 expected)"


@pytest.mark.parametrize("D", sorted(STREAM))
def test_lse_and_dsum_come_by_cp_async(D):
    code = _kernel("dkdv", D)
    small = [i for i in code if "LDGSTS" in i and ".128" not in i]
    assert small, "no 4-byte LDGSTS: lse / Dsum are not copied by cp.async"
    wide = [i for i in code if "LDGSTS" in i and ".128" in i]
    assert wide, "no 16-byte LDGSTS: the Q / dO tiles are not copied by cp.async"


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("D", sorted(STREAM))
def test_two_barriers_a_tile(kind, D):
    counts = opcode_counts(_kernel(kind, D))
    assert counts["BAR"] == 2, f"{counts['BAR']} barriers (2 a tile expected: after the wait, before a refill)"


@pytest.mark.parametrize("kind", ["dkdv", "dq"])
@pytest.mark.parametrize("D", sorted(STREAM))
def test_no_local_memory(kind, D):
    counts = opcode_counts(_kernel(kind, D))
    assert counts["LDL"] == 0 and counts["STL"] == 0, f"local memory: {counts['LDL']} LDL, {counts['STL']} STL"
