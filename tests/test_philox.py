"""The shared dropout RNG: the Python Philox 4x32-10 against the published known-answer vectors,
the C++ op and Triton's tl.randint against the Python definition, keep rates, seeding."""
import math

import pytest
import torch

from fastformer import _ext, philox
import hostile
from utils import kernel_backends

try:  # conftest sets TRITON_INTERPRET=1 before this import when there is no GPU
    import triton
    import triton.language as tl

    from fastformer.triton_kernels.utils import dropout_keep_tile
except ImportError:  # the triton tests are skipped (kernel_backends says why)
    triton = None

CPU = kernel_backends("cpu")
TRITON = kernel_backends("triton")
M32 = 0xFFFFFFFF

# Random123's known-answer tests for philox4x32 with 10 rounds (kat_vectors):
# (counter c0..c3, key k0 k1) -> output words 0..3.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox4x32_10(counter, key):
    """All four output words of Philox 4x32-10, built on fastformer.philox's round pieces
    (the same multiply-hi/lo and constants philox.philox_bits uses)."""
    c0, c1, c2, c3 = (torch.tensor([w], dtype=torch.int64) for w in counter)
    k0, k1 = key
    for _ in range(10):
        hi_b, lo_b = philox._mulhilo(philox._ROUND_B, c2)
        hi_a, lo_a = philox._mulhilo(philox._ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + philox._KEY_A) & M32, (k1 + philox._KEY_B) & M32
    return tuple(int(w) for w in (c0, c1, c2, c3))


# ---------------------------------------------------------------- the Python definition


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_round_function_matches_random123_known_answers(counter, key, expected):
    assert _philox4x32_10(counter, key) == expected


def test_philox4x32_gives_all_four_known_answer_words():
    # counter (0, 0, 0, 0), key (0, 0): Random123's first vector, all four words
    assert philox.philox4x32(1, 0, 0)[0].tolist() == list(KAT[0][2])
    # counter (n, 0, 0) for n = offset .. offset + 2 (the low word wraps), other keys
    gen = torch.Generator().manual_seed(6)
    for seed, offset in ((2**40 + 7, 2**32 - 2), (int(torch.randint(0, 2**62, (), generator=gen)), 2**62 + 5)):
        words = philox.philox4x32(3, seed, offset)
        assert words.dtype == torch.int64 and words.shape == (3, 4)
        for i in range(3):
            n = offset + i
            want = _philox4x32_10((n & M32, n >> 32, 0, 0), (seed & M32, seed >> 32))
            assert tuple(words[i].tolist()) == want


def test_philox_bits_is_the_first_word_with_counter_and_key_from_offset_and_seed():
    # counter (0, 0, 0, 0), key (0, 0): the first published word
    assert int(philox.philox_bits(1, 0, 0)[0]) == KAT[0][2][0]
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        seed = int(torch.randint(0, 2**62, (), generator=gen))
        counter = int(torch.randint(0, 2**62, (), generator=gen))
        want = _philox4x32_10((counter & M32, counter >> 32, 0, 0), (seed & M32, seed >> 32))[0]
        assert int(philox.philox_bits(1, seed, counter)[0]) == want
    bits = philox.philox_bits(1000, 123, 2**32 - 500)
    assert bits.dtype == torch.int64 and bits.shape == (1000,)
    assert int(bits.min()) >= 0 and int(bits.max()) <= M32


def test_philox_bits_of_a_range_is_the_bits_of_each_counter():
    bits = philox.philox_bits(64, 77, 2**32 - 30)  # crosses the low word's wrap
    singles = torch.cat([philox.philox_bits(1, 77, 2**32 - 30 + i) for i in range(64)])
    assert torch.equal(bits, singles)
    assert len(set(bits.tolist())) == 64


def _random16_by_hand(shape, seed, offset):
    """Every element's 16 bits computed on its own from the KAT-checked round function: row r,
    column c -> group n = offset + r * ceil(C / 8) + c // 8 -> word c % 8 // 2, half c % 2."""
    C = shape[-1]
    G = (C + 7) // 8
    rows = math.prod(shape[:-1])
    words = {}
    out = []
    for r in range(rows):
        for c in range(C):
            n = offset + r * G + c // 8
            if n not in words:
                words[n] = _philox4x32_10((n & M32, (n >> 32) & M32, 0, 0), (seed & M32, seed >> 32))
            j = c % 8
            out.append((words[n][j // 2] >> (16 * (j % 2))) & 0xFFFF)
    return torch.tensor(out, dtype=torch.int64).reshape(shape)


@pytest.mark.parametrize("shape,seed,offset", [
    ((3, 5), 7, 0), ((2, 8), 2**33 + 1, 3), ((4, 9), 11, 2**32 - 3),  # the low word wraps in row 1
    ((2, 3, 17), 2**62 - 1, 2**40), ((1, 1), 0, 0), ((2, 2, 1), 5, 2**32 - 1), ((65,), 9, 12)])
def test_random16_layout_matches_a_per_element_computation(shape, seed, offset):
    got = philox.random16(shape, seed, offset)
    assert got.shape == shape and got.dtype == torch.int64
    assert torch.equal(got, _random16_by_hand(shape, seed, offset))


def test_random16_rows_are_independent_of_the_other_dimensions():
    """Only the flattened row index and the column matter: (2, 3, C) is (6, C); the group counter
    restarts at a multiple of G = ceil(C / 8) each row, so rows never share a Philox call."""
    a = philox.random16((2, 3, 13), 4, 100)
    assert torch.equal(a.reshape(6, 13), philox.random16((6, 13), 4, 100))
    # row r of (6, 13) is row 0 of a one-row tensor at offset + r * 2
    for r in range(6):
        assert torch.equal(a.reshape(6, 13)[r], philox.random16((13,), 4, 100 + 2 * r))


def test_random16_is_the_four_words_little_endian():
    words = philox.philox4x32(3, 8, 2**32 - 1)  # (3, 4): a row of 24 columns = 3 groups
    u = philox.random16((24,), 8, 2**32 - 1)
    for g in range(3):
        for j in range(8):
            assert int(u[8 * g + j]) == (int(words[g, j // 2]) >> (16 * (j % 2))) & 0xFFFF


@pytest.mark.parametrize("shape,want", [((10, 16), 20), ((10, 17), 30), ((5, 1), 5), ((2, 3, 8), 6),
                                        ((1023,), 128), ((0, 9), 0), ((), 1)])
def test_counters_used(shape, want):
    assert philox.counters_used(shape) == want


def test_drop_threshold_is_p_times_65536_rounded_half_up():
    assert [philox.drop_threshold(p) for p in (0.0, 0.5, 0.1, 0.9, 2**-17, 3 * 2**-17)] == [
        0, 32768, 6554, 58982, 1, 2]  # 6553.6 -> 6554, 58982.4 -> 58982, halves go up
    gen = torch.Generator().manual_seed(8)
    for p in torch.rand(1000, generator=gen, dtype=torch.float64).tolist() + [1 - 2**-20, 0.99999]:
        t = philox.drop_threshold(p)
        assert isinstance(t, int) and 0 <= t <= 65536
        assert abs(t / 65536 - p) <= 2**-17 < 2**-16, f"threshold {t} for p={p}"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(p):
    shape = (500, 400)  # 200k elements, rows not a multiple of 64 columns
    keep = philox.keep_mask(shape, p, 2024, 3)
    want = 1.0 - philox.drop_threshold(p) / 2**16  # the exact keep probability of the 16-bit test
    assert abs(want - (1.0 - p)) < 2**-16
    n = keep.numel()
    rate = keep.double().mean().item()
    assert abs(rate - want) < 5 * math.sqrt(want * (1 - want) / n), f"keep rate {rate} for p={p}"
    # every column position of a group keeps at that rate too (the 16-bit halves are all used)
    per_j = keep.reshape(500, 50, 8).double().mean(dim=(0, 1))
    bound = 5 * math.sqrt(want * (1 - want) / (n / 8))
    assert ((per_j - want).abs() < bound).all(), f"per-column keep rates {per_j.tolist()} for p={p}"


def test_random16_looks_uniform():
    top = (philox.random16((512, 1024), 9, 0) >> 8).flatten().bincount(minlength=256).double()  # top byte
    expected = 512 * 1024 / 256
    chi2 = ((top - expected) ** 2 / expected).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255), f"chi-square {chi2} over 255 degrees of freedom"


def test_bits_look_uniform():
    top = (philox.philox_bits(65536, 9, 0) >> 24).bincount(minlength=256).double()  # top byte
    chi2 = ((top - 256.0) ** 2 / 256.0).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255), f"chi-square {chi2} over 255 degrees of freedom"


def test_dropout_scales_kept_values():
    x = torch.randn(8, 300)
    y = philox.dropout(x, 0.25, 3, 0)
    keep = philox.keep_mask(x.shape, 0.25, 3, 0)
    assert torch.equal(keep, philox.random16(x.shape, 3, 0) >= 16384)
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))
    assert torch.allclose(y[keep], x[keep] / 0.75)
    assert philox.dropout(x, 0.0, 3, 0) is x


def test_next_seed_repeatable_under_manual_seed():
    torch.manual_seed(11)
    a = [philox.next_seed() for _ in range(3)]
    torch.manual_seed(11)
    b = [philox.next_seed() for _ in range(3)]
    assert a == b
    assert len({s for s, _ in a}) == 3
    assert all(0 <= s < 2**62 and off == 0 for s, off in a)
    torch.manual_seed(12)
    assert philox.next_seed() != a[0]


# ---------------------------------------------------------------- C++ against Python


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("n,seed,offset", [
    (1, 0, 0), (1000, 0, 0), (4097, 42, 7), (300, 2**32 + 5, 2**32 - 150),  # crosses 2**32
    (257, 2**62 - 1, 2**40 + 3), (0, 1, 1), (50, 2**32 - 1, 2**33 - 25)])
def test_cpp_philox_bits_match_python(backend, n, seed, offset):
    assert _ext.load_error() is None
    got = torch.ops.fastformer.philox_bits(n, seed, offset)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, philox.philox_bits(n, seed, offset))


@pytest.mark.parametrize("backend", CPU)
def test_cpp_philox_bits_rejects_negative_arguments(backend):
    assert _ext.load_error() is None
    for args, name in (((-1, 0, 0), "n"), ((4, -2, 0), "seed"), ((4, 0, -3), "offset")):
        with pytest.raises(RuntimeError, match=f"philox_bits: {name} must be >= 0"):
            torch.ops.fastformer.philox_bits(*args)


_philox_bits = hostile.kernel_call("philox_bits", lambda: dict(n=8))
BAD_KERNEL_ARGS = {  # the same, in a child process as every C++ op's bad arguments (tests/hostile.py)
    "philox_bits": {
        "n_neg": (lambda: _philox_bits(n=-1), "n must be >= 0"),
        "seed_neg": (lambda: _philox_bits(seed=-1), "seed must be >= 0"),
        "offset_neg": (lambda: _philox_bits(offset=-1), "offset must be >= 0"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


@pytest.mark.parametrize("backend", CPU)
def test_opcheck_philox_bits(backend):
    assert _ext.load_error() is None
    for args in ((16, 3, 0), (100, 2**40, 2**32 - 10)):
        torch.library.opcheck(torch.ops.fastformer.philox_bits.default, args)


# ---------------------------------------------------------------- Triton against Python

if triton is not None:

    @triton.jit
    def _randint_kernel(
        out_ptr,  # (n,) int64: the uint32 bits
        seed,  # the Philox key, as philox.py takes it
        offset,  # the first counter
        n,  # how many counters
        BLOCK: tl.constexpr,  # counters per program
    ):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = tl.randint(seed, offset + idx.to(tl.int64))
        tl.store(out_ptr + idx, bits.to(tl.int64), mask=idx < n)

    @triton.jit
    def _randint4x_kernel(
        out_ptr,  # (n, 4) int64: the four uint32 words of each counter
        seed,  # the Philox key
        offset,  # the first counter
        n,  # how many counters
        BLOCK: tl.constexpr,  # counters per program
    ):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        w0, w1, w2, w3 = tl.randint4x(seed, offset + idx.to(tl.int64))
        mask = idx < n
        tl.store(out_ptr + idx * 4, w0.to(tl.int64), mask=mask)
        tl.store(out_ptr + idx * 4 + 1, w1.to(tl.int64), mask=mask)
        tl.store(out_ptr + idx * 4 + 2, w2.to(tl.int64), mask=mask)
        tl.store(out_ptr + idx * 4 + 3, w3.to(tl.int64), mask=mask)

    @triton.jit
    def _keep_tile_kernel(
        out_ptr,  # (R, C) int8: 1 where kept
        seed,  # the Philox key
        offset,  # the counter of row 0's first group
        threshold,  # round(p * 2**16)
        R,  # rows
        C,  # columns (row length of the dropout tensor)
        BLOCK_R: tl.constexpr,  # rows per program
        BLOCK_C: tl.constexpr,  # columns per program (a multiple of 8)
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        c0 = tl.program_id(1) * BLOCK_C
        cols = c0 + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        keep = dropout_keep_tile(seed, offset, rows, tl.cdiv(C, 8), c0, threshold, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], keep.to(tl.int8), mask=mask)


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("n,seed,offset", [(300, 0, 0), (200, 2**32 + 9, 2**32 - 100), (64, 5, 2**40)])
def test_triton_randint_matches_python(backend, n, seed, offset):
    out = torch.empty(n, dtype=torch.int64)
    block = 128
    _randint_kernel[(triton.cdiv(n, block),)](out, seed, offset, n, BLOCK=block)
    assert torch.equal(out, philox.philox_bits(n, seed, offset))


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("n,seed,offset", [(1, 0, 0), (200, 2**32 + 9, 2**32 - 100), (64, 2**62 - 1, 2**40)])
def test_triton_randint4x_matches_python_words(backend, n, seed, offset):
    out = torch.empty((n, 4), dtype=torch.int64)
    _randint4x_kernel[(triton.cdiv(n, 64),)](out, seed, offset, n, BLOCK=64)
    assert torch.equal(out, philox.philox4x32(n, seed, offset))


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("block_c", [16, 32, 64])
@pytest.mark.parametrize("R,C", [(3, 1), (2, 7), (5, 8), (4, 9), (3, 63), (2, 64), (3, 65), (2, 200)])
def test_triton_keep_tile_matches_python_mask(backend, block_c, R, C):
    p, seed = 0.3, 2**33 + 77
    offset = 2**32 - 5 * ((C + 7) // 8)  # the low 32 bits of the counter wrap inside the tensor
    out = torch.full((R, C), -1, dtype=torch.int8)
    _keep_tile_kernel[(triton.cdiv(R, 2), triton.cdiv(C, block_c))](
        out, seed, offset, philox.drop_threshold(p), R, C, BLOCK_R=2, BLOCK_C=block_c)
    assert torch.equal(out.bool(), philox.keep_mask((R, C), p, seed, offset))
    assert int(out.min()) >= 0  # every element written


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("p", [0.0, 1.0 / 65536, 0.5, 65535.0 / 65536, 1.0])
def test_triton_keep_tile_threshold_edges(backend, p):
    # threshold 0 keeps all, 65536 keeps none; in between the unsigned 16-bit compare decides
    R, C, seed, offset = 4, 40, 5, 7
    out = torch.empty((R, C), dtype=torch.int8)
    _keep_tile_kernel[(triton.cdiv(R, 2), triton.cdiv(C, 32))](
        out, seed, offset, philox.drop_threshold(p), R, C, BLOCK_R=2, BLOCK_C=32)
    assert torch.equal(out.bool(), philox.keep_mask((R, C), p, seed, offset))
    if p in (0.0, 1.0):
        assert bool(out.bool().all()) == (p == 0.0) and bool(out.bool().any()) == (p == 0.0)
