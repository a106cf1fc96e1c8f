"""Habits of the suite and its documents that a green run alone would not show.

- No test bounds the wall clock below 60 s: CI's machine is shared, so speed belongs in
  benchmarks/, and a test bounds work (bytes, rows, calls) or only catches hangs.
- The figures BENCHMARKS.md quotes for a checked-in schedule are that schedule's own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from canzona.schedules.format import read_schedule
from canzona.schedules.library import library_root

ROOT = Path(__file__).resolve().parents[1]
CLOCKS = {"perf_counter", "monotonic", "time"}
TIMED_NAMES = {"elapsed", "seconds"}
HANG_BOUND_S = 60


def _reads_the_clock(node: ast.AST) -> bool:
    """Whether an expression reads a clock or a measured duration (`elapsed`, `seconds`)."""
    for part in ast.walk(node):
        if isinstance(part, ast.Call) and isinstance(part.func, ast.Attribute) and part.func.attr in CLOCKS:
            return True
        if isinstance(part, ast.Name) and part.id in TIMED_NAMES:
            return True
        if isinstance(part, ast.Constant) and part.value in TIMED_NAMES:  # result["elapsed"]
            return True
    return False


def _small_bounds(tree: ast.AST) -> list[int]:
    """Lines of `assert <a duration> < N` (or <=) with a literal N under HANG_BOUND_S."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            pairs = zip([compare.left, *compare.comparators[:-1]], compare.ops, compare.comparators)
            for left, op, right in pairs:
                bound = right.value if isinstance(right, ast.Constant) else None
                if (
                    isinstance(op, (ast.Lt, ast.LtE))
                    and isinstance(bound, (int, float))
                    and bound < HANG_BOUND_S
                    and _reads_the_clock(left)
                ):
                    lines.append(node.lineno)
    return lines


def test_no_test_bounds_the_wall_clock_below_a_minute() -> None:
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = _small_bounds(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    assert not found, f"wall-clock bounds under {HANG_BOUND_S} s (bound work instead): {found}"


def test_the_checker_finds_a_clock_bound() -> None:
    """The negative control: what the habit forbids is found."""
    tree = ast.parse(
        "started = time.perf_counter()\nassert time.perf_counter() - started < 2.0\n"
        "assert result['elapsed'] < 9\nassert seconds < 60\n"
    )
    assert _small_bounds(tree) == [2, 3]


def test_benchmarks_quote_the_library_schedules_tp_figures() -> None:
    """The TP-mode table's rollback cell for a library layout is that schedule's metrics."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    row = re.search(r"^\| qwen3-32b \| tp8 dp32 ep1 \| ([0-9.]+); ([0-9.]+); ([0-9.]+); (\d+) groups", text, re.M)
    assert row is not None, "the TP-mode table lost its qwen3-32b tp8 dp32 row"
    tp = read_schedule(library_root() / "qwen3-32b" / "muon-tp8-dp32.yaml").metrics.tp
    quoted = [float(row.group(1)), float(row.group(3)), int(row.group(4))]
    assert quoted == [round(tp.efficiency, 4), round(tp.device_imbalance, 4), tp.num_groups]
