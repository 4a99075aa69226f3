"""cross_entropy's determinism (the harness: tests/determinism.py): forward and backward, label
smoothing, ignored rows and class weights, are bit-identical from run to run on every backend, also under
``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _cross_entropy(g, dev, big):
    n = 700 if big else 15
    logits = (3 * torch.randn(n, 50, generator=g)).to(dev)
    target = determinism.targets(g, n, 50, dev)
    return (logits,), lambda logits: ops.cross_entropy(logits, target, label_smoothing=0.1)


def _cross_entropy_weight(g, dev, big):
    """With torch's class weights: the weighted sums and the mean's weighted divisor."""
    n = 700 if big else 15
    logits = (3 * torch.randn(n, 50, generator=g)).to(dev)
    target = determinism.targets(g, n, 50, dev)
    weight = (0.1 + torch.rand(50, generator=g)).to(dev)
    return (logits,), lambda logits: ops.cross_entropy(logits, target, weight=weight, label_smoothing=0.1)


CASES = {"cross_entropy": _cross_entropy, "cross_entropy_weight": _cross_entropy_weight}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("cross_entropy", CASES))
