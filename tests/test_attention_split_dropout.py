"""The CPU attention backward's split schedule (a head of several tiles on several threads: pass 1
dK, dV per key block, pass 2 dQ per query block) with dropout: pass 1 makes each tile's keep bits
and keeps them for pass 2 (csrc/cpu/attention_kernel_bwd.cpp). After leading padded keys the two
passes' key blocks start at different keys, so pass 2 reads the bits at other offsets than pass 1
wrote them; a wrong bit there changes dq. Against the reference's exact mask (fp64)."""
import pytest
import torch

import fastformer
from fastformer import philox
from fastformer.ops import attention, reference
from utils import assert_close, kernel_backends

CPU = kernel_backends("cpu")


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one head on two threads: the split schedule
    yield
    torch.set_num_threads(threads)


# (Sq, Sk, leading padded keys, causal): kbegin 37 puts pass 2's key blocks at 37, 165, 293 and
# pass 1's at 37, 128, 256; the causal case also starts pass 1's query blocks past row 0
@pytest.mark.parametrize("Sq,Sk,lead,causal", [(150, 300, 37, False), (150, 300, 37, True), (70, 200, 0, True)])
@pytest.mark.parametrize("backend", CPU)
def test_split_backward_dropout_matches_the_reference(backend, two_threads, Sq, Sk, lead, causal):
    gen = torch.Generator().manual_seed(Sk + lead)
    q, k, v = (torch.randn(1, 1, S, 32, generator=gen) for S in (Sq, Sk, Sk))
    dout = torch.randn(1, 1, Sq, 32, generator=gen)
    kpm = torch.arange(Sk)[None, :] < lead
    masks = dict(key_padding_mask=kpm, is_causal=causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(9)
    with fastformer.use_backend(backend):
        out = attention(*leaves, dropout_p=0.3, **masks)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    torch.manual_seed(9)
    rng = philox.next_seed()  # the pair the op drew
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*ref_leaves, dropout_p=0.3, rng=rng, **masks)
    want = (ref, *torch.autograd.grad(ref, ref_leaves, dout.double()))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g.double(), w, atol=5e-5, rtol=1e-4)
