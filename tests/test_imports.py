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
