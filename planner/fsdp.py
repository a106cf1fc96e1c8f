"""Plans for FSDP2 (`fully_shard`) and HSDP: micro-groups over the whole fragmentation group.

Under FSDP every parameter is sharded over the DP shard dim (and, for TP-split ones, over TP):
no rank holds a whole matrix and FSDP reduce-scatters the gradients itself, so there are no DP
buckets and no owner cuts. Every matrix instead gets a host among the shards x TP devices of a
fragmentation group and a micro-group (one fused all-to-all gathers the pieces, the host
updates, one scatters the update back): the TP micro-group scheduler (`partition/tp.py`) at DP
scale, with its memory capacity. HSDP replicas execute the same plan on their own devices.

Pure: `make_fsdp_plan` solves, `compile_fsdp` writes the schedule (`canzona.schedules.fsdp`
holds the geometry the validator recomputes the figures with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from canzona.planner.partition.costs import (
    adamw_slice_bytes_per_element,
    make_cost_model,
    param_cost,
    param_state_bytes,
)
from canzona.planner.partition.layout import GRAD_BYTES_PER_ELEMENT
from canzona.planner.partition.tp import MODES, MicroGroup, Task, group_stats, schedule_tasks
from canzona.planner.spec import ADAMW, MATRIX, ModelSpec, validate_model
from canzona.schedules.format import (
    SCHEMA_VERSION,
    DeviceMetrics,
    DpMetrics,
    DpSection,
    Metrics,
    ParamEntry,
    Schedule,
    StrategyScore,
    TpGroup,
    TpMetrics,
    TpModeScore,
    TpRankPlan,
    TpSection,
    compute_fingerprint,
    model_parameters,
    sealed,
)
from canzona.schedules.fsdp import (
    REDUNDANT,
    ROUND_ROBIN,
    FsdpLayout,
    dp_loads,
    fragment_traffic,
    padding_ratio,
    shard_elements,
)

if TYPE_CHECKING:
    from canzona.planner.request import PlanRequest


@dataclass(frozen=True)
class FsdpPlan:
    """A solved FSDP plan: the matrices as tasks (reverse registration order, the order FSDP's
    backward finishes their gradients) and their micro-groups under every TP mode."""

    request: PlanRequest
    model: ModelSpec
    layout: FsdpLayout
    costs: tuple[float, ...]
    state_bytes: tuple[float, ...]
    matrices: tuple[int, ...]
    tasks: tuple[Task, ...]
    groups: dict[str, tuple[MicroGroup, ...]]

    @property
    def chosen_groups(self) -> tuple[MicroGroup, ...]:
        """The micro-groups under the requested mode."""
        return self.groups[self.request.tp_mode]


def make_fsdp_plan(model: ModelSpec, request: PlanRequest) -> FsdpPlan:
    """Host and micro-group of every matrix over the fragmentation group (DP shard x TP)."""
    request.validate()
    validate_model(model, request.tp)
    layout = FsdpLayout.of(request.tp, request.dp, request.dp_replicate)
    cost_model = make_cost_model(request.cost, request.optimizer)
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    state = tuple(param_state_bytes(param, request.optimizer) for param in model.params)
    matrices = tuple(i for i in reversed(range(len(model.params))) if model.params[i].optimizer == MATRIX)
    tasks = tuple(
        Task(model.params[i].name, costs[i], GRAD_BYTES_PER_ELEMENT * model.params[i].numel, False) for i in matrices
    )
    groups = {mode: schedule_tasks(tasks, layout.hosts, request.group_bytes, mode) for mode in MODES}
    return FsdpPlan(request, model, layout, costs, state, matrices, tasks, groups)


def _hosted(plan: FsdpPlan, groups: tuple[MicroGroup, ...], values: tuple[float, ...]) -> list[float]:
    """Per fragment rank, the sum of `values` (indexed by parameter) of the matrices it hosts."""
    hosted = [0.0] * plan.layout.hosts
    for group in groups:
        for task, host in zip(group.tasks, group.hosts):
            hosted[host] += values[plan.matrices[task]]
    return hosted


def _adamw_elements(plan: FsdpPlan) -> list[int]:
    """Per FSDP shard rank, the AdamW elements one of its devices updates."""
    return shard_elements([(p.shape, p.tp_dim) for p in plan.model.params if p.optimizer == ADAMW], plan.layout)


def _adamw_device_load(plan: FsdpPlan) -> list[float]:
    adamw_cost = make_cost_model(plan.request.cost, plan.request.optimizer).adamw_cost
    return [adamw_cost(elements) if elements else 0.0 for elements in _adamw_elements(plan)]


def _device_loads(plan: FsdpPlan, groups: tuple[MicroGroup, ...]) -> list[float]:
    """Per global rank: hosted matrices plus its AdamW pieces."""
    layout, hosted, adamw = plan.layout, _hosted(plan, groups, plan.costs), _adamw_device_load(plan)
    return [
        hosted[layout.fragment_of(r)] + adamw[layout.shard_of(layout.fragment_of(r))]
        for r in range(layout.dp * layout.tp)
    ]


def _score(loads: list[float], total: float, bound: float, padding: float | None) -> StrategyScore:
    maximum, mean = max(loads), sum(loads) / len(loads)
    return StrategyScore(
        load=loads,
        max=maximum,
        mean=mean,
        imbalance=maximum / mean if mean else 1.0,
        gap=(maximum / bound if bound else 1.0) - 1.0,
        redundancy=sum(loads) / total if total else 1.0,
        padding_overhead=padding,
    )


def _baselines(plan: FsdpPlan, total: float, bound: float) -> dict[str, StrategyScore]:
    """Every device gathers and updates every matrix (`redundant`), or matrix i of the
    registration order is hosted by fragment rank i mod (shards x TP) (`round_robin`)."""
    layout = plan.layout
    matrix_total = sum(plan.costs[i] for i in plan.matrices)
    redundant = [layout.tp * matrix_total] * layout.dp
    hosted = [0.0] * layout.hosts
    for position, index in enumerate(sorted(plan.matrices)):
        hosted[position % layout.hosts] += plan.costs[index]
    return {
        REDUNDANT: _score(redundant, total, bound, None),
        ROUND_ROBIN: _score(dp_loads(hosted, layout), total, bound, None),
    }


def _dp_metrics(plan: FsdpPlan) -> DpMetrics:
    layout, params = plan.layout, plan.model.params
    loads = dp_loads(_hosted(plan, plan.chosen_groups, plan.costs), layout)
    total = sum(loads)
    costs = [plan.costs[i] for i in plan.matrices]
    bound = max(sum(costs) / layout.shards, max(costs, default=0.0))
    score = _score(loads, total, bound, None)
    matrices = [params[i] for i in plan.matrices]
    held = shard_elements([(p.shape, p.tp_dim) for p in matrices], layout)
    slice_bytes = [GRAD_BYTES_PER_ELEMENT * held[d % layout.shards] for d in range(layout.dp)]
    hosted_state = dp_loads(_hosted(plan, plan.chosen_groups, plan.state_bytes), layout)
    adamw_bytes = adamw_slice_bytes_per_element(params)
    elements, adamw = _adamw_elements(plan), _adamw_device_load(plan)
    real = sum(p.numel // (layout.tp if p.tp_dim is not None else 1) for p in matrices)
    padded = sum(
        padding_ratio(p.shape, p.tp_dim, layout) * (p.numel // (layout.tp if p.tp_dim is not None else 1))
        for p in matrices
    )
    return DpMetrics(
        method="fsdp",
        load=loads,
        max=score.max,
        mean=score.mean,
        imbalance=score.imbalance,
        lower_bound=bound,
        gap=score.gap,
        slice_bytes=slice_bytes,
        state_bytes=[hosted_state[d] + layout.tp * adamw_bytes * elements[d % layout.shards] for d in range(layout.dp)],
        adamw_load=[layout.tp * adamw[d % layout.shards] for d in range(layout.dp)],
        padding_overhead=padded / real if real else 1.0,
        max_padding_overhead=max((padding_ratio(p.shape, p.tp_dim, layout) for p in matrices), default=1.0),
        baselines=_baselines(plan, total, bound),
    )


def _mode_score(plan: FsdpPlan, groups: tuple[MicroGroup, ...]) -> TpModeScore:
    hosts, capacity = plan.layout.hosts, plan.request.group_bytes
    stats = [group_stats(plan.tasks, group, hosts, capacity) for group in groups]
    span, work = sum(s.makespan for s in stats), sum(sum(s.host_loads) for s in stats)
    loads = _device_loads(plan, groups)
    mean = sum(loads) / len(loads)
    return TpModeScore(
        num_groups=len(groups),
        critical_time=span,
        efficiency=work / (hosts * span) if span else 1.0,
        worst_device_load=max(loads),
        device_imbalance=max(loads) / mean if mean else 1.0,
        max_saturation=max((s.saturation for s in stats), default=0.0),
    )


def _tp_metrics(plan: FsdpPlan) -> TpMetrics:
    chosen = _mode_score(plan, plan.chosen_groups)  # the only mode recorded (docs/schedule-format.md)
    costs = [task.cost for task in plan.tasks]
    return TpMetrics(
        mode=plan.request.tp_mode,
        critical_lower_bound=max(sum(costs) / plan.layout.hosts, max(costs)) if costs else 0.0,
        modes={plan.request.tp_mode: chosen},
        **chosen.model_dump(),
    )


def _tp_section(plan: FsdpPlan) -> TpSection:
    req, hosts = plan.request, plan.layout.hosts
    entries = []
    for index, group in enumerate(plan.chosen_groups):
        stats = group_stats(plan.tasks, group, hosts, req.group_bytes)
        entries.append(
            TpGroup(
                index=index,
                params=[plan.tasks[t].name for t in group.tasks],
                hosts=list(group.hosts),
                host_loads=list(stats.host_loads),
                host_bytes=list(stats.host_bytes),
                makespan=stats.makespan,
                saturation=stats.saturation,
            )
        )
    return TpSection(mode=req.tp_mode, group_bytes=req.group_bytes, ranks=[TpRankPlan(dp_rank=0, groups=entries)])


def _devices(plan: FsdpPlan) -> list[DeviceMetrics]:
    layout, params = plan.layout, plan.model.params
    hosts = {plan.matrices[t]: h for g in plan.chosen_groups for t, h in zip(g.tasks, g.hosts)}
    traffic = fragment_traffic([(params[i].shape, params[i].tp_dim, hosts[i]) for i in plan.matrices], layout)
    loads = _device_loads(plan, plan.chosen_groups)
    state = _hosted(plan, plan.chosen_groups, plan.state_bytes)
    adamw_state = adamw_slice_bytes_per_element(params) * 1.0
    elements = _adamw_elements(plan)
    out = []
    for rank in range(layout.dp * layout.tp):
        fragment = layout.fragment_of(rank)
        sent, received = traffic[fragment]
        out.append(
            DeviceMetrics(
                rank=rank,
                dp_rank=rank // layout.tp,
                tp_rank=rank % layout.tp,
                load=loads[rank],
                state_bytes=state[fragment] + adamw_state * elements[layout.shard_of(fragment)],
                bytes_sent=sent,
                bytes_received=received,
            )
        )
    return out


def _entries(plan: FsdpPlan) -> list[ParamEntry]:
    """Matrices in reverse registration order, then the AdamW parameters in the same order;
    no buckets (bucket 0, offset 0), every matrix owned by the fragmentation group (owner 0)."""
    params, tp = plan.model.params, plan.request.tp
    order = list(plan.matrices) + [i for i in reversed(range(len(params))) if params[i].optimizer == ADAMW]
    entries = []
    for index in order:
        p = params[index]
        matrix = p.optimizer == MATRIX
        entries.append(
            ParamEntry(
                name=p.name,
                index=index,
                shape=list(p.shape),
                tp_dim=p.tp_dim,
                dtype=p.dtype,
                optimizer=p.optimizer,
                bucket=0,
                offset=0,
                numel=p.local_numel(tp),
                owner=0 if matrix else None,
                cost=plan.costs[index],
                row_blocks=[[list(r) for r in block] for block in p.row_blocks] or None,
                param=p.parent,
                slice=p.expert_index if p.parent is not None else None,
                # FSDP2 redistributes every DTensor gradient to its parameter's placements before its
                # reduce-scatter, which sums a gradient partial over TP: nothing is left to reduce.
                grad_reduce=None,
            )
        )
    return entries


def compile_fsdp(plan: FsdpPlan) -> Schedule:
    """The schedule file of an FSDP plan (deterministic)."""
    params = plan.model.params
    fingerprint = compute_fingerprint(model_parameters((p.name, p.shape, p.dtype, p.tp_dim, p.parent) for p in params))
    schedule = Schedule(
        schema_version=SCHEMA_VERSION,
        request=plan.request.to_request(plan.model),
        fingerprint=fingerprint,
        digest="",
        params=_entries(plan),
        dp=DpSection(buckets=[], adamw_buckets=[]),
        tp=_tp_section(plan),
        metrics=Metrics(dp=_dp_metrics(plan), tp=_tp_metrics(plan), device=_devices(plan)),
    )
    return sealed(schedule)
