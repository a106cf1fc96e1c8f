"""Device-aware DP ownership: under TP the busiest device, not the busiest DP rank, sets the step.

The DP partition balances each DP rank's total work. A DP rank's P devices then share it through
the TP scheduler (hosts, micro-groups, teams), and how well they can depends on which matrices
the rank holds: one large matrix plus a small one can leave a device with far more than 1/P of
the rank's work, while a rank of a few equal matrices splits evenly. `reown` moves and swaps
matrices between DP ranks to shorten the busiest device, scored by the TP scheduler itself
(`DeviceModel.rank_time`: the sum of the rank's micro-groups' makespans, teams included, plus
its AdamW), while keeping:

- every constraint of the partition (each rank's slice of a bucket under α's cap; in
  registration order, owners non-decreasing along every bucket);
- the DP balance, as a constraint: no DP rank's load above the larger of the DP partition's
  largest and `DeviceModel.load_cap`, P times the device lower bound (what the rank's P
  devices could finish within the best busiest device any plan can have).

Owners also decide the buckets' slices, and so their collectives' time. The result (from the
partition's owners, and from a fresh device-aware assignment) is kept only where it shortens
the step the reference device predicts: the busiest device plus every bucket's reduction and
gather at the cheapest collective (`DeviceModel.comm`, seconds converted to FLOPs at the
reference throughput), each candidate with its slices evened out first (`even_slices`).

Local search on the DP rank with the busiest device: the move of one of its matrices, or the
swap of one with a matrix of another rank (one per distinct kind of matrix), that lowers the
larger of the two ranks' times the most; accepted only when it does (so the sorted list of
rank times falls and the search ends), within a deterministic budget of evaluations.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from canzona.planner.partition.cooperative import Shape, cooperate
from canzona.planner.partition.dp import DpInstance, Owners
from canzona.planner.partition.even_slices import SliceState, even_slices
from canzona.planner.partition.tp import Task, group_stats, schedule_tasks

PARTNER_RANKS = 16  # ranks tried per round: those with the shortest busiest device, and the lightest
MAX_EVALUATIONS = 4000  # distinct rank schedules computed per buffer
PER_KIND = 3  # items of one kind tried per rank (in different buckets)
MAX_CONSTRUCT_WORK = 200_000  # matrices x ranks up to which a fresh device-aware start is built
# A DP rank with more matrices than this spreads them over its P devices about evenly already
# (each is a small share of the rank), and rescheduling it costs the most.
MAX_RANK_TASKS = 64

Item = tuple[int, int]  # (bucket, position)


@dataclass(frozen=True)
class DeviceModel:
    """How the TP stage turns one DP rank's matrices into its busiest device's time: tp hosts,
    the group capacity, the scheduler mode, the matrices teams may host, Newton–Schulz steps
    and the cooperative mode; `extra[r]`: tasks DP rank r holds outside this buffer (its
    experts), `adamw[r]`: each of its devices' AdamW cost."""

    tp: int
    capacity: int
    mode: str
    shapes: dict[str, Shape]
    ns_steps: int
    coop: str
    extra: tuple[tuple[Task, ...], ...]
    adamw: tuple[float, ...]
    load_cap: float = 0.0
    comm: Callable[[DpInstance, Owners], float] | None = None

    def rank_time(self, rank: int, tasks: Sequence[Task]) -> float:
        """The sum of the rank's micro-groups' makespans (every group is as long as its busiest
        host), teams included, plus its AdamW."""
        tasks = list(tasks) + list(self.extra[rank] if self.extra else ())
        groups = schedule_tasks(tasks, self.tp, self.capacity, self.mode)
        if self.shapes:
            groups = cooperate(tasks, groups, self.tp, self.shapes, self.ns_steps, self.coop, self.capacity)
        adamw = self.adamw[rank] if self.adamw else 0.0
        return sum(group_stats(tasks, group, self.tp, self.capacity).makespan for group in groups) + adamw


class _Search:
    """Owners, loads and rank times during the search (mutable, internal)."""

    def __init__(
        self, instance: DpInstance, state: SliceState, tasks: dict[Item, Task], model: DeviceModel, load_cap: float
    ) -> None:
        self.instance, self.state, self.tasks, self.model, self.load_cap = instance, state, tasks, model, load_cap
        self.members: list[set[Item]] = [set() for _ in range(instance.num_ranks)]
        for bucket, owners in enumerate(state.owners):
            for index, rank in enumerate(owners):
                self.members[rank].add((bucket, index))
        self.loads = instance.initial_loads()
        for rank, items in enumerate(self.members):
            self.loads[rank] += sum(self.cost(item) for item in items)
        self.cache: dict[Hashable, float] = {}
        # Ranks alike but for their matrices (no experts, equal AdamW) share schedules.
        self.by_rank = bool(model.extra) or len(set(model.adamw)) > 1
        self.times = [self.time(rank, self.members[rank]) for rank in range(instance.num_ranks)]

    def cost(self, item: Item) -> float:
        """The item's cost (its DP load)."""
        return self.instance.costs[item[0]][item[1]]

    def kind(self, item: Item) -> tuple[float, int, bool]:
        """What the TP scheduler sees of an item: cost, gathered bytes, whether replicated."""
        task = self.tasks[item]
        return task.cost, task.size, task.replicated

    def time(self, rank: int, items: set[Item]) -> float:
        """The rank's busiest-device time with these items (remembered by their kinds: matrices
        of the same cost, size and shape schedule alike)."""
        key = self.key(rank, items)
        if key not in self.cache:
            self.cache[key] = self.model.rank_time(rank, [self.tasks[item] for item in sorted(items)])
        return self.cache[key]

    def key(self, rank: int, items: set[Item]) -> Hashable:
        """What a rank's schedule depends on: its matrices' kinds (and the rank, when ranks
        differ otherwise)."""
        kinds = tuple(sorted(self.kind(item) + (self.tasks[item].name in self.model.shapes,) for item in items))
        return (rank if self.by_rank else None, kinds)

    def valid(self, changes: list[tuple[Item, int]]) -> bool:
        """Whether giving each item its new rank keeps every touched bucket within the rules."""
        previous = [(item, self.state.owners[item[0]][item[1]]) for item, _ in changes]
        for item, rank in changes:
            self.state.set_owner(item, rank)
        ok = all(self.state.bucket_valid(bucket) for bucket in {item[0] for item, _ in changes})
        for item, rank in previous:
            self.state.set_owner(item, rank)
        return ok

    def apply(self, changes: list[tuple[Item, int]]) -> None:
        """Give each item its new rank, updating members, loads and times."""
        touched = set()
        for item, rank in changes:
            old = self.state.owners[item[0]][item[1]]
            self.state.set_owner(item, rank)
            self.members[old].discard(item)
            self.members[rank].add(item)
            self.loads[old] -= self.cost(item)
            self.loads[rank] += self.cost(item)
            touched |= {old, rank}
        for rank in touched:
            self.times[rank] = self.time(rank, self.members[rank])


def _distinct(search: _Search, items: set[Item]) -> list[Item]:
    """A few items of each kind (cost, size, replicated), in different buckets (one may be
    movable where another is not), the costliest kind first."""
    seen: dict[tuple[float, int, bool], list[Item]] = {}
    for item in sorted(items):
        chosen = seen.setdefault(search.kind(item), [])
        if len(chosen) < PER_KIND and all(other[0] != item[0] for other in chosen):
            chosen.append(item)
    return [item for kind in sorted(seen, key=lambda kind: (-kind[0], kind)) for item in seen[kind]]


def _candidates(search: _Search, heavy: int, other: int) -> list[list[tuple[Item, int]]]:
    """Moves of one of `heavy`'s matrices to `other`, and swaps of one with one of `other`'s."""
    out: list[list[tuple[Item, int]]] = []
    mine, theirs = _distinct(search, search.members[heavy]), _distinct(search, search.members[other])
    for x in mine:
        out.append([(x, other)])
        out += [[(x, other), (y, heavy)] for y in theirs if search.kind(y) != search.kind(x)]
    return out


def _score(search: _Search, heavy: int, other: int, changes: list[tuple[Item, int]]) -> tuple[float, float] | None:
    """(the larger of the two ranks' new times, the smaller), or None if the change breaks the
    load cap or a bucket's rules."""
    delta = {heavy: 0.0, other: 0.0}
    sets = {heavy: set(search.members[heavy]), other: set(search.members[other])}
    for item, rank in changes:
        old = heavy if item in sets[heavy] else other
        sets[old].discard(item)
        sets[rank].add(item)
        delta[old] -= search.cost(item)
        delta[rank] += search.cost(item)
    if any(search.loads[r] + delta[r] > search.load_cap for r in (heavy, other) if delta[r] > 0):
        return None
    if not search.valid(changes):
        return None
    times = sorted((search.time(heavy, sets[heavy]), search.time(other, sets[other])), reverse=True)
    return times[0], times[1]


def _construct(
    instance: DpInstance, state: SliceState, tasks: dict[Item, Task], model: DeviceModel, load_cap: float
) -> Owners | None:
    """A fresh assignment (free order only): matrices costliest first, each to the rank whose
    busiest device it lengthens least (ties: the lighter rank), within the load cap and α's
    caps; None if some matrix fits nowhere or the instance is too large to build this way."""
    items = sorted(
        ((b, i) for b, costs in enumerate(instance.costs) for i in range(len(costs))),
        key=lambda item: (-instance.costs[item[0]][item[1]], instance.names[item[0]][item[1]]),
    )
    if not state.free or len(items) * instance.num_ranks > MAX_CONSTRUCT_WORK:
        return None
    empty = SliceState(
        instance,
        state.caps,
        True,
        [[0] * len(c) for c in instance.costs],
        [[0] * instance.num_ranks for _ in instance.costs],
        list(state.totals),
    )
    search = _Search(instance, empty, tasks, model, load_cap)
    search.members = [set() for _ in range(instance.num_ranks)]
    search.loads = instance.initial_loads()
    search.times = [search.time(r, set()) for r in range(instance.num_ranks)]
    for item in items:
        bucket, cost, span = item[0], instance.costs[item[0]][item[1]], instance.spans[item[0]][item[1]]
        choices = {}
        for rank in range(instance.num_ranks):
            if search.loads[rank] + cost > load_cap or empty.fills[bucket][rank] + span > state.caps[bucket]:
                continue
            key = (search.key(rank, search.members[rank]), search.loads[rank])
            if key not in choices:
                choices[key] = (search.time(rank, search.members[rank] | {item}), search.loads[rank], rank)
        if not choices:
            return None
        rank = min(choices.values())[2]
        empty.fills[bucket][rank] += span
        empty.owners[bucket][item[1]] = rank
        search.members[rank].add(item)
        search.loads[rank] += cost
    return tuple(tuple(owners) for owners in empty.owners)


def _partners(search: _Search, heavy: int) -> list[int]:
    """The ranks with the shortest busiest device and the lightest DP loads (those with room),
    PARTNER_RANKS of each, in rank order."""
    others = [r for r in range(search.instance.num_ranks) if r != heavy]
    by_time = sorted(others, key=lambda r: (search.times[r], r))[:PARTNER_RANKS]
    by_load = sorted(others, key=lambda r: (search.loads[r], r))[:PARTNER_RANKS]
    return sorted(set(by_time) | set(by_load))


def _improve(search: _Search) -> Owners:
    """Local search from the search's state (changed in place): the owners at its end."""
    instance = search.instance
    for _ in range(4 * instance.num_ranks + 16):
        if len(search.cache) > MAX_EVALUATIONS:
            break
        heavy = max(range(instance.num_ranks), key=lambda r: (search.times[r], -r))
        best: tuple[tuple[float, float], list[tuple[Item, int]]] | None = None
        for other in _partners(search, heavy):
            for changes in _candidates(search, heavy, other):
                score = _score(search, heavy, other, changes)
                if (
                    score is not None
                    and score[0] < search.times[heavy] * (1 - 1e-9)
                    and (best is None or score < best[0])
                ):
                    best = (score, changes)
        if best is None:
            break
        search.apply(best[1])
    return tuple(tuple(owners) for owners in search.state.owners)


def reown(instance: DpInstance, state: SliceState, tasks: dict[Item, Task], model: DeviceModel) -> Owners:
    """The owners of `state` (a partition of `instance`, checked against its rules), changed to
    shorten the busiest device (see the module docstring): the best of them, a local search from
    them and one from a fresh device-aware assignment, each with its slices evened out, by the
    busiest device plus the collectives (`DeviceModel.comm`); ties keep the partition's."""
    original = tuple(tuple(owners) for owners in state.owners)
    counts = [0] * instance.num_ranks
    for owners in original:
        for rank in owners:
            counts[rank] += 1
    if max(count + len(model.extra[rank] if model.extra else ()) for rank, count in enumerate(counts)) > MAX_RANK_TASKS:
        return original
    caps, free = state.caps, state.free
    start = _Search(instance, state, tasks, model, 0.0)
    start.load_cap = load_cap = max(model.load_cap, max(start.loads))  # no worse than the partition's
    candidates = [original, _improve(start)]
    fresh = _construct(instance, state, tasks, model, load_cap)
    if fresh is not None:
        candidates.append(
            _improve(_Search(instance, SliceState.of(instance, caps, fresh, True), tasks, model, load_cap))
        )
    scored = []
    for position, candidate in enumerate(dict.fromkeys(candidates)):
        evened = even_slices(instance, caps, candidate, free)
        search = _Search(instance, SliceState.of(instance, caps, evened, free), tasks, model, load_cap)
        comm = model.comm(instance, evened) if model.comm else 0.0
        scored.append((max(search.times) + comm, position, evened))
    return min(scored)[2]
