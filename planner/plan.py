"""Build a plan: model + parallel layout + cost model → DP ownership of every matrix.

Pure: no I/O. `compile.py` turns a `Plan` into the schedule file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from canzona.planner.buffers import (
    BufferPlan,
    Partitioned,
    dp_instance,
    finish_buffer,
    param_task,
    partition_buffer,
)
from canzona.planner.partition.baselines import BaselineLoads, baseline_owners
from canzona.planner.partition.collectives import (
    REFERENCE_NETWORK,
    Link,
    cheapest_seconds,
    layout_links,
    reference_rate,
)
from canzona.planner.partition.cooperative import Shape, cooperate, smallest_share
from canzona.planner.partition.costs import CostModel, make_cost_model, param_cost, param_state_bytes
from canzona.planner.partition.device_aware import DeviceModel
from canzona.planner.partition.dp import (
    ALPHA_LADDER,
    DpAssignment,
    DpInstance,
    Owners,
    feasible,
    lower_bound,
    slice_caps,
)
from canzona.planner.partition.layout import BufferLayout, adamw_loads, build_buffer, param_bytes
from canzona.planner.partition.tp import MicroGroup, Task, schedule_tasks

# The request lives in its own module; planner code and tests name it from here too.
from canzona.planner.request import PlanRequest, TrainingSetup  # noqa: F401
from canzona.planner.spec import (
    ADAMW,
    MATRIX,
    ModelSpec,
    PlanError,
    validate_model,
)
from canzona.schedules.bounds import device_lower_bound, dp_lower_bound
from canzona.schedules.costs import update_precision
from canzona.schedules.limits import HOSTED, REPLICATED_UPDATE


@dataclass(frozen=True)
class SolverSummary:
    """What the optional CP-SAT refinement did (deterministic: no wall times)."""

    dp_status: str
    dp_objective: float
    dp_bound: float
    dp_accepted: bool
    tp_groups_refined: int
    tp_groups_improved: int


@dataclass(frozen=True)
class SearchTrial:
    """One candidate an automatic search planned and simulated: its α or bucket size, the
    matrix buffer's bucket count, and canzona's predicted step and iteration seconds."""

    value: float
    num_buckets: int
    step_s: float
    iteration_s: float


@dataclass(frozen=True)
class AutoSearch:
    """What `--alpha auto` and `--bucket-size auto` tried (empty: not asked for), and why the
    bucket size won."""

    alpha: tuple[SearchTrial, ...] = ()
    bucket: tuple[SearchTrial, ...] = ()
    bucket_reason: str = ""


@dataclass(frozen=True)
class Plan:
    """The solved plan. Per-parameter lists are indexed by registration position.

    `owners` maps every matrix parameter to its owner rank in its group (DP rank; for experts
    under expert parallelism, expert-DP rank); `expert_slot` maps every expert parameter to
    the EP-rank-0 expert at the same buffer position (itself when ep = 1 or not an expert).
    `lower_bound`: the DP load no plan of this model and layout can go below
    (`canzona.schedules.bounds.dp_lower_bound` over every matrix); `device_lower_bound`: the
    busiest device no plan can go below (`device_bound`). `groups`: every DP rank's
    micro-groups under the requested TP mode, by mode (`mode_groups` schedules the others).
    `tp_update`: whether they run ("hosted") or every TP rank updates every matrix of its DP
    rank ("replicated"; `canzona.schedules.limits.TP_UPDATES`), which the objective picks.
    """

    request: PlanRequest
    model: ModelSpec
    dense: BufferPlan
    expert: BufferPlan | None
    adamw_layout: BufferLayout
    costs: tuple[float, ...]
    state_bytes: tuple[float, ...]
    owners: dict[int, int]
    expert_slot: dict[int, int]
    lower_bound: float
    device_lower_bound: float
    loads: tuple[float, ...]
    baselines: tuple[BaselineLoads, ...]
    tasks: tuple[tuple[Task, ...], ...]
    groups: dict[str, tuple[tuple[MicroGroup, ...], ...]]
    solver: SolverSummary | None = None
    tp_update: str = HOSTED

    @property
    def chosen_groups(self) -> tuple[tuple[MicroGroup, ...], ...]:
        """Micro-groups of every DP rank under the requested mode."""
        return self.groups[self.request.tp_mode]

    def ep_rank(self, param: int) -> int | None:
        """EP rank holding an expert parameter under expert parallelism, else None."""
        spec = self.model.params[param]
        if self.expert is None or spec.expert_index is None:
            return None
        return spec.expert_index // (spec.num_experts // self.request.ep)


def _expert_slots(model: ModelSpec, ep: int) -> dict[int, int]:
    """Expert parameter → the EP-rank-0 expert at the same local slot (same name stem)."""
    slots: dict[int, int] = {}
    first: dict[tuple[str, int], int] = {}
    for index, param in enumerate(model.params):
        if param.expert_index is None:
            continue
        local = param.num_experts // ep
        stem = param.parent or param.name.removesuffix(str(param.expert_index))
        key = (stem, param.expert_index % local)
        if param.expert_index < local:
            first[key] = index
        slots[index] = first.get(key, index)
    return slots


def _combine(dense: tuple[float, ...], expert: tuple[float, ...], ep: int) -> tuple[float, ...]:
    """Per DP rank: its dense load plus the load of its expert-DP rank (dp_rank // ep)."""
    return tuple(load + (expert[rank // ep] if expert else 0.0) for rank, load in enumerate(dense))


def make_plan(model: ModelSpec, request: PlanRequest, seeds: tuple[Plan, ...] = ()) -> Plan:
    """Solve the DP partition (and expert partition) of `model`, schedule TP micro-groups,
    and score the baselines. `seeds`: plans of the same model and layout at coarser α, which
    this plan is then never worse than (what `--alpha auto` compares).

    Each buffer's partition is never worse at a larger α, nor in free order than in
    registration order, but under expert parallelism the dense buffer is balanced around the
    experts' loads, so a better expert plan can leave a worse sum. There, unless the partitions
    meet their bound, those at the next coarser ladder α and in registration order (valid
    partitions of this request too: tighter caps, and any order is a free order) replace them
    when their largest load is lower. Then (`finish_buffer`) the device stage, the even slices
    and the layout."""
    return finish_plan(model, partition_plan(model, request, seeds))


@dataclass(frozen=True)
class Partitions:
    """A request's DP partitions before the device stage (`partition_plan`): what
    `finish_plan` turns into its plan."""

    request: PlanRequest
    costs: tuple[float, ...]
    slots: dict[int, int]
    parts: _Parts

    def same_owners(self, other: Partitions) -> bool:
        """Whether both partitions give every matrix the same owner in the same buffers."""
        mine, theirs = self.parts, other.parts
        return (
            mine.dense.layout == theirs.dense.layout
            and mine.dense.assignment.owners == theirs.dense.assignment.owners
            and (
                (mine.expert is None and theirs.expert is None)
                or (
                    mine.expert is not None
                    and theirs.expert is not None
                    and mine.expert.assignment.owners == theirs.expert.assignment.owners
                )
            )
        )


def partition_plan(model: ModelSpec, request: PlanRequest, seeds: tuple[Plan, ...] = ()) -> Partitions:
    """The first half of `make_plan`: the request checked and its DP partitions solved."""
    _, costs, slots = _prepared(model, request)
    return Partitions(request, costs, slots, _best_parts(model, request, seeds, costs, slots, {}))


def _prepared(model: ModelSpec, request: PlanRequest) -> tuple[CostModel, tuple[float, ...], dict[int, int]]:
    """The request checked against the model; its cost model, every parameter's cost, and
    under expert parallelism each expert's slot (`_expert_slots`)."""
    request.validate()
    validate_model(model, request.tp)
    validate_expert_parallel(model, request)
    cost_model = make_cost_model(request.cost, request.optimizer)
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    return cost_model, costs, _expert_slots(model, request.ep) if request.ep > 1 else {}


def finish_plan(model: ModelSpec, partitions: Partitions) -> Plan:
    """The second half of `make_plan`: the plan of `partition_plan`'s partitions."""
    request = partitions.request
    cost_model = make_cost_model(request.cost, request.optimizer)
    return _finish(model, request, partitions.parts, partitions.costs, partitions.slots, cost_model)


def make_baseline_plan(model: ModelSpec, request: PlanRequest, rule: str) -> Plan | None:
    """The plan whose DP owners a baseline's rule sets (`baseline_owners`: start-owner,
    zero1-gather's slicing with whole-matrix owners, layer-wise), then finished as any plan
    but for the device stage (the rule's loads stand; equal-cost matrices may still swap owners
    to even the slices out); its `method` names the rule. None where the request cannot
    express them: α's slice caps forbid them, or layer-wise owners in registration order
    (they ignore the buffer order)."""
    cost_model, costs, slots = _prepared(model, request)
    ep, tp, dp = request.ep, request.tp, request.dp
    expert: Partitioned | None = None
    if ep > 1:
        layout = build_buffer(model, MATRIX, tp, dp // ep, request.bucket_size, lambda i: slots.get(i) == i)
        expert = _ruled(model, layout, costs, dp // ep, request, (), rule)
        if expert is None:
            return None
    base = _combine((0.0,) * dp, expert.loads, ep) if expert else ()
    dense_layout = build_buffer(model, MATRIX, tp, dp, request.bucket_size, lambda i: i not in slots)
    dense = _ruled(model, dense_layout, costs, dp, request, base, rule)
    if dense is None:
        return None
    loads = _combine(dense.loads, expert.loads if expert else (), ep)
    parts = _Parts(dense, expert, loads, lower_bound(dense.instance))
    return _finish(model, request, parts, costs, slots, cost_model, device_stage=False)


def _ruled(
    model: ModelSpec,
    layout: BufferLayout,
    costs: tuple[float, ...],
    ranks: int,
    request: PlanRequest,
    base: tuple[float, ...],
    rule: str,
) -> Partitioned | None:
    """One buffer partitioned by a baseline's owner rule, or None where the request forbids it."""
    instance = dp_instance(layout, model, costs, ranks, base)
    names = tuple(param.name for param in model.params)
    owners = baseline_owners(layout, costs, names, ranks, rule)
    free = request.order == "free"
    if not feasible(instance, slice_caps(instance, request.alpha), owners, free):
        return None
    return Partitioned(layout, instance, DpAssignment(owners, f"{rule} owners"))


@dataclass(frozen=True)
class _Parts:
    """The DP partitions of one request (the expert buffer's under expert parallelism), their
    combined DP loads, and the dense partition's own bound."""

    dense: Partitioned
    expert: Partitioned | None
    loads: tuple[float, ...]
    bound: float


def _best_parts(
    model: ModelSpec,
    request: PlanRequest,
    seeds: tuple[Plan, ...],
    costs: tuple[float, ...],
    slots: dict[int, int],
    done: dict[tuple[str, float], _Parts],
) -> _Parts:
    """The partitions `make_plan` keeps, with those already made for other (order, α) of this
    request in `done` (the fallbacks reach the same coarser ones by several paths)."""
    key = (str(request.order), request.alpha)
    if key in done:
        return done[key]
    parts = _partitions(model, request, seeds, costs, slots)
    if request.ep > 1 and max(parts.loads) > parts.bound * (1 + 1e-12):
        others = []
        if request.order == "free":
            others.append(_best_parts(model, replace(request, order="registration"), seeds, costs, slots, done))
        coarser = [alpha for alpha in ALPHA_LADDER if alpha < request.alpha]
        if coarser:
            others.append(_best_parts(model, replace(request, alpha=coarser[-1]), seeds, costs, slots, done))
        for other in others:
            if max(other.loads) < max(parts.loads):
                parts = other
    done[key] = parts
    return parts


def _partitions(
    model: ModelSpec, request: PlanRequest, seeds: tuple[Plan, ...], costs: tuple[float, ...], slots: dict[int, int]
) -> _Parts:
    """The expert partition (under expert parallelism), then the dense one around its loads."""
    ep, tp, dp = request.ep, request.tp, request.dp
    expert: Partitioned | None = None
    if ep > 1:
        layout = build_buffer(model, MATRIX, tp, dp // ep, request.bucket_size, lambda i: slots.get(i) == i)
        expert_seeds = tuple(seed.expert for seed in seeds if seed.expert is not None)
        expert = partition_buffer(model, layout, costs, dp // ep, request, seeds=expert_seeds)
    base = _combine((0.0,) * dp, expert.loads, ep) if expert else ()
    dense_layout = build_buffer(model, MATRIX, tp, dp, request.bucket_size, lambda i: i not in slots)
    dense_seeds = tuple(seed.dense for seed in seeds) if expert is None else ()
    dense = partition_buffer(model, dense_layout, costs, dp, request, base, dense_seeds)
    loads = _combine(dense.loads, expert.loads if expert else (), ep)
    return _Parts(dense, expert, loads, lower_bound(dense.instance))


def _finish(
    model: ModelSpec,
    request: PlanRequest,
    parts: _Parts,
    costs: tuple[float, ...],
    slots: dict[int, int],
    cost_model: CostModel,
    device_stage: bool = True,
) -> Plan:
    """The plan of the chosen partitions: the device stage (TP > 1, unless `device_stage` is
    False), even slices, layouts, TP micro-groups and teams, bounds and baselines."""
    ep, tp, dp = request.ep, request.tp, request.dp
    dp_link, expert_link, _ = layout_links(REFERENCE_NETWORK, tp, dp, ep)
    expert = finish_buffer(model, parts.expert, costs, request, expert_link) if parts.expert else None
    adamw_layout = build_buffer(model, ADAMW, tp, dp, request.bucket_size)
    adamw = adamw_loads(adamw_layout, dp, cost_model)
    bound = dp_lower_bound([c for c, p in zip(costs, model.params) if p.optimizer == MATRIX], dp)
    device_bound = layout_device_bound(model, request, costs, bound, adamw)
    experts = expert_tasks(model, expert, slots, costs, request)  # per DP rank
    device = None
    # FLOPs price the collectives too: seconds at the reference device's rate in the updates' precision
    if device_stage and tp > 1 and request.cost == "flops":
        rate = reference_rate(update_precision(request.optimizer))
        device = _device_model(
            model,
            request,
            experts,
            adamw,
            tp * device_bound,
            _comm_cost(model, parts.dense.layout, dp_link, rate),
        )
    dense = finish_buffer(model, parts.dense, costs, request, dp_link, device)
    owners = dict(dense.owners)
    if expert is not None:
        owners.update({param: expert.owners[slot] for param, slot in slots.items()})
    tasks = rank_tasks(model, dense, experts, costs, request.dp)
    mode = request.tp_mode  # the file records this mode only; `mode_groups` makes the others
    groups = {mode: tuple(schedule_tasks(rank, tp, request.group_bytes, mode) for rank in tasks)}
    summary = None
    if request.solver == "ilp":
        refined, num_refined, num_improved = refine_groups(tasks, groups[request.tp_mode], request)
        groups[request.tp_mode] = refined
        summary = _solver_summary(dense, num_refined, num_improved)
    shapes = team_shapes(model, request)
    if shapes:  # the chosen mode only: the others are scored beside it as their schedulers made them
        groups[request.tp_mode] = tuple(
            cooperate(rank, rank_groups, tp, shapes, request.optimizer.ns_steps, request.coop, request.group_bytes)
            for rank, rank_groups in zip(tasks, groups[request.tp_mode])
        )
    return Plan(
        request=request,
        model=model,
        dense=dense,
        expert=expert,
        adamw_layout=adamw_layout,
        costs=costs,
        state_bytes=tuple(param_state_bytes(param, request.optimizer) for param in model.params),
        owners=owners,
        expert_slot={index: slots.get(index, index) for index in owners},
        lower_bound=bound,
        device_lower_bound=device_bound,
        loads=_combine(dense.loads, expert.loads if expert else (), ep),
        baselines=_combined_baselines(dense, expert, ep),
        tasks=tasks,
        groups=groups,
        solver=summary,
        tp_update=REPLICATED_UPDATE if request.tp_update == REPLICATED_UPDATE else HOSTED,
    )


def mode_groups(plan: Plan, mode: str) -> tuple[tuple[MicroGroup, ...], ...]:
    """Every DP rank's micro-groups under TP `mode`: the plan's own for its mode (teams
    included), else that mode's scheduler on the same tasks."""
    if mode == plan.request.tp_mode:
        return plan.chosen_groups
    return tuple(schedule_tasks(rank, plan.request.tp, plan.request.group_bytes, mode) for rank in plan.tasks)


def team_shapes(model: ModelSpec, request: PlanRequest) -> dict[str, Shape]:
    """The matrices this request's teams may host (`teamable_shapes`); none when cooperative
    hosting is off, or `auto` under a cost model it cannot price (only FLOPs)."""
    if request.coop == "off" or (request.coop == "auto" and request.cost != "flops"):
        return {}
    return teamable_shapes(model, request)


def teamable_shapes(model: ModelSpec, request: PlanRequest) -> dict[str, Shape]:
    """The matrices a team of TP ranks can host in any plan of this model and layout: Muon,
    tp > 1, updated as one matrix (one submatrix)."""
    if request.optimizer.name != "muon" or request.tp < 2:
        return {}
    return {
        param.name: Shape(param.shape[0], param.shape[1], param.tp_dim)
        for param in model.params
        if param.optimizer == MATRIX and len(param.submatrices) == 1
    }


def _solver_summary(dense: BufferPlan, num_refined: int, num_improved: int) -> SolverSummary:
    report = dense.solver
    return SolverSummary(
        dp_status=report.status if report else "SKIPPED",
        dp_objective=report.objective if report else 0.0,
        dp_bound=report.bound if report else 0.0,
        dp_accepted=report.accepted if report else False,
        tp_groups_refined=num_refined,
        tp_groups_improved=num_improved,
    )


def refine_groups(
    tasks: tuple[tuple[Task, ...], ...], groups: tuple[tuple[MicroGroup, ...], ...], request: PlanRequest
) -> tuple[tuple[tuple[MicroGroup, ...], ...], int, int]:
    """CP-SAT host assignment inside every micro-group with 2+ tasks and 2+ hosts; the time
    limit is shared evenly among them. Returns the groups and how many were refined/improved."""
    from canzona.planner.partition.ilp import refine_hosts

    todo = [g for rank in groups for g in rank if len(g.tasks) > 1 and request.tp > 1]
    share = request.time_limit / max(1, len(todo))
    improved, refined_groups = 0, []
    for rank_tasks_, rank_groups in zip(tasks, groups):
        rank_refined = []
        for group in rank_groups:
            if len(group.tasks) > 1 and request.tp > 1:
                hosts, report = refine_hosts(
                    tuple(rank_tasks_[i].cost for i in group.tasks),
                    tuple(rank_tasks_[i].size for i in group.tasks),
                    group.hosts,
                    request.tp,
                    request.group_bytes,
                    time_limit=share,
                    seed=request.seed,
                )
                improved += report.accepted
                group = MicroGroup(group.tasks, hosts)
            rank_refined.append(group)
        refined_groups.append(tuple(rank_refined))
    return tuple(refined_groups), len(todo), improved


def _combined_baselines(dense: BufferPlan, expert: BufferPlan | None, ep: int) -> tuple[BaselineLoads, ...]:
    if expert is None:
        return dense.baselines
    return tuple(
        BaselineLoads(d.name, _combine(d.loads, e.loads, ep), d.padding_overhead)
        for d, e in zip(dense.baselines, expert.baselines)
    )


def validate_expert_parallel(model: ModelSpec, request: PlanRequest) -> None:
    """Raise PlanError unless `ep` divides the world and every layer's experts."""
    ep = request.ep
    if ep == 1:
        return
    if request.dp % ep:
        raise PlanError(f"ep {ep} does not divide dp {request.dp} (the world is tp x dp = {request.tp * request.dp})")
    counts = {param.num_experts for param in model.params if param.expert_index is not None}
    if not counts:
        raise PlanError(f"ep {ep} needs a model with MoE experts; {model.name!r} has none")
    for count in sorted(counts):
        if count % ep:
            raise PlanError(f"ep {ep} does not divide the {count} experts of {model.name!r}")


def layout_device_bound(
    model: ModelSpec, request: PlanRequest, costs: tuple[float, ...], dp_bound: float, adamw: list[float]
) -> float:
    """The busiest device no plan of this model and layout can go below, whatever its owners,
    hosts and teams (`canzona.schedules.bounds.device_lower_bound`): teams allowed wherever one
    can host a matrix (Muon, tp > 1), each matrix's least piece its smallest team share;
    `adamw`: per DP rank, each of its devices' AdamW cost."""
    tp, shapes = request.tp, teamable_shapes(model, request)
    matrices = [(param, cost) for param, cost in zip(model.params, costs) if param.optimizer == MATRIX]
    kinds = {(cost, shapes.get(param.name)) for param, cost in matrices}  # matrices alike share their pieces
    largest = max((smallest_share(cost, shape, request.optimizer.ns_steps, tp) for cost, shape in kinds), default=0.0)
    return device_lower_bound(
        sum(cost for _, cost in matrices),
        tp * request.dp,
        dp_bound,
        tp,
        largest,
        [load for load in adamw for _ in range(tp)],
    )


def _device_model(
    model: ModelSpec,
    request: PlanRequest,
    extra: tuple[tuple[Task, ...], ...],
    adamw: list[float],
    load_cap: float,
    comm: Callable[[DpInstance, Owners], float],
) -> DeviceModel:
    """The TP stage as the device-aware DP ownership scores it: this request's scheduler, group
    capacity and teams; `extra`: every DP rank's experts; `adamw`: its devices' AdamW cost;
    `load_cap`: the DP balance it keeps (P times the device lower bound); `comm`: the
    buffer's collectives."""
    return DeviceModel(
        request.tp,
        request.group_bytes,
        request.tp_mode,
        team_shapes(model, request),
        request.optimizer.ns_steps,
        request.coop,
        extra,
        tuple(adamw),
        load_cap,
        comm,
    )


def _comm_cost(
    model: ModelSpec, layout: BufferLayout, link: Link, rate: float
) -> Callable[[DpInstance, Owners], float]:
    """A partition's collectives on `link` in FLOPs: every bucket's reduction and gather at its
    cheapest collective, at `rate` FLOP/s (the reference device's, in the precision the updates
    run in; each rank's slice: its matrices' spans)."""
    per_bucket = [param_bytes(model, bucket) for bucket in layout.buckets]

    def cost(instance: DpInstance, owners: Owners) -> float:
        seconds = 0.0
        for spans, bucket_owners, elem_bytes in zip(instance.spans, owners, per_bucket):
            slices = [0] * instance.num_ranks
            for span, owner in zip(spans, bucket_owners):
                slices[owner] += span
            seconds += cheapest_seconds(link, slices, elem_bytes)
        return seconds * rate

    return cost


def expert_tasks(
    model: ModelSpec, expert: BufferPlan | None, slots: dict[int, int], costs: tuple[float, ...], request: PlanRequest
) -> tuple[tuple[Task, ...], ...]:
    """Per DP rank, the experts it updates as TP tasks, in buffer order (empty without EP)."""
    if expert is None:
        return ()
    tasks: list[list[Task]] = [[] for _ in range(request.dp)]
    by_slot: dict[int, list[int]] = {}
    for param, slot in slots.items():
        by_slot.setdefault(slot, []).append(param)
    for bucket in expert.layout.buckets:
        for entry in bucket.entries:
            for param in by_slot[entry.param]:
                spec = model.params[param]
                assert spec.expert_index is not None  # `slots` holds expert parameters only
                ep_rank = spec.expert_index // (spec.num_experts // request.ep)
                tasks[expert.owners[entry.param] * request.ep + ep_rank].append(param_task(model, costs, param))
    return tuple(tuple(rank) for rank in tasks)


def rank_tasks(
    model: ModelSpec, dense: BufferPlan, experts: tuple[tuple[Task, ...], ...], costs: tuple[float, ...], dp: int
) -> tuple[tuple[Task, ...], ...]:
    """Per DP rank, the matrices it owns as TP tasks, in buffer order: dense, then its
    `experts` (`expert_tasks`)."""
    tasks: list[list[Task]] = [[] for _ in range(dp)]
    for bucket in dense.layout.buckets:
        for entry in bucket.entries:
            tasks[dense.owners[entry.param]].append(param_task(model, costs, entry.param))
    for rank, extra in enumerate(experts):
        tasks[rank] += extra
    return tuple(tuple(rank) for rank in tasks)
