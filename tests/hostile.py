"""The machinery of every op's hostile-input tests (``tests/test_<op>_hostile.py``), so that no
op's file copies it:

* ``bad_input_test(**tables)``: the test that each bad call to the Python op raises a ValueError /
  TypeError whose message names the argument (checked with ``match``), with every backend forced
  (the op checks run before a backend is chosen, so no backend lets one through to its kernels).
  A table maps a case name to ``(thunk, exception, match)``; the op files export theirs as
  ``BAD_INPUT = {op: table}`` (test_hostile_ops.py checks that every public op has one).
* ``kernel_call`` / ``cpp_checks_test(module)``: the C++ ops called directly
  (``torch.ops.fastformer.<op>``, past the Python checks) with bad arguments must each raise a
  RuntimeError from a TORCH_CHECK whose message contains the given text; each op's cases run in
  a child process, so a segfault fails that op's test instead of killing pytest.
* ``assert_like_reference``: empty input gives what the reference gives, gradients included.

Mixed devices use the ``meta`` device, which exists on every machine."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fastformer
from utils import kernel_backends

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()
HERE = os.path.dirname(os.path.abspath(__file__))


def tensor(*shape, dtype=torch.float32, device="cpu"):
    """Random values of a floating ``dtype``, zeros of any other."""
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def strided(*shape):
    """A tensor of ``shape`` whose last dimension has stride 2 (not contiguous)."""
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def cu_seqlens(*lengths):
    """int32 (B + 1,) offsets of sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------ bad input to the Python op
def bad_input_test(**tables):
    """A test over every case of every ``op=table`` given, with every backend forced; ids
    ``<op>-<case>-<backend>``."""
    cases = [pytest.param(call, exc, match, id=f"{op}-{name}")
             for op, table in tables.items() for name, (call, exc, match) in table.items()]

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("call, exc, match", cases)
    def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
        with fastformer.use_backend(backend), pytest.raises(exc, match=match):
            call()
    return test_bad_input_raises_naming_the_argument


# ---------------------------------------------------------------- bad arguments to the C++ ops
def kernel_call(name, good):
    """A caller of ``torch.ops.fastformer.<name>``: keyword arguments override those of
    ``good()`` (fresh valid arguments) and are passed in schema order (an argument with a default
    in the schema takes it when neither gives it); ``seed`` and ``offset``
    are 0 unless given. Where the schema takes a ``philox`` tensor, the ints ``seed`` and
    ``offset`` become ``tensor([seed, offset])`` (int64 CPU (2,)) unless ``philox`` is given."""
    def call(**over):
        op = getattr(torch.ops.fastformer, name).default
        names = [a.name for a in op._schema.arguments]
        rng = dict(seed=0, offset=0) if {"philox", "seed"} & set(names) else {}
        kw = {**rng, **good(), **over}
        if "philox" in names:
            seed, offset = kw.pop("seed"), kw.pop("offset")
            kw.setdefault("philox", torch.tensor([seed, offset], dtype=torch.int64))
        # an argument with a schema default (a later addition, e.g. class_weight) may be left out
        args = [kw.pop(a.name) if a.name in kw or not a.has_default_value() else a.default_value
                for a in op._schema.arguments]
        assert not kw, f"{name} has no arguments {sorted(kw)}"
        return op(*args)
    return call


def child(cases) -> None:
    """Run one op's cases here (a child process) and print one JSON line per case."""
    from fastformer import _ext

    assert _ext.load_error() is None, _ext.load_error()
    for name, (thunk, _) in cases.items():
        try:
            thunk()
            result = {"case": name, "error": None, "message": ""}
        except Exception as e:  # report every exception type: the test asserts RuntimeError
            result = {"case": name, "error": type(e).__name__, "message": str(e).splitlines()[0]}
        print(json.dumps(result), flush=True)


def cpp_checks_test(module, table="BAD_KERNEL_ARGS"):
    """A test per group of ``module.<table>`` ({group: {case: (thunk, text the TORCH_CHECK
    message must contain)}}), on the cpu backend; ids ``<group>-cpu``."""
    groups = getattr(sys.modules[module], table)

    @pytest.mark.parametrize("backend", kernel_backends("cpu"))
    @pytest.mark.parametrize("group", list(groups))
    def test_cpp_ops_reject_bad_arguments(backend, group):
        code = (f"import sys; sys.path.insert(0, {HERE!r}); import hostile, {module} as t; "
                f"hostile.child(t.{table}[{group!r}])")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ))
        assert proc.returncode == 0, f"{group}: the child died (status {proc.returncode}):\n{proc.stderr[-3000:]}"
        results = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}
        assert set(results) == set(groups[group]), f"cases missing from the child's report: {proc.stderr[-2000:]}"
        bad = []
        for name, (_, want) in groups[group].items():
            r = results[name]
            if r["error"] != "RuntimeError" or want not in r["message"]:
                bad.append(f"{name}: {r['error']}: {r['message']!r} (want RuntimeError containing {want!r})")
        assert not bad, "\n".join(bad)
    return test_cpp_ops_reject_bad_arguments


# ----------------------------------------------------------------------------------- empty input
def leaves(*shapes):
    return [torch.randn(s, dtype=torch.float32, requires_grad=True) for s in shapes]


def run(backend, fn, inputs):
    """fn(*inputs) on ``backend``, then the gradients of the inputs for an all-ones upstream."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    with fastformer.use_backend(backend):
        out = fn(*xs)
        out.backward(torch.ones_like(out))
    return out.detach(), [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def assert_like_reference(backend, kernel_fn, ref_fn, inputs):
    """``kernel_fn`` on ``backend`` gives ``ref_fn``'s output (NaN where it has NaN) and gradients
    of the inputs' shapes and values."""
    out, grads = run(backend, kernel_fn, inputs)
    ref, ref_grads = run("reference", ref_fn, inputs)
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    torch.testing.assert_close(out, ref, equal_nan=True, atol=1e-5, rtol=1e-5)
    for x, g, rg in zip(inputs, grads, ref_grads):
        assert g.shape == x.shape
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)
