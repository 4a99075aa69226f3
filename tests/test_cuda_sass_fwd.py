"""The instruction mix of the tensor-core attention forward (csrc/cuda/flash_fwd_mma.cu) in its
SASS (sm_90, cuobjdump -sass of tests/cuda_build.py's one compile a session, shared with
tests/test_cuda_compile.py), for the bf16 cp.async kernels of the head-dim buckets 64 and 128:
what the design (FlashAttention-2's shape, csrc/cuda/flash_fwd_mma.md) promises, per key tile of
one loop body.

* 32 query rows a warp (two m16 row groups): every K or V fragment (ldmatrix .x4) feeds 4
  tensor-core products (HMMA), and the K / V / Q fragment loads are exactly the design's.
* One MUFU.EX2 per score, plus one per row for the running max's rescale: nothing else calls
  the exponential unit, and no range fix-up around it (ex2.approx.ftz, not exp2f).
* The online softmax (the straight-line code that holds the exponentials) at FlashAttention-2's
  cost: per score one FMNMX (max), one FFMA (scale and max folded in), one MUFU.EX2, one FADD
  (the row sum); per row a handful more (the quad's two shuffles and maxes, the running max, one
  -inf guard, the rescale); the O rescale (an FMUL per output accumulator) on top.
* Two barriers a key tile (its copies landed; its stage released), plus the Q tile's once where
  Q is kept in registers.

Reverting to 16 rows a warp (Cfg::kMG = 1) fails the first test (2 products a fragment); exp2f
without fast math in place of ex2.approx, or a per-element -inf test, fails the softmax bounds.
Skipped, with the reason, where nvcc or cuobjdump is missing.
"""
import os

import pytest

from cuda_build import CUOBJDUMP, NO_NVCC, NVCC, opcode, sass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU = os.path.join(ROOT, "csrc", "cuda", "flash_fwd_mma.cu")

pytestmark = [pytest.mark.skipif(NVCC is None, reason=NO_NVCC),
              pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (PATH or triton's bundled copy)")]

# The design per head-dim bucket (Cfg in flash_fwd_mma.cu): m16 row groups a warp, keys a tile,
# and whether Q's fragments stay in registers (else re-read from shared memory each k-step).
DESIGN = {64: dict(mg=2, bn=64, q_regs=True), 128: dict(mg=2, bn=32, q_regs=False)}
BUCKETS = sorted(DESIGN)
CONTROL = ("BRA", "BSYNC", "BSSY", "BAR", "EXIT", "RET", "CALL", "WARPSYNC")


def kernel(D):
    name = f"flash_fwd_mma_kernel<__nv_bfloat16, {D}, true, false>"
    kernels = sass(CU, "90")
    assert name in kernels, f"{name} not among {sorted(kernels)[:8]}"
    return kernels[name]


def full_op(instruction):
    """The opcode with its modifiers, past a predicate: 'LDSM.16.MT88.4'."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def count(code, op):
    return sum(1 for i in code if full_op(i) == op or (("." not in op) and opcode(i) == op))


def softmax_segments(code):
    """The straight-line runs (between control-flow instructions) that hold a MUFU.EX2."""
    runs, cur = [], []
    for ins in code:
        if opcode(ins) in CONTROL:
            runs.append(cur)
            cur = []
        else:
            cur.append(ins)
    runs.append(cur)
    return [i for run in runs if any(full_op(x) == "MUFU.EX2" for x in run) for i in run]


@pytest.mark.parametrize("D", BUCKETS, ids=[f"d{d}" for d in BUCKETS])
def test_each_kv_fragment_feeds_four_products(D):
    d = DESIGN[D]
    code = kernel(D)
    qk = d["mg"] * (D // 16) * (d["bn"] // 8)   # m16n8k16 products of Q K^T a tile
    pv = d["mg"] * (d["bn"] // 16) * (D // 8)   # and of P V
    k_frags = (D // 16) * (d["bn"] // 16)       # ldmatrix .x4 of K: two n8 tiles x one k16 step
    v_frags = (d["bn"] // 16) * (D // 16)       # ldmatrix .x4 .trans of V
    q_frags = d["mg"] * (D // 16)               # Q: once (registers) or every tile
    hmma, v_ld, kq_ld = count(code, "HMMA"), count(code, "LDSM.16.MT88.4"), count(code, "LDSM.16.M88.4")
    assert hmma == qk + pv, f"D {D}: {hmma} HMMA, the design has {qk} + {pv} a key tile (one loop body)"
    assert v_ld == v_frags and pv == 4 * v_ld, f"D {D}: {v_ld} V fragments for {pv} products"
    assert kq_ld == k_frags + q_frags and qk == 4 * k_frags, f"D {D}: {kq_ld} K and Q fragments"


@pytest.mark.parametrize("D", BUCKETS, ids=[f"d{d}" for d in BUCKETS])
def test_one_exponential_per_score(D):
    d = DESIGN[D]
    code = kernel(D)
    scores = d["bn"]           # a lane's scores a tile: 32 rows x bn keys over 32 lanes
    rows = 2 * d["mg"]         # a lane's rows (g, g + 8 of each group)
    ex2 = count(code, "MUFU.EX2")
    assert ex2 == scores + rows, f"D {D}: {ex2} MUFU.EX2 for {scores} scores and {rows} rescales"


@pytest.mark.parametrize("D", BUCKETS, ids=[f"d{d}" for d in BUCKETS])
def test_softmax_instructions_per_score(D):
    d = DESIGN[D]
    seg = softmax_segments(kernel(D))
    scores, rows = d["bn"], 2 * d["mg"]
    o_rescale = d["mg"] * (D // 8) * 4          # an FMUL per output accumulator a tile
    n = {op: count(seg, op) for op in ("FMNMX", "FFMA", "FADD", "FMUL", "FSEL", "FSETP", "SHFL", "MUFU.EX2")}
    detail = f"D {D}, {scores} scores a lane: {n}"
    assert n["MUFU.EX2"] == scores + rows, detail
    assert n["FMNMX"] <= scores + 3 * rows, detail      # one a score; the quad's two and m per row
    assert n["FFMA"] <= scores + rows, detail           # exp2(s * scale log2 e - m): one FFMA
    assert n["FADD"] <= scores + 2 * rows, detail       # the row sum
    assert n["FSETP"] <= rows and n["FSEL"] <= 2 * rows, detail  # one -inf guard a row, no per-score test
    assert n["FMUL"] <= o_rescale + 2 * rows, detail    # O and l rescaled, the tile max scaled
    per_score = (sum(n.values()) - n["FMUL"] + max(0, n["FMUL"] - o_rescale)) / scores
    bound = 4 + 10 * rows / scores  # 4 a score (max, FFMA, ex2, sum) + ~10 a row
    assert per_score <= bound, f"{per_score:.2f} non-MMA instructions a score > {bound:.2f}; {detail}"


@pytest.mark.parametrize("D", BUCKETS, ids=[f"d{d}" for d in BUCKETS])
def test_two_barriers_per_key_tile(D):
    bars = count(kernel(D), "BAR")
    want = 2 + (1 if DESIGN[D]["q_regs"] else 0)
    assert bars == want, f"D {D}: {bars} barriers, the design has 2 a key tile + {want - 2} for Q"
