"""Where a fastformer backend was measured slower than PyTorch's own composition on a GPU.

``auto`` on CUDA tensors reads :data:`TABLE` (through :func:`lookup`) and skips a backend for a
call in a class listed here, with the reason in ``backends.explain(..., auto=True)``: "measured
slower than PyTorch's composition on nvidia-h200 at <shape> (bf16, forward + backward): X ms vs
Y ms". Forcing a backend ignores the table. The CPU has no table: ``auto`` there is unchanged.

**The rule.** A class is one measured shape of one op and dtype on one GPU, widened to the calls
near it (see *classes*). It is listed when some fastformer backend took more than ``1 + MARGIN``
times PyTorch's composition's time there. ``auto`` then passes over that backend for a call in
the class only when the next backend in ``AUTO_ORDER`` that accepts the call was measured faster
in the same class: on CUDA, triton -> cuda when cuda was measured faster than triton, and cuda ->
reference only where the reference itself was measured (the bench's ``fastformer-reference``
provider) faster than cuda. Otherwise the backend is kept: passing it over would run something
measured slower, or not measured at all.

*Why never to the reference on PyTorch's numbers.* "PyTorch's composition" is the bench's
``torch-eager`` provider (fastformer/jobs/bench/ops.py): ``F.scaled_dot_product_attention`` with
the merged mask, ``F.dropout`` + add + ``F.layer_norm``. The reference (fastformer/ops/reference.py)
is not that composition: it avoids those fused torch functions on purpose (it is the tests'
oracle), keeps statistics in fp32, and for attention materialises the fp32 (B, H, Sq, Sk) scores
and probabilities, with or without dropout; with dropout it also builds the Philox keep-mask of
that shape. So PyTorch's time is no estimate of the reference's, and a dropout class is no
exception. Falling back from a kernel to the reference is right only where the reference was
measured faster; today's results hold no such measurement, so no skip lands on the reference.
Every backend draws the same dropout bits (fastformer/philox.py), so the choice never changes
which elements are dropped, in any class.

*Times.* Forward + backward (the training step: the op's Function keeps the chosen kernels for its
backward), the ``median_ms`` of each mode, from the providers timed interleaved in the same run.
A forward alone ranks the backends the same way in every listed class.

*Classes.* A call is in a class when every fact the class names was passed to ``backends.select``
and lies in its range; a call that does not pass a fact is in no class that names it, so it keeps
today's choice. Sizes (head dim, sequence lengths, batch x heads, rows, hidden size) were measured
at a few values each: a measured value covers up to the geometric midpoint to its measured
neighbours, and up to a factor 2 beyond the smallest and the largest. Flags (causal, dropout,
masked) match exactly. The facts of each op's bench shape are :data:`FACTS_OF`: the op passes the
same facts to ``backends.select`` for its classes to hold (attention: ``head_dim``, ``q_len``,
``k_len``, ``batch_heads`` = B x H, ``causal``, ``dropout`` = p > 0, ``masked`` = a mask given;
add_layer_norm: ``hidden_size``, ``rows``, ``dropout``). Until an op passes them, no class holds
for it and ``auto`` chooses as before.

*Which GPU.* The classes were measured on one GPU model (``machine``) and apply to every CUDA GPU,
as ``AUTO_ORDER`` does; the reason names the machine.

**Where the numbers are, and how to renew them.** ``benchmarks/results/nvidia-h200/results.json``
(written by ``make gpu-check``, benchmarks/gpu_check.py; ``results.md`` and ``attention.md`` are
its tables). The 2026-11-27 figures were taken with CUDA events recorded around one call on an
idle GPU, so they include the host's time to launch the call's kernels, Python included (a large
share at S 512 and at the add_layer_norm sizes, where a call takes 0.1-0.7 ms). The bench now
times device time (``median_ms``; the host's time is ``host_median_ms``, which this table does not
read), so the next ``make gpu-check`` gives figures to re-derive the table from. Then run::

    python -m fastformer.backends.measured benchmarks/results/<gpu>/results.json --write

which rewrites the block between the ``TABLE`` markers below (without ``--write`` it prints it);
``tests/test_backends_measured.py`` fails while the block and the committed results.json differ.
"""
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

MARGIN = 0.05           # a backend is "slower" above (1 + MARGIN) x PyTorch's time, beyond the run's noise
STATISTIC = "median_ms"  # which of the bench's statistics is compared
COMPOSITION = "torch-eager"  # the bench provider that is PyTorch's own composition
PROVIDER_PREFIX = "fastformer-"  # fastformer-<backend>: the bench's provider of each backend
RESULTS = os.path.join("benchmarks", "results", "nvidia-h200", "results.json")  # the table's source, from the repo root


@dataclass(frozen=True)
class Measured:
    """One measured class: ``op`` at ``dtype`` on ``device_type``, for calls whose facts lie in
    ``where`` (fact -> inclusive (low, high)); ``ms``: each fastformer backend's time there,
    ``composition_ms``: PyTorch's; ``label``: the bench's shape label; ``machine``: the GPU."""
    op: str
    dtype: str
    where: Tuple[Tuple[str, int, int], ...]
    ms: Tuple[Tuple[str, float], ...]
    composition_ms: float
    label: str
    machine: str
    device_type: str = "cuda"

    def holds(self, facts: Mapping[str, int]) -> bool:
        for fact, low, high in self.where:
            value = facts.get(fact)
            if value is None or not low <= value <= high:
                return False
        return True

    def time(self, backend: str) -> Optional[float]:
        return dict(self.ms).get(backend)

    def slower(self, backend: str) -> bool:
        ms = self.time(backend)
        return ms is not None and ms > self.composition_ms * (1.0 + MARGIN)


# --------------------------------------------------------------------------- the bench's shapes -> facts
# Each op's bench shape (fastformer/jobs/bench/ops.py) -> the facts its op passes to backends.select,
# and which of them are flags (matched exactly) rather than sizes (matched in ranges).

def _attention_facts(s: Mapping) -> Dict[str, int]:
    return {"head_dim": s["D"], "q_len": s["S"], "k_len": s["S"], "batch_heads": s["B"] * s["H"],
            "causal": int(bool(s.get("causal", False))), "dropout": int(s.get("dropout", 0.1) > 0),
            "masked": int(bool(s.get("pad", True)))}


def _add_layer_norm_facts(s: Mapping) -> Dict[str, int]:
    # the bench's add_layer_norm always has dropout (DROPOUT = 0.1 in fastformer/jobs/bench/ops.py)
    return {"rows": s["N"], "hidden_size": s["C"], "dropout": 1}


FACTS_OF: Dict[str, Callable[[Mapping], Dict[str, int]]] = {
    "attention": _attention_facts,
    "add_layer_norm": _add_layer_norm_facts,
}
FLAGS = ("causal", "dropout", "masked")


def _ranges(values: Iterable[int]) -> Dict[int, Tuple[int, int]]:
    """Each measured size -> the inclusive range it stands for: up to the geometric midpoints to
    its neighbours, a factor 2 beyond the ends."""
    vs = sorted(set(values))
    out = {}
    for i, v in enumerate(vs):
        low = math.floor(math.sqrt(vs[i - 1] * v)) + 1 if i > 0 else math.ceil(v / 2)
        high = math.floor(math.sqrt(v * vs[i + 1])) if i + 1 < len(vs) else 2 * v
        out[v] = (low, high)
    return out


def derive(results: Mapping, machine: str) -> Tuple[Measured, ...]:
    """The classes of one ``results.json`` (its parsed content): every measured shape of an op
    in :data:`FACTS_OF` where a fastformer backend took more than ``1 + MARGIN`` times
    PyTorch's composition, forward + backward. Ops without a fact mapping are left out."""
    device_type = results.get("machine", {}).get("device", "cuda")
    times: Dict[Tuple[str, str, str], Dict[str, Dict[str, float]]] = {}
    shapes: Dict[Tuple[str, str, str], Mapping] = {}
    for row in results["results"]:
        if row.get("status") != "ok" or row["op"] not in FACTS_OF or row["mode"] not in ("fwd", "bwd"):
            continue
        key = (row["op"], row["dtype"], row["label"])
        shapes[key] = row["shape"]
        times.setdefault(key, {}).setdefault(row["provider"], {})[row["mode"]] = row[STATISTIC]
    ranges: Dict[str, Dict[str, Dict[int, Tuple[int, int]]]] = {}
    for op in {k[0] for k in shapes}:
        facts = [FACTS_OF[op](s) for k, s in shapes.items() if k[0] == op]
        ranges[op] = {f: _ranges(fs[f] for fs in facts) for f in facts[0] if f not in FLAGS}
    table = []
    for key in sorted(times, key=lambda k: (k[0], k[1], tuple(FACTS_OF[k[0]](shapes[k]).values()))):
        op, dtype, label = key
        total = {p: m["fwd"] + m["bwd"] for p, m in times[key].items() if "fwd" in m and "bwd" in m}
        if COMPOSITION not in total:
            continue
        ms = tuple((p[len(PROVIDER_PREFIX):], round(t, 4)) for p, t in sorted(total.items())
                   if p.startswith(PROVIDER_PREFIX) and p != PROVIDER_PREFIX + "padded")
        entry = Measured(op, dtype, (), ms, round(total[COMPOSITION], 4), label, machine, device_type)
        if not any(entry.slower(b) for b, _ in ms):
            continue
        facts = FACTS_OF[op](shapes[key])
        where = tuple((f, v, v) if f in FLAGS else (f, *ranges[op][f][v]) for f, v in facts.items())
        table.append(Measured(op, dtype, where, ms, entry.composition_ms, label, machine, device_type))
    return tuple(table)


def derive_file(path: str) -> Tuple[Measured, ...]:
    """:func:`derive` of a results.json; the machine is its folder's name (``nvidia-h200``)."""
    with open(path) as f:
        results = json.load(f)
    return derive(results, os.path.basename(os.path.dirname(os.path.abspath(path))))


def render(table: Sequence[Measured]) -> str:
    """The Python source of ``TABLE = (...)`` for ``table``."""
    lines = ["TABLE: Tuple[Measured, ...] = ("]
    for m in table:
        lines.append(f"    Measured({m.op!r}, {m.dtype!r}, label={m.label!r}, machine={m.machine!r},")
        where = "             where=("
        for i, fact in enumerate(m.where):
            item = repr(fact) + (", " if i + 1 < len(m.where) else "),")
            if len(where) + len(item.rstrip()) > 110:
                lines.append(where.rstrip())
                where = " " * 20
            where += item
        lines.append(where if m.where else "             where=(),")
        lines.append(f"             ms={m.ms!r}, composition_ms={m.composition_ms!r}"
                     + (f", device_type={m.device_type!r}" if m.device_type != "cuda" else "") + "),")
    lines.append(")")
    return "\n".join(lines)


_BEGIN, _END = "# BEGIN TABLE (python -m fastformer.backends.measured <results.json> --write)", "# END TABLE"


def write(table: Sequence[Measured], path: str = __file__) -> None:
    """Replace the block between the TABLE markers of this module's source with ``table``."""
    with open(path) as f:
        source = f.read()
    pattern = re.compile(re.escape(_BEGIN) + r"\n.*?\n" + re.escape(_END), re.S)
    new = pattern.sub(lambda _: f"{_BEGIN}\n{render(table)}\n{_END}", source, count=1)
    with open(path, "w") as f:
        f.write(new)


def lookup(table: Sequence[Measured], op: str, device_type: str, dtype: str,
           facts: Mapping[str, int]) -> Optional[Measured]:
    """The first class of ``table`` the call is in, or None."""
    for m in table:
        if m.op == op and m.device_type == device_type and m.dtype == dtype and m.holds(facts):
            return m
    return None


# The classes measured slower, from benchmarks/results/nvidia-h200/results.json (2026-11-27, host time
# included; see the module's docstring). Generated: edit the results and regenerate, never by hand.
# BEGIN TABLE (python -m fastformer.backends.measured <results.json> --write)
TABLE: Tuple[Measured, ...] = (
    Measured('add_layer_norm', 'bf16', label='N32768 C512', machine='nvidia-h200',
             where=(('rows', 16384, 65536), ('hidden_size', 256, 724), ('dropout', 1, 1)),
             ms=(('cuda', 0.365), ('triton', 0.6507)), composition_ms=0.4458),
    Measured('add_layer_norm', 'bf16', label='N32768 C1024', machine='nvidia-h200',
             where=(('rows', 16384, 65536), ('hidden_size', 725, 2048), ('dropout', 1, 1)),
             ms=(('cuda', 0.4798), ('triton', 0.69)), composition_ms=0.6235),
    Measured('attention', 'bf16', label='B8 H16 S512 D64 nopad full p0', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 0.556), ('triton', 1.2923)), composition_ms=0.4811),
    Measured('attention', 'bf16', label='B8 H16 S512 D64 nopad full p0.1', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 0.7621), ('triton', 1.5408)), composition_ms=0.6579),
    Measured('attention', 'bf16', label='B8 H16 S512 D64 nopad causal p0', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 0.5373), ('triton', 1.4449)), composition_ms=0.5625),
    Measured('attention', 'bf16', label='B8 H16 S512 D64 nopad causal p0.1', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 0.5904), ('triton', 1.2927)), composition_ms=0.5757),
    Measured('attention', 'bf16', label='B8 H16 S2048 D64 nopad full p0', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 4.6862), ('triton', 2.3359)), composition_ms=2.2882),
    Measured('attention', 'bf16', label='B8 H16 S2048 D64 nopad full p0.1', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 6.1633), ('triton', 5.4223)), composition_ms=3.2622),
    Measured('attention', 'bf16', label='B8 H16 S2048 D64 nopad causal p0', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 2.7304), ('triton', 1.8133)), composition_ms=2.2131),
    Measured('attention', 'bf16', label='B8 H16 S2048 D64 nopad causal p0.1', machine='nvidia-h200',
             where=(('head_dim', 32, 90), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 3.6008), ('triton', 3.288)), composition_ms=3.2819),
    Measured('attention', 'bf16', label='B8 H16 S512 D128 nopad full p0', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 0.8072), ('triton', 1.3655)), composition_ms=0.6845),
    Measured('attention', 'bf16', label='B8 H16 S512 D128 nopad full p0.1', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 0.9395), ('triton', 1.9911)), composition_ms=0.8614),
    Measured('attention', 'bf16', label='B8 H16 S512 D128 nopad causal p0', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 0.5999), ('triton', 0.9967)), composition_ms=0.5909),
    Measured('attention', 'bf16', label='B8 H16 S512 D128 nopad causal p0.1', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 256, 1024), ('k_len', 256, 1024),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 0.7658), ('triton', 1.4657)), composition_ms=0.822),
    Measured('attention', 'bf16', label='B8 H16 S2048 D128 nopad full p0', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 7.3566), ('triton', 5.5559)), composition_ms=3.8038),
    Measured('attention', 'bf16', label='B8 H16 S2048 D128 nopad full p0.1', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 0, 0), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 8.7357), ('triton', 13.8261)), composition_ms=5.8729),
    Measured('attention', 'bf16', label='B8 H16 S2048 D128 nopad causal p0', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 0, 0), ('masked', 0, 0)),
             ms=(('cuda', 4.1086), ('triton', 3.3419)), composition_ms=3.6716),
    Measured('attention', 'bf16', label='B8 H16 S2048 D128 nopad causal p0.1', machine='nvidia-h200',
             where=(('head_dim', 91, 256), ('q_len', 1025, 4096), ('k_len', 1025, 4096),
                    ('batch_heads', 64, 256), ('causal', 1, 1), ('dropout', 1, 1), ('masked', 0, 0)),
             ms=(('cuda', 4.9304), ('triton', 7.411)), composition_ms=5.8445),
)
# END TABLE


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    do_write = "--write" in args
    paths = [a for a in args if a != "--write"] or [RESULTS]
    table = tuple(m for path in paths for m in derive_file(path))
    if do_write:
        write(table)
        print(f"wrote {len(table)} classes into {__file__}")
    else:
        print(render(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
