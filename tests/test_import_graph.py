"""No import cycles in ``gdn_dispatch`` or ``gdn_dispatch.backends``.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` and
``from ... import`` counts, at module level or inside a function (a deferred import that
closes a cycle is still a cycle, only hidden until the function runs). Importing a
submodule runs its packages' ``__init__`` first, so importing ``a.b.c`` also adds edges to
``a`` and ``a.b`` (except to the importer's own packages, which Python initializes before
the importer anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Package name -> source folder (gdn_dispatch.backends is the top-level backends/ folder).
PACKAGES = {"gdn_dispatch": ROOT / "gdn_dispatch", "gdn_dispatch.backends": ROOT / "backends"}


def _modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (``pkg/__init__.py`` as ``pkg``)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if package == "gdn_dispatch" and rel.parts[0] == "backends":
                continue  # the symlink to backends/, listed under its own package name
            parts = [package, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported_names(path: Path, module: str, is_package: bool) -> set[str]:
    """Dotted names ``path`` imports (absolute, relative imports resolved)."""
    names = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            # ``from pkg import mod`` imports the module pkg.mod when there is one.
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the two packages it imports (their packages included)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in _imported_names(path, module, path.name == "__init__.py"):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                # The importer's own packages are initialized before it in any case.
                if target in modules and target != module and not module.startswith(target + "."):
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path ``[a, b, ..., a]``, or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node):
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color.get(nxt) == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = BLACK
        return None

    for node in sorted(graph):
        if color[node] == WHITE:
            found = visit(node)
            if found:
                return found
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's module set (strongly connected components with an edge inside),
    each sorted, in sorted order."""
    found, rest = [], dict(graph)
    while rest:
        cycle = find_cycle(rest)
        if cycle is None:
            break
        # The component of the cycle: nodes reachable from its first node that reach it back.
        start = cycle[0]
        reach = _reachable(rest, start)
        component = sorted(n for n in reach if start in _reachable(rest, n))
        found.append(component)
        rest = {n: {m for m in e if m not in component} for n, e in rest.items() if n not in component}
    return sorted(found)


def _reachable(graph, start):
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_backends_have_no_import_cycle():
    graph = import_graph()
    assert "gdn_dispatch.backends.gluon_common.state_output" in graph, sorted(graph)
    through_backends = [c for c in cycles(graph) if any(m.startswith("gdn_dispatch.backends") for m in c)]
    assert through_backends == []


def test_shared_gluon_pipeline_imports_no_backend():
    """The engine is handed down by the backend that launches the kernels: gluon_common
    never imports gluon_sm100 or gluon_sm90."""
    shared = {m: e for m, e in import_graph().items() if m.startswith("gdn_dispatch.backends.gluon_common")}
    assert shared
    for module, edges in shared.items():
        assert not any(e.startswith(("gdn_dispatch.backends.gluon_sm100", "gdn_dispatch.backends.gluon_sm90"))
                       for e in edges), module


def test_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"c"}}, ["c", "c"]),
    ({"a": {"b"}, "b": set()}, None),
], ids=["three-cycle", "self-import", "acyclic"])
def test_find_cycle_finds_cycles(graph, cycle):
    """Negative control: the walk reports a cycle when there is one."""
    assert find_cycle(graph) == cycle
    assert cycles(graph) == ([] if cycle is None else [sorted(set(cycle))])


def test_cycles_lists_each_component_once():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b"], ["c", "d"]]


def test_deferred_import_counts(tmp_path):
    """An import inside a function is an edge too (the plan -> stage planner kind of cycle)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from gdn_dispatch.backends.gluon_common.wy import plan_wy\n")
    names = _imported_names(src, "gdn_dispatch.backends.gluon_common.plan", False)
    assert "gdn_dispatch.backends.gluon_common.wy" in names
