"""Where the time goes: full Python op vs the C++ op called straight (boxed, philox drawn in Python / not drawn) vs
its direct entry (fastformer._C.<op>_eager, philox drawn in C++) vs torch, interleaved (fwd+bwd, per call, thread CPU time).
argv: op p reps."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's fastformer
import statistics, sys, time, math, torch
import torch.nn.functional as F
import fastformer
from fastformer import ops as ff, philox, _ext
torch.set_num_threads(1)
N, C, Fd, V = 8, 16, 32, 32
CALLS = 16
ids = torch.randint(0, V, (1, N)); positions = torch.randn(N, C); scale = math.sqrt(C)
op = sys.argv[1]; p = float(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 60
_y = lambda out: out[0] if isinstance(out, tuple) else out  # (y, h) before hostpath3, y after
L = lambda *s: torch.randn(*s).requires_grad_()
if op == "add_layer_norm":
    leaves = lambda: (L(N, C), L(N, C), L(C), L(C))
    fns = {"ff": lambda x, r, w, b: ff.add_layer_norm(x, r, w, b, 1e-5, p),
           "cpp": lambda x, r, w, b: torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, p, False, philox.draw(p), None, False)[0],
           "cpp_nodraw": lambda x, r, w, b: torch.ops.fastformer.add_layer_norm(x, r, w, b, 1e-5, p, False, philox.NO_DROPOUT, None, False)[0],
           "direct": lambda x, r, w, b: _y(_ext.module().add_layer_norm_eager(x, r, w, b, 1e-5, p, False, None, False)),
           "torch": lambda x, r, w, b: F.layer_norm(r + F.dropout(x, p, True), (C,), w, b, 1e-5)}
elif op == "feed_forward":
    leaves = lambda: (L(N, C), L(Fd, C), L(Fd), L(C, Fd), L(C))
    fns = {"ff": lambda x, w1, b1, w2, b2: ff.feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=p),
           "cpp": lambda x, w1, b1, w2, b2: torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, "relu", p, philox.draw(p)),
           "cpp_nodraw": lambda x, w1, b1, w2, b2: torch.ops.fastformer.feed_forward(x, w1, b1, w2, b2, "relu", p, philox.NO_DROPOUT),
           "direct": lambda x, w1, b1, w2, b2: _ext.module().feed_forward_eager(x, w1, b1, w2, b2, "relu", p, None, None),
           "torch": lambda x, w1, b1, w2, b2: F.linear(F.dropout(F.relu(F.linear(x, w1, b1)), p, True), w2, b2)}
else:
    leaves = lambda: (L(V, C),)
    pos_ids = torch.arange(N)
    fns = {"ff": lambda w: ff.embedding(ids, w, scale=scale, positional=positions, dropout_p=p),
           "cpp": lambda w: torch.ops.fastformer.embedding(ids, w, positions, pos_ids.view(1, N), scale, p, -1, philox.draw(p)),
           "cpp_nodraw": lambda w: torch.ops.fastformer.embedding(ids, w, positions, pos_ids.view(1, N), scale, p, -1, philox.NO_DROPOUT),
           "direct": lambda w: _ext.module().embedding_eager(ids, w, positions, pos_ids.view(1, N), scale, p, -1),
           "torch": lambda w: F.dropout(F.embedding(ids, w) * scale + positions[:N], p, True)}
    # note: ff.embedding passes positions (its own) -- "cpp" here passes positional with positions=None
Ls = [leaves() for _ in range(CALLS)]
grads = [torch.ones_like(fns["torch"](*l)) for l in Ls]
S = {k: [] for k in fns}
names = list(fns)
for i in range(10 + reps):
    order = names if i % 2 == 0 else names[::-1]
    for k in order:
        for l in Ls:
            for t in l: t.grad = None
        t0 = time.thread_time()
        outs = [fns[k](*l) for l in Ls]
        torch.autograd.backward(outs, grads)
        dt = (time.thread_time() - t0) / CALLS
        if i >= 10: S[k].append(dt)
tm = statistics.median(S["torch"])
print(f"[{fastformer.__file__}] {op} p={p}: " + "  ".join(f"{k} {statistics.median(v)*1e6:.1f}us ({statistics.median(v)/tm:.3f}x)" for k, v in S.items()))
