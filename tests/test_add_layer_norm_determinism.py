"""add_layer_norm's determinism (the harness: tests/determinism.py): forward and backward, post-
and pre-norm with dropout, are bit-identical from run to run on every backend, also under
``torch.use_deterministic_algorithms(True)``."""
import torch

from fastformer import ops
import determinism


def _add_layer_norm(prenorm):
    def case(g, dev, big):
        x, res = (torch.randn(600 if big else 9, 64, generator=g).to(dev) for _ in range(2))
        w, b = (1 + 0.1 * torch.randn(64, generator=g)).to(dev), (0.1 * torch.randn(64, generator=g)).to(dev)

        def run(x, res, w, b):
            out = ops.add_layer_norm(x, res, w, b, dropout_p=0.1, prenorm=prenorm)
            return torch.cat([t.flatten() for t in out]) if prenorm else out
        return (x, res, w, b), run
    return case


CASES = {"add_layer_norm": _add_layer_norm(False), "add_layer_norm_prenorm": _add_layer_norm(True)}
test_forward_and_backward_are_bit_identical, test_under_deterministic_algorithms_is_bit_identical = (
    determinism.op_tests("add_layer_norm", CASES, dropout=CASES))
