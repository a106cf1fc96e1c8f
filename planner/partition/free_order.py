"""Free intra-bucket order: the planner picks each bucket's parameter order with its owners.

Where the runtime owns its exchange buffer, the order of parameters inside a bucket is free;
only bucket membership follows backward order (a bucket can be reduced once backward has made
all its gradients). The partition problem loses its contiguity constraint: any rank may own any
item of a bucket, each rank's slice of the bucket (its items' spans) staying under α's cap
(the caps of `slice_caps`, from the registration-order spans). The bucket is then repacked
with each owner's items together, owners ascending (registration order inside an owner), so
every owner's region is again one contiguous slice of the exchange buffer.

Integrations whose buffer order is fixed (Megatron's gradient buffer) keep registration order.
"""

from __future__ import annotations

import functools

from canzona.planner.partition.dp import (
    ALPHA_LADDER,
    DpAssignment,
    DpInstance,
    Owners,
    feasible,
    lower_bound,
    partition,
    polished,
    polished_lpt,
    rank_loads,
    slice_caps,
)
from canzona.planner.partition.layout import Bucket, BufferEntry, BufferLayout
from canzona.schedules.geometry import PARAM_ALIGNMENT, padded_bucket_numel, round_up


def partition_free(
    instance: DpInstance, alpha: float, seeds: tuple[Owners, ...] = (), ordered: DpAssignment | None = None
) -> DpAssignment:
    """Owners of every item under α's caps with any order inside a bucket, minimising the
    largest load. Starts: the registration-order plan (`partition`, feasible here too, so
    free order is never worse), LPT over every rank, the free plan at the next coarser α of
    `ALPHA_LADDER` and `seeds`; each polished by move/swap local search over all ranks. The
    lowest max load wins, ties to the earlier start. `ordered`: `partition(instance, alpha)`
    when the caller has it already. Without seeds the plan is remembered."""
    if not seeds and ordered is None:
        return _free_remembered(instance, alpha)
    return _partition_free(instance, alpha, seeds, ordered)


def _partition_free(
    instance: DpInstance, alpha: float, seeds: tuple[Owners, ...], ordered: DpAssignment | None
) -> DpAssignment:
    """`partition_free`, worked out."""
    ordered = ordered or partition(instance, alpha)
    if not any(instance.costs) or max(rank_loads(instance, ordered.owners)) <= lower_bound(instance) * (1 + 1e-12):
        return ordered
    caps = slice_caps(instance, alpha)
    starts: list[tuple[Owners, str]] = [(ordered.owners, ordered.method)]
    coarser = [ladder for ladder in ALPHA_LADDER if ladder < alpha]
    if coarser:
        starts.append((_free_remembered(instance, coarser[-1]).owners, f"free plan at alpha {coarser[-1]:g}"))
    starts += [(owners, "seed") for owners in seeds if feasible(instance, caps, owners, free=True)]
    candidates = [(polished(instance, caps, owners, free=True), method + "+free") for owners, method in starts]
    greedy = polished_lpt(instance, caps, free=True)
    if greedy is not None:
        candidates.append((greedy, "free-lpt+local-search"))
    best = min(range(len(candidates)), key=lambda i: (max(rank_loads(instance, candidates[i][0])), i))
    return DpAssignment(*candidates[best])


@functools.lru_cache(maxsize=32)
def _free_remembered(instance: DpInstance, alpha: float) -> DpAssignment:
    """`partition_free` without seeds, remembered for the finer α that reuse it."""
    return _partition_free(instance, alpha, (), None)


def reorder_buffer(layout: BufferLayout, owners: Owners, num_ranks: int) -> tuple[BufferLayout, Owners]:
    """The layout with each bucket's entries grouped by owner (ascending; registration order
    kept inside an owner, i.e. the layout's order) and repacked at the buffer's alignment, and
    the owners in the new order (non-decreasing along every bucket)."""
    buckets, new_owners = [], []
    for bucket, bucket_owners in zip(layout.buckets, owners):
        order = sorted(range(len(bucket.entries)), key=lambda i: (bucket_owners[i], i))
        entries, fill = [], 0
        for i in order:
            entry = bucket.entries[i]
            offset = round_up(fill, PARAM_ALIGNMENT)
            entries.append(BufferEntry(entry.param, entry.bucket, offset, entry.numel))
            fill = offset + entry.numel
        buckets.append(Bucket(bucket.index, tuple(entries), padded_bucket_numel(fill, num_ranks)))
        new_owners.append(tuple(bucket_owners[i] for i in order))
    return BufferLayout(layout.kind, tuple(buckets)), tuple(new_owners)
