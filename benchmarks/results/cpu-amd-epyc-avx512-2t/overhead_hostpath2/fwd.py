"""Forward-only host cost: ops.add_layer_norm vs its direct entry (thread CPU time, per call, median of rounds)."""
import statistics, sys, time, torch, fastformer
from fastformer import ops as ff, _ext
torch.set_num_threads(1)
p = float(sys.argv[1]); N, C = 8, 16
x, r = torch.randn(N, C, requires_grad=True), torch.randn(N, C, requires_grad=True)
w, b = torch.randn(C, requires_grad=True), torch.randn(C, requires_grad=True)
e = _ext.module().add_layer_norm_eager
fns = {"ff": lambda: ff.add_layer_norm(x, r, w, b, 1e-5, p),
       "direct": lambda: e(x, r, w, b, 1e-5, p, False, None, False),
       "torch": lambda: torch.nn.functional.layer_norm(r + torch.nn.functional.dropout(x, p, True), (C,), w, b, 1e-5)}
S = {k: [] for k in fns}
for i in range(220):
    for k, f in (fns.items() if i % 2 else reversed(fns.items())):
        t0 = time.thread_time()
        for _ in range(100): f()
        if i >= 20: S[k].append((time.thread_time() - t0) / 100)
m = {k: statistics.median(v) * 1e6 for k, v in S.items()}
print(f"[{fastformer.__file__}] p={p}: " + "  ".join(f"{k} {v:.2f}us" for k, v in m.items()) + f"  ff-direct {m['ff']-m['direct']:.2f}us")
