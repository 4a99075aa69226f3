"""``python -m fastformer check``: every op, forward and backward, on every kernel backend
that can run here, against :mod:`fastformer.ops.reference`.

One line per (op, backend, dtype): PASS or FAIL, the worst error over the cases (outputs and
every gradient) and the tolerance it was held to. fp32 is held to ``atol + rtol * max|ref|``
per tensor; fp16/bf16 to FlashAttention's rule, the kernel's error against the fp32 reference
at most ``LOWP_FACTOR`` times the error of the reference itself computed in that precision
(plus a small floor). The exit status is non-zero when any line fails.
"""
import argparse
import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import backends, ops
from ..ops import reference

KERNEL_BACKENDS = tuple(name for name in backends.NAMES if name != "reference")
# fp32 (atol, rtol) per tensor, held against max|ref| (sums over up to ~1000 terms).
FP32_TOL = (1e-4, 1e-4)
# Low precision: error <= LOWP_FACTOR x the reference's own low-precision error + LOWP_FLOOR x max|ref|.
LOWP_FACTOR = 3.0
LOWP_FLOOR = 1e-3
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Case:
    """One call: ``make(gen)`` -> (fp32 input tensors, the op's keyword arguments)."""
    name: str
    make: Callable[[torch.Generator], Tuple[List[Optional[torch.Tensor]], dict]]


def _rand(gen, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=gen)


def _attention_case(B, H, Sq, Sk, D, masks):
    def make(gen):
        q, k, v = _rand(gen, B, H, Sq, D), _rand(gen, B, H, Sk, D), _rand(gen, B, H, Sk, D)
        kw = {"is_causal": "causal" in masks}
        if "kpm" in masks:  # right padding, at least one key left
            lengths = torch.randint(1, Sk + 1, (B,), generator=gen)
            kw["key_padding_mask"] = torch.arange(Sk)[None, :] >= lengths[:, None]  # (B, Sk)
        if "bool" in masks:
            kw["attn_mask"] = torch.rand(Sq, Sk, generator=gen) < 0.2  # (Sq, Sk)
        if "float" in masks:
            kw["attn_mask"] = _rand(gen, B, 1, Sq, Sk)  # (B, 1, Sq, Sk)
        return [q, k, v], kw
    return Case(f"B{B} H{H} {Sq}x{Sk} D{D} {'+'.join(masks) or 'nomask'}", make)


def _varlen_case(H, D, lengths_q, lengths_k, causal):
    def make(gen):
        def cu(lengths):  # (B + 1,) int32 cumulative lengths
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        q, k, v = (_rand(gen, sum(n), H, D) for n in (lengths_q, lengths_k, lengths_k))
        return [q, k, v], {"cu_seqlens_q": cu(lengths_q), "cu_seqlens_k": cu(lengths_k),
                           "max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k), "is_causal": causal}
    return Case(f"H{H} D{D} lengths {lengths_q} x {lengths_k}{' causal' if causal else ''}", make)


def _aln_case(N, C, prenorm, rms_norm=False):
    def make(gen):
        return [_rand(gen, N, C), _rand(gen, N, C), 1 + _rand(gen, C, scale=0.1), _rand(gen, C, scale=0.1)], \
            {"prenorm": prenorm, "rms_norm": rms_norm}
    return Case(f"{N}x{C}{' prenorm' if prenorm else ''}{' rms_norm' if rms_norm else ''}", make)


def _ff_case(N, E, F, activation, gated=False):
    """gated: T5's GeGLU / LLaMA's SwiGLU, w3 given and no biases but b2."""
    def make(gen):
        inputs = [_rand(gen, N, E), _rand(gen, F, E, scale=E ** -0.5), _rand(gen, F, scale=0.1),
                  _rand(gen, E, F, scale=F ** -0.5), _rand(gen, E, scale=0.1)]
        if gated:
            inputs[2] = None
            inputs += [_rand(gen, F, E, scale=E ** -0.5), None]
        return inputs, {"activation": activation}
    return Case(f"{N}x{E}->{F} {activation}{' gated' if gated else ''}", make)


def _up_as_input(fn: Callable) -> Callable:
    """``fn(x, w1, b1, w2, b2, *, w3, b3)`` called with the gated form's w3 and b3 positionally
    after b2 (absent: the plain form): the checker passes every differentiable tensor positionally."""
    def call(x, w1, b1, w2, b2, w3=None, b3=None, **kwargs):
        return fn(x, w1, b1, w2, b2, w3=w3, b3=b3, **kwargs)
    return call


def _targets(gen, N, V, ignore_index):
    t = torch.randint(0, V, (N,), generator=gen)
    t[torch.rand(N, generator=gen) < 0.25] = ignore_index
    t[0] = 0  # at least one row counts
    return t


def _class_weight(gen, V, weighted):
    """torch's class weights in [0.1, 2) (keyword ``weight``), or nothing."""
    return {"weight": 0.1 + 1.9 * torch.rand(V, generator=gen)} if weighted else {}


def _ce_case(N, V, smoothing, weighted=False):
    def make(gen):
        return [_rand(gen, N, V, scale=2.0)], {"target": _targets(gen, N, V, -100), "label_smoothing": smoothing,
                                               **_class_weight(gen, V, weighted)}
    return Case(f"{N}x{V} smoothing {smoothing} ignore -100{' class weights' if weighted else ''}", make)


def _lce_case(N, D, V, smoothing, weighted=False):
    def make(gen):
        return [_rand(gen, N, D), _rand(gen, V, D, scale=D ** -0.5), _rand(gen, V, scale=0.1)], \
            {"target": _targets(gen, N, V, 3), "label_smoothing": smoothing, "ignore_index": 3,
             **_class_weight(gen, V, weighted)}
    return Case(f"{N}x{D}->{V} smoothing {smoothing} ignore 3{' class weights' if weighted else ''}", make)


def _bias_as_input(fn: Callable) -> Callable:
    """``fn(input, linear_weight, target, *, linear_bias)`` (torch's order) called as
    ``(input, linear_weight, linear_bias, *, target)``: the checker passes every differentiable
    tensor positionally, so the bias's gradient is checked like the others."""
    def call(input, linear_weight, linear_bias, *, target, **kwargs):
        return fn(input, linear_weight, target, linear_bias=linear_bias, **kwargs)
    return call


def _emb_case(shape, V, D, packed, padding_idx):
    def make(gen):
        ids = torch.randint(0, V, shape, generator=gen)
        ids.view(-1)[::3] = ids.view(-1)[0]  # a repeated id: its gradient row sums many rows
        kw = {"input": ids, "scale": D ** 0.5, "padding_idx": padding_idx}
        P = shape[-1] + 2
        if packed:  # positions of packed rows, restarting within the row
            kw["positions"] = torch.randint(0, P, shape, generator=gen)
        return [_rand(gen, V, D), _rand(gen, P, D)], kw
    return Case(f"{'x'.join(map(str, shape))} ids V{V} D{D}{' packed' if packed else ''}"
                f"{f' padding_idx {padding_idx}' if padding_idx is not None else ''}", make)


def _tables_as_inputs(fn: Callable) -> Callable:
    """``fn(input, weight, *, positional, ...)`` called as ``(weight, positional, *, input, ...)``: the
    checker passes every differentiable tensor positionally (a learned positional table's too)."""
    def call(weight, positional, *, input, **kwargs):
        return fn(input, weight, positional=positional, **kwargs)
    return call


# op name -> (fastformer op, reference op, cases). Odd sizes on purpose.
OPS: Dict[str, Tuple[Callable, Callable, List[Case]]] = {
    "attention": (ops.attention, reference.attention, [
        _attention_case(1, 1, 1, 1, 64, ()),
        _attention_case(2, 3, 7, 7, 40, ("kpm", "causal")),
        _attention_case(1, 2, 13, 29, 59, ("bool",)),
        _attention_case(2, 1, 29, 13, 80, ("causal", "float")),
    ]),
    "attention_varlen": (ops.attention_varlen, reference.attention_varlen, [
        _varlen_case(2, 40, [7, 1, 0, 29], [7, 1, 3, 29], True),
        _varlen_case(3, 59, [13, 2], [29, 0], False),
    ]),
    "add_layer_norm": (ops.add_layer_norm, reference.add_layer_norm, [
        _aln_case(7, 1023, False), _aln_case(16, 64, False), _aln_case(5, 333, True),
        _aln_case(7, 1023, False, rms_norm=True), _aln_case(3, 4097, True, rms_norm=True),
    ]),
    "feed_forward": (_up_as_input(ops.feed_forward), _up_as_input(reference.feed_forward), [
        _ff_case(7, 40, 111, "relu"), _ff_case(16, 64, 256, "gelu"), _ff_case(1, 33, 65, "gelu"),
        _ff_case(5, 48, 97, "silu"), _ff_case(9, 24, 67, "gelu_tanh", gated=True),
        _ff_case(4, 40, 88, "silu", gated=True),
    ]),
    "cross_entropy": (ops.cross_entropy, reference.cross_entropy, [
        _ce_case(7, 1001, 0.1), _ce_case(16, 128, 0.0), _ce_case(9, 203, 0.1, weighted=True),
    ]),
    "linear_cross_entropy": (_bias_as_input(ops.linear_cross_entropy),
                             _bias_as_input(reference.linear_cross_entropy), [
        _lce_case(13, 40, 1001, 0.1), _lce_case(4, 64, 97, 0.0), _lce_case(11, 24, 203, 0.1, weighted=True),
    ]),
    "embedding": (_tables_as_inputs(ops.embedding), _tables_as_inputs(reference.embedding), [
        _emb_case((3, 37), 101, 40, False, None), _emb_case((5,), 7, 1023, True, 0), _emb_case((2, 9), 13, 7, True, None),
    ]),
}


def _run(fn, inputs: Sequence[Optional[torch.Tensor]], kwargs: dict, douts_gen: torch.Generator):
    """fn's outputs and the gradients of every input, for a seeded random upstream gradient."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    douts = [torch.randn(o.shape, generator=douts_gen).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, [t for t in leaves if t is not None], douts)
    return [o.detach() for o in outs] + list(grads)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    return math.inf if not torch.isfinite(d).all() else d.max().item()


def check_case(op: str, case: Case, backend: str, device: str, dtype: torch.dtype) -> Tuple[float, float]:
    """(the worst error / tolerance ratio's error, its tolerance) over the case's outputs and grads."""
    fn, ref_fn, _ = OPS[op]
    inputs, kwargs = case.make(torch.Generator().manual_seed(0))
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    low = [None if t is None else t.to(device, dtype) for t in inputs]  # the inputs the kernel sees
    exact = [None if t is None else t.float() for t in low]             # the same values, in fp32

    def kernel(*args, **kw):
        with backends.use_backend(backend):
            return fn(*args, **kw)

    got = _run(kernel, low, kwargs, torch.Generator().manual_seed(1))
    want = _run(ref_fn, exact, kwargs, torch.Generator().manual_seed(1))
    lowp = _run(ref_fn, low, kwargs, torch.Generator().manual_seed(1)) if dtype != torch.float32 else None
    worst = (0.0, 1.0)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item() if w.numel() else 0.0
        if dtype == torch.float32:
            tol = FP32_TOL[0] + FP32_TOL[1] * scale
        else:
            tol = LOWP_FACTOR * _err(lowp[i], w) + LOWP_FLOOR * max(scale, 1e-3)
        err = _err(g, w)
        if g.dtype != dtype:
            err = math.inf
        if err / tol > worst[0] / worst[1]:
            worst = (err, tol)
    return worst


def targets(names: Optional[Sequence[str]] = None) -> List[Tuple[str, str, Optional[str]]]:
    """(backend, device, reason it cannot run or None) for each kernel backend asked for."""
    out = []
    for name in names or KERNEL_BACKENDS:
        device = "cuda" if name == "cuda" or torch.cuda.is_available() else "cpu"
        if name == "triton" and device == "cpu" and not names:
            out.append((name, device, "runs on a GPU (ask for it with --backend triton to use the interpreter)"))
            continue
        avail = backends.availability(name, device)
        out.append((name, device, None if avail else avail.reason))
    return out


def _kernel_configs(backend: str, autotune: bool):
    """Triton's autotuned kernels run their first config (as in deterministic mode) unless
    ``autotune``: autotuning compiles and times every candidate config of every shape bucket,
    which on a fresh Triton cache took longer than make gpu-check's 80 s for the whole check (H200)."""
    if backend != "triton" or autotune:
        return contextlib.nullcontext()
    from ..triton_kernels.utils import first_configs  # triton is importable: the backend is available

    return first_configs()


def _check_line(op: str, backend: str, device: str, dtype: torch.dtype, print_fn) -> bool:
    """Every case of ``op`` on one backend and dtype, printed as one line with the worst error."""
    worst, fail, bad_case = (0.0, 1.0), None, ""
    for case in OPS[op][2]:
        try:
            err, tol = check_case(op, case, backend, device, dtype)
        except Exception as e:  # a kernel that raises fails its line, the rest still run
            fail = f"{case.name}: {type(e).__name__}: {e}"
            break
        if err / tol > worst[0] / worst[1]:
            worst, bad_case = (err, tol), case.name
    ok = fail is None and worst[0] <= worst[1]
    detail = fail or f"max err {worst[0]:.2e} (tol {worst[1]:.2e}) worst case: {bad_case}"
    print_fn(f"{'PASS' if ok else 'FAIL'} {op:<21} {backend:<7} {DTYPE_NAMES[dtype]:<5} {detail}")
    return ok


def run(backend_names: Optional[Sequence[str]] = None, op_names: Optional[Sequence[str]] = None,
        print_fn=print, autotune: bool = False) -> int:
    """Print the availability table and one line per (op, backend, dtype); the number of failures.
    ``autotune``: let Triton autotune as in training, instead of running each kernel's first config."""
    print_fn("backends:")
    for name, avail in backends.available_backends().items():
        print_fn(f"  {name:<10} {'available' if avail else 'unavailable'}{': ' + avail.reason if avail.reason else ''}")
    failures = ran = 0
    for backend, device, why in targets(backend_names):
        if why is not None:
            print_fn(f"skip {backend}: {why}")
            continue
        dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])
        with _kernel_configs(backend, autotune):
            for op in op_names or OPS:
                for dtype in dtypes:
                    ran += 1
                    failures += not _check_line(op, backend, device, dtype, print_fn)
    if ran == 0:
        print_fn("FAIL no kernel backend could run here")
        return 1
    print_fn(f"{ran - failures}/{ran} passed")
    return failures


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", choices=KERNEL_BACKENDS, dest="backends",
                   help="check only this backend (repeatable; default: every one that can run here, "
                        "triton only on a GPU)")
    p.add_argument("--op", action="append", choices=sorted(OPS), dest="ops", help="check only this op (repeatable)")
    p.add_argument("--autotune", action="store_true",
                   help="let Triton autotune every shape, as training does (default: each autotuned kernel runs its "
                        "first config; autotuning compiles every candidate, slow on a fresh Triton cache)")


__all__ = ["run", "check_case", "targets", "add_arguments", "OPS"]
