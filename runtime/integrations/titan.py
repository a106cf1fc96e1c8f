"""torchtitan: what canzona reads from its models (docs/torchtitan.md).

torchtitan 0.3.0 parallelizes a model under one of two SPMD backends:

- DTensor (`spmd_backend="partial_dtensor"` or `"full_dtensor"`): parameters are DTensors,
  which `canzona.runtime.tools.describe` reads on its own;
- spmd_types (the default): parameters are plain tensors holding this rank's shard, annotated
  by the `spmd_types` package with a partition spec (which mesh axis shards which dim) and a
  local type per mesh axis. On the TP axis, `V` (varying) is a shard, `R` (replicate) a
  replicated weight whose gradient each rank holds only part of (a partial sum: a norm under
  sequence parallelism, q/k norms over split heads), and `I` (invariant) a replicated weight
  with a complete gradient. `spmd_placement` turns that into a TP dim and a partial gradient.

Its attention fuses Q, K and V into one `qkv_linear.wqkv` weight grouped per KV head as
[q heads, k, v] (`FusedQKVLinear`), the layout Megatron-core's `linear_qkv` has:
`fused_qkv_layout` reads it from the module, so `--split-qkv` splits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

QKV_SUFFIX = "wqkv.weight"


class TitanLayoutError(ValueError):
    """A torchtitan layout canzona cannot plan (one-line message)."""


@dataclass(frozen=True)
class SpmdPlacement:
    """A parameter's place on the TP axis under spmd_types: the dim it is split on (None:
    replicated), the axis size, and whether its gradient is a partial sum over the axis."""

    tp_dim: int | None
    tp_size: int
    partial: bool


def _spmd() -> Any:
    """The spmd_types package, or None where it is not installed."""
    try:
        import spmd_types
    except ImportError:
        return None
    return spmd_types


def _axis_name(spmd: Any, axis: Any) -> str:
    return repr(spmd.normalize_axis(axis)).strip("'")


def _sharding_axes(spmd: Any, spec: Any) -> list[Any]:
    """The mesh axes a partition spec names, flattened (an entry may be a tuple of axes)."""
    axes: list[Any] = []
    for entry in spec or ():
        axes += [] if entry is None else list(entry) if isinstance(entry, tuple) else [entry]
    return axes


def spmd_tp_axis(model: nn.Module, tp_mesh_dim: str = "tp") -> Any | None:
    """The mesh axis that is TP under spmd_types: the axis named `tp_mesh_dim` (torchtitan's
    meshes name it `mesh_<dim>`), or the only axis that shards any parameter (a TP-only run,
    whose axis is the default group). None when no parameter carries spmd_types' annotations.
    TitanLayoutError when the axes do not say which is TP."""
    spmd = _spmd()
    if spmd is None:
        return None
    typed = [p for p in model.parameters() if spmd.get_local_type(p)]
    if not typed:
        return None
    axes = {spmd.normalize_axis(a): a for p in typed for a in spmd.get_local_type(p)}
    named = [a for key, a in axes.items() if _axis_name(spmd, key) in (tp_mesh_dim, f"mesh_{tp_mesh_dim}")]
    if named:
        return named[0]
    sharding = {spmd.normalize_axis(a): a for p in typed for a in _sharding_axes(spmd, spmd.get_partition_spec(p))}
    if len(sharding) == 1 and not any(_axis_name(spmd, key).startswith("mesh_") for key in sharding):
        return next(iter(sharding.values()))
    if not sharding:
        return None  # nothing is split: no TP to read
    names = ", ".join(sorted(_axis_name(spmd, key) for key in axes))
    raise TitanLayoutError(
        f"the model's spmd_types axes ({names}) have none named {tp_mesh_dim!r} or "
        f"mesh_{tp_mesh_dim}: cannot tell which is TP"
    )


def spmd_placement(param: torch.Tensor, axis: Any) -> SpmdPlacement | None:
    """`param`'s place on the TP `axis` under spmd_types (None: it carries no annotation)."""
    spmd = _spmd()
    if spmd is None:
        return None
    key = spmd.normalize_axis(axis)
    local = next((t for a, t in spmd.get_local_type(param).items() if spmd.normalize_axis(a) == key), None)
    if local is None:
        return None
    size = key.size()
    spec = spmd.get_partition_spec(param)
    dims = [
        d
        for d, entry in enumerate(spec or ())
        if entry is not None
        and key in {spmd.normalize_axis(a) for a in (entry if isinstance(entry, tuple) else (entry,))}
    ]
    if local == spmd.V:
        if len(dims) != 1:
            raise TitanLayoutError(f"a parameter varies over TP without one dim split on it (partition spec {spec})")
        return SpmdPlacement(dims[0], size, False)
    if local in (spmd.R, spmd.I):
        return SpmdPlacement(None, size, local == spmd.R and size > 1)
    raise TitanLayoutError(f"a parameter has spmd_types type {local} on the TP axis; canzona plans V, R and I")


def fused_qkv_layout(name: str, rows: int, model: nn.Module) -> dict[str, int] | None:
    """`{query_groups, heads, head_dim}` of torchtitan's fused `qkv_linear.wqkv` weight `name`
    of `rows` rows in all (rows grouped per KV head as [q heads, k, v]), read from its
    `FusedQKVLinear`; None for any other parameter."""
    if not name.endswith(QKV_SUFFIX):
        return None
    parent_name = name[: -len(QKV_SUFFIX)].rstrip(".")
    try:
        owner = model.get_submodule(parent_name)
    except AttributeError:
        return None
    heads_per_kv, head_dim, r_dim = (getattr(owner, key, None) for key in ("heads_per_kv", "head_dim", "r_dim"))
    if not (isinstance(heads_per_kv, int) and isinstance(head_dim, int) and isinstance(r_dim, int)):
        return None
    if min(heads_per_kv, head_dim, r_dim) <= 0 or r_dim != heads_per_kv + 2:
        return None
    groups = rows // (r_dim * head_dim)
    return {"query_groups": groups, "heads": groups * heads_per_kv, "head_dim": head_dim}


def spmd_problems(name: str, tensor: torch.Tensor, tp_dim: int | None, partial: bool, tp: int) -> list[str]:
    """Where a plain tensor's spmd_types annotation on the TP axis disagrees with its schedule
    entry (`tp_dim`, and `partial`: whether the schedule sums its gradient over TP): a shard the
    schedule holds whole, or a partial gradient it would not sum, would train silently wrong.
    Empty without annotations, at TP 1, or where no axis is recognisably the TP one."""
    spmd = _spmd()
    types = spmd.get_local_type(tensor) if spmd is not None and tp > 1 else {}
    if not types:
        return []
    axes = [spmd.normalize_axis(a) for a in types]
    named = [a for a in axes if _axis_name(spmd, a) in ("tp", "mesh_tp")]
    sized = [a for a in axes if a.size() == tp]
    axis = named[0] if named else sized[0] if len(sized) == 1 else None
    if axis is None:
        return []
    try:
        placement = spmd_placement(tensor, axis)
    except TitanLayoutError as error:
        return [f"{name}: {error}"]
    if placement is None:
        return []
    problems = []
    if placement.tp_dim != tp_dim:
        found = f"split on dim {placement.tp_dim}" if placement.tp_dim is not None else "replicated"
        problems.append(
            f"{name}: spmd_types has it {found} over TP, the schedule says tp_dim {tp_dim}; plan the live model"
        )
    if placement.partial != partial:
        how = "partial over TP (R)" if placement.partial else "whole over TP"
        fix = "plan the live model or with --sequence-parallel" if placement.partial else "plan the live model"
        problems.append(
            f"{name}: spmd_types makes its gradient {how}, the schedule "
            f"{'does not sum' if placement.partial else 'sums'} it over TP; {fix}"
        )
    return problems
