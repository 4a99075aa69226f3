"""Every public op of ``fastformer.ops`` has hostile-input cases: its file
``tests/test_<op>_hostile.py`` exports them as ``BAD_INPUT = {op: {case: (thunk, exception,
match)}}`` and runs them there with every backend forced (the machinery: tests/hostile.py)."""
import glob
import importlib
import os

from fastformer import ops

HERE = os.path.dirname(os.path.abspath(__file__))


def _bad_input_tables():
    tables = {}
    for path in sorted(glob.glob(os.path.join(HERE, "test_*_hostile.py"))):
        module = importlib.import_module(os.path.basename(path)[:-3])
        for op, cases in getattr(module, "BAD_INPUT", {}).items():
            assert op not in tables, f"{op}'s hostile cases are in two files"
            tables[op] = cases
    return tables


def test_every_public_op_has_hostile_cases():
    public = [name for name in ops.__all__ if callable(getattr(ops, name))]
    tables = _bad_input_tables()
    assert sorted(public) == sorted(tables), f"ops.__all__ {public} and the hostile cases {sorted(tables)} differ"
    assert all(tables.values()), f"ops without a case: {[op for op, cases in tables.items() if not cases]}"
