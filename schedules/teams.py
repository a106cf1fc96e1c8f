"""Checks and arithmetic of cooperatively hosted matrices (`TpGroup.teams`) that both the
validator and the runtime need: which TP ranks a team's members are and which slice of the
gathered matrix each one holds.

A team of k TP ranks splits the gathered matrix along its long side (rows if it is taller
than wide, as Muon transposes it, else columns) into k equal slices, member i taking slice i.
"""

from __future__ import annotations

from math import prod
from typing import Any

from canzona.schedules.geometry import GRAD_BYTES_PER_ELEMENT


def long_dim(shape: tuple[int, ...] | list[int]) -> int:
    """The dim a team splits: 0 for a matrix taller than wide, else 1."""
    return 0 if shape[0] > shape[1] else 1


def team_problem(team: Any, entry: Any, host: int, tp: int, optimizer: str) -> str | None:
    """Why `team` (a TeamEntry) cannot host `entry` (a ParamEntry) whose `hosts` entry is
    `host`, or None."""
    k = len(team.hosts)
    if optimizer != "muon":
        return f"only Muon matrices can be hosted cooperatively (optimizer {optimizer})"
    if k < 2 or tp % k or list(team.hosts) != sorted(set(team.hosts)) or any(h >= tp for h in team.hosts):
        return f"team hosts must be 2 or more distinct TP ranks, ascending, their count dividing tp {tp}"
    if host not in team.hosts:
        return f"the team must include the matrix's host {host}"
    if entry.row_blocks is not None and len(entry.row_blocks) != 1:
        return "a cooperatively hosted matrix must be updated as one matrix (one row block)"
    if entry.shape[long_dim(entry.shape)] % k:
        return f"its long side {entry.shape[long_dim(entry.shape)]} does not split into {k} equal slices"
    if not team.load >= 0:
        return "a team's load must be >= 0"
    return None


def placements(group: Any, entries: dict[str, Any]) -> list[tuple[int, float, int]]:
    """(TP rank, cost, gathered fp32 bytes) of every host of every matrix of a TpGroup."""
    teams = {team.param: team for team in group.teams}
    out = []
    for name, host in zip(group.params, group.hosts):
        size = GRAD_BYTES_PER_ELEMENT * prod(entries[name].shape)
        team = teams.get(name)
        if team is None:
            out.append((host, entries[name].cost, size))
        else:
            out += [(member, team.load, size // len(team.hosts)) for member in team.hosts]
    return out
