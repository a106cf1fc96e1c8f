"""The figures a replicated (ZeRO-1) schedule records that are neither costs nor geometry:
the bytes each device moves per step and the baselines' per-rank loads. One definition that the
planner writes them by and the schedule validator recomputes them with. Pure, and linear in
what it is given: no per-parameter work grows with the number of ranks.

Traffic: the DP reduction (fp32 gradients) and gather (parameters) of every bucket, in the
collective the schedule records for it, plus the TP micro-group all-to-alls (fp32 gradients in,
fp32 updates out; a matrix replicated over TP needs no gather, only the scatter).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from canzona.schedules.geometry import GRAD_BYTES_PER_ELEMENT, equal_cuts, reslice_moves, slice_owner

DP_SC, ZERO1_GATHER, START_OWNER, LAYER_WISE = "dp-sc", "zero1-gather", "start-owner", "layer-wise"
BASELINES = (DP_SC, ZERO1_GATHER, START_OWNER, LAYER_WISE)  # the strategies canzona is compared with, in order
BASELINE_PADDING = {DP_SC: None, ZERO1_GATHER: 1.0, START_OWNER: 1.0, LAYER_WISE: None}
"""Padding overhead of each baseline's collectives (None: it gives up reduce-scatter geometry)."""

Member = tuple[int, int, float, str]
"""A bucket member for the baselines: (offset, elements, cost, name)."""


def bucket_traffic(
    numel: int, cuts: Sequence[int], param_bytes: int, collective: str = "all_to_all"
) -> list[tuple[int, int]]:
    """(sent, received) bytes of one bucket's reduction (fp32 gradients) and gather
    (`param_bytes` per element) per rank of the len(cuts) - 1 ranks it is cut over, in the form
    `collective` the runtime issues (`limits.BUCKET_COLLECTIVES`): "all_to_all" moves every
    other rank's slice, a native ring ("ring", or equal slices under "rooted") n - 1 slices
    padded to the largest, "rooted" chains (one per slice, from its owner's successor) every
    slice but the rank's own out and every slice but its predecessor's in, "reslice" n - 1
    equal slices plus the rank's spill-over between its equal slice and the owners' slices."""
    ranks, grad = len(cuts) - 1, GRAD_BYTES_PER_ELEMENT
    owns = [stop - start for start, stop in zip(cuts, cuts[1:])]
    per_element = grad + param_bytes
    if collective == "all_to_all":
        return [
            (
                grad * (numel - own) + param_bytes * (ranks - 1) * own,
                grad * (ranks - 1) * own + param_bytes * (numel - own),
            )
            for own in owns
        ]
    if collective == "reslice":
        ring = (ranks - 1) * (numel // ranks)
        return [
            (grad * (ring + out) + param_bytes * (ring + back), grad * (ring + back) + param_bytes * (ring + out))
            for out, back in reslice_moves(owns)
        ]
    if collective == "ring" or len(set(owns)) <= 1:
        volume = per_element * (ranks - 1) * max(owns, default=0)
        return [(volume, volume)] * ranks
    return [(per_element * (numel - owns[r]), per_element * (numel - owns[r - 1])) for r in range(ranks)]


def task_moves(size: int, team_size: int, replicated: bool, tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(sent, received) bytes on the host of one part (1/team_size) of a matrix of `size`
    gathered fp32 bytes, and on every other TP rank, in the gather and scatter all-to-alls."""
    part = size // team_size
    peers = tp - 1
    if replicated:
        return (part * peers, 0), (0, part)
    return (part * peers // tp,) * 2, (part // tp,) * 2


def micro_group_traffic(parts: Iterable[tuple[int, int, int, bool]], tp: int) -> list[tuple[int, int]]:
    """Per TP rank of one DP rank, (sent, received) bytes of its micro-group all-to-alls:
    `parts` holds every hosted part as (host TP rank, gathered bytes, team size, replicated)."""
    sent, received = [0] * tp, [0] * tp
    every_sent = every_received = 0
    for host, size, team_size, replicated in parts:
        (host_sent, host_received), (other_sent, other_received) = task_moves(size, team_size, replicated, tp)
        every_sent += other_sent
        every_received += other_received
        sent[host] += host_sent - other_sent
        received[host] += host_received - other_received
    return [(s + every_sent, r + every_received) for s, r in zip(sent, received)]


def replicated_update_traffic(sizes: Iterable[tuple[int, bool]], tp: int) -> list[tuple[int, int]]:
    """Per TP rank of one DP rank, (sent, received) bytes of a replicated update's fused
    all-gather: `sizes` holds every owned matrix as (gathered fp32 bytes, replicated over TP);
    a sharded one's shard goes to every other TP rank, a replicated one moves nothing."""
    moved = sum((size // tp) * (tp - 1) for size, replicated in sizes if not replicated)
    return [(moved, moved)] * tp


def start_owner(buckets: Sequence[tuple[int, Sequence[Member]]], ranks: int) -> list[float]:
    """Equal slices; a rank owns every matrix that starts in its slice (atomic, unbalanced).
    `buckets`: (padded size, members in registration-order layout) of each bucket."""
    loads = [0.0] * ranks
    for numel, members in buckets:
        cuts = equal_cuts(numel, ranks)
        for offset, _, cost, _ in members:
            loads[slice_owner(cuts, offset)] += cost
    return loads


def zero1_gather(buckets: Sequence[tuple[int, Sequence[Member]]], ranks: int) -> list[float]:
    """Equal slices; a rank updates every matrix touching its slice (split ones redundantly)."""
    loads = [0.0] * ranks
    for numel, members in buckets:
        cuts = equal_cuts(numel, ranks)
        for offset, size, cost, _ in members:
            for rank in range(slice_owner(cuts, offset), slice_owner(cuts, offset + max(size, 1) - 1) + 1):
                loads[rank] += cost
    return loads


def layer_wise(buckets: Sequence[tuple[int, Sequence[Member]]], ranks: int) -> list[float]:
    """Whole matrices to ranks by LPT, ignoring buffer order (all-reduce + broadcast)."""
    heap = [(0.0, rank) for rank in range(ranks)]
    for _, _, cost, _ in sorted((m for _, members in buckets for m in members), key=lambda m: (-m[2], m[3])):
        load, rank = heapq.heappop(heap)
        heapq.heappush(heap, (load + cost, rank))
    loads = [0.0] * ranks
    for load, rank in heap:
        loads[rank] = load
    return loads


def dp_sc(buckets: Sequence[tuple[int, Sequence[Member]]], ranks: int) -> list[float]:
    """Plain DDP: all-reduce, and every rank updates every matrix."""
    total = sum(cost for _, members in buckets for _, _, cost, _ in members)
    return [total] * ranks


def baseline_loads(buckets: Sequence[tuple[int, Sequence[Member]]], ranks: int) -> dict[str, list[float]]:
    """Every baseline's per-rank loads on one buffer, in BASELINES order."""
    return {
        DP_SC: dp_sc(buckets, ranks),
        ZERO1_GATHER: zero1_gather(buckets, ranks),
        START_OWNER: start_owner(buckets, ranks),
        LAYER_WISE: layer_wise(buckets, ranks),
    }
