"""Callgrind harness (callgrind_ab.sh): the overhead bench's add_layer_norm case (N=8, C=16, 16 calls then one
backward, 1 thread) run inside operator.call, so that --toggle-collect=_operator_call collects the loop alone.
argv: which (direct: fastformer._C.add_layer_norm_eager; ff: the public op; torch: PyTorch's composition), iters, p.
Callgrind's tree counts 2 * iters backward runs in the collected region (THPEngine_run_backward 40x for iters 20),
so callgrind_ab.sh divides by 2 * iters * 16 calls."""
import sys, torch
import torch.nn.functional as F
from fastformer import _ext, ops as ff
torch.set_num_threads(1)
N, C, CALLS = 8, 16, 16
which = sys.argv[1]; iters = int(sys.argv[2]); p = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
L = lambda *s: torch.randn(*s).requires_grad_()
Ls = [(L(N, C), L(N, C), L(C), L(C)) for _ in range(CALLS)]
m = _ext.module()
fns = {"direct": lambda x, r, w, b: m.add_layer_norm_eager(x, r, w, b, 1e-5, p, False, None, False),
       "ff": lambda x, r, w, b: ff.add_layer_norm(x, r, w, b, 1e-5, p),
       "torch": lambda x, r, w, b: F.layer_norm(r + F.dropout(x, p, True), (C,), w, b, 1e-5)}
fn = fns[which]
grads = [torch.ones(N, C) for _ in range(CALLS)]
def body(i):
    for l in Ls:
        for t in l: t.grad = None
    outs = [fn(*l) for l in Ls]
    torch.autograd.backward(outs, grads)
for i in range(20): body(i)  # warm
import gc; gc.collect()
import operator
operator.call(lambda: [body(i) for i in range(iters)])
