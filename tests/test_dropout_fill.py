"""DropoutScales::fill (csrc/cpu/dropout_scales.h), the vectorised dropout mask generator of every
CPU kernel, at each ISA level this CPU runs (forced with ATEN_CPU_CAPABILITY in a fresh process, as
tests/test_cpu_isa.py does): through the dropout_fill test op, its multipliers for start columns
and lengths on both sides of the vector blocks (8 groups = 64 columns for AVX2, 16 = 128 for
AVX512), for fp32 and fp64, are exactly those of fastformer/philox.py's mask, and nothing outside
the filled range is written. The kernels reach fill only in the combinations their shapes give."""
import json

import pytest
import torch

from fastformer import _ext, philox
from test_cpu_isa import FLAGS, LEVELS, NEEDS, _child, _supported

pytestmark = pytest.mark.skipif(_ext.load_error() is not None, reason=str(_ext.load_error()))

SEED = 2**40 + 0x9E3779B9  # both key words non-zero
SCALE = 1.25  # exact in fp32: the kept value compares exactly
GUARD = 131  # NaN elements each side of the filled range (more than a block)
C0S = (0, 1, 7, 63, 64, 65, 127, 128, 129, 1000)
NS = (1, 7, 8, 63, 64, 65, 127, 128, 129, 1023)
DTYPES = ("float32", "float64")


def _cases():
    """(dtype, threshold, c0, n, row_counter): every c0 x n at p = 0.1 and p = 0.5 (the second with a
    row counter whose low word wraps inside a block), thresholds at and past the 16-bit edges on a
    smaller grid."""
    cases = []
    for dtype in DTYPES:
        for c0 in C0S:
            for n in NS:
                cases.append((dtype, philox.drop_threshold(0.1), c0, n, 3))
                cases.append((dtype, 32768, c0, n, 2**32 - 20))
        for threshold in (0, 1, 65535, 65536, 70000, 2**32 - 1):
            for c0, n in ((0, 1), (1, 129), (63, 64), (129, 1023)):
                cases.append((dtype, threshold, c0, n, 2**33 + 5))
    return cases


CASES = _cases()

# The child: fills every case at its forced level, each into the middle of a NaN buffer whose start
# moves with n (unaligned outputs too), and prints the whole buffers.
CHILD = r"""
import json, sys
import torch

from fastformer import _ext

assert _ext.load_error() is None, _ext.load_error()
cases, seed, scale, guard = json.loads(PARAMS)
out = {"level": torch.ops.fastformer.cpu_capability(), "buffers": []}
for dtype, threshold, c0, n, row_counter in cases:
    shift = n % 4
    buf = torch.full((guard + shift + n + guard,), float("nan"), dtype=getattr(torch, dtype))
    torch.ops.fastformer.dropout_fill(buf[guard + shift:guard + shift + n], seed, threshold, scale, c0, row_counter)
    out["buffers"].append(buf.tolist())
json.dump(out, sys.stdout)
"""


def _expected(dtype, threshold, c0, n, row_counter):
    """The buffer fill must leave: NaN guards around the multipliers of philox.py's mask, computed
    from the definition (columns c0 .. c0 + n - 1 of the row whose first counter is row_counter)."""
    u = philox.random16((c0 + n,), SEED, row_counter)[c0:]
    dt = getattr(torch, dtype)
    vals = torch.where(u >= threshold, torch.tensor(SCALE, dtype=dt), torch.tensor(0.0, dtype=dt))
    nan = torch.full((GUARD + n % 4,), float("nan"), dtype=dt)
    return torch.cat((nan, vals, nan[:GUARD]))


@pytest.fixture(scope="module")
def results():
    code = f"PARAMS = {json.dumps([CASES, SEED, SCALE, GUARD])!r}\n" + CHILD
    return {level: _child(level, code) for level in LEVELS if _supported(level)}


@pytest.mark.parametrize("level", [pytest.param(lv, marks=pytest.mark.skipif(
    not _supported(lv), reason=f"this CPU lacks {lv} ({sorted(NEEDS[lv] - (FLAGS or set()))} missing)"))
    for lv in LEVELS])
@pytest.mark.slow
def test_fill_gives_the_reference_multipliers(results, level):
    res = results[level]
    assert res["level"] == level.upper()
    assert len(res["buffers"]) == len(CASES)
    bad = []
    for case, got in zip(CASES, res["buffers"]):
        want = _expected(*case)
        got = torch.tensor(got, dtype=want.dtype)
        if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()) \
                or not torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)):
            dtype, threshold, c0, n, row_counter = case
            wrong = (got.nan_to_num(-1.0) != want.nan_to_num(-1.0)).nonzero().flatten() - (GUARD + n % 4)
            bad.append(f"{dtype} T={threshold} c0={c0} n={n} row_counter={row_counter}: "
                       f"{wrong.numel()} wrong, first at out[{wrong[:5].tolist()}] (negative / >= n: a guard)")
    assert not bad, f"{level}: {len(bad)} of {len(CASES)} fills differ from philox.py:\n" + "\n".join(bad[:20])


def test_the_reference_masks_keep_and_drop():
    """The comparison means something: at p = 0.1 and 0.5 every case of 64 columns or more has kept
    and dropped columns (all-kept or all-dropped multipliers would hide a misplaced column)."""
    for case in CASES:
        dtype, threshold, c0, n, row_counter = case
        if threshold in (philox.drop_threshold(0.1), 32768) and n >= 64:
            vals = _expected(*case)[GUARD + n % 4:][:n]
            assert (vals == SCALE).any() and (vals == 0).any(), case


@pytest.mark.parametrize("args,match", [
    ((torch.empty(4), -1, 0, 1.0, 0, 0), "seed must be >= 0"),
    ((torch.empty(4), 0, -1, 1.0, 0, 0), r"threshold must be in \[0, 2\*\*32\)"),
    ((torch.empty(4), 0, 2**32, 1.0, 0, 0), r"threshold must be in \[0, 2\*\*32\)"),
    ((torch.empty(4), 0, 0, 1.0, -1, 0), "c0 must be >= 0"),
    ((torch.empty(4), 0, 0, 1.0, 0, -1), "row_counter must be >= 0"),
    ((torch.empty(4, dtype=torch.bfloat16), 0, 0, 1.0, 0, 0), "float32 or float64"),
    ((torch.empty(4, 2)[:, 0], 0, 0, 1.0, 0, 0), "1-D and contiguous"),
])
def test_fill_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fastformer.dropout_fill(*args)


def test_opcheck_dropout_fill():
    """The schema (out mutated in place, nothing returned) matches what the kernel does; the op is a
    test hook that torch.compile never traces, so the fake-tensor checks do not apply."""
    for out, c0 in ((torch.empty(200), 7), (torch.empty(65, dtype=torch.float64), 128)):
        torch.library.opcheck(torch.ops.fastformer.dropout_fill.default, (out, SEED, 6554, SCALE, c0, 3),
                              test_utils=("test_schema", "test_autograd_registration"))
