"""The strategies canzona is measured against, scored on the same instance.

Each returns the per-rank compute load of the matrix-optimizer buffer in cost units, and the
padding overhead of its collectives (None when it gives up reduce-scatter geometry). The
strategies themselves are `canzona.schedules.figures`, which the schedule validator recomputes
a file's baselines with.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from canzona.planner.partition.layout import BufferLayout
from canzona.schedules.figures import (
    BASELINE_PADDING,
    BASELINES,
    LAYER_WISE,
    START_OWNER,
    ZERO1_GATHER,
    Member,
    baseline_loads,
)
from canzona.schedules.geometry import equal_cuts, slice_owner

OWNER_RULES = (START_OWNER, ZERO1_GATHER, LAYER_WISE)
"""The baselines whose matrix owners a schedule can express (`baseline_owners`)."""


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
    return _scored(tuple((numel, tuple(rows)) for numel, rows in members(layout, costs, names)), dp)


@functools.lru_cache(maxsize=16)
def _scored(buckets: tuple[tuple[int, tuple[Member, ...]], ...], dp: int) -> tuple[BaselineLoads, ...]:
    """`all_baselines` of the buffer's members, remembered: every candidate plan of a request
    (each α, each owner rule) scores the same registration-order buffer."""
    loads = baseline_loads(buckets, dp)
    return tuple(BaselineLoads(name, tuple(loads[name]), BASELINE_PADDING[name]) for name in BASELINES)


def baseline_owners(
    layout: BufferLayout, costs: Sequence[float], names: Sequence[str], ranks: int, rule: str
) -> tuple[tuple[int, ...], ...]:
    """Each bucket entry's owner under a baseline's rule (`OWNER_RULES`), in the layout's order:
    `start-owner`, the rank whose equal slice holds the matrix's start; `zero1-gather`, the one
    holding most of it (the first of those on a tie); `layer-wise`, longest processing time
    over the whole buffer by `costs` (per parameter; ties by `names`), ignoring the buffer order.
    The first two rise along every bucket, as contiguous cuts need."""
    if rule == LAYER_WISE:
        entries = [(b, i, e.param) for b, bucket in enumerate(layout.buckets) for i, e in enumerate(bucket.entries)]
        owners = [[0] * len(bucket.entries) for bucket in layout.buckets]
        heap = [(0.0, rank) for rank in range(ranks)]
        for b, i, param in sorted(entries, key=lambda item: (-costs[item[2]], names[item[2]])):
            load, rank = heapq.heappop(heap)
            owners[b][i] = rank
            heapq.heappush(heap, (load + costs[param], rank))
        return tuple(tuple(bucket) for bucket in owners)
    if rule not in OWNER_RULES:
        raise ValueError(f"unknown owner rule {rule!r}; one of {', '.join(OWNER_RULES)}")
    out = []
    for bucket in layout.buckets:
        cuts = equal_cuts(bucket.numel, ranks)
        row = []
        for entry in bucket.entries:
            first = slice_owner(cuts, entry.offset)
            if rule == START_OWNER:
                row.append(first)
                continue
            last = slice_owner(cuts, entry.offset + max(entry.numel, 1) - 1)
            end = entry.offset + entry.numel
            shares = [min(end, cuts[r + 1]) - max(entry.offset, cuts[r]) for r in range(first, last + 1)]
            row.append(first + shares.index(max(shares)))
        out.append(tuple(row))
    return tuple(out)
