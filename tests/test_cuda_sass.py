"""The SASS reader of tests/cuda_build.py, on a sample of cuobjdump's output (the kernels' own
instruction-mix checks are tests/test_cuda_sass_*.py)."""
from cuda_build import opcode, opcode_counts, parse_sass

SAMPLE = """
        code for sm_90
                Function : _Z6kernelPf
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;        /* 0x0000000c0804723c */
        /*0020*/                   MUFU.EX2 R3, R3 ;                            /* 0x0000000300037308 */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                /* 0x0000000000007b1d */
                ..........
                Function : _Z5otherv
        /*0000*/                   EXIT ;                                       /* 0x000000000000794d */
"""


def test_parse_sass_splits_functions_and_keeps_instructions():
    functions = parse_sass(SAMPLE)
    assert list(functions) == ["_Z6kernelPf", "_Z5otherv"]
    assert functions["_Z6kernelPf"][1] == "@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4"
    assert functions["_Z5otherv"] == ["EXIT"]


def test_opcode_counts_take_the_base_name_past_a_predicate():
    assert opcode("@!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4") == "HMMA"
    counts = opcode_counts(parse_sass(SAMPLE)["_Z6kernelPf"])
    assert counts == {"LDC": 1, "HMMA": 1, "MUFU": 1, "BAR": 1}
