"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant: what Hugging Face's gradient
checkpointing uses) over the C++ differentiable ops. Their backward unpacks its saved tensors, which
recomputes the checkpointed forward; that recomputation must record the graph as the forward did.
The upstream ``nn.Linear`` is what shows it: run under the backward's below-autograd guard it saved
nothing, and checkpoint refused ("a different number of tensors was saved", BART and Whisper in
tests/test_hf_training.py). Each case: the checkpointed gradients equal the plain ones, dropout
included (checkpoint restores the generator, so the recomputed draw is the forward's)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastformer
from fastformer import ops

from test_cpp_autograd_aln_ffn_emb import _missing

pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))

C = 16


def _heads(t):  # (2, 3, C) -> (2, 2, 3, C // 2)
    return t.view(2, 3, 2, C // 2).transpose(1, 2)


CASES = {
    "add_layer_norm": lambda lin, x, r, p: ops.add_layer_norm(lin(x), r, r[0, 0], r[1, 0], 1e-5, p),
    "add_layer_norm x_bias": lambda lin, x, r, p: ops.add_layer_norm(x @ lin.weight.T, r, None, None, 1e-5, p,
                                                                     x_bias=lin.bias),
    "feed_forward": lambda lin, x, r, p: ops.feed_forward(lin(x), r.reshape(-1, C)[:6].repeat(2, 1), None,
                                                          r.reshape(-1, C)[:6].repeat(2, 1).T, None, dropout_p=p),
    "attention": lambda lin, x, r, p: ops.attention(_heads(lin(x)), _heads(r), _heads(r), dropout_p=p),
    "embedding": lambda lin, x, r, p: ops.embedding(torch.tensor([[1, 0, 2]]), lin(x)[0], dropout_p=p),
    "cross_entropy": lambda lin, x, r, p: ops.cross_entropy(lin(x).reshape(-1, C), torch.arange(6)),
    "linear_cross_entropy": lambda lin, x, r, p: ops.linear_cross_entropy(lin(x).reshape(-1, C), r[0],
                                                                          torch.arange(6) % 3),
}


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_cpp_ops_give_the_plain_gradients(case, p):
    fn = CASES[case]
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(C, C)
        x, r = torch.randn(2, 3, C, requires_grad=True), torch.randn(2, 3, C, requires_grad=True)
        with fastformer.use_backend("cpu"):
            out = checkpoint(fn, lin, x, r, p, use_reentrant=False) if checkpointed else fn(lin, x, r, p)
            assert type(out.grad_fn).__name__ == "CppFunction", "the C++ op's node (not the Python Function's)"
            out.square().sum().backward()
        grads.append([t.grad for t in (x, r, lin.weight, lin.bias)])
    for plain, ckpt in zip(*grads):
        assert (plain is None) == (ckpt is None)
        if plain is not None:
            torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)
