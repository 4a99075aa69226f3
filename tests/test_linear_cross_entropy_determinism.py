"""linear_cross_entropy's determinism (the harness: tests/determinism.py): forward and backward,
with a bias, label smoothing, ignored rows and class weights, are bit-identical from run to run on
every backend, also under ``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _linear_cross_entropy(g, dev, big):
    n = 700 if big else 15
    hidden = torch.randn(n, 32, generator=g).to(dev)
    weight, bias = (0.2 * torch.randn(50, 32, generator=g)).to(dev), (0.1 * torch.randn(50, generator=g)).to(dev)
    target = determinism.targets(g, n, 50, dev)
    return (hidden, weight, bias), lambda h, w, b: ops.linear_cross_entropy(h, w, target, linear_bias=b,
                                                                           label_smoothing=0.1)


def _linear_cross_entropy_weight(g, dev, big):
    """With torch's class weights, reduction sum (the gradients written in the forward)."""
    n = 700 if big else 15
    hidden = torch.randn(n, 32, generator=g).to(dev)
    weight, bias = (0.2 * torch.randn(50, 32, generator=g)).to(dev), (0.1 * torch.randn(50, generator=g)).to(dev)
    target = determinism.targets(g, n, 50, dev)
    class_weight = (0.1 + torch.rand(50, generator=g)).to(dev)
    return (hidden, weight, bias), lambda h, w, b: ops.linear_cross_entropy(h, w, target, linear_bias=b,
                                                                           weight=class_weight, reduction="sum",
                                                                           label_smoothing=0.1)


CASES = {"linear_cross_entropy": _linear_cross_entropy, "linear_cross_entropy_weight": _linear_cross_entropy_weight}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("linear_cross_entropy", CASES))
