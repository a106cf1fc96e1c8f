"""Planner quality sweep: presets x TP x DP x bucket size x α, max load against the lower bound.

Run:  python benchmarks/plan_sweep.py                  (the subsample below, a few minutes on 1 core)
      python benchmarks/plan_sweep.py --save FILE      (also write every layout's gaps, CSV)
      python benchmarks/plan_sweep.py --before FILE    (compare with gaps saved by an earlier run)

The issue's grid is every preset x TP {1, 2, 4, 8} (where the preset allows it) x DP {2, 4,
..., 1024} x bucket size {10M, 40M, 160M, one bucket} x α {0, 0.5, 1}: 1,600+ layouts, an hour
and more on one core (the MoE presets at ep = 1 put up to 30k matrices in one buffer); α here
is the whole ladder {0, 0.25, 0.5, 0.75, 1}. The
default subsample, deterministic:
- dense presets: every 13th layout of their full grid (in preset, TP, DP, bucket order; 13 is
  prime to the 4 bucket sizes and 10 DP sizes, so every TP, DP and bucket size is hit), plus
  the issue's four example layouts;
- MoE presets (every expert in the dense buffer, ep = 1): qwen3-30b-a3b and mixtral-8x7b at
  TP 4, DP 64, 40M buckets (deepseek-v3 and qwen3-235b-a22b take minutes per layout here).
`--full` runs the issue's whole grid.

Per α it prints the share of layouts at the bound (gap <= 1e-9), the mean and worst gaps, and
the monotonicity violations: layouts where a larger α plans a larger max load than a smaller
one. The gap of a layout is max DP-rank load / lower bound - 1 (Muon, flops cost model), the
lower bound that of `canzona.planner.partition.dp.lower_bound` (the mean, the largest matrix and
the pairing of the largest: `canzona.schedules.bounds`). Then the same with free intra-bucket order
(`--order free`): how many layouts improve over registration order, and by how much. Only the
DP partition is solved (what α and the order change); `canzona plan` adds TP scheduling and
compilation on top.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from canzona.planner.buffers import dp_instance
from canzona.planner.partition.costs import OptimizerConfig, make_cost_model, param_cost
from canzona.planner.partition.dp import DpInstance, lower_bound, partition, rank_loads
from canzona.planner.partition.layout import build_buffer
from canzona.planner.sources.catalog import PRESETS
from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX, PlanError

try:  # free order is new: the same script measures the planner before it ("before" numbers)
    from canzona.planner.partition.free_order import partition_free
except ImportError:
    partition_free = None

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
ONE_BUCKET = 1 << 40
BUCKETS = {"10M": 10_000_000, "40M": 40_000_000, "160M": 160_000_000, "one": ONE_BUCKET}
TPS = (1, 2, 4, 8)
DPS = tuple(2**k for k in range(1, 11))
STRIDE = 13
EXAMPLES = (
    ("qwen3-8b", 4, 64, "40M"),
    ("qwen3-4b", 2, 64, "40M"),
    ("qwen3-1.7b", 2, 64, "10M"),
    ("llama3.1-70b", 8, 64, "160M"),
)
MOE_LAYOUTS = (("qwen3-30b-a3b", 4, 64, "40M"), ("mixtral-8x7b", 4, 64, "40M"))
AT_BOUND = 1e-9
Gaps = dict[str, float]  # "alpha 0", ..., "free alpha 1" -> gap


@dataclass(frozen=True)
class Layout:
    """One swept layout: preset, TP, DP, bucket size label."""

    model: str
    tp: int
    dp: int
    bucket: str

    @property
    def key(self) -> str:
        return f"{self.model} tp{self.tp} dp{self.dp} {self.bucket}"


def layouts(full: bool) -> Iterator[Layout]:
    """The swept layouts, in a fixed order (the subsample unless `full`)."""
    grid = [
        Layout(name, tp, dp, bucket)
        for name, arch in PRESETS.items()
        if full or arch.num_experts == 0
        for tp in TPS
        for dp in DPS
        for bucket in BUCKETS
    ]
    if full:
        yield from grid
        return
    chosen = grid[::STRIDE] + [Layout(*example) for example in EXAMPLES + MOE_LAYOUTS]
    yield from dict.fromkeys(chosen)


def instance_of(layout: Layout) -> DpInstance | None:
    """The DP partition problem of a layout's matrix buffer, or None if the preset refuses the TP."""
    try:
        model = load_model(layout.model, layout.tp)
    except PlanError:
        return None
    cost_model = make_cost_model("flops", OptimizerConfig())
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    buffer = build_buffer(model, MATRIX, layout.tp, layout.dp, BUCKETS[layout.bucket])
    return dp_instance(buffer, model, costs, layout.dp)


def gaps_of(instance: DpInstance) -> Gaps:
    """Per α (and per α in free order, when this canzona has it): max load / lower bound - 1."""
    bound = lower_bound(instance)
    gaps: Gaps = {}
    for alpha in ALPHAS:
        ordered = partition(instance, alpha)
        gaps[f"alpha {alpha:g}"] = max(rank_loads(instance, ordered.owners)) / bound - 1
        if partition_free is not None:
            free = partition_free(instance, alpha, ordered=ordered)
            gaps[f"free alpha {alpha:g}"] = max(rank_loads(instance, free.owners)) / bound - 1
    return gaps


def violations(gaps: Gaps, prefix: str = "") -> int:
    """Pairs (smaller α, larger α) where the larger α is worse (beyond float noise)."""
    row = [gaps[f"{prefix}alpha {a:g}"] for a in ALPHAS]
    return sum(1 for i in range(len(row)) for j in range(i + 1, len(row)) if row[j] > row[i] + 1e-12)


def summary(results: dict[str, Gaps], prefix: str = "") -> None:
    """Per α: share at the bound, mean and worst gaps; then monotonicity violations."""
    print("| alpha | layouts | at bound | mean gap | worst gaps |")
    print("|---|---|---|---|---|")
    for alpha in ALPHAS:
        gaps = {key: row[f"{prefix}alpha {alpha:g}"] for key, row in results.items()}
        at_bound = sum(gap <= AT_BOUND for gap in gaps.values())
        worst = sorted(gaps.items(), key=lambda item: (-item[1], item[0]))[:3]
        worst_text = "; ".join(f"{key} {gap:.1%}" for key, gap in worst)
        print(
            f"| {alpha:g} | {len(gaps)} | {at_bound / len(gaps):.1%} | {sum(gaps.values()) / len(gaps):.2%} "
            f"| {worst_text} |"
        )
    bad = {key: row for key, row in results.items() if violations(row, prefix)}
    print(f"\nmonotonicity violations (a larger alpha worse than a smaller one): {len(bad)} of {len(results)} layouts")
    for key, row in sorted(
        bad.items(), key=lambda item: (-(item[1][f"{prefix}alpha 1"] - item[1][f"{prefix}alpha 0"]), item[0])
    )[:5]:
        print(f"  {key}: " + " / ".join(f"alpha {a:g} {row[f'{prefix}alpha {a:g}']:.1%}" for a in ALPHAS))


def free_gain(results: dict[str, Gaps]) -> None:
    """Per α: layouts whose free-order plan beats registration order, and by how much."""
    print("\n## free intra-bucket order against registration order (same alpha)\n")
    print("| alpha | layouts improved | mean gain (improved) | largest gain | layout |")
    print("|---|---|---|---|---|")
    for alpha in ALPHAS:
        gains = {key: row[f"alpha {alpha:g}"] - row[f"free alpha {alpha:g}"] for key, row in results.items()}
        improved = {key: gain for key, gain in gains.items() if gain > 1e-12}
        worse = sum(gain < -1e-12 for gain in gains.values())
        best = max(improved.items(), key=lambda item: (item[1], item[0]), default=("-", 0.0))
        mean = sum(improved.values()) / len(improved) if improved else 0.0
        print(
            f"| {alpha:g} | {len(improved)} of {len(gains)}{f' ({worse} worse!)' if worse else ''} | "
            f"{mean:.2%} of the bound | {best[1]:.2%} | {best[0]} |"
        )


def load(path: str) -> dict[str, Gaps]:
    """Gaps saved by `--save`."""
    with open(path, newline="") as handle:
        return {row["layout"]: {k: float(v) for k, v in row.items() if k != "layout"} for row in csv.DictReader(handle)}


def compare(results: dict[str, Gaps], path: str) -> None:
    """Against an earlier run's gaps: layouts better and worse per α (worse must be 0)."""
    before = load(path)
    common = [key for key in results if key in before]
    print(f"\n## against {path} ({len(common)} layouts in both)\n")
    for alpha in ALPHAS:
        column = f"alpha {alpha:g}"
        better = [
            before[k][column] - results[k][column] for k in common if results[k][column] < before[k][column] - 1e-12
        ]
        worse = [k for k in common if results[k][column] > before[k][column] + 1e-12]
        print(
            f"- alpha {alpha:g}: {len(better)} better (by up to {max(better, default=0.0):.1%} of the bound), "
            f"{len(worse)} worse" + (f": {', '.join(worse[:5])}" if worse else "")
        )


def save(results: dict[str, Gaps], path: str) -> None:
    columns = list(next(iter(results.values())))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layout", *columns])
        for key, row in results.items():
            writer.writerow([key] + [repr(row[c]) for c in columns])


def main() -> None:
    """Sweep, print the tables, optionally save and compare."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the issue's whole grid (an hour and more)")
    parser.add_argument("--save", help="write every layout's gaps to this CSV file")
    parser.add_argument("--before", help="compare with the gaps in this CSV file")
    parser.add_argument("--progress", action="store_true", help="each layout's time on stderr")
    parser.add_argument("--results", help="print the tables of gaps saved by --save instead of sweeping")
    args = parser.parse_args()
    started = time.perf_counter()
    results: dict[str, Gaps] = load(args.results) if args.results else {}
    for layout in [] if args.results else layouts(args.full):
        instance = instance_of(layout)
        if instance is not None:
            began = time.perf_counter()
            results[layout.key] = gaps_of(instance)
            if args.progress:
                print(f"{layout.key}: {time.perf_counter() - began:.2f} s", file=sys.stderr, flush=True)
    print(f"## DP max load / lower bound over {len(results)} layouts (Muon, flops), registration order\n")
    summary(results)
    if any(key.startswith("free") for key in next(iter(results.values()))):
        free_gain(results)
        print("\n## free order, per alpha\n")
        summary(results, "free ")
    if args.before:
        compare(results, args.before)
    if args.save:
        save(results, args.save)
    print(f"\nsweep time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
