"""The strategies canzona is measured against, scored on the same instance.

Each returns the per-rank compute load of the matrix-optimizer buffer in cost units, and the
padding overhead of its collectives (None when it gives up reduce-scatter geometry). The
strategies themselves are `canzona.schedules.figures`, which the schedule validator recomputes
a file's baselines with.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.planner.partition.layout import BufferLayout
from canzona.schedules.figures import BASELINE_PADDING, BASELINES, Member, baseline_loads


@dataclass(frozen=True)
class BaselineLoads:
    """Per-rank loads of one strategy and how it moves gradients."""

    name: str
    loads: tuple[float, ...]
    padding_overhead: float | None


def members(layout: BufferLayout, costs: dict[int, float], names: dict[int, str]) -> list[tuple[int, list[Member]]]:
    """Each bucket's padded size and its members as the baselines read them."""
    return [
        (bucket.numel, [(e.offset, e.numel, costs[e.param], names[e.param]) for e in bucket.entries])
        for bucket in layout.buckets
    ]


def all_baselines(
    layout: BufferLayout, costs: dict[int, float], names: dict[int, str], dp: int
) -> tuple[BaselineLoads, ...]:
    """Every DP baseline, in a fixed order."""
    loads = baseline_loads(members(layout, costs, names), dp)
    return tuple(BaselineLoads(name, tuple(loads[name]), BASELINE_PADDING[name]) for name in BASELINES)
