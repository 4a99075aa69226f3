"""The tensor-core wrappers of csrc/cuda/mma.cuh on the SIMT harness, through the test kernels of
tests/simt/mma_selftest.cu, and the harness's dynamic shared-memory opt-in.

The fragment layouts are written here a second time, from the PTX ISA's own formulas (element a_i
of a lane, i = 0 .. 7, two to a register, the lower index in the low half), independently of the
emulation in mma.cuh, which is written per register:

* each instruction alone: mma.sync (bf16, f16, tf32) from registers built here, ldmatrix (.x1, .x2,
  .x4, plain and .trans) from row addresses chosen here, against these formulas and a float64
  matrix product;
* together, as the flash-attention kernel will use them: a GEMM over 16 x 16 tiles with a cp.async
  pipeline, A through ldmatrix, B through ldmatrix (B stored n-major) or ldmatrix.trans (B stored
  k-major), accumulating into a non-zero C, against torch; the same kernel with a register in the
  wrong place must be wrong;
* cp.async with src-size zero-fill and wait_group; the launch errors the wrappers report.

The emulation sums exact products in float64 and rounds once; a GPU rounds in its own way, so the
comparisons allow fp32 accumulation error (far below the O(1) error of any misplaced element).
"""
import pytest
import torch

from simt import plugin

pytestmark = pytest.mark.skipif(plugin.load_error() is not None, reason=str(plugin.load_error()))

ATOL, RTOL = 1e-4, 1e-5  # fp32 accumulation over K <= 128 of O(1) terms


def ops():
    return torch.ops.fastformer_simt_selftest


# ---------------------------------------------------------------- the PTX ISA's fragment layouts
def _lane(lane):
    return lane // 4, lane % 4  # groupID, threadID_in_group


def a_m16n8k16(lane, i):
    """(row, col) of element a_i (i < 8) of A, 16 x 16, .f16 / .bf16."""
    g, t = _lane(lane)
    row = g if i < 2 or 4 <= i < 6 else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_m16n8k16(lane, i):
    """(row, col) of element b_i (i < 4) of B, 16 x 8."""
    g, t = _lane(lane)
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def c_m16n8(lane, i):
    """(row, col) of element c_i / d_i (i < 4) of C and D, 16 x 8, fp32."""
    g, t = _lane(lane)
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def a_m16n8k8_tf32(lane, i):
    g, t = _lane(lane)
    return (g if i in (0, 2) else g + 8), (t if i < 2 else t + 4)


def b_m16n8k8_tf32(lane, i):
    g, t = _lane(lane)
    return (t if i == 0 else t + 4), g


def _index(layout, elements):
    """rows, cols (32, elements) long tensors of a layout."""
    pos = [[layout(lane, i) for i in range(elements)] for lane in range(32)]
    rows = torch.tensor([[p[0] for p in lane] for lane in pos])
    cols = torch.tensor([[p[1] for p in lane] for lane in pos])
    return rows, cols


def _as_int32(x):
    """uint32 values held in int64 -> the int32 tensor with the same bits."""
    return ((x + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack16(m, layout, regs):
    """Registers (tiles, 32, regs) of 16-bit matrices m (tiles, R, C) in a fragment layout."""
    rows, cols = _index(layout, 2 * regs)
    bits = m.view(torch.int16).long() & 0xFFFF
    e = bits[:, rows, cols].view(m.shape[0], 32, regs, 2)
    return _as_int32(e[..., 0] | (e[..., 1] << 16))


def pack32(m, layout, regs):
    rows, cols = _index(layout, regs)
    return m[:, rows, cols].contiguous().view(torch.int32)


def unpack_c(d):
    """D (tiles, 16, 8) from its registers (tiles, 32, 4)."""
    rows, cols = _index(c_m16n8, 4)
    out = torch.empty(d.shape[0], 16, 8, dtype=d.dtype)
    out[:, rows, cols] = d
    return out


def pack_c(c):
    rows, cols = _index(c_m16n8, 4)
    return c[:, rows, cols].contiguous()


# ---------------------------------------------------------------- mma.sync from registers
@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, 0), (torch.float16, 1)])
def test_mma_m16n8k16_from_registers_is_the_matrix_product(dtype, kind):
    tiles = 5  # three blocks of two warps, the last one half idle
    a = torch.randn(tiles, 16, 16).to(dtype)
    b = torch.randn(tiles, 16, 8).to(dtype)
    c = torch.randn(tiles, 16, 8)
    d = ops().mma_fragments(pack16(a, a_m16n8k16, 4), pack16(b, b_m16n8k16, 2), pack_c(c), kind)
    want = a.double() @ b.double() + c.double()
    torch.testing.assert_close(unpack_c(d).double(), want, atol=ATOL, rtol=RTOL)
    # the instruction reads both halves of every register: an exact check with small integers
    ai = torch.randint(-4, 5, (tiles, 16, 16)).to(dtype)
    bi = torch.randint(-4, 5, (tiles, 16, 8)).to(dtype)
    di = ops().mma_fragments(pack16(ai, a_m16n8k16, 4), pack16(bi, b_m16n8k16, 2), pack_c(c * 0), kind)
    assert torch.equal(unpack_c(di), (ai.float() @ bi.float()))


def test_mma_m16n8k16_fragments_in_the_wrong_places_give_wrong_products():
    """The emulation is the layout, not a shortcut: A transposed, or B's two registers swapped,
    give another product."""
    a = torch.randn(2, 16, 16).to(torch.bfloat16)
    b = torch.randn(2, 16, 8).to(torch.bfloat16)
    c = torch.zeros(2, 16, 8)
    want = a.double() @ b.double()
    good = unpack_c(ops().mma_fragments(pack16(a, a_m16n8k16, 4), pack16(b, b_m16n8k16, 2), pack_c(c), 0))
    torch.testing.assert_close(good.double(), want, atol=ATOL, rtol=RTOL)
    at = ops().mma_fragments(pack16(a.transpose(1, 2).contiguous(), a_m16n8k16, 4),
                             pack16(b, b_m16n8k16, 2), pack_c(c), 0)
    bs = ops().mma_fragments(pack16(a, a_m16n8k16, 4), pack16(b, b_m16n8k16, 2).flip(2).contiguous(),
                             pack_c(c), 0)
    for wrong in (at, bs):
        assert (unpack_c(wrong).double() - want).abs().max() > 0.5


def test_mma_m16n8k8_tf32_from_registers():
    tiles = 3
    # tf32-exact inputs (10 mantissa bits), as ff_float_to_tf32 makes them
    a = (torch.randn(tiles, 16, 8).view(torch.int32) & ~0x1FFF).view(torch.float32)
    b = (torch.randn(tiles, 8, 8).view(torch.int32) & ~0x1FFF).view(torch.float32)
    c = torch.randn(tiles, 16, 8)
    d = ops().mma_fragments(pack32(a, a_m16n8k8_tf32, 4), pack32(b, b_m16n8k8_tf32, 2), pack_c(c), 2)
    torch.testing.assert_close(unpack_c(d).double(), a.double() @ b.double() + c.double(),
                               atol=ATOL, rtol=RTOL)
    # the emulation reads only tf32's 19 bits (as tensor cores are described to): the low 13 bits
    # of an input change nothing
    noisy = (a.view(torch.int32) | 0x1FFF).view(torch.float32)
    d2 = ops().mma_fragments(pack32(noisy, a_m16n8k8_tf32, 4), pack32(b, b_m16n8k8_tf32, 2), pack_c(c), 2)
    assert torch.equal(d2, d)


def test_float_to_tf32_rounds_to_nearest_ties_away():
    """cvt.rna.tf32.f32: 10 mantissa bits, the low 13 bits zero, ties away from zero."""
    ulp = 2.0**-10
    fmax = torch.finfo(torch.float32).max  # above tf32's largest finite value's midpoint to 2^128
    x = torch.tensor([1.0, 1 + ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 - 2.0**-23, 1 + 1.5 * ulp,
                      fmax, float("inf"), -float("inf"), 0.0, -0.0])
    want = torch.tensor([1.0, 1 + ulp, -(1 + ulp), 1.0, 1 + 2 * ulp, float("inf"), float("inf"),
                         -float("inf"), 0.0, -0.0])
    got = ops().tf32(x).view(torch.float32)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert (ops().tf32(torch.randn(1000)) & 0x1FFF == 0).all()


# ---------------------------------------------------------------- ldmatrix from chosen rows
def _ldmatrix_want(tile, offsets, num, trans):
    """Registers (threads, num) as uint32 in int64, from the PTX ldmatrix layout: matrix i's rows
    start at the addresses of lanes 8i .. 8i+7; lane (g, t) gets row g, columns 2t and 2t+1, or
    with .trans column g of rows 2t and 2t+1."""
    flat = tile.reshape(-1).long() & 0xFFFF
    threads = offsets.numel()
    out = torch.empty(threads, num, dtype=torch.long)
    for thread in range(threads):
        warp, lane = divmod(thread, 32)
        g, t = _lane(lane)
        for i in range(num):
            row = [int(offsets[warp * 32 + 8 * i + r]) for r in range(8)]
            if trans:
                lo, hi = flat[row[2 * t] + g], flat[row[2 * t + 1] + g]
            else:
                lo, hi = flat[row[g] + 2 * t], flat[row[g] + 2 * t + 1]
            out[thread, i] = lo | (hi << 16)
    return out


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_reads_each_lanes_row_in_the_ptx_layout(num, trans):
    ld, rows = 24, 80  # 48-byte rows: 16-byte aligned starts at columns 0, 8, 16
    tile = torch.randint(-2**15, 2**15, (rows, ld), dtype=torch.int32).to(torch.int16)
    threads = 64  # two warps, each its own rows (per-warp scratch)
    offsets = torch.empty(threads, dtype=torch.int32)
    for warp in range(2):
        row = torch.randperm(rows)[:32]  # scattered rows in a scrambled order
        col = torch.randint(0, 3, (32,)) * 8
        offsets[warp * 32:(warp + 1) * 32] = (row * ld + col).to(torch.int32)
        # lanes past 8 num give no row: a misaligned address there must not matter
        offsets[warp * 32 + 8 * num:(warp + 1) * 32] = 3
    got = ops().ldmatrix(tile, offsets, num, trans).long() & 0xFFFFFFFF
    assert torch.equal(got, _ldmatrix_want(tile, offsets, num, trans))
    if num == 4:  # the other form differs: the test tells them apart
        assert not torch.equal(got, _ldmatrix_want(tile, offsets, num, not trans))


# ---------------------------------------------------------------- the flash kernel's pattern
# one tile; edges in M and K (a half-empty last K step); many tiles. A k-major B needs N % 8 == 0
# (16-byte rows for cp.async), an n-major one also runs an N edge.
GEMM_SHAPES = [(16, 16, 16), (37, 24, 40), (70, 48, 96)]
GEMM_CASES = ([(False, *shape) for shape in GEMM_SHAPES + [(33, 29, 24)]]
              + [(True, *shape) for shape in GEMM_SHAPES])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("b_kmajor,M,N,K", GEMM_CASES,
                         ids=[f"{'b_kn_trans' if c[0] else 'b_nk'}-{c[1]}x{c[2]}x{c[3]}" for c in GEMM_CASES])
def test_gemm_ldmatrix_mma_cp_async(dtype, b_kmajor, M, N, K):
    a = torch.randn(M, K).to(dtype)
    b = torch.randn(K, N).to(dtype)
    c = torch.randn(M, N)
    d = ops().mma_gemm(a, b.contiguous() if b_kmajor else b.t().contiguous(), c, b_kmajor, 0)
    want = a.double() @ b.double() + c.double()
    torch.testing.assert_close(d.double(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("b_kmajor", [False, True], ids=["b_nk", "b_kn"])
@pytest.mark.parametrize("mistake", [1, 2, 3], ids=["b_other_ldmatrix_form", "a_registers_swapped",
                                                    "wait_group_too_lax"])
def test_gemm_with_a_layout_or_wait_mistake_is_wrong(b_kmajor, mistake):
    """The same kernel with B loaded by the other ldmatrix form, two of A's registers swapped, or
    one cp.async group too few waited for (the harness lands a copy only at its wait) is wrong."""
    M, N, K = 32, 16, 32
    a = torch.randn(M, K).to(torch.bfloat16)
    b = torch.randn(K, N).to(torch.bfloat16)
    c = torch.zeros(M, N)
    want = a.double() @ b.double()
    bb = b.contiguous() if b_kmajor else b.t().contiguous()
    torch.testing.assert_close(ops().mma_gemm(a, bb, c, b_kmajor, 0).double(), want, atol=ATOL, rtol=RTOL)
    wrong = ops().mma_gemm(a, bb, c, b_kmajor, mistake).double()
    assert not ((wrong - want).abs() <= 0.5).all()  # NaN (0xFF bytes read) counts as wrong


# ---------------------------------------------------------------- cp.async
def test_cp_async_copies_zero_fills_and_lands_at_its_wait():
    """Thread t copies chunk 2t (group 0) and 2t + 1 (group 1). After wait_group 1 only group 0 has
    landed: the harness writes a copy's destination at the wait that completes it, so the other
    chunk still holds fresh dynamic shared memory's 0xFF (on a GPU, anything), which is how a
    missing wait shows in the tests. After wait_group 0 every chunk holds its src-size bytes of the
    source and zeros after them."""
    chunks = 64
    src = torch.randint(0, 256, (chunks * 16,), dtype=torch.int32).to(torch.uint8)
    sizes = torch.randint(0, 24, (chunks,)).clamp(max=16).to(torch.int32)  # many full chunks
    sizes[:4] = torch.tensor([0, 16, 7, 1], dtype=torch.int32)
    mid, out = ops().cp_async(src, sizes)
    keep = torch.arange(16)[None, :] < sizes[:, None].long()
    want = torch.where(keep, src.view(chunks, 16), torch.zeros((), dtype=torch.uint8))
    assert torch.equal(out.view(chunks, 16), want)
    mid = mid.view(chunks // 2, 2, 16)
    assert torch.equal(mid[:, 0], want.view(chunks // 2, 2, 16)[:, 0])
    assert (mid[:, 1] == 0xFF).all()


# ---------------------------------------------------------------- dynamic shared memory opt-in
KIB = 1024


def _reversed_indices(bytes_):
    return torch.arange(bytes_ // 4 - 1, -1, -1, dtype=torch.float32)


def test_100_kib_of_dynamic_shared_memory_after_opt_in():
    out = ops().big_smem(0, 100 * KIB, 100 * KIB)  # kernel 0 opts in to 100 KiB
    assert torch.equal(out, _reversed_indices(100 * KIB))  # every byte of it is usable
    # the opt-in is a limit: more than it fails, and it is the kernel's own (kernel 1 never opts in)
    with pytest.raises(RuntimeError, match=r"invalid argument: more dynamic shared memory than the "
                       r"kernel's limit of 102400 bytes \(set by cudaFuncSetAttribute\)"):
        ops().big_smem(0, 100 * KIB + 16, -1)
    with pytest.raises(RuntimeError, match=r"limit of 49152 bytes \(48 KiB without opt-in"):
        ops().big_smem(1, 100 * KIB, -1)


def test_more_than_48_kib_without_opt_in_fails_as_cuda_does():
    assert torch.equal(ops().big_smem(1, 48 * KIB, -1), _reversed_indices(48 * KIB))  # the default
    with pytest.raises(RuntimeError, match=r"invalid argument: more dynamic shared memory than the "
                       r"kernel's limit of 49152 bytes \(48 KiB without opt-in: raise it with "
                       r"cudaFuncSetAttribute\(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, "
                       r"bytes\), up to 232448\) \(kernel big_smem, grid \(1, 1, 1\), block \(256, 1, 1\), "
                       r"102400 bytes of dynamic shared memory\)"):
        ops().big_smem(1, 100 * KIB, -1)


def test_opt_in_up_to_227_kib_the_sm90_maximum():
    assert torch.equal(ops().big_smem(0, 232448, 232448), _reversed_indices(232448))
    with pytest.raises(RuntimeError, match=r"invalid argument: cudaFuncSetAttribute\(attribute 8, "
                       r"value 232449\): the dynamic shared memory limit must be in \[0, 232448\]"):
        ops().big_smem(0, 1024, 232449)
    assert torch.equal(ops().big_smem(0, 1024, 1024), _reversed_indices(1024))  # no error left over


# ---------------------------------------------------------------- misuse is reported
@pytest.mark.parametrize("mode,message", [
    (0, r"ldmatrix.sync.aligned.m8n8.x4.shared.b16: lane 5's row address 0x[0-9a-f]+ is not "
        r"16-byte aligned"),
    (1, r"warp 0: mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 needs all 32 lanes of the warp, "
        r"but the block has 16 threads"),
    (2, r"lane 0 is at mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 .* but lane 16 at "
        r"ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
    (3, r"thread \d+: cp.async of 16 bytes from 0x[0-9a-f]+ to 0x[0-9a-f]+: both addresses must be "
        r"16-byte aligned"),
    (4, r"thread \d+: cp.async src-size 17 is not in \[0, 16\]"),
])
def test_misuse_is_reported(mode, message):
    with pytest.raises(RuntimeError, match=message):
        ops().mma_broken(mode)
    # the harness recovers: the next launch runs and reports nothing
    assert torch.equal(ops().big_smem(1, 1024, -1), _reversed_indices(1024))
