"""The import graphs of `planner/`, `runtime/`, `schedules/` and `cli/` (docs/architecture.md,
dependency rules): no import circles in any, and the planner's layers depend one way.

The graph is read from the source with `ast`, so every import statement counts: at module level,
inside a function and under `if TYPE_CHECKING:` alike. A circle is a strongly connected
component of that graph; the test names each one as a chain of imports with file and line.
"""

import ast
from collections import deque
from pathlib import Path
from types import ModuleType

import pytest

import canzona.cli
import canzona.planner
import canzona.runtime
import canzona.schedules

# An import edge: importer, imported.
Edge = tuple[str, str]

# The planner's layers, and the layers each may import from ("top": the modules at the top of
# the package, `plan`, `compile` and the like; `spec` is its own layer, below everything).
PLANNER_LAYERS = {
    "spec": ("spec",),
    "sources": ("spec", "sources"),
    "partition": ("spec", "partition"),
    "top": ("spec", "sources", "partition", "top"),
    "predict": ("spec", "sources", "partition", "top", "predict"),
}


def module_files(package: str, directory: Path) -> dict[str, Path]:
    """Every module of a package by dotted name (a subpackage by its own name, for its `__init__`)."""
    modules = {}
    for path in sorted(directory.rglob("*.py")):
        parts = list(path.relative_to(directory).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative imports resolved against the importer."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    parts = parts if is_package else parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def imported_modules(source: str, importer: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """The known modules a source file imports anywhere, each with the line of its first import.

    `from package import name` counts as importing the submodule `package.name` when there is one,
    else as importing `package` itself.
    """
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, is_package, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            if name in known and name != importer:
                found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def import_graph(package: str, directory: Path) -> dict[Edge, str]:
    """Every import edge between a package's own modules, with where it is written (`file:line`)."""
    files = module_files(package, directory)
    known = set(files)
    edges = {}
    for importer, path in files.items():
        source = path.read_text(encoding="utf-8")
        for imported, line in imported_modules(source, importer, path.name == "__init__.py", known).items():
            edges[importer, imported] = f"{path.relative_to(directory.parent)}:{line}"
    return edges


def strongly_connected(edges: set[Edge]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    successors: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in successors[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(start: str, component: set[str], edges: set[Edge]) -> list[str]:
    """A shortest chain of imports inside a component from `start` back to `start`."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for source, target in sorted(edges):
            if source != node or target not in component:
                continue
            if target == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(previous[chain[-1]])
                return [*reversed(chain), start]
            if target not in previous:
                previous[target] = node
                queue.append(target)
    raise AssertionError(f"{start} is on no cycle")


def describe_cycles(edges: dict[Edge, str]) -> list[str]:
    """Each import circle: its modules, then shortest cycles until every one of them is on one."""
    reports = []
    for component in strongly_connected(set(edges)):
        lines = [f"circle among {', '.join(component)}:"]
        covered: set[str] = set()
        for start in component:
            if start in covered:
                continue
            cycle = shortest_cycle(start, set(component), set(edges))
            covered.update(cycle)
            lines += [f"    {a} -> {b}  ({edges[a, b]})" for a, b in zip(cycle, cycle[1:])]
            lines.append("    --")
        reports.append("\n".join(lines[:-1]))
    return reports


def planner_layer(module: str) -> str:
    """The layer of a planner module (its subpackage, `spec`, or "top")."""
    parts = module.split(".")[2:]
    if parts and parts[0] in PLANNER_LAYERS:
        return parts[0]
    return "top"


def layer_violations(edges: dict[Edge, str]) -> list[str]:
    """Each planner import that points up a layer, as "importer -> imported (file:line)"."""
    return [
        f"{importer} -> {imported}  ({where})"
        for (importer, imported), where in sorted(edges.items())
        if importer != "canzona.planner" and planner_layer(imported) not in PLANNER_LAYERS[planner_layer(importer)]
    ]


@pytest.mark.parametrize(
    "package",
    [canzona.planner, canzona.runtime, canzona.schedules, canzona.cli],
    ids=["planner", "runtime", "schedules", "cli"],
)
def test_no_import_circles(package: ModuleType) -> None:
    edges = import_graph(package.__name__, Path(package.__file__).parent)
    # The graph really covers the package: function-level and TYPE_CHECKING imports are edges.
    assert len(edges) > 20
    cycles = describe_cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_planner_layers_depend_one_way() -> None:
    edges = import_graph("canzona.planner", Path(canzona.planner.__file__).parent)
    assert planner_layer("canzona.planner.partition.dp") == "partition"
    assert planner_layer("canzona.planner.spec") == "spec" and planner_layer("canzona.planner.compile") == "top"
    violations = layer_violations(edges)
    assert not violations, "imports up the planner's layers:\n" + "\n".join(violations)


def test_an_import_up_a_layer_is_reported() -> None:
    edges = {
        ("canzona.planner.partition.costs", "canzona.planner.predict.profile_cost"): "a.py:1",
        ("canzona.planner.sources.catalog", "canzona.planner.partition.costs"): "b.py:2",
        ("canzona.planner.spec", "canzona.planner.plan"): "c.py:3",
        ("canzona.planner.plan", "canzona.planner.partition.costs"): "d.py:4",
        ("canzona.planner.predict.simulate", "canzona.planner.plan"): "e.py:5",
    }
    assert layer_violations(edges) == [
        "canzona.planner.partition.costs -> canzona.planner.predict.profile_cost  (a.py:1)",
        "canzona.planner.sources.catalog -> canzona.planner.partition.costs  (b.py:2)",
        "canzona.planner.spec -> canzona.planner.plan  (c.py:3)",
    ]


def test_every_kind_of_import_is_an_edge() -> None:
    known = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.d", "p.sub.e"}
    source = "\n".join(
        [
            "from typing import TYPE_CHECKING",
            "import p.a",
            "if TYPE_CHECKING:",
            "    from p.b import Thing",
            "def f():",
            "    from ..c import g",
            "from p.sub import d, helper",
            "from . import e",
            "from .. import a",
        ]
    )
    found = imported_modules(source, "p.sub.x", False, known)
    assert found == {"p.a": 2, "p.b": 4, "p.c": 6, "p.sub.d": 7, "p.sub": 7, "p.sub.e": 8}
    assert imported_modules("from . import d", "p.sub", True, known) == {"p.sub.d": 1}


def test_a_circle_is_found_and_printed() -> None:
    edges = {
        ("a", "b"): "a.py:1",
        ("b", "c"): "b.py:2",
        ("c", "a"): "c.py:3",
        ("c", "d"): "c.py:4",
        ("d", "e"): "d.py:1",
        ("e", "d"): "e.py:1",
    }
    assert strongly_connected(set(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert describe_cycles(edges)[0] == (
        "circle among a, b, c:\n    a -> b  (a.py:1)\n    b -> c  (b.py:2)\n    c -> a  (c.py:3)"
    )
    assert strongly_connected({("a", "b"), ("b", "c")}) == []
