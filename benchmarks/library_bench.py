"""Schedule library benchmark: load + validate time of the largest library files, split into
the safe reader, pydantic, the fingerprint and digest, and the semantic validator; and the time
of `canzona check` over the whole library.

Run:  python benchmarks/library_bench.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from canzona.schedules import reading
from canzona.schedules.format import Schedule, parse_schedule, schedule_digest, schedule_fingerprint
from canzona.schedules.validate import schedule_problem

ROOT = Path(__file__).resolve().parent.parent / "schedules"
REPEATS = 5
TARGET_S = 1.0


def median_seconds(action: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall time of `action()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def runtime_load(path: Path) -> str:
    """Median seconds of the runtime's `load_schedule` on `path` (what every rank runs at
    launch: reading, validation and the runtime's own check), or "-" without torch."""
    try:
        from canzona.runtime.schedule import load_schedule
    except ImportError:
        return "-"
    return f"{median_seconds(lambda: load_schedule(path)):.2f}"


def stages(text: str) -> dict[str, float]:
    """Median seconds of each stage of `parse_schedule` on `text`, and of the whole."""
    document = reading.schedule_json(text)
    schedule = Schedule.model_validate_json(document.json)
    return {
        "total": median_seconds(lambda: parse_schedule(text)),
        "reader": median_seconds(lambda: reading.schedule_json(text)),
        "pydantic": median_seconds(lambda: Schedule.model_validate_json(document.json)),
        "sums": median_seconds(lambda: (schedule_fingerprint(schedule), schedule_digest(schedule))),
        "validator": median_seconds(lambda: schedule_problem(schedule)),
    }


def main() -> None:
    """Print the load-time table and the check time."""
    print(f"libyaml C loader available: {hasattr(yaml, 'CSafeLoader')}\n")
    print(
        "| schedule | MB | load + validate s | runtime load_schedule s | reader s | pydantic s "
        "| fingerprint + digest s | validator s | validator share | plain yaml.safe_load s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    files = sorted(ROOT.rglob("*.yaml"), key=lambda p: p.stat().st_size)
    largest = 0.0
    for path in [p for p in files if "profiles" not in p.parts][-4:]:
        text = path.read_text()
        times = stages(text)
        slow = median_seconds(
            lambda text=text: yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)), 1
        )
        name = path.relative_to(ROOT).with_suffix("").as_posix()
        print(
            f"| {name} | {len(text) / 1e6:.1f} | {times['total']:.2f} | {runtime_load(path)} | {times['reader']:.2f} "
            f"| {times['pydantic']:.2f} | {times['sums']:.2f} | {times['validator']:.2f} "
            f"| {times['validator'] / times['total']:.0%} | {slow:.2f} |"
        )
        largest = times["total"]
    verdict = "under" if largest < TARGET_S else "OVER"
    print(f"\nlargest file: load + validate {largest:.2f} s ({verdict} the {TARGET_S:g} s target)")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "canzona.cli", "check", str(ROOT)], check=True, capture_output=True)
    print(f"`canzona check schedules` over {len(files)} files: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
