"""The import graph of ficco has no cycles: each concept has one home and data flows one way.

Every import statement counts: those inside functions (a late import hides a cycle from
Python, not from a reader) and those under ``if TYPE_CHECKING:`` (a type named across two
modules couples them as much as a call does). A package and its submodules count too: a
package's ``__init__`` that imports a submodule which imports a name back from the package
(``from . import name``, lazily or not) is a loop. Importing a submodule through its package
(``from . import sibling``) is an edge to that submodule only. Imports by name through
``importlib`` (backend selection) are not edges.
"""
from __future__ import annotations

import ast
from pathlib import Path

import ficco

ROOT = Path(ficco.__file__).resolve().parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(module: str, is_package: bool, node, modules) -> list[str]:
    """The ficco modules ``node`` imports: a name that is a module is an edge to it, any other
    name an edge to the module (or package ``__init__``) that defines it."""
    def defining(target: str) -> str:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    if isinstance(node, ast.Import):
        return [defining(alias.name) for alias in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else defining(prefix)
            for alias in node.names]


def _imports(tree: ast.AST):
    """Every import node, at any depth (functions, ``if TYPE_CHECKING:`` bodies included)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text())):
            for target in _targets(module, is_package, node, modules):
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 30 and sum(map(len, graph.values())) > 100   # it really walked ficco/
    assert cycles(graph) == [], "import cycles: " + "; ".join(
        " <-> ".join(c) for c in cycles(graph))


def test_the_checker_finds_a_cycle(tmp_path):
    """The walker itself: a two-module cycle through a late import is reported, and so is one
    through an import under ``if TYPE_CHECKING:``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from . import a\n")
    (pkg / "d.py").write_text("from . import e\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .d import Thing\n")
    graph = import_graph(pkg)
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.e"]]
    assert graph["pkg.c"] == {"pkg.a"}


def test_the_checker_finds_a_package_submodule_loop(tmp_path):
    """A package's ``__init__`` importing a submodule that imports a name back from the
    package (lazily here) is a loop; a submodule importing its sibling through the package
    (``from . import sibling``) is not one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\nLIMIT = 8\n")
    (pkg / "a.py").write_text("from . import b\ndef f():\n    from . import LIMIT\n")
    (pkg / "b.py").write_text("X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import g\n")
    (pkg / "sub" / "c.py").write_text("from . import d\ndef g():\n    pass\n")
    (pkg / "sub" / "d.py").write_text("from .. import b\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg", "pkg.a"]]
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.sub.c"] == {"pkg.sub.d"}


def private_imports(root: Path = ROOT) -> list[str]:
    """``path:line name`` of every private name one ficco module imports from another
    (``from .x import _y``) or reads off one it imported (``x._y``): a helper two modules
    share is public in its home, or lives where it is used."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(
                    ".")[0] == root.name):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                                     f"{alias.name}")
                    imported.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and isinstance(node.value, ast.Name) and \
                    node.value.id in imported:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                             f"{node.value.id}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    assert private_imports() == []


def test_the_private_import_scan_sees_them(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    pass\ndef public():\n    pass\n")
    (pkg / "b.py").write_text("from .a import _helper, public\nfrom . import a\n"
                              "def f(obj):\n    a._helper()\n    obj._own()\n")
    assert sorted(private_imports(pkg)) == ["pkg/b.py:1 _helper", "pkg/b.py:4 a._helper"]


#: The floors of ficco/, top first: a module imports from its own floor or the ones below it,
#: never from one above. The public faces sit on the ops (one package per op family under
#: ficco/ops/, and the torch-op glue they share), the ops on the engine, the engine in floors
#: down to the plain data of plans and the modules everything reads.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("", "__main__", "api", "nn", "parallel", "moe", "float8", "rng", "compat", "demo",
     "selftest", "bench", "torchtitan", "integrations"),
    ("ops",),
    ("runtime",),
    ("heuristics",),
    ("schedules",),
    ("executor",),
    ("backends",),
    ("kernels",),
    ("symm_mem",),
    ("plan",),
    ("config", "errors", "group", "logs", "profiling"),
)
#: op package -> the op packages it may import: the all-reduce's spec and its rs-ag schedules
#: are built on the reduce-scatter's.
DECLARED: dict[str, set[str]] = {"matmul_all_reduce": {"matmul_reduce_scatter"}}


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not on any floor of FLOORS (add its folder there)")


def layering_violations(root: Path = ROOT) -> list[str]:
    """``a -> b: why`` for every import that climbs a floor (:data:`FLOORS`), every engine
    module (below the ops) that imports an op, and every op package that imports another one
    it does not declare (:data:`DECLARED`)."""
    graph = import_graph(root)
    packages = {m for m, p in {_module_name(p, root): p for p in root.rglob("*.py")}.items()
                if p.name == "__init__.py"}
    ops_floor = FLOORS.index(("ops",))

    def op_of(module: str) -> str | None:
        parts = module.split(".")
        if len(parts) >= 3 and parts[1] == "ops" and f"{parts[0]}.ops.{parts[2]}" in packages:
            return parts[2]
        return None

    found = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if _floor(b) < _floor(a):
                why = "an engine module imports an op" if _floor(b) == ops_floor else \
                    "imports from a floor above"
                found.append(f"{a} -> {b}: {why}")
                continue
            op_a, op_b = op_of(a), op_of(b)
            if op_b is None or op_a == op_b:
                continue
            if op_a is None:
                if _floor(a) == ops_floor:
                    found.append(f"{a} -> {b}: a shared module of ficco.ops names an op")
            elif op_b not in DECLARED.get(op_a, set()):
                found.append(f"{a} -> {b}: op {op_a} imports op {op_b}, undeclared")
    return found


def test_imports_keep_to_the_floors_and_ops_to_their_declared_neighbours():
    assert layering_violations() == []


def test_the_layering_check_finds_planted_violations(tmp_path):
    """An engine module importing an op, a floor importing one above it, an op importing an
    undeclared op and a shared ops module naming an op are each reported; a declared neighbour,
    an op importing the engine and a face importing an op are not."""
    pkg = tmp_path / "ficco"
    files = {
        "__init__.py": "", "api.py": "from .ops.expert import dispatch\n",
        "ops/__init__.py": "", "ops/base.py": "from ..runtime import session\n",
        "ops/front.py": "from .expert import dispatch\n",
        "ops/expert/__init__.py": "", "ops/expert/dispatch.py": "from ...plan import tasks\n",
        "ops/all_gather_matmul/__init__.py": "",
        "ops/all_gather_matmul/spec.py": "from ..expert import dispatch\n",
        "ops/matmul_reduce_scatter/__init__.py": "", "ops/matmul_reduce_scatter/spec.py": "",
        "ops/matmul_all_reduce/__init__.py": "",
        "ops/matmul_all_reduce/spec.py": "from ..matmul_reduce_scatter import spec\n",
        "runtime/__init__.py": "", "runtime/session.py": "from ..symm_mem import handle\n",
        "heuristics/__init__.py": "",
        "heuristics/model.py": "def f():\n    from ..ops.expert import dispatch\n",
        "symm_mem/__init__.py": "", "symm_mem/handle.py": "from ..backends import cpu\n",
        "backends/__init__.py": "", "backends/cpu.py": "",
        "plan/__init__.py": "", "plan/tasks.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert layering_violations(pkg) == [
        "ficco.heuristics.model -> ficco.ops.expert.dispatch: an engine module imports an op",
        ("ficco.ops.all_gather_matmul.spec -> ficco.ops.expert.dispatch: op all_gather_matmul "
         "imports op expert, undeclared"),
        "ficco.ops.front -> ficco.ops.expert.dispatch: a shared module of ficco.ops names an op",
        "ficco.symm_mem.handle -> ficco.backends.cpu: imports from a floor above",
    ]
