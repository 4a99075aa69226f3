"""The one table of ops (fastformer/op_table.py) against every list of ops in the house.

``problems(table)`` names, per op, each list that lacks it and each op a list has that the table
lacks. The lists derived from the table are compared too, so a list that stops deriving from it
shows up here. The last two tests run it on deliberately wrong tables: one with an op that no
list has, one without an op that every list has.
"""
import ast
import os
import re
from typing import Callable, Dict, List, Sequence, Set

import pytest
import torch

import fastformer
from fastformer import _ext, backends, fake_ops, op_table, ops
from fastformer.backends import builtin, declaration
from fastformer.jobs import check
from fastformer.jobs.bench import ops as bench_ops
from fastformer.jobs.bench import train_step
from fastformer.ops import reference
from fastformer.triton_kernels import MODULES as TRITON_MODULES
import utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_DIR = os.path.join(ROOT, "fastformer", "triton_kernels")
NOT_AN_OP_KERNEL = {"philox_bits", "next_seed", "cpu_capability", "dropout_fill"}  # helpers, not fused ops


def _defined_names(path: str) -> Set[str]:
    """The module-level names a Python file defines (assignments and defs), read without importing
    it: a Triton module imports triton."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _library_kernels() -> Set[str]:
    """The fastformer:: ops of the built C++ library that have a CPU kernel."""
    assert _ext.load_error() is None, _ext.load_error()
    names = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastformer::")}
    return {n for n in names if _ext.has_kernel(n, "CPU")} - NOT_AN_OP_KERNEL


def _op_of_function(name: str, table: Sequence[op_table.Op]) -> str:
    """The op a kernel function or overload name belongs to (``attention_varlen_bwd.into`` ->
    ``attention_varlen``): the longest op name it starts with, else the name up to its last ``_``."""
    base = name.split(".")[0]
    owners = [op.name for op in table if base.startswith(op.name + "_")]
    return max(owners, key=len) if owners else base.rsplit("_", 1)[0]


# Each list: (where it is, the op names it holds). The derived ones are read back as they are.
def _lists() -> Dict[str, Callable[[], Set[str]]]:
    return {
        "backends.declaration.OPS (derived)": lambda: set(declaration.OPS),
        "backends.builtin.TRITON_MODULE_OF (derived)": lambda: set(builtin.TRITON_MODULE_OF),
        "tests/utils.py ALL_OPS (derived)": lambda: set(utils.ALL_OPS),
        "fastformer.ops (the public functions)": lambda: {n for n in ops.__all__ if callable(getattr(ops, n))},
        "fastformer.ops.reference (the definitions)": lambda: {n for n in dir(reference)
                                                               if callable(getattr(reference, n))},
        "fastformer/jobs/check.py OPS": lambda: set(check.OPS),
        "fastformer/jobs/bench/ops.py OPS": lambda: set(bench_ops.OPS),
    }


def problems(table: Sequence[op_table.Op]) -> List[str]:
    """Every disagreement between ``table`` and the house's lists of ops, one line each."""
    found = []
    names = [op.name for op in table]
    if len(set(names)) != len(names):
        found.append(f"the table names an op twice: {names}")
    # The functional op files and the reference may hold helpers and variants beyond the table
    # (attention_varlen_qkvpacked, ...): only a missing op counts there.
    superset_ok = {"fastformer.ops (the public functions)", "fastformer.ops.reference (the definitions)"}
    for where, read in _lists().items():
        held = read()
        wanted = {op.name for op in table if op.bench} if "bench" in where else set(names)
        found += [f"{op}: missing from {where}" for op in sorted(wanted - held)]
        if where not in superset_ok:
            found += [f"{op}: in {where} but not in the table" for op in sorted(held - set(names))]
    # The kernels: the C++ library (csrc/schemas.h + csrc/cpu), the fakes, the Triton host functions.
    library, fakes = _library_kernels(), set(fake_ops.FAKES) - NOT_AN_OP_KERNEL
    for op in table:
        for fn in op.functions + op.overload_names:
            if fn not in library:
                found.append(f"{op.name}: {fn} missing from the C++ library (csrc/schemas.h, csrc/cpu/{op.name}.cpp)")
            if fn not in fakes:
                found.append(f"{op.name}: {fn} missing from fastformer/fake_ops.py")
        module = os.path.join(TRITON_DIR, op.triton_module + ".py")
        missing = [fn for fn in op.functions if fn not in _defined_names(module)]
        if missing:
            found.append(f"{op.name}: {', '.join(missing)} missing from "
                         f"fastformer/triton_kernels/{op.triton_module}.py")
        if not os.path.exists(os.path.join(ROOT, "tests", f"test_{op.name}.py")):
            found.append(f"{op.name}: missing its tests, tests/test_{op.name}.py")
    for where, held in (("the C++ library", library), ("fastformer/fake_ops.py", fakes)):
        found += [f"{op}: in {where} but not in the table"
                  for op in sorted({_op_of_function(fn, table) for fn in held} - set(names))]
    return found


def test_every_list_holds_every_op_of_the_table():
    assert problems(op_table.TABLE) == []


def test_the_derived_lists_are_the_tables():
    assert declaration.OPS == op_table.NAMES
    assert declaration.OVERLOADS == {"attention_varlen": ("bwd.into",), "add_layer_norm": ("fwd.x_bias", "bwd.x_bias")}
    assert builtin.TRITON_MODULE_OF["linear_cross_entropy"] == "cross_entropy"
    assert set(TRITON_MODULES) == {op.triton_module for op in op_table.TABLE}
    assert set(train_step.STEP_OPS) <= set(op_table.NAMES)


def test_the_backend_choices_are_the_registry():
    from fastformer.jobs import cli, config

    choices = ("auto",) + backends.NAMES
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.choices and "train" in a.choices).choices
    for command in ("train", "translate"):
        backend = next(a for a in subs[command]._actions if "--backend" in a.option_strings)
        assert tuple(backend.choices) == choices, command
    assert check.KERNEL_BACKENDS == tuple(n for n in backends.NAMES if n != "reference")
    with pytest.raises(ValueError, match=re.escape(f"--backend must be one of {sorted(choices)}")):
        config.TrainConfig(backend="nope").validate()


def test_an_op_no_list_has_is_named_with_every_list():
    """A row added to the table alone: each list it still lacks is named."""
    found = problems(op_table.TABLE + (op_table.Op("frobnicate", overloads=("fwd.fast",)),))
    frob = [line for line in found if line.startswith("frobnicate:")]
    for where in _lists():
        assert f"frobnicate: missing from {where}" in frob
    for fn in ("frobnicate_fwd", "frobnicate_bwd", "frobnicate_fwd.fast"):
        assert f"frobnicate: {fn} missing from the C++ library (csrc/schemas.h, csrc/cpu/frobnicate.cpp)" in frob
        assert f"frobnicate: {fn} missing from fastformer/fake_ops.py" in frob
    assert "frobnicate: frobnicate_fwd, frobnicate_bwd missing from fastformer/triton_kernels/frobnicate.py" in frob
    assert "frobnicate: missing its tests, tests/test_frobnicate.py" in frob
    assert len(frob) == len(found) == len(_lists()) + 6 + 2


def test_an_op_missing_from_the_table_is_named_with_every_list_that_has_it():
    """A table without embedding: every list that still has it says so."""
    found = problems(tuple(op for op in op_table.TABLE if op.name != "embedding"))
    for where in ("fastformer/jobs/check.py OPS", "fastformer/jobs/bench/ops.py OPS", "the C++ library",
                  "fastformer/fake_ops.py", "backends.declaration.OPS (derived)", "tests/utils.py ALL_OPS (derived)"):
        assert f"embedding: in {where} but not in the table" in found
    assert not any(line.startswith(("attention", "feed_forward")) for line in found)
