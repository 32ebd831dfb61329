"""A group's state lives on its Session (ficco/runtime/session.py), not in containers at
module level keyed by the group's name; and the tests read ficco only through public names.
Both are counted by reading the source (ast), not by running it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE, TESTS = ROOT / "ficco", ROOT / "tests"

#: constructors of mutable containers (and per-thread state)
_CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter",
               "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local", "bytearray"}
#: state by nature, mutated or not where the module binds it
_ALWAYS = {"WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local"}
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault",
             "add", "discard", "remove", "move_to_end", "appendleft", "popleft", "sort"}
#: what is left: process-wide registries (backends, their symmetric-memory providers by
#: device type, ops and their Problems' collectives, sessions, settings' per-thread scopes,
#: the integrations' saved styles), memos keyed by what they memoise (profiles, the
#: model's decisions, tuned kernel configs, compiled shot tables per workspace handle, bias
#: digests per tensor, the calls a dynamo trace met, one warn-once memo) and the few kept
#: per group object weakly (torch's symmetric buffers, the workspaces); none keyed by a
#: group's name
LIMIT = 20


def _container(value: ast.expr) -> str | None:
    """The kind of mutable container ``value`` builds, or None."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return type(value).__name__
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _CONTAINERS:
            return name
    return None


def _target_name(node: ast.expr) -> str | None:
    """The name a subscript, attribute or call chain finally acts on (``x`` of ``x[k]``,
    ``mod.x[k]``, ``x.append``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mutated_names(trees) -> set[str]:
    """Names the package mutates anywhere: item stores and deletes, mutating methods,
    rebinding through ``global``."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
                    [node.target]
                for target in targets:
                    if isinstance(target, ast.Subscript):
                        names.add(_target_name(target.value) or "")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _MUTATORS:
                names.add(_target_name(node.func.value) or "")
            elif isinstance(node, ast.Global):
                names.update(node.names)
    return names


def module_state(package: Path = PACKAGE) -> list[str]:
    """``path:line name`` of every module-level mutable container of ``package`` that is
    mutable state: one the package mutates, or a weak or per-thread container."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    mutated = _mutated_names(trees.values())
    found = []
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            kind = _container(value)
            if kind is None:
                continue
            for target in targets:
                if isinstance(target, ast.Name) and target.id != "__all__" and (
                        kind in _ALWAYS or target.id in mutated):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {target.id}")
    return found


def test_module_level_mutable_containers_are_few():
    """Before: 32 (a group's state in ~17 of them, keyed by its name: runtime's plans,
    decisions, settings; agreement's agreed calls, ranks, sequence, epoch; guard's locks,
    poison, watched groups; the workspaces and drains; the known calls; the compiled plans;
    the dispatch routings). Now a group's state is its Session's, found from the group
    object; what is left are process-wide registries and memos of pure functions."""
    found = module_state()
    assert len(found) <= LIMIT, "\n".join(found)


def test_the_count_sees_state_and_only_state(tmp_path):
    (tmp_path / "m.py").write_text(
        "import threading, weakref\n"
        "CONSTANT = {'a': 1}\n"             # never mutated: a constant
        "__all__ = ['x']\n"
        "_cache = {}\n"                     # mutated below
        "_seen = []\n"                      # mutated below
        "_local = threading.local()\n"      # per-thread state
        "_weak = weakref.WeakKeyDictionary()\n"
        "def f(k):\n"
        "    _cache[k] = 1\n"
        "    _seen.append(k)\n")
    names = sorted(f.split()[-1] for f in module_state(tmp_path))
    assert names == ["_cache", "_local", "_seen", "_weak"], names


# -- no test reads a private name of ficco ---------------------------------------------------------
def private_uses(root: Path = TESTS) -> list[str]:
    """``path:line what`` of every private name of ficco a test file reads: ``from ficco...
    import _x``, ``m._x`` where ``m`` was imported from ficco (a module, class or function,
    at any depth: ``m.y._x``), and ``setattr``/``getattr``/``monkeypatch.setattr`` of such an
    ``m`` with a "_x" string. (An attribute of an object a test made, ``obj._x``, cannot be
    told apart from its own and is not counted.)"""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        ficco_names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "ficco":
                        ficco_names.add(alias.asname or "ficco")
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "ficco":
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                                     f"from {node.module} import {alias.name}")
                    ficco_names.add(alias.asname or alias.name)
        found += [f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(node)}"
                  for node in ast.walk(tree) if _reads_private(node, ficco_names)]
    return found


def _reads_private(node: ast.AST, ficco_names: set[str]) -> bool:
    if isinstance(node, ast.Attribute):
        return _private(node.attr) and _root(node.value) in ficco_names
    return (isinstance(node, ast.Call) and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and _private(node.args[1].value) and _root(node.args[0]) in ficco_names)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_test_reads_a_private_name_of_ficco():
    found = private_uses()
    assert not found, "\n".join(found)


def test_the_scan_sees_private_reads(tmp_path):
    (tmp_path / "t.py").write_text(
        "import ficco\n"
        "from ficco import runtime, _hidden\n"
        "from ficco.backends import cpu as backend\n"
        "def test(monkeypatch):\n"
        "    runtime._plans.clear()\n"
        "    ficco.runtime.path._settings.clear()\n"
        "    monkeypatch.setattr(backend, '_map', None)\n"
        "    runtime.run()\n"                      # public: fine
        "    obj = object(); obj._mine = 1\n")     # not ficco's
    found = sorted(line.split(" ", 1)[1] for line in private_uses(tmp_path))
    assert found == sorted(["from ficco import _hidden", "runtime._plans",
                     "ficco.runtime.path._settings", "monkeypatch.setattr(backend, '_map', None)"]), found


# -- what a warm call costs: ficco's Python calls and its locks -------------------------------------
#: ficco Python calls per warm call of each dense op on CPU ranks (``python -m ficco.bench calls``)
WARM_CALL_LIMIT = 70


def test_a_warm_dense_call_makes_few_python_calls_and_takes_one_lock():
    """A warm call (the same shapes and settings on the same group) is one lookup on its
    Session, the tensors bound, the plan run: at most WARM_CALL_LIMIT calls into ficco's
    Python, and one lock (the session's) taken by ficco's code, on every rank."""
    from .. import harness
    from ..warm_call_cases import warm_call_counts

    pool = harness.pool(2)
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        for ficco_calls, locks, ran in pool.run(warm_call_counts, op):
            assert ficco_calls <= WARM_CALL_LIMIT, (op, ficco_calls, ran)
            assert locks == 1, (op, locks, ran)


#: ficco Python calls of the warm serial call over dma at W=2 (``python -m ficco.bench calls
#: --schedule serial --transport dma``), per op
SERIAL_DMA_LIMITS = {"all_gather_matmul": 61, "matmul_reduce_scatter": 64}


def test_a_warm_serial_dma_call_stays_within_its_python_calls():
    """The warm path of a forced serial call over dma, its fewest ficco Python calls on each
    rank (each warm call profiled alone), at most :data:`SERIAL_DMA_LIMITS`."""
    from .. import harness
    from ..warm_call_cases import fewest_warm_calls

    pool = harness.pool(2)
    for op, limit in SERIAL_DMA_LIMITS.items():
        for fewest, ran in pool.run(fewest_warm_calls, op, "serial", "dma"):
            assert ran == ("serial", "dma"), (op, ran)
            assert fewest <= limit, (op, fewest)


def test_the_lock_count_sees_ficco_locks_only():
    import cProfile
    import pstats
    import threading

    from ficco.symm_mem import workspace

    from ..warm_call_cases import lock_acquisitions

    own = threading.Lock()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        workspace.kept(object())        # one `with` on the workspace registry's lock
        with own:                       # the caller's lock: not ficco's
            pass
    profiler.disable()
    assert lock_acquisitions(pstats.Stats(profiler), 3) == 1


_HISTORY = __import__("re").compile(r"\b[Ii]ssue \d+")


def history_lines(root: Path = PACKAGE) -> list[str]:
    """Lines of the package's sources that narrate which issue led to the code (git keeps
    that; a comment states the rule)."""
    return [f"{path.relative_to(root.parent)}:{number}"
            for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if _HISTORY.search(line)]


def test_no_comment_narrates_history():
    found = history_lines()
    assert not found, "\n".join(found)


def test_the_history_scan_sees_an_issue_number(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(f"x = 1  # the fix of issue {12}\ny = 2  # a rule\n")
    assert history_lines(pkg) == ["pkg/m.py:1"]
