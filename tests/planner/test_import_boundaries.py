"""The planner package tree stays light: no torch, ortools, typer, runtime or CLI on import."""

import json
import subprocess
import sys

# Imports every module under canzona.planner in a fresh interpreter, then reports which modules
# it found and which forbidden ones got loaded along the way.
PROBE = """
import importlib, json, pkgutil, sys
import canzona.planner as root
names = [root.__name__] + sorted(
    info.name for info in pkgutil.walk_packages(root.__path__, prefix=root.__name__ + ".")
)
for name in names:
    importlib.import_module(name)
forbidden = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "ortools", "typer")
    or m.startswith(("canzona.runtime", "canzona.cli"))
)
print(json.dumps({"modules": names, "forbidden": forbidden}))
"""


def test_importing_every_planner_module_loads_no_torch_ortools_runtime_or_cli() -> None:
    """Every planner module imports cleanly without pulling in torch, ortools, typer, runtime or CLI."""
    result = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True)
    report = json.loads(result.stdout)
    modules = set(report["modules"])
    # The walk really covered the tree: each subpackage and a module deep inside each.
    expected = {
        "canzona.planner.plan",
        "canzona.planner.compile",
        "canzona.planner.sources.load",
        "canzona.planner.partition.dp",
        "canzona.planner.partition.ilp",
        "canzona.planner.predict.simulate",
    }
    assert expected <= modules, sorted(expected - modules)
    assert report["forbidden"] == []
