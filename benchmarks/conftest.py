"""The benchmark suite: ``pytest benchmarks/ --benchmark-only --benchmark-group-by=group``.

Files are named ``bench_*.py`` (so ``make test``, which collects ``tests/``, never runs them);
this hook collects them when ``benchmarks/`` is given to pytest.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collect_file(file_path, parent):
    # a file named on the command line is collected by pytest itself; do not collect it twice
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
