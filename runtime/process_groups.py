"""DP, TP and expert-DP process groups under canzona's rank layout.

Global rank = dp_rank · tp + tp_rank. Under expert parallelism (EP size `ep`, dividing dp) a DP
rank is dp_rank = expert_dp_rank · ep + ep_rank, as the planner records it (an expert's `owner`
is its expert-DP rank and it runs on DP rank owner · ep + ep_rank): EP rank = dp_rank mod ep,
expert-DP rank = dp_rank // ep. The EP group of a rank is the `ep` consecutive DP ranks
(its expert-DP rank's); its expert-DP group is the dp / ep DP ranks of the same EP rank (and TP
rank), over which the gradients of the experts it holds are reduced. A DeviceMesh of shape
(dp / ep, ep, tp) with dims ("edp", "ep", "tp") has exactly this layout.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

EDP, EP = "edp", "ep"


def make_groups(
    dp: int, tp: int, timeout: timedelta | None = None, *, ep: int | None = None
) -> tuple[dist.ProcessGroup, ...]:
    """This rank's (DP, TP) groups under canzona's layout, global rank = dp_rank · tp +
    tp_rank; with `ep` (expert parallelism) also its expert-DP group, (DP, TP, expert-DP):
    the DP ranks of its EP rank (dp_rank mod ep). Every rank must call it (new_group needs every
    rank to create every group, in the same order); `timeout` bounds each group's collectives
    (None: the default)."""
    if dp * tp != dist.get_world_size():
        raise ValueError(f"dp {dp} x tp {tp} does not match the world size {dist.get_world_size()}")
    if ep is not None and (not isinstance(ep, int) or ep < 1 or dp % ep):
        raise ValueError(f"ep {ep!r} must be a positive divisor of dp {dp}")
    rank = dist.get_rank()
    dp_group = tp_group = expert_group = None
    for t in range(tp):
        group = dist.new_group([d * tp + t for d in range(dp)], timeout=timeout)
        dp_group = group if rank % tp == t else dp_group
    for d in range(dp):
        group = dist.new_group([d * tp + t for t in range(tp)], timeout=timeout)
        tp_group = group if rank // tp == d else tp_group
    assert dp_group is not None and tp_group is not None
    if ep is None:
        return dp_group, tp_group
    for t in range(tp):
        for e in range(ep):
            group = dist.new_group([(o * ep + e) * tp + t for o in range(dp // ep)], timeout=timeout)
            expert_group = group if (rank % tp == t and (rank // tp) % ep == e) else expert_group
    assert expert_group is not None
    return dp_group, tp_group, expert_group


def resolve_process_groups(
    dp_group: Any, tp_group: Any, mesh: Any, expert_dp_group: Any = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, Any]:
    """The DP, TP and expert-DP process groups (the last None without expert parallelism),
    from explicit groups or a DeviceMesh: 2-D with dims (dp, tp), or 3-D with dims
    (edp, ep, tp), whose DP group is the flattened (edp, ep)."""
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim == 2 and set(names) == {"dp", "tp"}:
            return mesh.get_group("dp"), mesh.get_group("tp"), None
        if mesh.ndim == 3 and names == (EDP, EP, "tp"):
            return mesh[EDP, EP]._flatten().get_group(), mesh.get_group("tp"), mesh.get_group(EDP)
        raise ValueError(
            f"the device mesh must be 2-D with dims ('dp', 'tp') or 3-D with dims ('edp', 'ep', 'tp'), "
            f"got {names or mesh.ndim}"
        )
    if dp_group is None or tp_group is None:
        raise TypeError("CanzonaOptimizer needs dp_group and tp_group (or mesh=DeviceMesh with dims dp, tp)")
    return dp_group, tp_group, expert_dp_group
