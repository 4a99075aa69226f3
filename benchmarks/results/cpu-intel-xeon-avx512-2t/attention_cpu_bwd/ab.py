# Usage: A=base.so B=new.so python ab.py ROUNDS THREADS [all|step|L,L,...] [N]
# Interleaved A/B: alternate processes base, new, ...; min over rounds of each process's best-of-N.
import os, subprocess, sys, collections
libs = {"base": os.environ["A"], "new": os.environ["B"]}
rounds = int(sys.argv[1]); rest = sys.argv[2:]
best = collections.defaultdict(dict)
for _ in range(rounds):
    for name, lib in libs.items():
        r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py"), *rest], capture_output=True, text=True,
                             env=dict(os.environ, FASTFORMER_EXT_LIBRARY=lib))
        if r.returncode: print(r.stderr); sys.exit(1)
        for line in r.stdout.splitlines():
            k, v = line.split("\t"); v = float(v)
            best[k][name] = min(best[k].get(name, 1e9), v)
print(f"{'config':30s} {'base ms':>9s} {'new ms':>9s} {'new/base':>8s}")
for k, d in best.items():
    print(f"{k:30s} {d['base']:9.3f} {d['new']:9.3f} {d['new']/d['base']:8.3f}")
