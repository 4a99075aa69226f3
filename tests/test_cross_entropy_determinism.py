"""cross_entropy's determinism (the harness: tests/determinism.py): forward and backward, label
smoothing and ignored rows, are bit-identical from run to run on every backend, also under
``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _cross_entropy(g, dev, big):
    n = 700 if big else 15
    logits = (3 * torch.randn(n, 50, generator=g)).to(dev)
    target = determinism.targets(g, n, 50, dev)
    return (logits,), lambda logits: ops.cross_entropy(logits, target, label_smoothing=0.1)


CASES = {"cross_entropy": _cross_entropy}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("cross_entropy", CASES))
