"""How `CanzonaOptimizer` (replicated parameters) tells FSDP2 apart: a schedule planned with
`--fsdp`, or parameters that `fully_shard` has sharded over a DP mesh dim, belong to
`FsdpOptimizer`. Kept apart from `optimizer.py` so the replicated runtime loads no FSDP machinery."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from canzona.runtime.binding import TP_MESH_DIM
from canzona.schedules.format import Schedule
from canzona.schedules.limits import FSDP


def dp_sharded_dim(tensor: Tensor) -> str | None:
    """The name (or index) of a mesh dim other than `tp` over which a DTensor parameter is
    sharded (FSDP2's `fully_shard`), or None."""
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names or ()
    for axis, placement in enumerate(tensor.placements):
        sharded = hasattr(placement, "dim") and not placement.is_replicate() and not placement.is_partial()
        name = names[axis] if axis < len(names) else str(axis)
        if sharded and name != TP_MESH_DIM:
            return name
    return None


def _pairs(given: list[Any]) -> list[tuple[str, Tensor]]:
    listed = (pair for item in given for pair in (item.get("params", []) if isinstance(item, dict) else [item]))
    return [pair for pair in listed if isinstance(pair, tuple) and len(pair) == 2]


def fsdp_mismatch(schedule: Schedule, given: list[Any]) -> str | None:
    """Why `CanzonaOptimizer` cannot execute this schedule on these parameters (FSDP), or None."""
    if schedule.request.sharding == FSDP:
        return (
            "the schedule was planned with --fsdp (parameters sharded by FSDP2): execute it with "
            "canzona.runtime.FsdpOptimizer, not CanzonaOptimizer"
        )
    for name, tensor in _pairs(given):
        dim = dp_sharded_dim(tensor)
        if dim is not None:
            return (
                f"{name} is sharded by FSDP2 over mesh dim {dim!r}, but the schedule was planned without --fsdp "
                "(replicated parameters): plan with `canzona plan ... --fsdp` and use canzona.runtime.FsdpOptimizer"
            )
    return None
