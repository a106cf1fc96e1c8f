"""Even out a partition's slices without changing any rank's load.

The DP partition minimises the largest compute load; many plans reach it, and they can move
very different bytes. A bucket whose slices are all near T / n is reduced and gathered by a
ring for about (n − 1)/n of the bucket per rank; a bucket whole on one rank costs that rank
the whole bucket (`canzona.planner.partition.collectives`). With equal layers that is the
common case: the best contiguous plan of an expert buffer over two ranks gives each rank
whole buckets, while swapping half of one bucket's experts with half of another's balances
compute just as well and halves the bytes.

`even_slices` swaps the owners of two items of exactly equal cost on different ranks (so every
rank keeps its load, and with it every bound and the α monotonicity of the plan), when that
lowers the summed communication proxy of the buckets involved: per bucket, the bytes the
busiest rank moves in the cheaper of a padded ring ((n − 1) · largest slice) and rooted chains
(bucket − smallest slice), hardware-free. Swaps keep every slice under α's cap, and in
registration order keep owners non-decreasing along every bucket. Only buckets with at least n
items can gain (otherwise some rank's slice is empty and both forms move the whole bucket).
Deterministic; each swap lowers an integer total, and the work is bounded: accepted swaps per
item, and swaps weighed per call (`MAX_EVALUATIONS`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from canzona.planner.partition.dp import DpInstance, Owners

LOW_RANKS = 4  # the emptiest ranks of a bucket tried, in turn, to take an item from its fullest
MAX_SWAPS_PER_ITEM = 4  # accepted swaps, in total, per item of the buffer
# Swaps weighed per call: owners scattered over every bucket (layer-wise's, in free order) can
# offer millions, each a small gain; the planner's own partitions stop far below this.
MAX_EVALUATIONS = 200_000


def proxy(fills: list[int], total: int) -> int:
    """Elements the busiest rank moves for one bucket with these slices, in the cheaper of a
    padded ring and rooted chains."""
    n = len(fills)
    return min((n - 1) * max(fills), total - min(fills))


@dataclass
class SliceState:
    """A partition being changed: owners and per-bucket slice fills, checked against α's caps
    (and, in registration order, the bucket order) one bucket at a time."""

    instance: DpInstance
    caps: tuple[int, ...]
    free: bool
    owners: list[list[int]]
    fills: list[list[int]]
    totals: list[int]
    evaluations: int = 0  # swaps weighed by `gain` so far

    @classmethod
    def of(cls, instance: DpInstance, caps: tuple[int, ...], owners: Owners, free: bool) -> SliceState:
        """The state of `owners` (a partition of `instance` under `caps`)."""
        fills = []
        for spans, bucket_owners in zip(instance.spans, owners):
            fill = [0] * instance.num_ranks
            for span, owner in zip(spans, bucket_owners):
                fill[owner] += span
            fills.append(fill)
        return cls(instance, caps, free, [list(o) for o in owners], fills, [sum(s) for s in instance.spans])

    def ordered(self, bucket: int) -> bool:
        """Registration order: owners never decrease along the bucket."""
        owners = self.owners[bucket]
        return all(owners[i] <= owners[i + 1] for i in range(len(owners) - 1))

    def bucket_valid(self, bucket: int) -> bool:
        """Every slice of the bucket under its cap (and in order, unless free)."""
        return max(self.fills[bucket]) <= self.caps[bucket] and (self.free or self.ordered(bucket))

    def set_owner(self, item: tuple[int, int], rank: int) -> None:
        """Give one item to `rank`."""
        bucket, index = item
        span, old = self.instance.spans[bucket][index], self.owners[bucket][index]
        self.fills[bucket][old] -= span
        self.fills[bucket][rank] += span
        self.owners[bucket][index] = rank

    def gain(self, x: tuple[int, int], y: tuple[int, int]) -> int:
        """How much swapping the owners of x and y lowers the proxy total (negative: raises it;
        a swap that breaks a cap or the order gains nothing)."""
        self.evaluations += 1
        (bx, ix), (by, iy) = x, y
        rx, ry = self.owners[bx][ix], self.owners[by][iy]
        sx, sy = self.instance.spans[bx][ix], self.instance.spans[by][iy]
        touched = (bx,) if bx == by else (bx, by)
        before = 0
        for b in touched:
            before += proxy(self.fills[b], self.totals[b])
        self._apply(x, y, rx, ry, sx, sy)
        valid, after = True, 0
        for b in touched:
            valid = valid and self.bucket_valid(b)
            after += proxy(self.fills[b], self.totals[b])
        self._apply(x, y, ry, rx, sx, sy)
        return before - after if valid else 0

    def _apply(self, x: tuple[int, int], y: tuple[int, int], rx: int, ry: int, sx: int, sy: int) -> None:
        """Give x (now on rx) to ry and y (now on ry) to rx."""
        (bx, ix), (by, iy) = x, y
        self.owners[bx][ix], self.owners[by][iy] = ry, rx
        self.fills[bx][rx] -= sx
        self.fills[bx][ry] += sx
        self.fills[by][ry] -= sy
        self.fills[by][rx] += sy

    def swap(self, x: tuple[int, int], y: tuple[int, int]) -> None:
        """Swap the owners of x and y."""
        (bx, ix), (by, iy) = x, y
        self._apply(
            x, y, self.owners[bx][ix], self.owners[by][iy], self.instance.spans[bx][ix], self.instance.spans[by][iy]
        )


def _excess(state: SliceState, bucket: int) -> int:
    """How far a bucket's proxy is above what equal slices would move."""
    n, total = state.instance.num_ranks, state.totals[bucket]
    return proxy(state.fills[bucket], total) - (n - 1) * total // n


def _run_ends(owners: list[int], rank: int) -> list[int]:
    """Positions of the first and last item `rank` owns in a bucket (registration order: the
    only ones that can change owner without breaking the order)."""
    positions = [i for i, owner in enumerate(owners) if owner == rank]
    return sorted({positions[0], positions[-1]}) if positions else []


Held = dict[tuple[int, float], dict[int, set[int]]]  # (rank, cost) -> bucket -> positions


def _held(state: SliceState, eligible: list[int]) -> Held:
    """Where each rank holds items of each cost, in the eligible buckets."""
    held: Held = defaultdict(lambda: defaultdict(set))
    for bucket in eligible:
        for index, (cost, owner) in enumerate(zip(state.instance.costs[bucket], state.owners[bucket])):
            held[(owner, cost)][bucket].add(index)
    return held


def _movable(state: SliceState, held: Held, rank: int, cost: float, bucket: int) -> list[int]:
    """Positions of `rank`'s items of `cost` in `bucket` that a swap may try: the widest one
    (free order), or those at an end of its run (registration order)."""
    positions = held[(rank, cost)].get(bucket, set())
    if state.free:
        spans = state.instance.spans[bucket]
        return [min(positions, key=lambda i: (-spans[i], i))] if positions else []
    return [i for i in _run_ends(state.owners[bucket], rank) if i in positions]


def _swap(state: SliceState, held: Held, x: tuple[int, int], y: tuple[int, int]) -> None:
    """Swap the owners of x and y (equal costs) and keep `held` in step."""
    cost = state.instance.costs[x[0]][x[1]]
    rx, ry = state.owners[x[0]][x[1]], state.owners[y[0]][y[1]]
    for (bucket, index), old, new in ((x, rx, ry), (y, ry, rx)):
        held[(old, cost)][bucket].discard(index)
        held[(new, cost)][bucket].add(index)
    state.swap(x, y)


def _improve_bucket(state: SliceState, held: Held, bucket: int) -> bool:
    """The best swap that moves an item out of the bucket's fullest slice to one of its
    emptiest ranks (the emptiest first) for an equal-cost item of that rank's in another
    bucket; False when none lowers the total."""
    fills, costs = state.fills[bucket], state.instance.costs[bucket]
    high = max(range(len(fills)), key=lambda r: (fills[r], -r))
    kinds = sorted({costs[i] for i, owner in enumerate(state.owners[bucket]) if owner == high}, reverse=True)
    lows = sorted((r for r in range(len(fills)) if fills[r] < fills[high]), key=lambda r: (fills[r], r))
    spans, n = state.instance.spans, len(fills)
    for low in lows[:LOW_RANKS]:
        best: tuple[int, tuple[int, int], tuple[int, int]] | None = None
        for cost in kinds:
            # Partner buckets where `low` is fullest against `high` first: swapping there evens both.
            others = sorted(
                (b for b in held[(low, cost)] if b != bucket and held[(low, cost)][b]),
                key=lambda b: (state.fills[b][high] - state.fills[b][low], b),
            )
            for ix in _movable(state, held, high, cost, bucket):
                for other in others:
                    for iy in _movable(state, held, low, cost, other):
                        gain = state.gain((bucket, ix), (other, iy))
                        if gain > 0 and (best is None or gain > best[0]):
                            best = (gain, (bucket, ix), (other, iy))
                    # No swap of these items can gain more than both buckets' full share of them.
                    if best is not None and best[0] >= (n - 1) * (spans[bucket][ix] + spans[best[2][0]][best[2][1]]):
                        break
        if best is not None:
            _swap(state, held, best[1], best[2])
            return True
    return False


def even_slices(instance: DpInstance, caps: tuple[int, ...], owners: Owners, free: bool) -> Owners:
    """`owners` with equal-cost items swapped between ranks while that lowers the buckets'
    summed communication proxy (see the module docstring); every rank's load is unchanged."""
    n = instance.num_ranks
    eligible = [b for b, costs in enumerate(instance.costs) if len(costs) >= n > 1]
    if not eligible:
        return owners
    state = SliceState.of(instance, caps, owners, free)
    held = _held(state, eligible)
    budget = MAX_SWAPS_PER_ITEM * sum(len(instance.costs[b]) for b in eligible)
    stuck: set[int] = set()
    while budget > 0 and state.evaluations < MAX_EVALUATIONS:
        todo = [b for b in eligible if b not in stuck and _excess(state, b) > 0]
        if not todo:
            break
        bucket = max(todo, key=lambda b: (_excess(state, b), -b))
        if _improve_bucket(state, held, bucket):
            budget -= 1
            stuck.clear()
        else:
            stuck.add(bucket)
    return tuple(tuple(bucket_owners) for bucket_owners in state.owners)
