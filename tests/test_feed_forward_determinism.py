"""feed_forward's determinism (the harness: tests/determinism.py): forward and backward, GELU
with dropout, are bit-identical from run to run on every backend, also under
``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _feed_forward(g, dev, big):
    x = torch.randn(600 if big else 37, 32, generator=g).to(dev)
    w1, w2 = (0.2 * torch.randn(64, 32, generator=g)).to(dev), (0.2 * torch.randn(32, 64, generator=g)).to(dev)
    b1, b2 = (0.1 * torch.randn(64, generator=g)).to(dev), (0.1 * torch.randn(32, generator=g)).to(dev)
    return (x, w1, b1, w2, b2), lambda *a: ops.feed_forward(*a, activation="gelu", dropout_p=0.1)


CASES = {"feed_forward": _feed_forward}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("feed_forward", CASES, dropout=CASES))
