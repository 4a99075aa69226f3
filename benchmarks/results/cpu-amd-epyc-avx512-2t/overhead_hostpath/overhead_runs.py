"""fastformer.jobs.bench.overhead.bench() for the three ops of this task (the dev library has only their
kernels), written as <out>.json and <out>.md with the load before and after."""
import json, os, sys, platform, torch
import fastformer
from fastformer.jobs.bench import overhead as o
out = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
ops = ["add_layer_norm", "feed_forward", "embedding"]
load0 = os.getloadavg()[0]
recs = o.bench(torch.device("cpu"), reps=reps, log=print, ops=ops)
load1 = os.getloadavg()[0]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
head = (f"overhead (fastformer.jobs.bench.overhead.bench, ops {', '.join(ops)}, reps {reps}, 1 thread) on {cpu}, "
        f"torch {torch.__version__}, library {os.path.basename(os.environ.get('FASTFORMER_EXT_LIBRARY', 'fastformer._C'))}; "
        f"load average {load0:.2f} before the run, {load1:.2f} after (shared 2-core machine: not README-grade)\n\n")
open(out + ".md", "w").write(head + o.markdown(recs))
json.dump({"load_before": load0, "load_after": load1, "records": recs}, open(out + ".json", "w"), indent=1)
print(head + o.markdown(recs))
