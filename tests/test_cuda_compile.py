"""Every CUDA kernel file compiles for sm_80 (A100) and sm_90 (H100) with nvcc, no GPU needed:

    nvcc -c -O3 -std=c++17 -gencode arch=compute_<a>,code=sm_<a> -Xptxas -v csrc/cuda/<op>.cu

for a = 80 and 90 (one nvcc a target: tests/cuda_build.py), for every csrc/cuda/*.cu, and for
tests/simt/mma_selftest.cu (the test kernels of the tensor-core wrappers csrc/cuda/mma.cuh: the
inline PTX is checked by ptxas only here), the selected files' (file, target) pieces in parallel
(``-k mma_selftest`` compiles one file). A file fails on a compile error or on any
register spill (ptxas's "bytes spill stores / loads" not 0, any function). The table of registers,
stack frame and shared memory per kernel and target prints with ``pytest -s`` and is attached to
every failure message. Skipped, with the reason, only where nvcc is not installed.
"""
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuda_build import ARCHS, NO_NVCC, NVCC, _demangle, _short, compile_arch, compile_cu, parse_ptxas

pytestmark = pytest.mark.skipif(NVCC is None, reason=NO_NVCC)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))) + [
    os.path.join(ROOT, "tests", "simt", "mma_selftest.cu")]


def _table(cu, result):
    rows = result["rows"]
    names = _demangle(sorted({r["name"] for r in rows}))
    lines = [f"{os.path.relpath(cu, ROOT)}: {len(rows)} functions"]
    lines.append(f"  {'arch':6} {'regs':>4} {'stack':>5} {'spill st/ld':>11} {'smem':>6}  kernel")
    for r in sorted(rows, key=lambda r: (names[r["name"]], r["arch"])):
        lines.append(f"  {r['arch']:6} {r['registers']:>4} {r['stack']:>5} "
                     f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['smem']:>6}  {_short(names[r['name']])}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def compiled(request):
    # the files of the tests this session runs (every file when run whole), compiled together
    files = [cu for cu in CU_FILES
             if any(getattr(item, "callspec", None) is not None and item.callspec.params.get("cu") == cu
                    for item in request.session.items)]
    # (file, target) pieces, the largest file's first (attention.cu: 54 kernels a target), so a
    # 2-core machine runs its two halves side by side rather than one nvcc for both targets
    pieces = [(cu, a) for cu in sorted(files, key=os.path.getsize, reverse=True) for a in ARCHS]
    jobs = max(1, min(len(pieces), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # objects kept for tests/test_cuda_sass*.py
        list(pool.map(lambda piece: compile_arch(*piece), pieces))
    results = {cu: compile_cu(cu) for cu in files}  # the pieces, merged (compiled above: cached)
    for cu, result in results.items():
        print(_table(cu, result))
    return results


def test_there_are_kernel_files():
    assert CU_FILES, "csrc/cuda has no .cu files"


@pytest.mark.parametrize("cu", CU_FILES, ids=[os.path.basename(f) for f in CU_FILES])
def test_compiles_for_sm80_and_sm90_without_spills(compiled, cu):
    result = compiled[cu]
    table = _table(cu, result)
    assert result["rc"] == 0, f"{' '.join(result['cmd'])} failed:\n{result['output'][-8000:]}"
    kernels = [r for r in result["rows"] if r["arch"] in ("sm_80", "sm_90")]
    assert {r["arch"] for r in kernels} == {"sm_80", "sm_90"}, f"no kernels for both targets\n{table}"
    spilled = [r for r in result["rows"] if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, f"register spills in {len(spilled)} functions:\n{table}"


def test_parse_ptxas_reads_registers_spills_and_smem():
    text = """ptxas info    : Compiling entry function '_Z1kPf' for 'sm_80'
ptxas info    : Function properties for _Z1kPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem, 380 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    rows = parse_ptxas(text)
    assert rows[0] == {"name": "_Z1kPf", "arch": "sm_80", "registers": 40, "stack": 8,
                       "spill_stores": 4, "spill_loads": 12, "smem": 128}
    assert rows[1]["name"] == "_Z6helperv" and rows[1]["spill_stores"] == 0
