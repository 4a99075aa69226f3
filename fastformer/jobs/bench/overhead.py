"""``python -m fastformer bench --ops overhead``: what one op call costs the host.

Each op runs forward and backward at a tiny shape, where its kernels take next to nothing, beside
PyTorch's own composition of the same work (what ``torch.nn`` runs): so the time is the host's
per-call cost, the cost that decides a step on a GPU, where a model makes ~120 fused calls a step.

One repetition makes ``CALLS`` calls on their own leaves, then ONE ``torch.autograd.backward``
over the ``CALLS`` outputs (the engine's start-up is paid once a step in a model, not once a
call), and is divided by ``CALLS``. fastformer (``auto``) and the composition are timed
interleaved, repetition by repetition, one thread; the table gives the medians and their ratio,
with dropout 0 and 0.1. The compositions:

* attention: ``F.scaled_dot_product_attention(q, k, v, dropout_p=p)``
* add_layer_norm: ``F.layer_norm(residual + F.dropout(x, p))``
* feed_forward: ``linear -> relu -> dropout -> linear``
* cross_entropy: ``F.cross_entropy(logits, target, label_smoothing=0.1)``
* linear_cross_entropy: ``F.cross_entropy(F.linear(h, w), target, label_smoothing=0.1)``
* embedding: ``F.dropout(F.embedding(ids, w) * scale + positions)``

``profile(...)`` gives the cProfile of the fastformer calls (where the microseconds go).
"""
import cProfile
import io
import math
import pstats
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

OP = "overhead"
CALLS = 16  # calls per repetition, then one backward over them all
DROPOUTS = (0.0, 0.1)
# the targets: every op at most 1.0x PyTorch's composition; the ops that replace three or
# more PyTorch calls at most 0.7x (attention only with dropout: without, SDPA is one call)
MULTI_CALL = {"add_layer_norm", "feed_forward", "embedding"}


def target(op: str, p: float) -> float:
    return 0.7 if op in MULTI_CALL or (op == "attention" and p > 0) else 1.0


@dataclass
class Case:
    """One op at one dropout: ``make()`` builds the leaves of one call and returns the two
    callables (fastformer, composition), each taking those leaves and returning the output."""
    op: str
    p: float
    leaves: Callable[[], Tuple[torch.Tensor, ...]]
    fastformer: Callable[..., torch.Tensor]
    torch: Callable[..., torch.Tensor]


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def cases(ops: Optional[Sequence[str]] = None) -> List[Case]:
    """The tiny-shape cases: ``(op, dropout)`` for every op of the table (attention_varlen is
    attention's packed layout, left out: PyTorch has no varlen composition to compare with)."""
    from fastformer import ops as ff  # noqa: F401 (import fastformer first: the bench's job)

    B, H, S, D = 1, 2, 8, 16  # attention: (B, H, S, D)
    N, C, Fd, V = 8, 16, 32, 32  # rows, width, feed-forward width, classes / vocabulary
    target_ids = torch.randint(0, V, (N,))
    ids = torch.randint(0, V, (1, N))
    positions = torch.randn(N, C)
    scale = math.sqrt(C)
    out: List[Case] = []
    for p in DROPOUTS:
        out += [
            Case("attention", p, lambda: (_leaf(B, H, S, D), _leaf(B, H, S, D), _leaf(B, H, S, D)),
                 lambda q, k, v, p=p: ff.attention(q, k, v, dropout_p=p),
                 lambda q, k, v, p=p: F.scaled_dot_product_attention(q, k, v, dropout_p=p)),
            Case("add_layer_norm", p, lambda: (_leaf(N, C), _leaf(N, C), _leaf(C), _leaf(C)),
                 lambda x, r, w, b, p=p: ff.add_layer_norm(x, r, w, b, 1e-5, p),
                 lambda x, r, w, b, p=p: F.layer_norm(r + F.dropout(x, p, True), (C,), w, b, 1e-5)),
            Case("feed_forward", p, lambda: (_leaf(N, C), _leaf(Fd, C), _leaf(Fd), _leaf(C, Fd), _leaf(C)),
                 lambda x, w1, b1, w2, b2, p=p: ff.feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=p),
                 lambda x, w1, b1, w2, b2, p=p: F.linear(F.dropout(F.relu(F.linear(x, w1, b1)), p, True), w2, b2)),
            Case("embedding", p, lambda: (_leaf(V, C),),
                 lambda w, p=p: ff.embedding(ids, w, scale=scale, positional=positions, dropout_p=p),
                 lambda w, p=p: F.dropout(F.embedding(ids, w) * scale + positions[:N], p, True)),
        ]
    out += [
        Case("cross_entropy", 0.0, lambda: (_leaf(N, V),),
             lambda x: ff.cross_entropy(x, target_ids, label_smoothing=0.1),
             lambda x: F.cross_entropy(x, target_ids, label_smoothing=0.1)),
        Case("linear_cross_entropy", 0.0, lambda: (_leaf(N, C), _leaf(V, C)),
             lambda h, w: ff.linear_cross_entropy(h, w, target_ids, label_smoothing=0.1),
             lambda h, w: F.cross_entropy(F.linear(h, w), target_ids, label_smoothing=0.1)),
    ]
    return [c for c in out if ops is None or c.op in ops]


def _step(fn: Callable[..., torch.Tensor], leaves: List[Tuple[torch.Tensor, ...]],
          grads: List[torch.Tensor]) -> float:
    """Seconds for ``len(leaves)`` calls and one backward over their outputs."""
    start = time.perf_counter()
    outs = [fn(*ls) for ls in leaves]
    torch.autograd.backward(outs, grads)
    return time.perf_counter() - start


def measure(case: Case, reps: int = 30, warmup: int = 5) -> Dict[str, List[float]]:
    """Per-call seconds of each repetition: {"fastformer": [...], "torch": [...]}, interleaved."""
    leaves = [case.leaves() for _ in range(CALLS)]
    grads = [torch.ones_like(case.fastformer(*ls)) for ls in leaves]
    samples: Dict[str, List[float]] = {"fastformer": [], "torch": []}
    for i in range(warmup + reps):
        order = (("fastformer", case.fastformer), ("torch", case.torch))
        for name, fn in (order if i % 2 == 0 else order[::-1]):  # neither always goes first
            for ls in leaves:
                for t in ls:
                    t.grad = None
            seconds = _step(fn, leaves, grads) / CALLS
            if i >= warmup:
                samples[name].append(seconds)
    return samples


def profile(case: Case, calls: int = 400, top: int = 25) -> str:
    """cProfile of ``calls`` fastformer calls (forward and backward) of ``case``, by own time."""
    leaves = [case.leaves() for _ in range(CALLS)]
    grads = [torch.ones_like(case.fastformer(*ls)) for ls in leaves]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(max(1, calls // CALLS)):
        _step(case.fastformer, leaves, grads)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"## {case.op}, dropout {case.p}\n\n```\n{text.getvalue().strip()}\n```\n"


def bench(device: torch.device, reps: Optional[int] = None, log=None,
          ops: Optional[Sequence[str]] = None) -> List[Dict]:
    """The overhead records (one per op, dropout and provider) on the CPU, one thread."""
    from .records import new_record  # the bench's record layout (report.markdown reads it)

    if device.type != "cpu":
        rec = new_record(OP, "fastformer", {}, "all ops", "fwd+bwd", "fp32",
                         "skipped: the host-overhead table runs on a CPU (a GPU's host time is in its op "
                         "tables' host column)")
        return [rec]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host cost, not parallel speed
    records: List[Dict] = []
    try:
        for case in cases(ops):
            samples = measure(case, reps=reps or 30)
            med = {name: statistics.median(s) for name, s in samples.items()}
            ratio = med["fastformer"] / med["torch"]
            label = f"{case.op} p={case.p:g}"
            for name, provider in (("fastformer", "fastformer"), ("torch", "torch-eager")):
                rec = new_record(OP, provider, {"op": case.op, "dropout_p": case.p}, label, "fwd+bwd", "fp32", "ok")
                rec.update(median_ms=med[name] * 1e3, min_ms=min(samples[name]) * 1e3,
                           q25_ms=_quantile(samples[name], 0.25) * 1e3, q75_ms=_quantile(samples[name], 0.75) * 1e3,
                           reps=len(samples[name]), host_us_per_call=med[name] * 1e6)
                rec["iqr_ms"] = rec["q75_ms"] - rec["q25_ms"]
                if name == "fastformer":
                    rec.update(ratio_vs_torch=ratio, target=target(case.op, case.p),
                               ratios=[a / b for a, b in zip(samples["fastformer"], samples["torch"])])
                records.append(rec)
            if log:
                log(f"  {label}: fastformer {med['fastformer'] * 1e6:.1f} us, PyTorch {med['torch'] * 1e6:.1f} us "
                    f"a call ({ratio:.2f}x, target <= {target(case.op, case.p)}x)")
    finally:
        torch.set_num_threads(threads)
    return records


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def markdown(records: List[Dict]) -> str:
    """The README's table: microseconds a call (forward + backward), fastformer against PyTorch."""
    rows = [r for r in records if r["op"] == OP and r["provider"] == "fastformer" and r["status"] == "ok"]
    torch_us = {r["label"]: r["host_us_per_call"] for r in records
                if r["op"] == OP and r["provider"] == "torch-eager" and r["status"] == "ok"}
    lines = ["| op | dropout | fastformer us/call | PyTorch us/call | ratio | target | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        met = "yes" if r["ratio_vs_torch"] <= r["target"] else "no"
        lines.append(f"| {s['op']} | {s['dropout_p']:g} | {r['host_us_per_call']:.1f} | {torch_us[r['label']]:.1f} "
                     f"| {r['ratio_vs_torch']:.2f}x | <= {r['target']}x | {met} |")
    return "\n".join(lines) + "\n"
