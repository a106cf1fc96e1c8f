"""TP micro-group scheduling: host TP ranks and micro-groups.

For one DP rank, the matrices it owns become tasks; each task gets a host TP rank (which
gathers the full gradient, runs the update and keeps the optimizer state) and a micro-group
(tasks gathered by one fused all-to-all, computed, and scattered back by another).

Capacity is a memory bound: the bytes of gathered full gradients one host holds in a group.
Balance is in cost units. The two are never mixed: capacity decides where groups end, cost
decides hosts. A single task larger than the capacity still gets a group of its own (a
matrix cannot be split); its saturation then exceeds 1 and the file says so.

Modes, all scored on the same instance:
- `rollback`: tasks by cost (descending, ties by name); grow a candidate group while a
  capacity-respecting LPT placement of it exists, otherwise seal it and start a new one.
- `fixed`: chunks of P tasks in buffer order, task j of a chunk on host j.
- `sorted`: the same chunks after sorting tasks by cost.
- `heap`: LPT of all tasks over the hosts (a min-heap of host loads), then group k holds
  every host's k-th task.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from canzona.planner.spec import PlanError
from canzona.schedules.limits import TP_MODES

MODES = TP_MODES  # defined with the other request vocabularies in canzona.schedules.limits


@dataclass(frozen=True)
class Task:
    """One matrix update: its parameter name, cost, gathered full-gradient bytes, and whether
    every TP rank holds the whole matrix (then the host needs no gather, only a scatter)."""

    name: str
    cost: float
    size: int
    replicated: bool = False


@dataclass(frozen=True)
class Team:
    """The TP ranks (ascending) that host one matrix cooperatively, and the cost each pays
    (`canzona.planner.partition.cooperative`)."""

    hosts: tuple[int, ...]
    cost: float


@dataclass(frozen=True)
class MicroGroup:
    """Task positions (into the rank's task list) in execution order, and their hosts.
    `teams` (empty: none) is parallel to `tasks`: a task with a team is hosted by all of its
    hosts (its `hosts` entry is one of them)."""

    tasks: tuple[int, ...]
    hosts: tuple[int, ...]
    teams: tuple[Team | None, ...] = ()

    def team(self, position: int) -> Team | None:
        """The team of the task at `position`, if it has one."""
        return self.teams[position] if self.teams else None

    def placements(self, tasks: Sequence[Task]) -> list[tuple[int, float, int]]:
        """(host, cost, gathered bytes) of every host of every task (a team member holds
        1/k of the matrix)."""
        out = []
        for position, (index, host) in enumerate(zip(self.tasks, self.hosts)):
            team, task = self.team(position), tasks[index]
            if team is None:
                out.append((host, task.cost, task.size))
            else:
                out += [(member, team.cost, task.size // len(team.hosts)) for member in team.hosts]
        return out


def _by_cost(tasks: Sequence[Task]) -> list[int]:
    return sorted(range(len(tasks)), key=lambda i: (-tasks[i].cost, tasks[i].name))


class _HostFill:
    """Running per-host cost and bytes of the candidate group."""

    def __init__(self, num_hosts: int, capacity: int) -> None:
        self.loads = [0.0] * num_hosts
        self.sizes = [0] * num_hosts
        self.capacity = capacity

    def host_for(self, task: Task) -> int | None:
        """Least loaded host with room; a task over capacity alone may take an empty host."""
        fitting = [
            h
            for h, size in enumerate(self.sizes)
            if size + task.size <= self.capacity or (size == 0 and task.size > self.capacity)
        ]
        return min(fitting, key=lambda h: (self.loads[h], h)) if fitting else None

    def add(self, task: Task, host: int) -> None:
        self.loads[host] += task.cost
        self.sizes[host] += task.size


def _fits(sizes: list[int], host: int, extra: int, capacity: int) -> bool:
    return sizes[host] + extra <= capacity or (sizes[host] == 0 and extra > capacity)


def _relieve(tasks: Sequence[Task], members: list[int], hosts: list[int], num_hosts: int, capacity: int) -> bool:
    """One move or swap off the busiest host that lowers the pair's larger load; False if none."""
    loads, sizes = [0.0] * num_hosts, [0] * num_hosts
    for member, host in zip(members, hosts):
        loads[host] += tasks[member].cost
        sizes[host] += tasks[member].size
    busy = max(range(num_hosts), key=lambda h: (loads[h], -h))
    best: tuple[float, int, int] | None = None  # (new pair max, position, partner position or -1-host)
    for i, (member, host) in enumerate(zip(members, hosts)):
        if host != busy:
            continue
        cost, size = tasks[member].cost, tasks[member].size
        for other in range(num_hosts):
            if other != busy and loads[other] + cost < loads[busy] and _fits(sizes, other, size, capacity):
                best = min(best or (loads[busy], 0, 0), (max(loads[busy] - cost, loads[other] + cost), i, -1 - other))
        for j, (partner, other) in enumerate(zip(members, hosts)):
            delta, moved = cost - tasks[partner].cost, size - tasks[partner].size
            if other == busy or delta <= 0 or loads[other] + delta >= loads[busy]:
                continue
            if sizes[other] + moved <= capacity and sizes[busy] - moved <= capacity:
                best = min(best or (loads[busy], 0, 0), (max(loads[busy] - delta, loads[other] + delta), i, j))
    if best is None or best[0] >= loads[busy]:
        return False
    _, i, target = best
    if target < 0:
        hosts[i] = -1 - target
    else:
        hosts[i], hosts[target] = hosts[target], hosts[i]
    return True


def _polished(tasks: Sequence[Task], members: list[int], hosts: list[int], num_hosts: int, capacity: int) -> MicroGroup:
    """The group with its hosts rebalanced by local search (each step lowers the sum of
    squared host loads, so it stops; the bound keeps its time predictable)."""
    hosts = list(hosts)
    for _ in range(4 * len(members) + 8):
        if not _relieve(tasks, members, hosts, num_hosts, capacity):
            break
    return MicroGroup(tuple(members), tuple(hosts))


def rollback(tasks: Sequence[Task], num_hosts: int, capacity: int) -> tuple[MicroGroup, ...]:
    """Greedy rollback: extend the candidate group while its LPT placement fits, else seal it
    (then polish its hosts by local search).

    Tasks come in cost order, so the LPT placement of the group plus the next task is the
    group's placement plus that task on the least loaded host with room.
    """
    groups: list[MicroGroup] = []
    members: list[int] = []
    hosts: list[int] = []
    fill = _HostFill(num_hosts, capacity)
    for index in _by_cost(tasks):
        host = fill.host_for(tasks[index])
        if host is None:
            groups.append(_polished(tasks, members, hosts, num_hosts, capacity))
            members, hosts, fill = [], [], _HostFill(num_hosts, capacity)
            host = fill.host_for(tasks[index])
            assert host is not None  # an empty group takes any task
        members.append(index)
        hosts.append(host)
        fill.add(tasks[index], host)
    if members:
        groups.append(_polished(tasks, members, hosts, num_hosts, capacity))
    return tuple(groups)


def _chunks(order: list[int], num_hosts: int) -> tuple[MicroGroup, ...]:
    return tuple(
        MicroGroup(tuple(order[start : start + num_hosts]), tuple(range(len(order[start : start + num_hosts]))))
        for start in range(0, len(order), num_hosts)
    )


def fixed_chunks(tasks: Sequence[Task], num_hosts: int, capacity: int) -> tuple[MicroGroup, ...]:
    """Chunks of P tasks in buffer order; ignores capacity and cost."""
    return _chunks(list(range(len(tasks))), num_hosts)


def sorted_chunks(tasks: Sequence[Task], num_hosts: int, capacity: int) -> tuple[MicroGroup, ...]:
    """Chunks of P tasks in cost order; ignores capacity."""
    return _chunks(_by_cost(tasks), num_hosts)


def heap_slots(tasks: Sequence[Task], num_hosts: int, capacity: int) -> tuple[MicroGroup, ...]:
    """LPT over all tasks, then group k = every host's k-th task; ignores capacity."""
    heap = [(0.0, host) for host in range(num_hosts)]
    per_host: list[list[int]] = [[] for _ in range(num_hosts)]
    for index in _by_cost(tasks):
        load, host = heapq.heappop(heap)
        per_host[host].append(index)
        heapq.heappush(heap, (load + tasks[index].cost, host))
    groups = []
    for slot in range(max((len(queue) for queue in per_host), default=0)):
        pairs = [(queue[slot], host) for host, queue in enumerate(per_host) if slot < len(queue)]
        groups.append(MicroGroup(tuple(t for t, _ in pairs), tuple(h for _, h in pairs)))
    return tuple(groups)


SCHEDULERS: dict[str, Callable[[Sequence[Task], int, int], tuple[MicroGroup, ...]]] = {
    "rollback": rollback,
    "fixed": fixed_chunks,
    "sorted": sorted_chunks,
    "heap": heap_slots,
}


def schedule_tasks(tasks: Sequence[Task], num_hosts: int, capacity: int, mode: str) -> tuple[MicroGroup, ...]:
    """Micro-groups of one DP rank's tasks under `mode`."""
    if mode not in SCHEDULERS:
        raise PlanError(f"unknown TP mode {mode!r}; choose one of {', '.join(MODES)}")
    if num_hosts < 1:
        raise PlanError(f"tp must be >= 1, got {num_hosts}")
    if capacity < 1:
        raise PlanError(f"group capacity must be >= 1 byte, got {capacity}")
    return SCHEDULERS[mode](tasks, num_hosts, capacity)


@dataclass(frozen=True)
class GroupStats:
    """Per-host cost and bytes of one micro-group, its makespan and saturation."""

    host_loads: tuple[float, ...]
    host_bytes: tuple[int, ...]
    makespan: float
    saturation: float


def group_stats(tasks: Sequence[Task], group: MicroGroup, num_hosts: int, capacity: int) -> GroupStats:
    """Figures of one micro-group."""
    loads, sizes = [0.0] * num_hosts, [0] * num_hosts
    for host, cost, size in group.placements(tasks):
        loads[host] += cost
        sizes[host] += size
    return GroupStats(tuple(loads), tuple(sizes), max(loads), max(sizes) / capacity)
