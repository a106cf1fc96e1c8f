"""Build a plan: model + parallel layout + cost model → DP ownership of every matrix.

Pure: no I/O. `compile.py` turns a `Plan` into the schedule file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from canzona.planner.partition.baselines import BaselineLoads, all_baselines
from canzona.planner.partition.cooperative import COOP_MODES, Shape, cooperate
from canzona.planner.partition.costs import OptimizerConfig, make_cost_model, param_cost, param_state_bytes
from canzona.planner.partition.dp import (
    ALPHA_LADDER,
    DpAssignment,
    DpInstance,
    lower_bound,
    owners_to_cuts,
    partition,
    rank_loads,
    slice_caps,
)
from canzona.planner.partition.free_order import partition_free, reorder_buffer
from canzona.planner.partition.layout import DEFAULT_BUCKET_SIZE, GRAD_BYTES_PER_ELEMENT, BufferLayout, build_buffer
from canzona.planner.partition.tp import DEFAULT_GROUP_MB, MODES, MicroGroup, Task, schedule_tasks
from canzona.planner.spec import ADAMW, MATRIX, ModelOptions, ModelSpec, PlanError, validate_model
from canzona.schedules.limits import FSDP, REPLICATED, request_problem, settings_problem, sharding_problem

if TYPE_CHECKING:
    from canzona.planner.partition.ilp import SolverReport

DEFAULT_GLOBAL_BATCH = 256  # sequences per optimizer step, over every DP rank
DEFAULT_SEQ_LEN = 4096  # tokens per sequence


@dataclass(frozen=True)
class TrainingSetup:
    """What one training iteration processes, for predictions of the whole iteration:
    `global_batch` sequences of `seq_len` tokens per optimizer step over all DP ranks, in
    `micro_batches` forward/backward passes per DP rank (None: one sequence per micro-batch,
    i.e. global_batch / dp, Megatron's usual micro-batch size 1)."""

    global_batch: int = DEFAULT_GLOBAL_BATCH
    seq_len: int = DEFAULT_SEQ_LEN
    micro_batches: int | None = None

    def validate(self, dp: int) -> int:
        """The micro-batch count per DP rank; PlanError unless the batch splits evenly."""
        if self.global_batch < 1 or self.seq_len < 1:
            raise PlanError(f"global batch and sequence length must be >= 1, got {self.global_batch} and {self.seq_len}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise PlanError(f"micro-batches must be >= 1, got {self.micro_batches}")
        count = self.micro_batches if self.micro_batches is not None else self.global_batch // dp
        if count < 1 or self.global_batch % (dp * count):
            raise PlanError(f"a global batch of {self.global_batch} sequences does not split into dp {dp} x "
                            f"{count if count >= 1 else 'any'} micro-batches of whole sequences; give --global-batch "
                            "(a multiple of dp) or --micro-batches")
        return count


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
class PlanRequest:
    """What the user asked for; recorded in the schedule so it can be regenerated."""

    model: str
    tp: int
    dp: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cost: str = "flops"
    alpha: float = 1.0
    bucket_size: int = DEFAULT_BUCKET_SIZE
    options: ModelOptions = field(default_factory=ModelOptions)
    tp_mode: str = "rollback"
    group_bytes: int = DEFAULT_GROUP_MB << 20
    ep: int = 1
    solver: str = "greedy"
    time_limit: float = 10.0
    seed: int = 0
    alpha_device: str | None = None  # set: alpha was chosen by the simulator on this device
    bucket_device: str | None = None  # set: bucket_size was chosen by the simulator on this device
    training: TrainingSetup | None = None  # what those searches assumed (None: the defaults)
    sharding: str = REPLICATED  # or FSDP: FSDP2 fully_shard (planner/fsdp.py)
    dp_replicate: int = 1  # HSDP (FSDP only): dp = dp_replicate x shard ranks
    coop: str = "auto"  # cooperative hosting of dominant Muon matrices: off, auto, force
    # "free": the planner picks each bucket's parameter order (canzona's runtimes pack by the
    # schedule); "registration": Megatron's fixed gradient buffer. None resolves to free, or to
    # registration under --solver ilp (CP-SAT refines registration-order plans only).
    order: str | None = None

    def __post_init__(self) -> None:
        if self.order is None:
            # CP-SAT refines contiguous cuts; FSDP plans have no buckets to order.
            fixed = self.solver == "ilp" or self.sharding == FSDP
            object.__setattr__(self, "order", "registration" if fixed else "free")

    def validate(self) -> None:
        """Raise PlanError on a layout or setting no plan can have (canzona's limits)."""
        opt = self.optimizer
        problem = request_problem(
            tp=self.tp, dp=self.dp, ep=self.ep, alpha=self.alpha, bucket_size=self.bucket_size,
            group_bytes=self.group_bytes, tp_mode=self.tp_mode, solver=self.solver, time_limit=self.time_limit,
            seed=self.seed, order=self.order,
        ) or settings_problem(opt.name, opt.ns_steps, opt.block_size, opt.precondition_frequency, opt.max_precond_dim)
        problem = problem or sharding_problem(self.sharding, self.dp, self.dp_replicate, self.ep) or self._fsdp_problem()
        if problem:
            raise PlanError(problem)
        if self.coop not in COOP_MODES:
            raise PlanError(f"unknown cooperative hosting mode {self.coop!r}; choose one of {', '.join(COOP_MODES)}")
        if self.alpha_device is not None or self.bucket_device is not None:
            (self.training or TrainingSetup()).validate(self.dp)


    def _fsdp_problem(self) -> str | None:
        """What FSDP plans do not have: DP cuts (alpha), buckets, CP-SAT refinement."""
        if self.sharding != FSDP:
            return None
        if self.alpha_device is not None or self.bucket_device is not None:
            return "--alpha auto and --bucket-size auto search DP cuts and buckets, which FSDP plans do not have"
        if self.alpha != 1.0 or self.bucket_size != DEFAULT_BUCKET_SIZE:
            return "alpha and the bucket size shape DP cuts and buckets, which FSDP plans do not have; leave them out"
        if self.solver != "greedy":
            return "--solver ilp is not supported with --fsdp (FSDP plans use the greedy micro-group scheduler)"
        if self.coop == "force":
            return "--coop force is not supported with --fsdp (FSDP plans host every matrix on one device)"
        return None


@dataclass(frozen=True)
class BufferPlan:
    """One partitioned matrix-optimizer buffer: layout, group size, owners, cuts, loads.

    Owners are ranks within the buffer's data-parallel group: DP ranks for the dense buffer,
    expert-data-parallel ranks for the expert buffer (laid out once, for EP rank 0's local
    experts; every EP rank's experts sit at the same offsets).
    """

    layout: BufferLayout
    num_ranks: int
    owners: dict[int, int]
    cuts: tuple[tuple[int, ...], ...]
    method: str
    loads: tuple[float, ...]
    baselines: tuple[BaselineLoads, ...]
    solver: SolverReport | None = None


@dataclass(frozen=True)
class Plan:
    """The solved plan. Per-parameter lists are indexed by registration position.

    `owners` maps every matrix parameter to its owner rank in its group (DP rank; for experts
    under expert parallelism, expert-DP rank); `expert_slot` maps every expert parameter to
    the EP-rank-0 expert at the same buffer position (itself when ep = 1 or not an expert).
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
    loads: tuple[float, ...]
    baselines: tuple[BaselineLoads, ...]
    tasks: tuple[tuple[Task, ...], ...]
    groups: dict[str, tuple[tuple[MicroGroup, ...], ...]]
    solver: SolverSummary | None = None

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


def plan_buffer(
    model: ModelSpec, layout: BufferLayout, costs: tuple[float, ...], num_ranks: int, request: PlanRequest,
    base_loads: tuple[float, ...] = (), seeds: tuple[BufferPlan, ...] = (),
) -> tuple[BufferPlan, DpInstance]:
    """Partition one buffer over `num_ranks` (refined by CP-SAT if asked) and score the
    baselines on it. `seeds`: plans of the same buffer at coarser α (see `partition`)."""
    instance = dp_instance(layout, model, costs, num_ranks, base_loads)
    seed_owners = tuple(
        tuple(tuple(seed.owners[e.param] for e in bucket.entries) for bucket in layout.buckets)
        for seed in seeds
        if _members(seed.layout) == _members(layout)
    )
    if request.order == "free":
        assignment = partition_free(instance, request.alpha, seed_owners)
    else:
        assignment = partition(instance, request.alpha, seed_owners)
    report = None
    if request.solver == "ilp" and any(instance.costs):
        from canzona.planner.partition.ilp import refine_dp

        refined, report = refine_dp(
            instance, slice_caps(instance, request.alpha), assignment.owners,
            time_limit=request.time_limit, seed=request.seed,
        )
        if report.accepted:
            assignment = DpAssignment(refined, assignment.method + "+cp-sat")
    owners = {
        entry.param: owner
        for bucket, bucket_owners in zip(layout.buckets, assignment.owners)
        for entry, owner in zip(bucket.entries, bucket_owners)
    }
    loads = tuple(l - b for l, b in zip(rank_loads(instance, assignment.owners), instance.initial_loads()))
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
    return BufferPlan(layout, num_ranks, owners, cuts, assignment.method, loads, baselines, report), instance


def _members(layout: BufferLayout) -> tuple[frozenset[int], ...]:
    """Each bucket's parameters (what a seed plan must share, whatever its order)."""
    return tuple(frozenset(e.param for e in bucket.entries) for bucket in layout.buckets)


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

    Each buffer's plan is never worse at a larger α, nor in free order than in registration
    order, but under expert parallelism the dense buffer is balanced around the experts'
    loads, so a better expert plan can leave a worse sum. There, unless the plan meets the
    lower bound, the whole plan at the next coarser ladder α and the registration-order plan
    (valid plans of this request too: tighter caps, and any order is a free order) replace it
    when their largest load is lower."""
    return _best_plan(model, request, seeds, {})


def _best_plan(model: ModelSpec, request: PlanRequest, seeds: tuple[Plan, ...],
               done: dict[tuple[str, float], Plan]) -> Plan:
    """`make_plan`, with the plans already made for other (order, α) of this request in `done`
    (the fallbacks reach the same coarser plans by several paths)."""
    key = (str(request.order), request.alpha)
    if key in done:
        return done[key]
    plan = _make_plan(model, request, seeds)
    if request.ep > 1 and max(plan.loads) > plan.lower_bound * (1 + 1e-12):
        others = []
        if request.order == "free":
            others.append(_best_plan(model, replace(request, order="registration"), seeds, done))
        coarser = [alpha for alpha in ALPHA_LADDER if alpha < request.alpha]
        if coarser:
            others.append(_best_plan(model, replace(request, alpha=coarser[-1]), seeds, done))
        for other in others:
            if max(other.loads) < max(plan.loads):
                plan = replace(other, request=request)
    done[key] = plan
    return plan


def _make_plan(model: ModelSpec, request: PlanRequest, seeds: tuple[Plan, ...]) -> Plan:
    request.validate()
    validate_model(model, request.tp)
    validate_expert_parallel(model, request)
    cost_model = make_cost_model(request.cost, request.optimizer)
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    state = tuple(param_state_bytes(param, request.optimizer) for param in model.params)
    ep, tp, dp = request.ep, request.tp, request.dp
    slots = _expert_slots(model, ep) if ep > 1 else {}
    expert: BufferPlan | None = None
    if ep > 1:
        layout = build_buffer(model, MATRIX, tp, dp // ep, request.bucket_size, lambda i: slots.get(i) == i)
        expert_seeds = tuple(seed.expert for seed in seeds if seed.expert is not None)
        expert, _ = plan_buffer(model, layout, costs, dp // ep, request, seeds=expert_seeds)
    expert_base = _combine((0.0,) * dp, expert.loads if expert else (), ep)
    dense_layout = build_buffer(model, MATRIX, tp, dp, request.bucket_size, lambda i: i not in slots)
    dense_seeds = tuple(seed.dense for seed in seeds) if expert is None else ()
    dense, instance = plan_buffer(model, dense_layout, costs, dp, request, expert_base if expert else (), dense_seeds)
    owners = dict(dense.owners)
    if expert is not None:
        owners.update({param: expert.owners[slot] for param, slot in slots.items()})
    tasks = rank_tasks(model, dense, expert, slots, costs, request)
    groups = {mode: tuple(schedule_tasks(rank, tp, request.group_bytes, mode) for rank in tasks) for mode in MODES}
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
        adamw_layout=build_buffer(model, ADAMW, tp, dp, request.bucket_size),
        costs=costs,
        state_bytes=state,
        owners=owners,
        expert_slot={index: slots.get(index, index) for index in owners},
        lower_bound=lower_bound(instance),
        loads=_combine(dense.loads, expert.loads if expert else (), ep),
        baselines=_combined_baselines(dense, expert, ep),
        tasks=tasks,
        groups=groups,
        solver=summary,
    )


def team_shapes(model: ModelSpec, request: PlanRequest) -> dict[str, Shape]:
    """The matrices a team may host: Muon, updated as one matrix (one submatrix); none when
    cooperative hosting is off, or `auto` under a cost model it cannot price (only FLOPs)."""
    if request.optimizer.name != "muon" or request.coop == "off" or request.tp < 2:
        return {}
    if request.coop == "auto" and request.cost != "flops":
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
                    tuple(rank_tasks_[i].cost for i in group.tasks), tuple(rank_tasks_[i].size for i in group.tasks),
                    group.hosts, request.tp, request.group_bytes, time_limit=share, seed=request.seed,
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


def rank_tasks(
    model: ModelSpec,
    dense: BufferPlan,
    expert: BufferPlan | None,
    slots: dict[int, int],
    costs: tuple[float, ...],
    request: PlanRequest,
) -> tuple[tuple[Task, ...], ...]:
    """Per DP rank, the matrices it owns as TP tasks, in buffer order (dense, then experts)."""
    tasks: list[list[Task]] = [[] for _ in range(request.dp)]

    def add(rank: int, param_index: int) -> None:
        param = model.params[param_index]
        size = GRAD_BYTES_PER_ELEMENT * param.numel
        tasks[rank].append(Task(param.name, costs[param_index], size, param.tp_dim is None))

    for bucket in dense.layout.buckets:
        for entry in bucket.entries:
            add(dense.owners[entry.param], entry.param)
    if expert is not None:
        by_slot: dict[int, list[int]] = {}
        for param, slot in slots.items():
            by_slot.setdefault(slot, []).append(param)
        for bucket in expert.layout.buckets:
            for entry in bucket.entries:
                for param in by_slot[entry.param]:
                    spec = model.params[param]
                    ep_rank = spec.expert_index // (spec.num_experts // request.ep)
                    add(expert.owners[entry.param] * request.ep + ep_rank, param)
    return tuple(tuple(rank) for rank in tasks)
