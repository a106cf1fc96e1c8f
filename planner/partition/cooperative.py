"""Cooperative hosting (Muon only): one dominant matrix hosted by a team of k TP ranks.

A micro-group task normally lives on one host, so the optimizer stage of a DP rank can never
be shorter than its largest matrix's Newton–Schulz. A team of k hosts (k | P) splits the
orthogonalised matrix X (r × c after Muon's transpose, r = min side) along its long side c
into k equal slices; each host keeps its slice's momentum and runs every Newton–Schulz
iteration on it. Only the r × r Gram X·Xᵀ needs every slice: it is all-reduced over the team
once per iteration (plus one scalar all-reduce for the Frobenius norm); B = b·A + c·A² is
computed redundantly by every host and X ← a·X + B·X is local.

Per host that costs T·(4r²c/k + 2r³) + 10·r·c/k FLOPs plus T all-reduces of r² fp32 over k
ranks, priced by the α–β model (`canzona.planner.partition.collectives`) on a reference device
(H100, the TP group's link) and converted to FLOPs at that device's matrix throughput.

`cooperate` decides, per DP rank, after normal hosting: while the busiest host's largest
single-hosted matrix is eligible, try every team size k in the divisors of P (the team: its
host and the k − 1 least loaded others; the one whose host loads, busiest first, are
lexicographically smallest), place the single-hosted tasks again around the teams (LPT in
each group, within its byte capacity), and keep the team if the rank's score went down: its
critical time (the sum of its groups' makespans), then its host loads busiest first. One
such run per team size and one mixing them; the best is kept, and only if the critical time
went down.
Deterministic: ties break by host index. `force` gives every eligible matrix a team of all P
ranks (for tests of the runtime on small models).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from canzona.planner.partition.collectives import NS_BF16_FLOPS, REFERENCE_NETWORK, Link, all_reduce
from canzona.planner.partition.costs import ELEMENTWISE_FLOPS_PER_ELEMENT
from canzona.planner.partition.tp import MicroGroup, Task, Team
from canzona.schedules.limits import COOP_MODES  # noqa: F401 - the planner's vocabulary

GRAM_BYTES = 4  # the Gram matrix is all-reduced in fp32


@dataclass(frozen=True)
class Shape:
    """A matrix a team may host: its gathered shape and TP dim (None: replicated)."""

    rows: int
    cols: int
    tp_dim: int | None

    @property
    def long_dim(self) -> int:
        """The dim Muon's X has as columns (the one the team splits): rows if the matrix is
        taller than wide (Muon transposes it), else cols."""
        return 0 if self.rows > self.cols else 1

    def splits(self, k: int, tp: int) -> bool:
        """Whether k hosts can each take an equal slice of the long side that is whole TP
        shards (long side = TP dim) or an equal part of every shard (otherwise)."""
        long = (self.rows, self.cols)[self.long_dim]
        return tp % k == 0 and long % k == 0


def team_flops(shape: Shape, k: int, ns_steps: int) -> float:
    """FLOPs per host of a k-host Newton–Schulz (the r × r products on every host)."""
    r, c = min(shape.rows, shape.cols), max(shape.rows, shape.cols)
    return float(ns_steps * (4 * r * r * c / k + 2 * r**3) + ELEMENTWISE_FLOPS_PER_ELEMENT * r * c / k)


def team_comm_seconds(shape: Shape, k: int, ns_steps: int, tp: int) -> float:
    """Seconds of the team's all-reduces (one r × r Gram per iteration, one norm) on the
    reference device's TP link."""
    network = REFERENCE_NETWORK
    # A TP group within one node talks over NVLink; one spanning nodes (tp > GPUs per node) may not.
    bandwidth = network.intra_bandwidth if tp <= network.gpus_per_node else network.inter_bandwidth
    link = Link("coop", k, bandwidth, network.latency)
    r = min(shape.rows, shape.cols)
    return ns_steps * all_reduce(link, r * r, GRAM_BYTES).seconds() + all_reduce(link, 1, GRAM_BYTES).seconds()


def team_cost(shape: Shape, k: int, ns_steps: int, tp: int) -> float:
    """Per-host cost (FLOPs; communication at the reference device's throughput)."""
    return team_flops(shape, k, ns_steps) + NS_BF16_FLOPS * team_comm_seconds(shape, k, ns_steps, tp)


def smallest_share(cost: float, shape: Shape | None, ns_steps: int, tp: int) -> float:
    """The least work one device can be left with of a matrix costing `cost`: the matrix itself,
    or the per-member cost of any team that can host it (`shape`; None: no team can)."""
    if shape is None:
        return cost
    shares = [team_cost(shape, k, ns_steps, tp) for k in range(2, tp + 1) if shape.splits(k, tp)]
    return min([cost, *shares])


def host_loads(tasks: Sequence[Task], groups: Sequence[MicroGroup], num_hosts: int) -> list[float]:
    """Cost per host over every group (a team task loads each of its hosts by its share)."""
    loads = [0.0] * num_hosts
    for group in groups:
        for host, cost, _ in group.placements(tasks):
            loads[host] += cost
    return loads


def _with_team(groups: list[MicroGroup], where: tuple[int, int], team: Team) -> None:
    group_index, position = where
    group = groups[group_index]
    teams: list[Team | None] = list(group.teams) if group.teams else [None] * len(group.tasks)
    teams[position] = team
    groups[group_index] = MicroGroup(group.tasks, group.hosts, tuple(teams))


def _largest_single(
    tasks: Sequence[Task], groups: Sequence[MicroGroup], host: int | None, shapes: Mapping[str, Shape]
) -> tuple[int, int] | None:
    """(group, position) of the costliest eligible single-hosted task (on `host` if given)."""
    best: tuple[float, str, tuple[int, int]] | None = None
    for g, group in enumerate(groups):
        for position, (index, on) in enumerate(zip(group.tasks, group.hosts)):
            task = tasks[index]
            if group.team(position) is None and (host is None or on == host) and task.name in shapes:
                key = (-task.cost, task.name, (g, position))
                best = key if best is None or key < best else best
    return best[2] if best else None


def _descending(loads: Sequence[float]) -> list[float]:
    return sorted(loads, reverse=True)


def _best_team(
    task: Task, host: int, shape: Shape, loads: list[float], ns_steps: int, sizes: Sequence[int]
) -> tuple[list[float], Team] | None:
    """The team for `task` (now on `host`) whose host loads, busiest first, are smallest, with
    those loads."""
    tp = len(loads)
    base = list(loads)
    base[host] -= task.cost
    best: tuple[list[float], Team] | None = None
    for k in (k for k in sizes if shape.splits(k, tp)):
        others = sorted((h for h in range(tp) if h != host), key=lambda h: (base[h], h))[: k - 1]
        share = team_cost(shape, k, ns_steps, tp)
        trial = list(base)
        for member in (host, *others):
            trial[member] += share
        if best is None or _descending(trial) < best[0]:
            best = (_descending(trial), Team(tuple(sorted((host, *others))), share))
    return best


def _forced(
    tasks: Sequence[Task], groups: list[MicroGroup], num_hosts: int, shapes: Mapping[str, Shape], ns_steps: int
) -> tuple[MicroGroup, ...]:
    """Every eligible matrix on a team of all P ranks (whatever it costs: for tests)."""
    for g, group in enumerate(list(groups)):
        for position, index in enumerate(group.tasks):
            shape = shapes.get(tasks[index].name)
            if shape is not None and shape.splits(num_hosts, num_hosts):
                team = Team(tuple(range(num_hosts)), team_cost(shape, num_hosts, ns_steps, num_hosts))
                _with_team(groups, (g, position), team)
    return tuple(groups)


def _rehosted(tasks: Sequence[Task], groups: Sequence[MicroGroup], num_hosts: int, capacity: int) -> list[MicroGroup]:
    """The groups with their single-hosted tasks placed again by LPT around the teams' shares,
    in every group that has a team (costliest first, least loaded host of the group with room,
    then least loaded overall; ties by index)."""
    totals = [0.0] * num_hosts
    out = []
    for group in groups:
        if not any(group.teams):  # nothing moved here: keep the scheduler's placement
            out.append(group)
            continue
        loads, sizes, hosts = [0.0] * num_hosts, [0] * num_hosts, list(group.hosts)
        singles = []
        for position, index in enumerate(group.tasks):
            team = group.team(position)
            if team is None:
                singles.append((-tasks[index].cost, tasks[index].name, position))
                continue
            for member in team.hosts:
                loads[member] += team.cost
                sizes[member] += tasks[index].size // len(team.hosts)
        for _, _, position in sorted(singles):
            task = tasks[group.tasks[position]]
            room = [h for h in range(num_hosts) if sizes[h] + task.size <= capacity or sizes[h] == 0]
            host = min(room, key=lambda h: (loads[h], totals[h], h)) if room else hosts[position]
            hosts[position] = host
            loads[host] += task.cost
            sizes[host] += task.size
        totals = [a + b for a, b in zip(totals, loads)]
        out.append(MicroGroup(group.tasks, tuple(hosts), group.teams))
    return out


Cache = dict[MicroGroup, list[float]]


def _group_loads(tasks: Sequence[Task], group: MicroGroup, num_hosts: int, cache: Cache) -> list[float]:
    if group not in cache:
        cache[group] = host_loads(tasks, (group,), num_hosts)
    return cache[group]


def _score(
    tasks: Sequence[Task], groups: Sequence[MicroGroup], num_hosts: int, cache: Cache
) -> tuple[float, list[float]]:
    """The rank's critical time (its groups' makespans summed: the pipeline's compute) and
    its hosts' loads, busiest first (several hosts may tie at the top, each needing a team)."""
    per_group = [_group_loads(tasks, group, num_hosts, cache) for group in groups]
    return sum(max(loads) for loads in per_group), _descending([sum(column) for column in zip(*per_group)])


def _greedy(
    tasks: Sequence[Task],
    groups: Sequence[MicroGroup],
    num_hosts: int,
    shapes: Mapping[str, Shape],
    ns_steps: int,
    sizes: Sequence[int],
    capacity: int,
    cache: Cache,
) -> list[MicroGroup]:
    """Teams of sizes in `sizes`, one at a time (the other tasks placed again around them),
    while the score improves."""
    out = list(groups)
    for _ in range(len(tasks)):
        loads = [sum(column) for column in zip(*(_group_loads(tasks, g, num_hosts, cache) for g in out))]
        busy = max(range(num_hosts), key=lambda h: (loads[h], -h))
        where = _largest_single(tasks, out, busy, shapes)
        if where is None:
            break
        task = tasks[out[where[0]].tasks[where[1]]]
        found = _best_team(task, busy, shapes[task.name], loads, ns_steps, sizes)
        if found is None or found[1].cost >= task.cost:  # not even its own host gets lighter
            break
        trial = list(out)
        _with_team(trial, where, found[1])
        trial = _rehosted(tasks, trial, num_hosts, capacity)
        if not _score(tasks, trial, num_hosts, cache) < _score(tasks, out, num_hosts, cache):
            break
        out = trial
    return out


def cooperate(
    tasks: Sequence[Task],
    groups: Sequence[MicroGroup],
    num_hosts: int,
    shapes: Mapping[str, Shape],
    ns_steps: int,
    mode: str,
    capacity: int,
) -> tuple[MicroGroup, ...]:
    """One DP rank's micro-groups with teams where they shorten its busiest host (see the
    module docstring); `shapes`: the matrices a team may host (Muon, one submatrix);
    `capacity`: the micro-groups' bytes per host."""
    if mode == "off" or num_hosts < 2:
        return tuple(groups)
    if mode == "force":
        return _forced(tasks, list(groups), num_hosts, shapes, ns_steps)
    divisors = [k for k in range(2, num_hosts + 1) if num_hosts % k == 0]
    loads = host_loads(tasks, groups, num_hosts)
    where = _largest_single(tasks, groups, max(range(num_hosts), key=lambda h: (loads[h], -h)), shapes)
    if where is None:
        return tuple(groups)
    first = tasks[groups[where[0]].tasks[where[1]]]
    if all(team_cost(shapes[first.name], k, ns_steps, num_hosts) >= first.cost for k in divisors):
        return tuple(groups)  # the busiest host's largest matrix costs more shared than alone
    cache: Cache = {}
    start = _score(tasks, groups, num_hosts, cache)
    best_score, best = start, tuple(groups)
    # One greedy run per team size, and one free to mix them: the myopic choice of k for the
    # first of several equal matrices can leave the next nowhere good to go.
    for sizes in [[k] for k in divisors] + ([divisors] if len(divisors) > 1 else []):
        trial = _greedy(tasks, groups, num_hosts, shapes, ns_steps, sizes, capacity, cache)
        score = _score(tasks, trial, num_hosts, cache)
        if score < best_score:
            best_score, best = score, tuple(trial)
    # Teams that do not shorten the critical time only cost communication.
    return best if best_score[0] < start[0] * (1 - 1e-9) else tuple(groups)
