"""The house's layering, read from the source with ``ast`` (nothing is imported):

* the library (everything in ``fastformer/`` outside ``fastformer/jobs/`` and ``__main__.py``,
  the Triton kernels of ``fastformer/triton_kernels/`` included) never imports the jobs'
  subpackage ``fastformer.jobs``;
* the import graph of ``fastformer/`` has no circle.

Every import counts, at module level or inside a function (a function-level import still ties
the two modules together; it only hides the circle until the call), except those under
``if TYPE_CHECKING:``, which never run. ``importlib.import_module("literal")`` counts too.
Importing ``a.b.c`` is an edge to ``a.b.c`` alone: the parent packages' ``__init__`` run first,
but a package importing its own submodules is how packages work, not a circle.
"""
import ast
import os
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fastformer",)
JOBS = "fastformer.jobs"

Edges = Dict[str, Dict[str, Tuple[str, int]]]  # module -> imported module -> (file, line)


def module_names(root: str) -> Dict[str, str]:
    """Dotted module name -> file, for every .py under the packages in ``root``."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, root)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts.pop()
                    found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """What a file imports, as ``(candidates, line)``: the first candidate that is a module of
    the packages is the one imported (``from X import a`` imports the submodule ``X.a`` if
    there is one, else the name ``a`` from ``X``)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: List[Tuple[Tuple[str, ...], int]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [((alias.name,), node.lineno) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        self.found += [((f"{source}.{alias.name}", source), node.lineno) for alias in node.names]

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
            self.found.append(((node.args[0].value,), node.lineno))
        self.generic_visit(node)


def import_graph(root: str = ROOT) -> Edges:
    """module -> {module of the packages it imports: (file, line) of the first such import}."""
    modules = module_names(root)
    graph: Edges = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        visitor = _Imports(module, os.path.basename(path) == "__init__.py")
        visitor.visit(tree)
        edges = graph.setdefault(module, {})
        for candidates, line in visitor.found:
            known = [c for c in candidates if c in modules]
            if known and known[0] != module:
                edges.setdefault(known[0], (os.path.relpath(path, root), line))
    return graph


def is_job(module: str) -> bool:
    return module == JOBS or module.startswith(JOBS + ".") or module == "fastformer.__main__"


def library_imports_of_jobs(graph: Edges) -> List[str]:
    """``file:line: module imports job`` for every import of the jobs by a library module."""
    return [f"{where[0]}:{where[1]}: {module} imports {target}"
            for module, edges in sorted(graph.items()) if not is_job(module)
            for target, where in sorted(edges.items()) if is_job(target)]


def find_cycle(graph: Edges) -> Optional[List[str]]:
    """One import circle as ``[m0, m1, ..., m0]``, or None."""
    state: Dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: List[str] = []

    def visit(module: str) -> Optional[List[str]]:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def describe(cycle: List[str], graph: Edges) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b][0]}:{graph[a][b][1]})" for a, b in zip(cycle, cycle[1:]))


# -- the house ------------------------------------------------------------------------------------
def test_the_library_never_imports_the_jobs():
    graph = import_graph()
    assert any(m.startswith(JOBS + ".") for m in graph), "fastformer/jobs/ not found: is the layout test stale?"
    bad = library_imports_of_jobs(graph)
    assert not bad, "the library imports fastformer.jobs (jobs import the library, never the reverse):\n" + \
        "\n".join(bad)


def test_the_package_has_no_import_circle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle:\n" + describe(cycle, graph)


def test_the_jobs_share_devices_and_config_instead_of_importing_each_other():
    """translate needs the model and device picking, which live below the jobs, not in train."""
    graph = import_graph()
    assert "fastformer.jobs.train" not in graph["fastformer.jobs.translate"]
    assert "fastformer.jobs.train" not in graph["fastformer.jobs.bench"]
    assert {"fastformer.jobs.config", "fastformer.jobs.devices"} <= set(graph["fastformer.jobs.translate"])


# -- the checker itself, on a made-up tree --------------------------------------------------------
def _tree(tmp_path, files: Dict[str, str]) -> str:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_the_checker_sees_relative_function_level_and_aliased_imports(tmp_path):
    root = _tree(tmp_path, {
        "fastformer/__init__.py": "from . import ops\n",
        "fastformer/ops/__init__.py": "from .core import f\n",
        "fastformer/ops/core.py": "def f():\n    from ..jobs import train\n",  # function level, relative
        "fastformer/jobs/__init__.py": "",
        "fastformer/jobs/train.py": "import fastformer.ops.core\n",
        "fastformer/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fastformer.jobs\n",
        "fastformer/triton_kernels/__init__.py": "",
        "fastformer/triton_kernels/a.py": "from fastformer.triton_kernels import b\n",
        "fastformer/triton_kernels/b.py": "import importlib\nX = importlib.import_module('fastformer.triton_kernels.a')\n",
    })
    graph = import_graph(root)
    assert library_imports_of_jobs(graph) == [
        f"{os.path.join('fastformer', 'ops', 'core.py')}:2: fastformer.ops.core imports fastformer.jobs.train"]
    assert graph["fastformer.ops"] == {"fastformer.ops.core": (os.path.join("fastformer", "ops", "__init__.py"), 1)}
    assert "fastformer.jobs" not in graph["fastformer.typed"]  # TYPE_CHECKING imports never run
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) == 3
    assert set(cycle) in ({"fastformer.ops.core", "fastformer.jobs.train"}, {"fastformer.triton_kernels.a", "fastformer.triton_kernels.b"})
    assert "->" in describe(cycle, graph)


def test_a_package_importing_its_submodules_is_no_circle(tmp_path):
    root = _tree(tmp_path, {
        "fastformer/__init__.py": "from .ops import f\n",
        "fastformer/ops/__init__.py": "from .core import f\n",
        "fastformer/ops/core.py": "from .. import backends\n\ndef f():\n    pass\n",
        "fastformer/backends.py": "import torch\n",
    })
    assert find_cycle(import_graph(root)) is None
