"""Pieces every Triton kernel shares: the dropout keep-test on the shared Philox stream."""
import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, offsets, threshold):
    """Keep-mask for element ``offsets`` (counter = dropout offset + row-major index):
    True iff ``(randint(seed, offsets) >> 8) >= threshold``, threshold = round(p * 2**24),
    exactly as fastformer/philox.py and csrc/cpu/philox.h define it."""
    bits = tl.randint(seed, offsets)
    return (bits >> 8).to(tl.int32) >= threshold


def dropout_threshold(p: float) -> int:
    return int(p * (1 << 24) + 0.5)  # round half up, as fastformer/philox.py and philox.h


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
