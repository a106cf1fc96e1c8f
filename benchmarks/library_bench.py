"""Schedule library benchmark: load time of every library file and of `canzona check`.

Run:  python benchmarks/library_bench.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from canzona.schedules.format import parse_schedule

ROOT = Path(__file__).resolve().parent.parent / "schedules"
REPEATS = 5


def median_seconds(action: object, repeats: int = REPEATS) -> float:
    """Median wall time of `action()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    """Print the load-time table and the check time."""
    print(f"libyaml C loader available: {hasattr(yaml, 'CSafeLoader')}\n")
    print("| schedule | MB | load + validate s (median of 5) | plain yaml.safe_load s |")
    print("|---|---|---|---|")
    files = sorted(ROOT.rglob("*.yaml"), key=lambda p: p.stat().st_size)
    for path in [p for p in files if "profiles" not in p.parts][-4:]:
        text = path.read_text()
        fast = median_seconds(lambda: parse_schedule(text))
        slow = median_seconds(lambda: yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)), 1)
        name = path.relative_to(ROOT).with_suffix("").as_posix()
        print(f"| {name} | {len(text) / 1e6:.1f} | {fast:.2f} | {slow:.2f} |")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "canzona.cli", "check", str(ROOT)], check=True, capture_output=True)
    print(f"\n`canzona check schedules` over {len(files)} files: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
