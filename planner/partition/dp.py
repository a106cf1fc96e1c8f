"""α-balanced static DP partitioning: contiguous cuts of every bucket.

The problem: each bucket of the matrix-optimizer buffer is cut into D contiguous slices, rank r
taking slice r, with every cut on a parameter boundary; a parameter's owner is the rank whose
slice holds it. Equivalently, every item (parameter) gets an owner rank and owners never
decrease along a bucket. Rank r's compute load is the sum of its items' costs over all buckets.

What α means here (measurable, see `slice_caps`): at α = 0 every bucket's largest slice is the
smallest that parameter boundaries allow (stock ZeRO geometry snapped to boundaries); at α = 1
slices may take any size; in between, a bucket's largest slice may grow geometrically from that
minimum towards the whole bucket. Within those caps the partitioner minimises the largest
compute load, over the whole buffer at once rather than bucket by bucket.

Methods: a single bucket is solved exactly (bisection on the max load with a greedy feasibility
check). Several buckets: greedy longest-processing-time placement constrained to the ranks the
bucket order allows, then move/swap local search on the most loaded rank. Monotone α: the plan
at a coarser α (`ALPHA_LADDER`, or seeds) is a start too, so a larger α is never worse.
`free_order` drops the order constraint inside a bucket (`--order free`).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from canzona.planner.spec import PlanError
from canzona.schedules.bounds import dp_lower_bound

BISECTION_STEPS = 100
NARROW_INTERVAL = 48
SWAP_ITEMS_PER_COST = 2
SWEEP_WORK_LIMIT = 2_000_000  # DP steps of one sweep over every bucket; larger instances skip
# exact bucket re-solves (they are layer-periodic MoE models whose plans are already near the bound)
SWAP_WINDOW = 64


@dataclass(frozen=True)
class DpInstance:
    """One buffer's partition problem. Per bucket, per item in buffer order: cost, span, name.

    An item's span is the elements from its start to the next item's start (or the bucket
    end), so a rank's slice of a bucket is the sum of its items' spans. `base_loads` is load
    each rank carries already (e.g. its experts when expert parallelism plans them apart);
    empty means none.
    """

    costs: tuple[tuple[float, ...], ...]
    spans: tuple[tuple[int, ...], ...]
    names: tuple[tuple[str, ...], ...]
    num_ranks: int
    base_loads: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise PlanError(f"dp must be >= 1, got {self.num_ranks}")
        if self.base_loads and len(self.base_loads) != self.num_ranks:
            raise PlanError(f"{len(self.base_loads)} base loads for {self.num_ranks} ranks")

    def initial_loads(self) -> list[float]:
        """Per-rank load before any item is placed."""
        return list(self.base_loads) if self.base_loads else [0.0] * self.num_ranks


@dataclass(frozen=True)
class DpAssignment:
    """The owner rank of every item, per bucket, and how it was found."""

    owners: tuple[tuple[int, ...], ...]
    method: str


def lower_bound(instance: DpInstance) -> float:
    """No partition of `instance` has a smaller max load: the mean, the largest item on the
    least loaded rank, and the pairing bounds of the largest items
    (`canzona.schedules.bounds.dp_lower_bound`; the base loads included)."""
    return dp_lower_bound(
        [cost for bucket in instance.costs for cost in bucket], instance.num_ranks, instance.base_loads
    )


def rank_loads(instance: DpInstance, owners: Sequence[Sequence[int]]) -> list[float]:
    """Compute load of every rank under `owners` (base loads included)."""
    loads = instance.initial_loads()
    for costs, bucket_owners in zip(instance.costs, owners):
        for cost, owner in zip(costs, bucket_owners):
            loads[owner] += cost
    return loads


def _fit_bucket(
    costs: tuple[float, ...], spans: tuple[int, ...], cap: int, loads: list[float], rank: int, cost_limit: float
) -> list[int] | None:
    """Owners of one bucket's items packed from `rank` upwards on top of `loads`, or None."""
    owners: list[int] = []
    span_fill, added = 0, 0.0
    for cost, span in zip(costs, spans):
        if cost > cost_limit or span > cap:
            return None
        while loads[rank] + added + cost > cost_limit or span_fill + span > cap:
            rank, span_fill, added = rank + 1, 0, 0.0
            if rank >= len(loads):
                return None
        owners.append(rank)
        span_fill += span
        added += cost
    return owners


def _earliest_fit(instance: DpInstance, caps: tuple[int, ...], cost_limit: float) -> list[list[int]] | None:
    """Owners from a pass over the whole buffer, each item on the earliest rank that keeps the
    rank's load under `cost_limit` and its slice of the bucket under the bucket's cap.

    Ranks rise along the concatenated buffer, so owners never decrease within a bucket; when a
    bucket no longer fits in the ranks left, the pass wraps to rank 0 at that bucket's start.
    Without wrapping, packing as early as possible is optimal for feasibility: any feasible
    contiguous plan can be shifted item by item towards it without breaking a limit.
    """
    owners: list[list[int]] = []
    loads = instance.initial_loads()
    rank = 0
    for costs, spans, cap in zip(instance.costs, instance.spans, caps):
        bucket_owners = _fit_bucket(costs, spans, cap, loads, rank, cost_limit)
        if bucket_owners is None and rank > 0:
            bucket_owners = _fit_bucket(costs, spans, cap, loads, 0, cost_limit)
        if bucket_owners is None:
            return None
        for owner, cost in zip(bucket_owners, costs):
            loads[owner] += cost
        owners.append(bucket_owners)
        rank = bucket_owners[-1] if bucket_owners else rank
    return owners


def min_max_slice(spans: tuple[int, ...], num_ranks: int) -> int:
    """Smallest possible largest slice of one bucket (exact, binary search on integers)."""
    if not spans:
        return 0
    bucket = DpInstance((tuple(0.0 for _ in spans),), (spans,), (tuple("" for _ in spans),), num_ranks)
    low, high = max(max(spans), -(-sum(spans) // num_ranks)), sum(spans)
    while low < high:
        middle = (low + high) // 2
        if _earliest_fit(bucket, (middle,), 0.0) is None:
            low = middle + 1
        else:
            high = middle
    return low


def slice_caps(instance: DpInstance, alpha: float) -> tuple[int, ...]:
    """Per bucket, the largest slice α allows: m*^(1-α) · T^α (m* = best possible, T = bucket)."""
    if not 0.0 <= alpha <= 1.0:
        raise PlanError(f"alpha must be in [0, 1], got {alpha}")
    caps = []
    for spans, best in zip(instance.spans, _best_slices(instance.spans, instance.num_ranks)):
        total = sum(spans)
        cap = total if alpha == 1.0 else int(best ** (1.0 - alpha) * total**alpha)
        caps.append(min(total, max(best, cap)))
    return tuple(caps)


@functools.lru_cache(maxsize=16)
def _best_slices(spans: tuple[tuple[int, ...], ...], num_ranks: int) -> tuple[int, ...]:
    """`min_max_slice` of every bucket, remembered: every α of a plan's ladder needs them."""
    return tuple(min_max_slice(bucket, num_ranks) for bucket in spans)


def solve_contiguous(instance: DpInstance, caps: tuple[int, ...]) -> list[list[int]]:
    """Best plan whose ranks rise along the concatenated buffer (bisection on the max load).

    With one bucket this is the exact optimum of the partition problem.
    """
    # No cost limit first: summing in another order could put sum(costs) a bit under the
    # plan's own total and reject it.
    best = _earliest_fit(instance, caps, math.inf)
    if best is None:  # caps never go below min_max_slice, so one rank per slice always fits
        raise PlanError("slice caps leave no feasible partition")
    low, high = lower_bound(instance), max(rank_loads(instance, best))
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        owners = _earliest_fit(instance, caps, middle)
        if owners is None:
            low = middle
        else:
            best, high = owners, middle
        if high - low <= 1e-12 * high:
            break
    return best


class _Search:
    """Mutable state of the multi-bucket heuristic (owners, loads, caps). `free`: any owner
    order within a bucket (free intra-bucket order); only each rank's slice cap binds."""

    def __init__(self, instance: DpInstance, caps: tuple[int, ...], free: bool = False) -> None:
        self.instance = instance
        self.caps = caps
        self.free = free
        self.owners: list[list[int]] = [[-1] * len(costs) for costs in instance.costs]
        self.loads = instance.initial_loads()
        self.members: list[set[tuple[int, int]]] = [set() for _ in range(instance.num_ranks)]

    def cost(self, item: tuple[int, int]) -> float:
        return self.instance.costs[item[0]][item[1]]

    def name(self, item: tuple[int, int]) -> str:
        return self.instance.names[item[0]][item[1]]

    def assign(self, item: tuple[int, int], rank: int) -> None:
        bucket, index = item
        previous = self.owners[bucket][index]
        if previous >= 0:
            self.loads[previous] -= self.cost(item)
            self.members[previous].discard(item)
        self.owners[bucket][index] = rank
        if rank >= 0:
            self.loads[rank] += self.cost(item)
            self.members[rank].add(item)

    def bucket_ok(self, bucket: int) -> bool:
        """Placed owners never decrease, slices stay under the cap, unplaced items still fit."""
        spans, cap = self.instance.spans[bucket], self.caps[bucket]
        if self.free:
            fills: dict[int, int] = {}
            for span, owner in zip(spans, self.owners[bucket]):
                if owner >= 0:
                    fills[owner] = fills.get(owner, 0) + span
            return max(fills.values(), default=0) <= cap
        rank, fill = 0, 0
        for span, owner in zip(spans, self.owners[bucket]):
            if owner < 0:
                if fill + span > cap:
                    rank, fill = rank + 1, 0
            elif owner < rank:
                return False
            elif owner > rank:
                rank, fill = owner, 0
            fill += span
            if fill > cap or rank >= self.instance.num_ranks:
                return False
        return True

    def interval(self, item: tuple[int, int]) -> tuple[int, int, float]:
        """Ranks allowed by placed bucket-mates, and a preferred spot inside them."""
        bucket, index = item
        owners = self.owners[bucket]
        low, high, before, after = 0, self.instance.num_ranks - 1, -1, len(owners)
        if self.free:
            return low, high, 0.0
        for j in range(index - 1, -1, -1):
            if owners[j] >= 0:
                low, before = owners[j], j
                break
        for j in range(index + 1, len(owners)):
            if owners[j] >= 0:
                high, after = owners[j], j
                break
        fraction = (index - before) / (after - before)
        return low, high, low + fraction * (high - low)


def _place_greedy(search: _Search) -> bool:
    """Longest-processing-time first: each item on the least loaded rank its bucket allows.
    False when an item fits nowhere (only in free order, where caps are a bin packing)."""
    instance = search.instance
    items = [(b, i) for b, costs in enumerate(instance.costs) for i in range(len(costs))]
    items.sort(key=lambda item: (-search.cost(item), search.name(item)))
    by_load = sorted((load, rank) for rank, load in enumerate(search.loads))
    key_of = [(load, rank) for rank, load in enumerate(search.loads)]
    for item in items:
        low, high, target = search.interval(item)
        candidates: Iterable[int]
        if high - low < NARROW_INTERVAL:
            candidates = sorted(range(low, high + 1), key=lambda r: (search.loads[r], abs(r - target), r))
        else:
            candidates = _ranks_by_load(by_load, low, high, target)
        for rank in candidates:
            search.assign(item, rank)
            if search.bucket_ok(item[0]):
                break
            search.assign(item, -1)
        else:  # in registration order unreachable: bucket_ok keeps every partial plan completable
            if search.free:
                return False
            raise AssertionError(f"no feasible rank for {search.name(item)}")
        # Remove the rank's entry by the exact key it was filed under: recomputing it by
        # subtraction can differ in the last bit for non-integral costs.
        del by_load[bisect.bisect_left(by_load, key_of[rank])]
        key_of[rank] = (search.loads[rank], rank)
        bisect.insort(by_load, key_of[rank])
    return True


def _ranks_by_load(by_load: list[tuple[float, int]], low: int, high: int, target: float) -> Iterator[int]:
    """Ranks in [low, high] by load; among those tied on the lowest load, nearest `target` first.
    `by_load` is sorted by (load, rank), so the tied ranks are one run sorted by rank: walked
    outward from the target, with no sort."""
    entries = ((load, rank) for load, rank in by_load if low <= rank <= high)
    first = next(entries, None)
    if first is None:
        return
    lightest = first[0]
    start, stop = bisect.bisect_left(by_load, (lightest, low)), bisect.bisect_right(by_load, (lightest, high))
    right = bisect.bisect_left(by_load, (lightest, target), start, stop)
    left = right - 1
    while left >= start or right < stop:
        if right >= stop or (left >= start and target - by_load[left][1] <= by_load[right][1] - target):
            yield by_load[left][1]
            left -= 1
        else:
            yield by_load[right][1]
            right += 1
    yield from (rank for _load, rank in by_load[stop:] if low <= rank <= high)


def _neighbour_interval(search: _Search, item: tuple[int, int]) -> range:
    """Ranks `item` may move to with every other item of its bucket fixed."""
    if search.free:
        return range(search.instance.num_ranks)
    bucket, index = item
    owners = search.owners[bucket]
    low = owners[index - 1] if index > 0 else 0
    high = owners[index + 1] if index + 1 < len(owners) else search.instance.num_ranks - 1
    return range(low, high + 1)


def _would_be_valid(search: _Search, changes: list[tuple[tuple[int, int], int]]) -> bool:
    """Whether applying `changes` keeps every touched bucket valid (state is left unchanged)."""
    previous = [(item, search.owners[item[0]][item[1]]) for item, _ in changes]
    for item, rank in changes:
        search.assign(item, rank)
    valid = all(search.bucket_ok(bucket) for bucket in {item[0] for item, _ in changes})
    for item, rank in reversed(previous):
        search.assign(item, rank)
    return valid


Change = list[tuple[tuple[int, int], int]]


def _first_valid(search: _Search, candidates: list[tuple[tuple[float, str, str | int], Change]]) -> Change | None:
    """The best-scoring candidate that keeps its buckets valid (validity is the costly check)."""
    for _, change in sorted(candidates, key=lambda candidate: candidate[0]):
        if _would_be_valid(search, change):
            return change
    return None


def _best_move(search: _Search, heavy: int) -> Change | None:
    """The single-item move off `heavy` that lowers the pair's max load the most."""
    loads = search.loads
    candidates: list[tuple[tuple[float, str, str | int], Change]] = []
    for item in search.members[heavy]:
        cost = search.cost(item)
        for rank in _neighbour_interval(search, item):
            new_max = max(loads[heavy] - cost, loads[rank] + cost)
            if rank != heavy and new_max < loads[heavy]:
                candidates.append(((new_max, search.name(item), rank), [(item, rank)]))
    return _first_valid(search, candidates)


def _best_swap(
    search: _Search, heavy: int, by_cost: list[tuple[float, str, tuple[int, int]]], costs_only: list[float]
) -> Change | None:
    """The swap of an item on `heavy` with a cheaper one elsewhere that helps the most."""
    loads = search.loads
    slack = loads[heavy] - min(loads)
    candidates: list[tuple[tuple[float, str, str | int], Change]] = []
    tried_per_cost: dict[float, int] = {}
    for item in sorted(search.members[heavy], key=lambda it: (-search.cost(it), search.name(it))):
        cost, name = search.cost(item), search.name(item)
        # Items of equal cost are interchangeable but for validity: a few of each suffice.
        tried_per_cost[cost] = tried_per_cost.get(cost, 0) + 1
        if tried_per_cost[cost] > SWAP_ITEMS_PER_COST:
            continue
        start = bisect.bisect_right(costs_only, cost - slack)
        stop = bisect.bisect_left(costs_only, cost)
        # The ideal partner moves half the slack; look at a window of partners around it.
        centre = bisect.bisect_left(costs_only, cost - slack / 2)
        window = by_cost[max(start, centre - SWAP_WINDOW) : min(stop, centre + SWAP_WINDOW)]
        for other_cost, other_name, other in window:
            rank = search.owners[other[0]][other[1]]
            new_max = max(loads[heavy] - cost + other_cost, loads[rank] + cost - other_cost)
            if rank != heavy and new_max < loads[heavy]:
                candidates.append(((new_max, name, other_name), [(item, rank), (other, heavy)]))
    return _first_valid(search, candidates)


def _segment_dp(
    base: list[float], costs: tuple[float, ...], spans: tuple[int, ...], cap: int, limit: float | None
) -> list[list[float]]:
    """table[r][i]: best value for items [0, i) on ranks [0, r). With `limit` None the value is
    the largest load (bottleneck); otherwise the sum of squared loads, loads kept <= limit."""
    k, inf = len(costs), math.inf
    cost_prefix, span_prefix = [0.0], [0]
    for cost, span in zip(costs, spans):
        cost_prefix.append(cost_prefix[-1] + cost)
        span_prefix.append(span_prefix[-1] + span)
    table = [[-inf if limit is None else 0.0] + [inf] * k]
    for load in base:
        previous, row = table[-1], [inf] * (k + 1)
        for i in range(k + 1):
            for j in range(i, -1, -1):
                if span_prefix[i] - span_prefix[j] > cap:
                    break
                # Moving j down only adds items to this rank's segment: its total only grows,
                # while previous[j] (fewer items on the earlier ranks) only shrinks.
                total = load + cost_prefix[i] - cost_prefix[j]
                if limit is None:
                    row[i] = min(row[i], max(previous[j], total))
                    if total >= previous[j]:
                        break
                elif total <= limit:
                    row[i] = min(row[i], previous[j] + total * total)
                else:
                    break
        table.append(row)
    return table


def _resolve_bucket(search: _Search, bucket: int) -> bool:
    """Re-solve one bucket exactly with every other bucket fixed; apply it if it lowers
    (max load, sum of squared loads). Returns whether it did."""
    instance = search.instance
    costs, spans = instance.costs[bucket], instance.spans[bucket]
    base = list(search.loads)
    for index, owner in enumerate(search.owners[bucket]):
        base[owner] -= costs[index]
    bottleneck = _segment_dp(base, costs, spans, search.caps[bucket], None)[-1][-1]
    limit = bottleneck * (1 + 1e-12)
    table = _segment_dp(base, costs, spans, search.caps[bucket], limit)
    owners = _trace_segments(table, base, costs, spans, search.caps[bucket], limit)
    before = (max(search.loads), sum(load * load for load in search.loads))
    previous = list(search.owners[bucket])
    for index, rank in enumerate(owners):
        search.assign((bucket, index), rank)
    after = (max(search.loads), sum(load * load for load in search.loads))
    if after[0] < before[0] * (1 - 1e-12) or (after[0] <= before[0] and after[1] < before[1] * (1 - 1e-12)):
        return True
    for index, rank in enumerate(previous):
        search.assign((bucket, index), rank)
    return False


def _trace_segments(
    table: list[list[float]],
    base: list[float],
    costs: tuple[float, ...],
    spans: tuple[int, ...],
    cap: int,
    limit: float,
) -> list[int]:
    """Owners of the bucket's items from the sum-of-squares table, walking back from the end."""
    owners = [0] * len(costs)
    i = len(costs)
    for rank in range(len(base) - 1, -1, -1):
        for j in range(i + 1):
            segment_cost, segment_span = sum(costs[j:i]), sum(spans[j:i])
            total = base[rank] + segment_cost
            if (
                segment_span <= cap
                and total <= limit
                and math.isclose(table[rank][j] + total * total, table[rank + 1][i], rel_tol=1e-12, abs_tol=1e-300)
            ):
                owners[j:i] = [rank] * (i - j)
                i = j
                break
    return owners


def _improve(search: _Search, max_rounds: int) -> None:
    """Move/swap local search on the most loaded rank until it cannot be relieved.

    Every accepted step lowers the sum of squared loads, so the search terminates; the round
    limit only bounds its time deterministically.
    """
    instance = search.instance
    by_cost = sorted(
        (instance.costs[b][i], instance.names[b][i], (b, i))
        for b in range(len(instance.costs))
        for i in range(len(instance.costs[b]))
    )
    costs_only = [entry[0] for entry in by_cost]
    sweep_work = instance.num_ranks * sum(len(costs) ** 2 for costs in instance.costs)
    for _ in range(max_rounds):
        heavy = max(range(instance.num_ranks), key=lambda r: (search.loads[r], -r))
        step = _best_move(search, heavy) or _best_swap(search, heavy, by_cost, costs_only)
        if step is not None:
            for item, rank in step:
                search.assign(item, rank)
            continue
        if sweep_work > SWEEP_WORK_LIMIT:
            return
        buckets = sorted({bucket for bucket, _ in search.members[heavy]})
        if any(_resolve_bucket(search, bucket) for bucket in buckets):
            continue
        # Relieving the heavy rank may need room made elsewhere first: sweep every other bucket
        # (those of the heavy rank were just re-solved in vain, with nothing changed since).
        if not [b for b in range(len(instance.costs)) if b not in buckets and _resolve_bucket(search, b)]:
            return


def _polished(search: _Search) -> tuple[tuple[int, ...], ...]:
    num_items = sum(len(costs) for costs in search.instance.costs)
    _improve(search, max_rounds=4 * num_items + 100)
    return tuple(tuple(owners) for owners in search.owners)


def partition(instance: DpInstance, alpha: float, seeds: tuple[Owners, ...] = ()) -> DpAssignment:
    """Owners of every item minimising the largest compute load under α's slice caps.

    Two starts of its own, each polished by local search: the best contiguous plan over the
    whole buffer (exact for one bucket; near perfect for layer-periodic models), and
    longest-processing-time placement (good when items are few per rank and uneven); ties go
    to the contiguous plan. Then monotone α: unless that plan is at the lower bound, the plan
    at the next coarser α of `ALPHA_LADDER` (planned the same way) and any `seeds` (plans at
    coarser α, so feasible under these looser caps) replace it when they are better, polished
    here first (local search never raises the max load). So the plan at α is never worse than
    at any coarser ladder α or seed. Without seeds the plan is remembered (every finer α,
    `--alpha auto` and the free order reuse it).
    """
    return _remembered(instance, alpha) if not seeds else _partition(instance, alpha, seeds)


def _partition(instance: DpInstance, alpha: float, seeds: tuple[Owners, ...]) -> DpAssignment:
    """`partition`, worked out."""
    if not any(instance.costs):
        return DpAssignment(tuple(() for _ in instance.costs), "empty")
    caps = slice_caps(instance, alpha)
    own = solve(instance, caps)
    own_load = max(rank_loads(instance, own.owners))
    coarser = [ladder for ladder in ALPHA_LADDER if ladder < alpha]
    if own_load <= lower_bound(instance) * (1 + 1e-12) or not (coarser or seeds):
        return own
    starts = [(owners, "seed") for owners in seeds if feasible(instance, caps, owners)]
    if coarser:
        seed = _remembered(instance, coarser[-1])
        method = seed.method if "(from alpha" in seed.method else f"{seed.method} (from alpha {coarser[-1]:g})"
        starts.insert(0, (seed.owners, method))
    if not starts:
        return own
    best, method = min(starts, key=lambda start: max(rank_loads(instance, start[0])))
    if max(rank_loads(instance, best)) >= own_load:
        return own
    return DpAssignment(polished(instance, caps, best), method)


Owners = tuple[tuple[int, ...], ...]
ALPHA_LADDER = (0.0, 0.25, 0.5, 0.75)
"""Coarser α whose plans seed every finer one: plans at 0, 0.25, 0.5, 0.75 and any larger α
never get worse as α grows (other coarser α can be passed as seeds, as `--alpha auto` does)."""


@functools.lru_cache(maxsize=32)
def _remembered(instance: DpInstance, alpha: float) -> DpAssignment:
    """`partition` without seeds, remembered: every finer α and `--alpha auto` reuse it."""
    return _partition(instance, alpha, ())


def _seeded(instance: DpInstance, caps: tuple[int, ...], owners: Owners, free: bool = False) -> _Search:
    """A search state holding `owners` (feasible under `caps`)."""
    search = _Search(instance, caps, free)
    for bucket, bucket_owners in enumerate(owners):
        for index, rank in enumerate(bucket_owners):
            search.assign((bucket, index), rank)
    return search


def feasible(instance: DpInstance, caps: tuple[int, ...], owners: Owners, free: bool = False) -> bool:
    """Whether `owners` (a seed from elsewhere) is a plan of `instance` within `caps`."""
    if [len(bucket) for bucket in owners] != [len(costs) for costs in instance.costs] or any(
        not 0 <= rank < instance.num_ranks for bucket in owners for rank in bucket
    ):
        return False
    search = _seeded(instance, caps, owners, free)
    return all(search.bucket_ok(bucket) for bucket in range(len(owners)))


def polished(instance: DpInstance, caps: tuple[int, ...], owners: Owners, free: bool = False) -> Owners:
    """`owners` (feasible under `caps`; `free`: in any order inside a bucket) improved by local
    search, which never raises the max load."""
    return _polished(_seeded(instance, caps, owners, free))


def polished_lpt(instance: DpInstance, caps: tuple[int, ...], free: bool = False) -> Owners | None:
    """Longest-processing-time placement under `caps`, improved by local search; None when an
    item fits nowhere (only in free order, where the caps are a bin packing)."""
    search = _Search(instance, caps, free)
    return _polished(search) if _place_greedy(search) else None


@functools.lru_cache(maxsize=32)
def solve(instance: DpInstance, caps: tuple[int, ...]) -> DpAssignment:
    """The better polished plan of the contiguous and the LPT start under `caps` (remembered:
    ladder α whose caps coincide, as slice sizes are discrete, share it)."""
    contiguous = polished(instance, caps, tuple(tuple(b) for b in solve_contiguous(instance, caps)))
    greedy = polished_lpt(instance, caps)
    assert greedy is not None  # in registration order every partial plan is completable
    candidates = [(contiguous, "contiguous+local-search"), (greedy, "lpt+local-search")]
    owners, method = min(candidates, key=lambda c: (max(rank_loads(instance, c[0])), c[1]))
    return DpAssignment(owners, method)
