"""feed_forward's determinism (the harness: tests/determinism.py): forward and backward, GELU
with dropout (plain and gated), are bit-identical from run to run on every backend, also under
``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _feed_forward(g, dev, big):
    x = torch.randn(600 if big else 37, 32, generator=g).to(dev)
    w1, w2 = (0.2 * torch.randn(64, 32, generator=g)).to(dev), (0.2 * torch.randn(32, 64, generator=g)).to(dev)
    b1, b2 = (0.1 * torch.randn(64, generator=g)).to(dev), (0.1 * torch.randn(32, generator=g)).to(dev)
    return (x, w1, b1, w2, b2), lambda *a: ops.feed_forward(*a, activation="gelu", dropout_p=0.1)


def _feed_forward_gated(g, dev, big):
    """GeGLU (tanh gelu) with dropout and a bias on the up projection only."""
    (x, w1, b1, w2, b2), _ = _feed_forward(g, dev, big)
    w3, b3 = (0.2 * torch.randn(64, 32, generator=g)).to(dev), (0.1 * torch.randn(64, generator=g)).to(dev)
    return (x, w1, w2, b2, w3, b3), lambda x, w1, w2, b2, w3, b3: ops.feed_forward(
        x, w1, None, w2, b2, activation="gelu_tanh", dropout_p=0.1, w3=w3, b3=b3)


CASES = {"feed_forward": _feed_forward, "feed_forward_gated": _feed_forward_gated}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("feed_forward", CASES, dropout=CASES))
