"""What the validator's rules share: the first problem found, raised as `Problem` and turned
into the one line `validate.schedule_problem` returns, the float tolerance of recomputed
figures, and the rules every sharding mode applies to a micro-group."""

from __future__ import annotations

import math
from typing import Any

from canzona.schedules.models import ParamEntry
from canzona.schedules.teams import placements, team_problem

# Recomputed sums differ from the planner's only by summation order: about n · 2^-53 relative
# for n ≤ 65536 terms (< 1e-11), so 1e-9 relative flags any edit while never a planner file.
REL_TOL = 1e-9
ABS_TOL = 1e-12


class Problem(Exception):
    """The first inconsistency found (its message is the validator's one line)."""


def fail(message: str) -> None:
    """Stop validating: `message` is the file's first problem."""
    raise Problem(message)


def close(a: float, b: float) -> bool:
    """Whether a recorded float agrees with its recomputation."""
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def expect(label: str, recorded: float, derived: float, what: str) -> None:
    """Fail unless the recorded `label` agrees with the value `what` gives."""
    if not close(recorded, derived):
        fail(f"{label} is {recorded!r}, but {what} gives {derived!r}")


def dp_rank_of(entry: ParamEntry, ep: int) -> int:
    """The DP rank whose micro-groups update a matrix (owner · ep + ep_rank for experts)."""
    assert entry.owner is not None
    return entry.owner if entry.ep_rank is None else entry.owner * ep + entry.ep_rank


def check_group(
    where: str, group: Any, entries: dict[str, ParamEntry], tp: int, capacity: int, mode: str, optimizer: str
) -> None:
    """One micro-group of `tp` hosts: its teams, and its per-host loads and bytes, makespan and
    saturation recomputed from its matrices (`entries` by name; every one of the group's)."""
    if len(group.host_loads) != tp or len(group.host_bytes) != tp:
        fail(f"{where}: host_loads and host_bytes must hold one value per host ({tp})")
    host_of = dict(zip(group.params, group.hosts))
    if len({team.param for team in group.teams}) != len(group.teams):
        fail(f"{where}: a matrix has two teams")
    for team in group.teams:
        problem = (
            f"{team.param!r} is not in the group"
            if team.param not in host_of
            else team_problem(team, entries[team.param], host_of[team.param], tp, optimizer)
        )
        if problem:
            fail(f"{where}: team of {team.param!r}: {problem}")
    loads, sizes, counts = [0.0] * tp, [0] * tp, [0] * tp
    for host, cost, size in placements(group, entries):
        loads[host] += cost
        sizes[host] += size
        counts[host] += 1
    if not all(close(a, b) for a, b in zip(group.host_loads, loads)):
        fail(f"{where}: host_loads disagree with its matrices' costs")
    if list(group.host_bytes) != sizes:
        fail(f"{where}: host_bytes disagree with its matrices' gathered fp32 sizes")
    expect(f"{where} makespan", group.makespan, max(loads), "its largest host load")
    expect(f"{where} saturation", group.saturation, max(sizes) / capacity, "its largest host bytes / group_bytes")
    if mode == "rollback":
        over = next((h for h in range(tp) if sizes[h] > capacity and counts[h] > 1), None)
        if over is not None:
            fail(f"{where}: TP host {over} holds {sizes[over]} bytes, over the group capacity {capacity}")
