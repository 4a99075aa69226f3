"""What packing gives a torch.compile'd fastformer loss: the base training step (bench's full
train_step shape, cpu backend, Adam) eager, compiled on the packed rows, and compiled in the
padded layout, interleaved.

    PYTHONPATH=. python benchmarks/compiled_packing.py                 # 12 repeats, 2 threads
    PYTHONPATH=. python benchmarks/compiled_packing.py --repeats 20 --threads 1

The packed graph is what dynamo traces with ``capture_dynamic_output_shape_ops`` (the number of
real tokens a data-dependent size); without it the compiled model computes the padding. Each
variant compiles (inductor, ``fullgraph=True``) and runs two steps before the timing; each repeat
then times one step of every variant, the order rotating, so a noisy neighbour slows all alike.
"""
import argparse
import statistics
import time

import torch

import fastformer
from fastformer.jobs.bench.train_step import fastformer_model, make_batch, sweep
from fastformer.optim import make_optimizer

VARIANTS = ("eager", "compiled, packed", "compiled, padded")


def build_step(variant: str, shape: dict, src: torch.Tensor, tgt: torch.Tensor):
    torch.manual_seed(0)
    model = fastformer_model(shape, torch.device("cpu")).train()
    optimizer = make_optimizer(model, lr=1e-4)

    def loss_fn(s, t):
        return model.loss(s, t, label_smoothing=shape["smoothing"])
    if variant != "eager":
        loss_fn = torch.compile(loss_fn, fullgraph=True, dynamic=False)
    packed = variant == "compiled, packed"

    def step():
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=packed), fastformer.use_backend("cpu"):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(src, tgt).backward()
            optimizer.step()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = sweep("cpu", "full")[0]
    src, tgt = make_batch(shape, torch.device("cpu"))
    steps = {}
    for variant in VARIANTS:
        start = time.perf_counter()
        steps[variant] = build_step(variant, shape, src, tgt)
        steps[variant]()
        steps[variant]()
        print(f"{variant}: built and ran two steps in {time.perf_counter() - start:.1f} s", flush=True)
    times = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            start = time.perf_counter()
            steps[v]()
            times[v].append(1e3 * (time.perf_counter() - start))
    eager = min(times["eager"])
    print(f"\n| variant ({args.threads} threads, {args.repeats} repeats) | best ms | median ms | best vs eager |")
    print("| --- | --- | --- | --- |")
    for v in VARIANTS:
        print(f"| {v} | {min(times[v]):.0f} | {statistics.median(times[v]):.0f} | {eager / min(times[v]):.2f}x |")


if __name__ == "__main__":
    main()
