"""Binding the model's parameters to the schedule's entries: which local tensor holds each
entry's values and where its gradient comes from.

The schedule lists what the optimizer updates; the model registers what autograd fills. They
differ in two ways, and this module is the only place that knows about them:

- **DTensor parameters** (`parallelize_module`, `distribute_tensor`): the optimizer works on
  the local shard (`DTensor.to_local()`, a view: writing it writes the parameter). The
  placement on the mesh dim named `tp` must be the schedule's TP dim (`Shard(d)` ↔ `tp_dim:
  d`, `Replicate` ↔ replicated; a strided shard, transformers' packed gate/up, counts as its
  dim) and that dim's size the schedule's TP size. Other mesh dims must be replicated (FSDP2
  is not bound here). A DTensor gradient whose placement differs from the parameter's is
  brought to the parameter's local shard without communication: a `Replicate` gradient of a
  sharded parameter is chunked locally; a `Partial` gradient is a partial sum over TP, which
  only a `grad_reduce: tp` entry may have (its local part is packed and the runtime sums it
  over TP after the DP reduction, `sum_partial_over_tp`).
- **Grouped 3-D expert tensors** ([E, rows, cols]): the schedule lists E entries named
  `param[e]`, each a 2-D matrix; the model registers one tensor. Each entry is bound to the
  view `local[k]` of the k-th expert this rank holds (under expert parallelism, the EP
  rank's E / ep experts), and its gradient to `grad[k]`.

`model_entries` folds a schedule's slices back into the tensors the model registers, so that
names, order, shapes and dtypes are checked against what a script passes
(`named_parameters()`), and `bind` gives, per schedule entry, its `Bound`.

Nothing here communicates. Problems are returned as lines or raised as ValueError (a bad
gradient, reported at the step's safe point), never left to hang a collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from canzona.runtime.faults import wait
from canzona.schedules.format import ParamEntry

TP_MESH_DIM = "tp"
PARTIAL_OVER_TP = "tp"


@dataclass(frozen=True)
class Bound:
    """Schedule entry ↔ model parameter: `param` is the model's parameter (the leaf autograd
    fills: a plain tensor or a DTensor), `value` this rank's values of the entry (a view of its
    local shard), `slice` the position of the entry's expert in the local grouped tensor (None:
    the entry is the whole parameter), `grad_reduce` the entry's partial-gradient axis."""

    name: str
    param: Tensor
    value: Tensor
    slice: int | None = None
    grad_reduce: str | None = None


def expert_count_problems(pairs: Iterable[tuple[str, Tensor]], held: Iterable[ParamEntry]) -> list[str]:
    """Grouped tensors passed with another number of experts than this rank holds (under
    expert parallelism: its EP rank's E / ep experts, as one tensor)."""
    slices, problems = slices_of(held), []
    for name, tensor in pairs:
        count = local(tensor).shape[0] if tensor.ndim == 3 else None
        if name in slices and count is not None and count != len(slices[name]):
            mine = slices[name]
            problems.append(
                f"{name}: a tensor of {count} experts, but this rank holds {len(mine)} (experts "
                f"{mine[0].slice}..{mine[-1].slice}): pass its EP rank's experts only, as one tensor"
            )
    return problems


def local(tensor: Tensor) -> Tensor:
    """This rank's local values of a parameter (a view for a DTensor; the tensor otherwise)."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def model_entries(entries: Iterable[ParamEntry]) -> dict[str, ParamEntry]:
    """The entries keyed by the names the model registers: a grouped tensor's slices (those
    given, e.g. one EP rank's) fold into one entry named after the tensor, of shape
    [slices, *slice shape], TP dim one higher, at its first slice's index."""
    out: dict[str, ParamEntry] = {}
    counts: dict[str, int] = {}
    for entry in sorted(entries, key=lambda e: e.index):
        if entry.param is None:
            out[entry.name] = entry
            continue
        counts[entry.param] = counts.get(entry.param, 0) + 1
        if entry.param not in out:
            tp_dim = None if entry.tp_dim is None else entry.tp_dim + 1
            out[entry.param] = entry.model_copy(
                update={"name": entry.param, "tp_dim": tp_dim, "param": None, "slice": None}
            )
    for parent, count in counts.items():
        out[parent] = out[parent].model_copy(
            update={"shape": [count, *out[parent].shape], "numel": count * out[parent].numel}
        )
    return out


def slices_of(entries: Iterable[ParamEntry]) -> dict[str, list[ParamEntry]]:
    """Grouped tensor name -> its slice entries (those given), in slice order."""
    out: dict[str, list[ParamEntry]] = {}
    for entry in sorted(entries, key=lambda e: e.index):
        if entry.param is not None:
            out.setdefault(entry.param, []).append(entry)
    return out


def bind(
    name: str, param: Tensor, entries: Mapping[str, ParamEntry], slices: Mapping[str, list[ParamEntry]]
) -> list[tuple[int, Bound]]:
    """(schedule index, binding) of every schedule entry the model parameter `name` holds."""
    values = local(param)
    if name in slices:
        return [(e.index, Bound(e.name, param, values[k], k, e.grad_reduce)) for k, e in enumerate(slices[name])]
    entry = entries[name]
    return [(entry.index, Bound(name, param, values, None, entry.grad_reduce))]


def _tp_axis(tensor: DTensor) -> int | None:
    names = tensor.device_mesh.mesh_dim_names or ()
    return names.index(TP_MESH_DIM) if TP_MESH_DIM in names else None


def _split_dim(placement: Any, ndim: int) -> int | None:
    """The tensor dim a placement splits (Shard or a strided shard), None if it splits none."""
    if isinstance(placement, Shard) or (hasattr(placement, "split_factor") and hasattr(placement, "dim")):
        return int(placement.dim) % ndim
    return None


def placement_problems(entry: ParamEntry, tensor: Tensor, tp: int) -> list[str]:
    """Where a DTensor parameter's full shape, mesh and placements differ from its (model-level)
    entry: full shape, TP dim, TP size, a split over another mesh dim; empty for a plain tensor
    (whose full shape and TP dim only a Megatron-style `partition_dim` tells: `tensor_problems`)
    or a match."""
    if not isinstance(tensor, DTensor):
        return []
    mesh, placements, problems = tensor.device_mesh, tensor.placements, []
    if tuple(tensor.shape) != tuple(entry.shape):  # a DTensor knows its full shape: a swapped tp_dim shows here
        problems.append(
            f"{entry.name}: full shape {list(tensor.shape)}, the schedule says {list(entry.shape)} "
            f"(tp_dim {entry.tp_dim})"
        )
    axis = _tp_axis(tensor)
    for dim, placement in enumerate(placements):
        if dim != axis and not isinstance(placement, Replicate):
            label = (mesh.mesh_dim_names or ())[dim] if mesh.mesh_dim_names else str(dim)
            problems.append(
                f"{entry.name}: a DTensor placed {placement!r} on mesh dim {label!r}; the runtime binds "
                f"DTensors split over the {TP_MESH_DIM!r} mesh dim only"
            )
    if axis is None:
        if entry.tp_dim is not None and tp > 1:
            problems.append(
                f"{entry.name}: a DTensor on a mesh without a {TP_MESH_DIM!r} dim, the schedule splits it over "
                f"TP (tp_dim {entry.tp_dim})"
            )
        return problems
    size = mesh.size(axis)
    if size != tp:
        problems.append(f"{entry.name}: its DTensor mesh has {TP_MESH_DIM} size {size}, the schedule is for TP {tp}")
    placement = placements[axis]
    split = _split_dim(placement, tensor.ndim)
    if split is None and not isinstance(placement, Replicate):
        problems.append(
            f"{entry.name}: placement {placement!r} on the {TP_MESH_DIM!r} mesh dim; parameters are Shard or "
            "Replicate there"
        )
    elif size > 1 and split != entry.tp_dim:
        found = f"Shard({split})" if split is not None else "Replicate()"
        wanted = f"Shard({entry.tp_dim})" if entry.tp_dim is not None else "Replicate()"
        problems.append(
            f"{entry.name}: placed {found} over {TP_MESH_DIM}, the schedule says {wanted} (tp_dim "
            f"{entry.tp_dim}); a different TP plan?"
        )
    return problems


@overload
def local_grad(bound: Bound, grad: Tensor) -> Tensor: ...


@overload
def local_grad(bound: Bound, grad: None) -> None: ...


def local_grad(bound: Bound, grad: Tensor | None) -> Tensor | None:
    """The gradient of `bound`'s entry on this rank, in its local shape (None: none). A DTensor
    gradient is brought to the parameter's placement locally (see the module docstring);
    ValueError when that needs communication the schedule does not plan."""
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        grad = _local_dtensor_grad(bound, grad)
    return grad if bound.slice is None else grad[bound.slice]


def _local_dtensor_grad(bound: Bound, grad: DTensor) -> Tensor:
    param = bound.param
    axis = _tp_axis(grad)
    partial = axis is not None and isinstance(grad.placements[axis], Partial)
    if bound.grad_reduce == PARTIAL_OVER_TP and axis is not None and grad.device_mesh.size(axis) > 1:
        if not partial:
            raise ValueError(
                f"the gradient of {bound.name} is already whole over TP ({grad.placements[axis]!r}), but the "
                "schedule sums it over TP (grad_reduce: tp): plan without the partial-gradient flag"
            )
        return grad.to_local()
    if partial:
        raise ValueError(
            f"the gradient of {bound.name} is a partial sum over TP (Partial), but the schedule does not sum "
            "it: plan with --sequence-parallel (or mark it grad_reduce: tp)"
        )
    if not isinstance(param, DTensor) or tuple(grad.placements) == tuple(param.placements):
        return grad.to_local()
    if any(isinstance(p, Partial) for p in grad.placements):
        raise ValueError(
            f"the gradient of {bound.name} has placements {list(grad.placements)}: a partial sum over "
            "a mesh dim the runtime does not reduce"
        )
    if any(_split_dim(p, grad.ndim) is not None for p in grad.placements):
        raise ValueError(
            f"the gradient of {bound.name} is placed {list(grad.placements)}, the parameter "
            f"{list(param.placements)}: only a replicated gradient is re-split locally"
        )
    # Replicate -> the parameter's shards: a local chunk, no communication.
    return grad.redistribute(param.device_mesh, param.placements).to_local()


def sum_partial_over_tp(
    spans: Sequence[tuple[int, int]], send: Tensor, tp_group: dist.ProcessGroup, timeout: timedelta | None
) -> None:
    """Sum the DP-mean gradients at `spans` of `send` (those of `grad_reduce: tp` entries) over
    the TP group, in place (summing over TP commutes with the mean over DP). Collective over
    TP: every rank of a TP group calls it at the same point of the step, with the same spans,
    after the reduction's safe point."""
    if not spans or dist.get_world_size(tp_group) == 1:
        return
    parts = [send[start:stop] for start, stop in spans]
    packed = torch.cat(parts)
    wait(dist.all_reduce(packed, group=tp_group, async_op=True), timeout, "the TP sum of partial gradients")
    for part, piece in zip(parts, packed.split([part.numel() for part in parts])):
        part.copy_(piece)
