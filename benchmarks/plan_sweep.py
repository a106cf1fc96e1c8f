"""Planner quality sweep: presets x TP x DP x bucket size x α, max load against the lower bound.

Run:  python benchmarks/plan_sweep.py                  (the subsample below, a few minutes on 1 core)
      python benchmarks/plan_sweep.py --save FILE      (also write every layout's gaps, CSV)
      python benchmarks/plan_sweep.py --before FILE    (compare with gaps saved by an earlier run)

The full grid is every preset x TP {1, 2, 4, 8} (where the preset allows it) x DP {2, 4, ...,
1024} x bucket size {10M, 40M, 160M, one bucket} x α {0, 0.5, 1}: 1,600+ layouts, hours for
the MoE presets at ep = 1 (up to 30k matrices in one buffer). The default subsample keeps it
to a few minutes, deterministically:
- dense presets: every TP, DP {2, 8, 32, 64, 256, 1024}, every bucket size;
- MoE presets (every expert in the dense buffer, ep = 1): TP 4, DP {8, 64}, 40M buckets.
`--full` runs the whole grid.

Per α it prints the share of layouts at the bound (gap <= 1e-9), the mean and worst gaps, and
the monotonicity violations: layouts where a larger α plans a larger max load than a smaller
one. The gap of a layout is max DP-rank load / lower bound - 1 (Muon, flops cost model), the
lower bound max(total / D, largest matrix). Only the DP partition is solved (what α and the
order change); `canzona plan` adds TP scheduling and compilation on top.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Iterator
from dataclasses import dataclass

from canzona.planner.partition.costs import OptimizerConfig, make_cost_model, param_cost
from canzona.planner.partition.dp import DpInstance, lower_bound, partition, rank_loads
from canzona.planner.partition.layout import build_buffer
from canzona.planner.plan import dp_instance
from canzona.planner.sources.catalog import PRESETS
from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX, PlanError

ALPHAS = (0.0, 0.5, 1.0)
ONE_BUCKET = 1 << 40
BUCKETS = {"10M": 10_000_000, "40M": 40_000_000, "160M": 160_000_000, "one": ONE_BUCKET}
TPS = (1, 2, 4, 8)
FULL_DPS = tuple(2**k for k in range(1, 11))
DENSE_DPS = (2, 8, 32, 64, 256, 1024)
MOE_LAYOUTS = ((4, 8, "40M"), (4, 64, "40M"))
AT_BOUND = 1e-9


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
    for name, arch in PRESETS.items():
        moe = arch.num_experts > 0
        if full or not moe:
            dps = FULL_DPS if full else DENSE_DPS
            for tp in TPS:
                for dp in dps:
                    for bucket in BUCKETS:
                        yield Layout(name, tp, dp, bucket)
        else:
            for tp, dp, bucket in MOE_LAYOUTS:
                yield Layout(name, tp, dp, bucket)


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


def gaps_of(instance: DpInstance) -> dict[float, float]:
    """Per α: the plan's max load / lower bound - 1."""
    bound = lower_bound(instance)
    return {alpha: max(rank_loads(instance, partition(instance, alpha).owners)) / bound - 1 for alpha in ALPHAS}


def violations(gaps: dict[float, float]) -> int:
    """Pairs (smaller α, larger α) where the larger α is worse (beyond float noise)."""
    return sum(
        1 for low in ALPHAS for high in ALPHAS if low < high and gaps[high] > gaps[low] + 1e-12
    )


def summary(results: dict[str, dict[float, float]]) -> None:
    """Per α: share at the bound, mean and worst gaps; then monotonicity violations."""
    print("| alpha | layouts | at bound | mean gap | worst gaps |")
    print("|---|---|---|---|---|")
    for alpha in ALPHAS:
        gaps = {key: row[alpha] for key, row in results.items()}
        at_bound = sum(gap <= AT_BOUND for gap in gaps.values())
        worst = sorted(gaps.items(), key=lambda item: (-item[1], item[0]))[:3]
        worst_text = "; ".join(f"{key} {gap:.1%}" for key, gap in worst)
        print(f"| {alpha:g} | {len(gaps)} | {at_bound / len(gaps):.1%} | {sum(gaps.values()) / len(gaps):.2%} | {worst_text} |")
    bad = {key: row for key, row in results.items() if violations(row)}
    print(f"\nmonotonicity violations (a larger alpha worse than a smaller one): {len(bad)} of {len(results)} layouts")
    for key, row in sorted(bad.items(), key=lambda item: -(item[1][1.0] - item[1][0.0]))[:5]:
        print(f"  {key}: " + " / ".join(f"alpha {a:g} {row[a]:.1%}" for a in ALPHAS))


def compare(results: dict[str, dict[float, float]], path: str) -> None:
    """Against an earlier run's gaps: layouts better and worse per α (worse must be 0)."""
    with open(path, newline="") as handle:
        before = {row["layout"]: {a: float(row[f"alpha {a:g}"]) for a in ALPHAS} for row in csv.DictReader(handle)}
    print(f"\nagainst {path}:")
    for alpha in ALPHAS:
        common = [key for key in results if key in before]
        better = [before[k][alpha] - results[k][alpha] for k in common if results[k][alpha] < before[k][alpha] - 1e-12]
        worse = [k for k in common if results[k][alpha] > before[k][alpha] + 1e-12]
        best = max(better, default=0.0)
        print(f"  alpha {alpha:g}: {len(common)} layouts, {len(better)} better (by up to {best:.1%} of the bound), "
              f"{len(worse)} worse" + (f": {', '.join(worse[:5])}" if worse else ""))


def save(results: dict[str, dict[float, float]], path: str) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layout"] + [f"alpha {a:g}" for a in ALPHAS])
        for key, row in results.items():
            writer.writerow([key] + [repr(row[a]) for a in ALPHAS])


def main() -> None:
    """Sweep, print the tables, optionally save and compare."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the whole grid (hours)")
    parser.add_argument("--save", help="write every layout's gaps to this CSV file")
    parser.add_argument("--before", help="compare with the gaps in this CSV file")
    args = parser.parse_args()
    started = time.perf_counter()
    results: dict[str, dict[float, float]] = {}
    for layout in layouts(args.full):
        instance = instance_of(layout)
        if instance is not None:
            results[layout.key] = gaps_of(instance)
    print(f"## DP max load / lower bound over {len(results)} layouts (Muon, flops)\n")
    summary(results)
    if args.before:
        compare(results, args.before)
    if args.save:
        save(results, args.save)
    print(f"\nsweep time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
