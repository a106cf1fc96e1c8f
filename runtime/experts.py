"""Expert parallelism: which experts a rank holds, and the checks of the expert-DP group.

The rank layout (`canzona.runtime.process_groups`): DP rank = expert_dp_rank · ep + ep_rank. A
rank holds the dense parameters and the experts of its EP rank (the schedule's `ep_rank`),
under the schedule's (global) names. An expert's gradient on a rank is what backward gives it
there: the sum over the tokens its EP group routed to it. The runtime sums it over the
expert-DP group and divides by the DP size (not the expert-DP size), as Megatron scales expert
gradients, so an expert sees the gradient of the same global mean loss as a dense parameter:
(1 / dp) · Σ over the expert-DP ranks holding it of their gradients.

Nothing here raises on bad input: problems are returned as lines, so the optimizer can make
every rank raise the same error before any collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from canzona.schedules.format import Schedule

MAX_LISTED = 3


def materialized(given: Sequence[Any]) -> list[Any]:
    """`given` with every group's "params" iterable turned into a list (copies of the group
    dicts), so that reading the names here does not use up a generator the groups hold."""
    out = []
    for item in given:
        params = item.get("params") if isinstance(item, dict) else None
        if params is not None and not isinstance(params, (Tensor, str, dict, list)) and isinstance(params, Iterable):
            item = {**item, "params": list(params)}
        out.append(item)
    return out


def given_names(given: Sequence[Any]) -> list[str]:
    """The names of every (name, tensor) pair a script passed, in groups or flat."""
    names = []
    for item in given:
        pairs = item.get("params", []) if isinstance(item, dict) else [item]
        for pair in pairs if not isinstance(pairs, (str, dict)) else []:
            if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str):
                names.append(pair[0])
    return names


def foreign_experts(schedule: Schedule, names: list[str], dp_rank: int) -> str | None:
    """A line naming the experts passed on this rank that the schedule puts on another EP rank."""
    ep = schedule.request.ep
    if ep == 1:
        return None
    mine = dp_rank % ep  # the EP rank of a DP rank
    placed = {e.name: e.ep_rank for e in schedule.params if e.ep_rank is not None}
    wrong = [f"{name} (EP rank {placed[name]})" for name in names if placed.get(name, mine) != mine]
    if not wrong:
        return None
    more = f" (and {len(wrong) - MAX_LISTED} more)" if len(wrong) > MAX_LISTED else ""
    return (
        f"experts on the wrong rank: this is EP rank {mine} (DP rank {dp_rank} = expert-DP rank {dp_rank // ep} "
        f"x ep {ep} + EP rank {mine}), but it was given {', '.join(wrong[:MAX_LISTED])}{more}"
    )


def expert_group_problem(schedule: Schedule, dp_rank: int, dp_global: Sequence[int], expert_group: Any) -> str | None:
    """Why the expert-DP group does not fit the schedule's EP layout, or None. `dp_global`:
    the global ranks of the DP group, in DP-rank order."""
    dp, ep = schedule.request.dp, schedule.request.ep
    if ep == 1:
        if expert_group is not None and dist.get_world_size(expert_group) != dp:
            return (
                f"an expert-DP group of {dist.get_world_size(expert_group)} ranks was given, but the schedule has "
                f"no expert parallelism (ep 1)"
            )
        return None
    if expert_group is None:
        return (
            f"the schedule is for expert parallelism (ep {ep}): pass expert_dp_group= (make_groups(dp, tp, ep={ep}) "
            "returns it) or mesh= with dims ('edp', 'ep', 'tp')"
        )
    size = dist.get_world_size(expert_group)
    if size != dp // ep:
        found = f"EP {dp // size}" if size and dp % size == 0 else "no EP size"
        return f"the schedule is for EP {ep} (expert-DP {dp // ep}), but the expert-DP group has {size} ranks ({found})"
    mine = dp_rank % ep  # the EP rank of a DP rank
    expected = [dp_global[o * ep + mine] for o in range(size)]
    found_ranks = dist.get_process_group_ranks(expert_group)
    if found_ranks != expected:
        return (
            f"the expert-DP group holds global ranks {found_ranks}, the schedule's EP layout needs {expected} "
            f"(DP ranks expert_dp_rank x ep + ep_rank, EP rank {mine})"
        )
    return None
