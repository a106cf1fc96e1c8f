"""DP and TP process groups under canzona's rank layout: global rank = dp_rank · tp + tp_rank."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


def make_groups(dp: int, tp: int, timeout: timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's DP and TP groups under canzona's layout, global rank = dp_rank · tp +
    tp_rank. Every rank must call it (new_group needs every rank to create every group, in
    the same order); `timeout` bounds each group's collectives (None: the default)."""
    if dp * tp != dist.get_world_size():
        raise ValueError(f"dp {dp} x tp {tp} does not match the world size {dist.get_world_size()}")
    rank, options = dist.get_rank(), ({"timeout": timeout} if timeout is not None else {})
    dp_group = tp_group = None
    for t in range(tp):
        group = dist.new_group([d * tp + t for d in range(dp)], **options)
        dp_group = group if rank % tp == t else dp_group
    for d in range(dp):
        group = dist.new_group([d * tp + t for t in range(tp)], **options)
        tp_group = group if rank // tp == d else tp_group
    assert dp_group is not None and tp_group is not None
    return dp_group, tp_group


def resolve_process_groups(dp_group: Any, tp_group: Any, mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The DP and TP process groups, from explicit groups or a 2-D DeviceMesh (axes dp, tp)."""
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim != 2 or set(names) != {"dp", "tp"}:
            raise ValueError(f"the device mesh must be 2-D with dims named 'dp' and 'tp', got {names or mesh.ndim}")
        return mesh.get_group("dp"), mesh.get_group("tp")
    if dp_group is None or tp_group is None:
        raise TypeError("CanzonaOptimizer needs dp_group and tp_group (or mesh=DeviceMesh with dims dp, tp)")
    return dp_group, tp_group
