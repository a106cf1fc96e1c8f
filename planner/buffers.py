"""Plan one matrix-optimizer buffer: partition it over its DP group (`partition_buffer`), then
shorten the busiest device under TP, even out its slices, lay it out and cut it
(`finish_buffer`).

Pure: `canzona.planner.plan.make_plan` plans the dense buffer and, under expert parallelism,
the expert buffer with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from canzona.planner.partition.baselines import BaselineLoads, all_baselines
from canzona.planner.partition.collectives import Link, choose_collective
from canzona.planner.partition.device_aware import DeviceModel, reown
from canzona.planner.partition.dp import DpAssignment, DpInstance, Owners, partition, rank_loads, slice_caps
from canzona.planner.partition.even_slices import SliceState, even_slices
from canzona.planner.partition.free_order import partition_free, reorder_buffer
from canzona.planner.partition.layout import (
    GRAD_BYTES_PER_ELEMENT,
    BufferLayout,
    owners_to_cuts,
    param_bytes,
    slice_sizes,
)
from canzona.planner.partition.tp import Task
from canzona.planner.spec import ModelSpec

if TYPE_CHECKING:  # the request is only read here
    from canzona.planner.partition.ilp import SolverReport
    from canzona.planner.request import PlanRequest


@dataclass(frozen=True)
class BufferPlan:
    """One partitioned matrix-optimizer buffer: layout, group size, owners, cuts, loads.

    Owners are ranks within the buffer's data-parallel group: DP ranks for the dense buffer,
    expert-data-parallel ranks for the expert buffer (laid out once, for EP rank 0's local
    experts; every EP rank's experts sit at the same offsets). `collectives`: per bucket, the
    form that reduces and gathers it (`choose_collective` on the reference network).
    """

    layout: BufferLayout
    num_ranks: int
    owners: dict[int, int]
    cuts: tuple[tuple[int, ...], ...]
    method: str
    loads: tuple[float, ...]
    baselines: tuple[BaselineLoads, ...]
    solver: SolverReport | None = None
    collectives: tuple[str, ...] = ()


def param_task(model: ModelSpec, costs: tuple[float, ...], index: int) -> Task:
    """The TP task of one matrix parameter: its cost and gathered fp32 gradient bytes."""
    param = model.params[index]
    return Task(param.name, costs[index], GRAD_BYTES_PER_ELEMENT * param.numel, param.tp_dim is None)


def dp_instance(
    layout: BufferLayout, model: ModelSpec, costs: tuple[float, ...], dp: int, base_loads: tuple[float, ...] = ()
) -> DpInstance:
    """The partition problem of one buffer."""
    return DpInstance(
        costs=tuple(tuple(costs[e.param] for e in bucket.entries) for bucket in layout.buckets),
        spans=tuple(bucket.spans() for bucket in layout.buckets),
        names=tuple(tuple(model.params[e.param].name for e in bucket.entries) for bucket in layout.buckets),
        num_ranks=dp,
        base_loads=base_loads,
    )


def _assign(
    instance: DpInstance, request: PlanRequest, seeds: tuple[tuple[tuple[int, ...], ...], ...]
) -> tuple[DpAssignment, SolverReport | None]:
    """The α-balanced partition (free or registration order), refined by CP-SAT if asked."""
    if request.order == "free":
        assignment = partition_free(instance, request.alpha, seeds)
    else:
        assignment = partition(instance, request.alpha, seeds)
    report = None
    if request.solver == "ilp" and any(instance.costs):
        from canzona.planner.partition.ilp import refine_dp

        refined, report = refine_dp(
            instance,
            slice_caps(instance, request.alpha),
            assignment.owners,
            time_limit=request.time_limit,
            seed=request.seed,
        )
        if report.accepted:
            assignment = DpAssignment(refined, assignment.method + "+cp-sat")
    return assignment, report


def _polish(
    instance: DpInstance,
    layout: BufferLayout,
    model: ModelSpec,
    costs: tuple[float, ...],
    request: PlanRequest,
    assignment: DpAssignment,
    device: DeviceModel | None,
) -> DpAssignment:
    """Device-aware ownership (when `device` is given), then slices evened out at equal loads."""
    if not any(instance.costs):
        return assignment
    caps, free = slice_caps(instance, request.alpha), request.order == "free"
    owners = assignment.owners
    if device is None:
        return DpAssignment(even_slices(instance, caps, owners, free), assignment.method)
    tasks = {
        (b, i): param_task(model, costs, entry.param)
        for b, bucket in enumerate(layout.buckets)
        for i, entry in enumerate(bucket.entries)
    }
    moved = reown(instance, SliceState.of(instance, caps, owners, free), tasks, device)
    loads = rank_loads(instance, moved) != rank_loads(instance, owners)
    return DpAssignment(moved, assignment.method + ("+device" if loads else ""))


def own_loads(instance: DpInstance, owners: Owners) -> tuple[float, ...]:
    """Each rank's load from a buffer's partition (its base loads not counted)."""
    return tuple(total - base for total, base in zip(rank_loads(instance, owners), instance.initial_loads()))


@dataclass(frozen=True)
class Partitioned:
    """One buffer's DP partition before the device stage, the even slices and the layout: what
    `make_plan` compares between the plans of a request at other α and orders."""

    layout: BufferLayout
    instance: DpInstance
    assignment: DpAssignment
    solver: SolverReport | None = None

    @property
    def loads(self) -> tuple[float, ...]:
        """Each rank's load from this buffer (its base loads not counted)."""
        return own_loads(self.instance, self.assignment.owners)


def partition_buffer(
    model: ModelSpec,
    layout: BufferLayout,
    costs: tuple[float, ...],
    num_ranks: int,
    request: PlanRequest,
    base_loads: tuple[float, ...] = (),
    seeds: tuple[BufferPlan, ...] = (),
) -> Partitioned:
    """Partition one buffer over `num_ranks` (refined by CP-SAT if asked). `seeds`: plans of
    the same buffer at coarser α (see `partition`)."""
    instance = dp_instance(layout, model, costs, num_ranks, base_loads)
    seed_owners = tuple(
        tuple(tuple(seed.owners[e.param] for e in bucket.entries) for bucket in layout.buckets)
        for seed in seeds
        if _members(seed.layout) == _members(layout)
    )
    assignment, report = _assign(instance, request, seed_owners)
    return Partitioned(layout, instance, assignment, report)


def finish_buffer(
    model: ModelSpec,
    part: Partitioned,
    costs: tuple[float, ...],
    request: PlanRequest,
    link: Link,
    device: DeviceModel | None = None,
) -> BufferPlan:
    """The plan of a partitioned buffer: with `device`, owners moved to shorten the busiest
    device; slices evened out; laid out (free order: each owner's matrices together), cut, each
    bucket's collective chosen on `link` (its DP group's), and the baselines scored on it."""
    layout, instance, num_ranks = part.layout, part.instance, part.instance.num_ranks
    assignment = _polish(instance, layout, model, costs, request, part.assignment, device)
    owners = {
        entry.param: owner
        for bucket, bucket_owners in zip(layout.buckets, assignment.owners)
        for entry, owner in zip(bucket.entries, bucket_owners)
    }
    loads = own_loads(instance, assignment.owners)
    registration_layout = layout
    if request.order == "free":
        layout, bucket_owners_list = reorder_buffer(layout, assignment.owners, num_ranks)
        assignment = DpAssignment(bucket_owners_list, assignment.method)
    cuts = tuple(
        owners_to_cuts(bucket_owners, tuple(e.offset for e in bucket.entries), bucket.numel, num_ranks)
        for bucket, bucket_owners in zip(layout.buckets, assignment.owners)
    )
    cost_by_param = {param: costs[param] for param in owners}
    names = {index: param.name for index, param in enumerate(model.params)}
    baselines = all_baselines(registration_layout, cost_by_param, names, num_ranks)
    collectives = tuple(
        choose_collective(link, slice_sizes(bucket_cuts), param_bytes(model, bucket))
        for bucket, bucket_cuts in zip(layout.buckets, cuts)
    )
    return BufferPlan(layout, num_ranks, owners, cuts, assignment.method, loads, baselines, part.solver, collectives)


def _members(layout: BufferLayout) -> tuple[frozenset[int], ...]:
    """Each bucket's parameters (what a seed plan must share, whatever its order)."""
    return tuple(frozenset(e.param for e in bucket.entries) for bucket in layout.buckets)
