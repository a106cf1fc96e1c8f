"""Build a plan: model + parallel layout + cost model → DP ownership of every matrix.

Pure: no I/O. `compile.py` turns a `Plan` into the schedule file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from canzona.planner.baselines import BaselineLoads, all_baselines
from canzona.planner.costs import OptimizerConfig, make_cost_model, param_cost, param_state_bytes
from canzona.planner.dp import DpInstance, lower_bound, owners_to_cuts, partition
from canzona.planner.layout import DEFAULT_BUCKET_SIZE, BufferLayout, build_buffer
from canzona.planner.spec import ADAMW, MATRIX, ModelOptions, ModelSpec, PlanError, validate_model
from canzona.planner.tp import DEFAULT_GROUP_MB, MODES, MicroGroup, Task, schedule_tasks

GRAD_BYTES_PER_ELEMENT = 4  # Megatron keeps main gradients in fp32


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

    def validate(self) -> None:
        """Raise PlanError on a layout or setting no plan can have."""
        if self.tp < 1:
            raise PlanError(f"tp must be >= 1, got {self.tp}")
        if self.dp < 1:
            raise PlanError(f"dp must be >= 1, got {self.dp}")
        if not 0.0 <= self.alpha <= 1.0:
            raise PlanError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.bucket_size < 1:
            raise PlanError(f"bucket size must be >= 1, got {self.bucket_size}")
        if self.tp_mode not in MODES:
            raise PlanError(f"unknown TP mode {self.tp_mode!r}; choose one of {', '.join(MODES)}")
        if self.group_bytes < 1:
            raise PlanError(f"group capacity must be >= 1 byte, got {self.group_bytes}")


@dataclass(frozen=True)
class Plan:
    """The solved plan. Per-parameter lists are indexed by registration position."""

    request: PlanRequest
    model: ModelSpec
    matrix_layout: BufferLayout
    adamw_layout: BufferLayout
    costs: tuple[float, ...]
    state_bytes: tuple[float, ...]
    owners: dict[int, int]
    cuts: tuple[tuple[int, ...], ...]
    method: str
    lower_bound: float
    baselines: tuple[BaselineLoads, ...]
    tasks: tuple[tuple[Task, ...], ...]
    groups: dict[str, tuple[tuple[MicroGroup, ...], ...]]

    @property
    def chosen_groups(self) -> tuple[tuple[MicroGroup, ...], ...]:
        """Micro-groups of every DP rank under the requested mode."""
        return self.groups[self.request.tp_mode]


def dp_instance(layout: BufferLayout, model: ModelSpec, costs: tuple[float, ...], dp: int) -> DpInstance:
    """The partition problem of one buffer."""
    return DpInstance(
        costs=tuple(tuple(costs[e.param] for e in bucket.entries) for bucket in layout.buckets),
        spans=tuple(bucket.spans() for bucket in layout.buckets),
        names=tuple(tuple(model.params[e.param].name for e in bucket.entries) for bucket in layout.buckets),
        num_ranks=dp,
    )


def make_plan(model: ModelSpec, request: PlanRequest) -> Plan:
    """Solve the DP partition of `model` for `request` and score the baselines."""
    request.validate()
    validate_model(model, request.tp)
    cost_model = make_cost_model(request.cost, request.optimizer)
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    state = tuple(param_state_bytes(param, request.optimizer) for param in model.params)
    matrix = build_buffer(model, MATRIX, request.tp, request.dp, request.bucket_size)
    adamw = build_buffer(model, ADAMW, request.tp, request.dp, request.bucket_size)
    instance = dp_instance(matrix, model, costs, request.dp)
    assignment = partition(instance, request.alpha)
    owners = {
        entry.param: owner
        for bucket, bucket_owners in zip(matrix.buckets, assignment.owners)
        for entry, owner in zip(bucket.entries, bucket_owners)
    }
    cuts = tuple(
        owners_to_cuts(bucket_owners, tuple(e.offset for e in bucket.entries), bucket.numel, request.dp)
        for bucket, bucket_owners in zip(matrix.buckets, assignment.owners)
    )
    cost_by_param = {entry.param: costs[entry.param] for b in matrix.buckets for entry in b.entries}
    names = {index: param.name for index, param in enumerate(model.params)}
    tasks = rank_tasks(model, matrix, owners, costs, request.dp)
    groups = {
        mode: tuple(schedule_tasks(rank, request.tp, request.group_bytes, mode) for rank in tasks)
        for mode in MODES
    }
    return Plan(
        request=request,
        model=model,
        matrix_layout=matrix,
        adamw_layout=adamw,
        costs=costs,
        state_bytes=state,
        owners=owners,
        cuts=cuts,
        method=assignment.method,
        lower_bound=lower_bound(instance),
        baselines=all_baselines(matrix, cost_by_param, names, request.dp),
        tasks=tasks,
        groups=groups,
    )


def rank_tasks(
    model: ModelSpec, layout: BufferLayout, owners: dict[int, int], costs: tuple[float, ...], dp: int
) -> tuple[tuple[Task, ...], ...]:
    """Per DP rank, the matrices it owns as TP tasks, in buffer order."""
    tasks: list[list[Task]] = [[] for _ in range(dp)]
    for bucket in layout.buckets:
        for entry in bucket.entries:
            param = model.params[entry.param]
            size = GRAD_BYTES_PER_ELEMENT * param.numel
            tasks[owners[entry.param]].append(Task(param.name, costs[entry.param], size, param.tp_dim is None))
    return tuple(tuple(rank) for rank in tasks)
