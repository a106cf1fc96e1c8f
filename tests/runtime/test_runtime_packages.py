"""The runtime's layout: every module imports cleanly without the planner, and its subpackages
depend one way (docs/architecture.md, dependency rules)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import canzona.runtime

ROOT = "canzona.runtime"
RUNTIME_DIR = Path(canzona.runtime.__file__).parent

# Imports every module under canzona.runtime in a fresh interpreter, then reports which modules
# it found and which forbidden ones got loaded along the way.
PROBE = """
import importlib, importlib.util, json, pkgutil, sys
import canzona.runtime as root
names = [root.__name__] + sorted(
    info.name for info in pkgutil.walk_packages(root.__path__, prefix=root.__name__ + ".")
)
optional = {"canzona.runtime.integrations.hf": "transformers",  # an adapter needs its stack installed
            "canzona.runtime.integrations.titan_optimizers": "torchtitan"}
for name in names:
    if name in optional and importlib.util.find_spec(optional[name]) is None:
        continue
    importlib.import_module(name)
forbidden = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("typer", "ortools") or m.startswith(("canzona.planner", "canzona.cli"))
)
print(json.dumps({"modules": names, "forbidden": forbidden}))
"""

# Per area (a subpackage, or "core" for the top level), the runtime modules it may not import
# outside `if TYPE_CHECKING:`, as prefixes relative to canzona.runtime.
FORBIDDEN = {
    "rules": (
        "exchange",
        "state",
        "fsdp",
        "tools",
        "optimizer",
        "update",
        "groups",
        "binding",
        "process_groups",
        "experts",
    ),
    "exchange": ("state", "fsdp", "tools", "optimizer", "update"),
    "state": ("exchange", "fsdp", "tools"),
    "fsdp": ("tools",),
    "tools": ("tools", "fsdp.optimizer"),
    # adapters over the public API (`canzona.runtime` itself), never the step's internals
    "integrations": ("exchange", "state", "fsdp", "tools", "optimizer", "update", "engine", "plan", "rules"),
    "core": ("tools", "fsdp.optimizer"),
}


def module_name(path: Path) -> str:
    """The dotted name of a runtime source file."""
    parts = list(path.relative_to(RUNTIME_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOT, *parts])


def area(name: str) -> str:
    """The subpackage a runtime module belongs to, or "core" for the top level."""
    parts = name.split(".")[2:]
    return parts[0] if parts and (RUNTIME_DIR / parts[0]).is_dir() else "core"


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def runtime_imports(source: str, known: set[str]) -> set[str]:
    """The runtime modules a source file imports at run time (not under `if TYPE_CHECKING:`)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt] | list[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    found.add(dotted if dotted in known else node.module)
            visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(source).body)
    return {name for name in found if name.startswith(ROOT + ".")}


def violations(imports: dict[str, set[str]]) -> list[str]:
    """Each import that breaks the one-way rule, as "importer -> imported"."""
    problems = []
    for importer, targets in sorted(imports.items()):
        if importer == ROOT:
            continue  # the package's __init__ exports the public API from everywhere
        banned = tuple(f"{ROOT}.{prefix}" for prefix in FORBIDDEN[area(importer)])
        problems += [
            f"{importer} -> {target}"
            for target in sorted(targets)
            if any(target == ban or target.startswith(ban + ".") for ban in banned)
        ]
    return problems


def all_imports() -> dict[str, set[str]]:
    files = sorted(RUNTIME_DIR.rglob("*.py"))
    known = {module_name(path) for path in files}
    return {module_name(path): runtime_imports(path.read_text(encoding="utf-8"), known) for path in files}


def test_importing_every_runtime_module_loads_no_planner_cli_typer_or_ortools() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout)
    modules = set(report["modules"])
    # The walk really covered the tree: each subpackage and a module inside each.
    expected = {
        "canzona.runtime.optimizer",
        "canzona.runtime.exchange.comm",
        "canzona.runtime.rules.optimizers",
        "canzona.runtime.state.logical",
        "canzona.runtime.fsdp.optimizer",
        "canzona.runtime.tools.describe",
    }
    assert expected <= modules, sorted(expected - modules)
    assert modules == set(all_imports()), sorted(modules ^ set(all_imports()))
    assert report["forbidden"] == []


def test_runtime_subpackages_depend_one_way() -> None:
    imports = all_imports()
    assert area("canzona.runtime.exchange.comm") == "exchange" and area("canzona.runtime.tools") == "tools"
    assert area("canzona.schedules.layout") == "core"
    assert "canzona.runtime.rules.optimizers" in imports["canzona.runtime.rules.cooperative"]
    assert violations(imports) == []


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        ("canzona.runtime.rules.precision", "from canzona.runtime.state import logical", ["state.logical"]),
        ("canzona.runtime.exchange.comm", "import canzona.runtime.optimizer", ["optimizer"]),
        ("canzona.runtime.plan", "def f():\n    from canzona.runtime.tools.reference import X", ["tools.reference"]),
        ("canzona.runtime.exchange.gather", "if TYPE_CHECKING:\n    from canzona.runtime.optimizer import C", []),
        ("canzona.runtime.state.checkpoint", "from canzona.runtime.optimizer import CanzonaOptimizer", []),
    ],
)
def test_a_backward_import_is_reported(importer: str, source: str, expected: list[str]) -> None:
    known = {f"{ROOT}.state.logical"}
    problems = violations({importer: runtime_imports(source, known)})
    assert problems == [f"{importer} -> {ROOT}.{target}" for target in expected]
