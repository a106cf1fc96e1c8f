"""Planner benchmark: balance of canzona vs the baselines, TP modes, α trade-off, planning time.

Run:  python benchmarks/plan_bench.py            (all tables, a few minutes)
      python benchmarks/plan_bench.py --quick    (one repeat, smaller α sweep)

Every figure comes from plans built in this run; times are medians of repeated runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.devices import tp_score
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule, dump_schedule, parse_schedule

LAYOUTS = [("qwen3-8b", 2, 4), ("qwen3-32b", 8, 32), ("qwen3-235b-a22b", 4, 64)]
ALPHAS = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
BASELINES = ["dp-sc", "zero1-gather", "start-owner", "layer-wise"]


def timed_plan(name: str, tp: int, dp: int, alpha: float, repeats: int, ep: int = 1) -> tuple[Schedule, float]:
    """The schedule and the median wall time of load + plan + compile."""
    times, schedule = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        request = PlanRequest(name, tp, dp, alpha=alpha, ep=ep)
        schedule = compile_schedule(make_plan(load_model(name, tp), request))
        times.append(time.perf_counter() - started)
    assert schedule is not None
    return schedule, statistics.median(times)


def balance_table(repeats: int) -> None:
    """DP balance of canzona and every baseline (flops, α = 1), and planning time."""
    print("## DP balance, Muon flops, alpha = 1 (max load / lower bound; imbalance = max / mean)\n")
    header = ["model", "layout", "canzona"] + BASELINES + ["plan s", "write s", "load s", "file MB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, tp, dp in LAYOUTS:
        schedule, seconds = timed_plan(name, tp, dp, 1.0, repeats)
        started = time.perf_counter()
        text = dump_schedule(schedule)
        written = time.perf_counter() - started
        started = time.perf_counter()
        parse_schedule(text)
        loaded = time.perf_counter() - started
        metrics = schedule.metrics.dp
        cells = [f"{1 + metrics.gap:.4f} / {metrics.imbalance:.4f}"]
        cells += [f"{1 + metrics.baselines[b].gap:.3f} / {metrics.baselines[b].imbalance:.3f}" for b in BASELINES]
        row = [name, f"tp{tp} dp{dp}", *cells, f"{seconds:.2f}", f"{written:.2f}", f"{loaded:.2f}", f"{len(text) / 1e6:.1f}"]
        print("| " + " | ".join(row) + " |")
    print()


def tp_table(repeats: int) -> None:
    """TP micro-group modes on the same DP partition."""
    print("## TP micro-group modes (efficiency; critical path / lower bound; device imbalance; groups)\n")
    print("| model | layout | rollback | fixed | sorted | heap |")
    print("|---|---|---|---|---|---|")
    layouts = [("qwen3-8b", 2, 4, 1), ("qwen3-32b", 8, 32, 1), ("qwen3-235b-a22b", 4, 16, 8), ("qwen3-30b-a3b", 4, 8, 4)]
    for name, tp, dp, ep in layouts:
        plan = make_plan(load_model(name, tp), PlanRequest(name, tp, dp, ep=ep))
        bound = compile_schedule(plan).metrics.tp.critical_lower_bound
        # A schedule records the chosen mode only: the others are scored on the plan itself.
        cells = [
            f"{s.efficiency:.4f}; {s.critical_time / bound:.4f}; {s.device_imbalance:.4f}; {s.num_groups} groups"
            for s in (tp_score(plan, plan.groups[m]) for m in ("rollback", "fixed", "sorted", "heap"))
        ]
        print(f"| {name} | tp{tp} dp{dp} ep{ep} | " + " | ".join(cells) + " |")
    print()


def alpha_table(alphas: list[float]) -> None:
    """What α trades: compute balance against slice equality (padding overhead)."""
    print("## alpha trade-off, qwen3-32b tp8 dp32 and qwen3-8b tp2 dp4 (Muon flops)\n")
    print("| model | alpha | max load / lower bound | padding overhead (mean) | worst bucket |")
    print("|---|---|---|---|---|")
    for name, tp, dp in [("qwen3-32b", 8, 32), ("qwen3-8b", 2, 4)]:
        for alpha in alphas:
            schedule, _ = timed_plan(name, tp, dp, alpha, 1)
            metrics = schedule.metrics.dp
            print(
                f"| {name} | {alpha:g} | {1 + metrics.gap:.4f} | {metrics.padding_overhead:.2f}x "
                f"| {metrics.max_padding_overhead:.2f}x |"
            )
    print()


def main() -> None:
    """Print every table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer alpha values")
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    balance_table(repeats)
    tp_table(repeats)
    alpha_table([0.0, 0.5, 1.0] if args.quick else ALPHAS)


if __name__ == "__main__":
    main()
