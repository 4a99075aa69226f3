"""What dropout adds to the CPU kernels: forward + backward with p = 0.1 against p = 0, interleaved.

    PYTHONPATH=. python benchmarks/dropout_cost.py                  # the two default cases
    PYTHONPATH=. python benchmarks/dropout_cost.py --repeats 31 --threads 1
    valgrind --tool=callgrind --toggle-collect='fastformer::*' \\
        python benchmarks/dropout_cost.py --count --op attention --p 0.1   # instructions of one call

Each repeat times one forward + backward call at every p in turn (best of --repeats per p), so a
noisy neighbour slows both sides alike; the table gives the best times, their ratio and the target.
--count runs one warm-up-free call of one op at one p (for callgrind / perf instruction counts).

With dropout and a residual, add_layer_norm's backward returns dresidual as a second (N, C) tensor
(without dropout it is dx itself), so part of the added cost is that tensor's writing, not the random
bits. Outputs of 4 MiB or more come from the CPU buffer pool (fastformer.cpu_pool), already mapped,
so both sides time the kernels, not page faults of fresh blocks.
"""
import argparse
import os
import time

import torch

from fastformer import _ext, backends, philox

TARGETS = {"attention": 1.10, "add_layer_norm": 1.25}


def attention_case(B, H, S, D, seed=0):
    """fwd + bwd of the CPU attention kernel, fp32, key padding (random lengths >= S / 2)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=gen) for _ in range(4))
    lengths = torch.randint(S // 2, S + 1, (B,), generator=gen)
    kpm = torch.arange(S)[None, :] >= lengths[:, None]  # (B, S): True = padded
    kern = backends.Kernels("cpu")
    scale = D ** -0.5

    def run(p):
        out, lse = kern.attention_fwd(q, k, v, kpm, None, False, scale, p, philox.pack(1234, 0))
        kern.attention_bwd(dout, q, k, v, out, lse, kpm, None, False, scale, p, philox.pack(1234, 0))

    return f"attention B{B} H{H} S{S} D{D} fp32 kpm", run


def add_layer_norm_case(N, C, seed=0):
    """fwd + bwd of the CPU add_layer_norm kernel, fp32, with a residual."""
    gen = torch.Generator().manual_seed(seed)
    x, res, dy = (torch.randn(N, C, generator=gen) for _ in range(3))
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    kern = backends.Kernels("cpu")

    def run(p):
        _, h, mean, rstd = kern.add_layer_norm_fwd(x, res, w, b, 1e-5, p, philox.pack(1234, 0))
        kern.add_layer_norm_bwd(dy, None, h, w, mean, rstd, p, philox.pack(1234, 0), True)

    return f"add_layer_norm {N}x{C} fp32 residual", run


def best_times(run, ps, repeats, warmup):
    for _ in range(warmup):
        for p in ps:
            run(p)
    best = {p: float("inf") for p in ps}
    for _ in range(repeats):
        for p in ps:
            t0 = time.perf_counter()
            run(p)
            best[p] = min(best[p], time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=["attention", "add_layer_norm", "all"], default="all")
    ap.add_argument("--p", type=float, default=0.1, help="the dropout probability against p = 0")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved timed calls per p (best kept)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--attention-shape", type=int, nargs=4, default=[8, 8, 128, 64], metavar=("B", "H", "S", "D"))
    ap.add_argument("--aln-shape", type=int, nargs=2, default=[4096, 512], metavar=("N", "C"))
    ap.add_argument("--count", action="store_true", help="one call of --op at --p, nothing timed")
    args = ap.parse_args()
    if _ext.load_error() is not None:
        raise SystemExit(_ext.load_error())
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = {"attention": lambda: attention_case(*args.attention_shape),
             "add_layer_norm": lambda: add_layer_norm_case(*args.aln_shape)}
    ops = list(cases) if args.op == "all" else [args.op]
    if args.count:
        if len(ops) != 1:
            ap.error("--count needs one --op")
        cases[ops[0]]()[1](args.p)
        return
    load = os.getloadavg()
    print(f"threads {torch.get_num_threads()}, best of {args.repeats} interleaved runs, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'case':<40} {'p=0 ms':>9} {f'p={args.p:g} ms':>10} {'ratio':>7} {'target':>7}")
    for op in ops:
        name, run = cases[op]()
        best = best_times(run, (0.0, args.p), args.repeats, args.warmup)
        ratio = best[args.p] / best[0.0]
        target = TARGETS[op]
        print(f"{name:<40} {best[0.0] * 1e3:9.3f} {best[args.p] * 1e3:10.3f} {ratio:7.3f} "
              f"{'<=' if ratio <= target else '> '}{target:.2f}")


if __name__ == "__main__":
    main()
