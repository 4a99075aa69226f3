"""Interleaved overhead ratios (argv: ops comma-separated, reps, "cpu" for thread CPU time) for chosen ops (fastformer.jobs.bench.overhead's cases and measure)."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's fastformer
import statistics, sys, torch
import fastformer
from fastformer.jobs.bench import overhead as o
ops = sys.argv[1].split(",") if len(sys.argv) > 1 else ["add_layer_norm", "feed_forward", "embedding"]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
torch.set_num_threads(1)
import time
if len(sys.argv) > 3 and sys.argv[3] == "cpu":  # thread CPU time: a loaded machine's preemption left out
    def _step(fn, leaves, grads):
        start = time.thread_time()
        outs = [fn(*ls) for ls in leaves]
        torch.autograd.backward(outs, grads)
        return time.thread_time() - start
    o._step = _step
print("package:", fastformer.__file__, flush=True)
for c in o.cases(ops):
    s = o.measure(c, reps=reps)
    f, t = statistics.median(s["fastformer"]), statistics.median(s["torch"])
    r = statistics.median([a / b for a, b in zip(s["fastformer"], s["torch"])])
    print(f"{c.op:16s} p={c.p:<4g} ff {f*1e6:6.1f} us  torch {t*1e6:6.1f} us  ratio {f/t:.3f} (median of ratios {r:.3f})", flush=True)
