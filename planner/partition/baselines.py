"""The strategies canzona is measured against, scored on the same instance.

Each returns the per-rank compute load of the matrix-optimizer buffer in cost units, and the
padding overhead of its collectives (None when it gives up reduce-scatter geometry).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from canzona.planner.partition.layout import BufferLayout, equal_cuts, slice_owner


@dataclass(frozen=True)
class BaselineLoads:
    """Per-rank loads of one strategy and how it moves gradients."""

    name: str
    loads: tuple[float, ...]
    padding_overhead: float | None


def start_owner(layout: BufferLayout, costs: dict[int, float], dp: int) -> BaselineLoads:
    """Equal slices; a rank owns every matrix that starts in its slice (atomic, unbalanced)."""
    loads = [0.0] * dp
    for bucket in layout.buckets:
        cuts = equal_cuts(bucket.numel, dp)
        for entry in bucket.entries:
            loads[slice_owner(cuts, entry.offset)] += costs[entry.param]
    return BaselineLoads("start-owner", tuple(loads), 1.0)


def zero1_gather(layout: BufferLayout, costs: dict[int, float], dp: int) -> BaselineLoads:
    """Equal slices; a rank updates every matrix touching its slice (split ones redundantly)."""
    loads = [0.0] * dp
    for bucket in layout.buckets:
        cuts = equal_cuts(bucket.numel, dp)
        for entry in bucket.entries:
            first = slice_owner(cuts, entry.offset)
            last = slice_owner(cuts, entry.offset + max(entry.numel, 1) - 1)
            for rank in range(first, last + 1):
                loads[rank] += costs[entry.param]
    return BaselineLoads("zero1-gather", tuple(loads), 1.0)


def layer_wise(layout: BufferLayout, costs: dict[int, float], names: dict[int, str], dp: int) -> BaselineLoads:
    """Whole matrices to ranks by LPT, ignoring buffer order (all-reduce + broadcast)."""
    params = sorted(
        (entry.param for bucket in layout.buckets for entry in bucket.entries),
        key=lambda param: (-costs[param], names[param]),
    )
    heap = [(0.0, rank) for rank in range(dp)]
    for param in params:
        load, rank = heapq.heappop(heap)
        heapq.heappush(heap, (load + costs[param], rank))
    loads = [0.0] * dp
    for load, rank in heap:
        loads[rank] = load
    return BaselineLoads("layer-wise", tuple(loads), None)


def dp_sc(layout: BufferLayout, costs: dict[int, float], dp: int) -> BaselineLoads:
    """Plain DDP: all-reduce, and every rank updates every matrix."""
    total = sum(costs[entry.param] for bucket in layout.buckets for entry in bucket.entries)
    return BaselineLoads("dp-sc", tuple(total for _ in range(dp)), None)


def all_baselines(
    layout: BufferLayout, costs: dict[int, float], names: dict[int, str], dp: int
) -> tuple[BaselineLoads, ...]:
    """Every DP baseline, in a fixed order."""
    return (
        dp_sc(layout, costs, dp),
        zero1_gather(layout, costs, dp),
        start_owner(layout, costs, dp),
        layer_wise(layout, costs, names, dp),
    )
