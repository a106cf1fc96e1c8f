"""Turn a solved `Plan` into a `Schedule` (the file format), computing every metric."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypedDict

from canzona.planner.buffers import BufferPlan
from canzona.planner.devices import device_figures, tp_score
from canzona.planner.fsdp import FsdpPlan, compile_fsdp
from canzona.planner.partition.baselines import BaselineLoads
from canzona.planner.partition.costs import adamw_slice_bytes_per_element, make_cost_model
from canzona.planner.partition.layout import GRAD_BYTES_PER_ELEMENT, equal_cuts, slice_sizes
from canzona.planner.partition.tp import MicroGroup, Task, group_stats
from canzona.planner.plan import AutoSearch, Plan
from canzona.planner.spec import MATRIX
from canzona.schedules.costs import predicted_peak_bytes, tp_transient_bytes
from canzona.schedules.format import (
    SCHEMA_VERSION,
    AdamwBucketEntry,
    AlphaTrial,
    BucketEntry,
    BucketSearch,
    BucketTrial,
    DeviceMetrics,
    DpMetrics,
    DpSection,
    Metrics,
    ParamEntry,
    Schedule,
    SolverMetrics,
    StrategyScore,
    TeamEntry,
    TpGroup,
    TpMetrics,
    TpModeScore,
    TpRankPlan,
    TpSection,
    compute_fingerprint,
    model_parameters,
    sealed,
)


def _ratio(numerator: float, denominator: float, empty: float) -> float:
    return numerator / denominator if denominator else empty


def _entry(
    plan: Plan, param_index: int, bucket: int, offset: int, numel: int, ep_rank: int | None, checked: bool = True
) -> ParamEntry:
    """One parameter's row; `checked=False` builds it without pydantic's checks (for
    `simulation_schedule`, from the planner's own values: the longest part at scale)."""
    param = plan.model.params[param_index]
    return (ParamEntry if checked else ParamEntry.model_construct)(
        name=param.name,
        index=param_index,
        shape=list(param.shape),
        tp_dim=param.tp_dim,
        dtype=param.dtype,
        optimizer=param.optimizer,
        bucket=bucket,
        offset=offset,
        numel=numel,
        owner=plan.owners.get(param_index) if param.optimizer == MATRIX else None,
        cost=plan.costs[param_index],
        row_blocks=_row_blocks(param.row_blocks),
        ep_rank=ep_rank,
        param=param.parent,
        slice=param.expert_index if param.parent is not None else None,
        # A sum over one TP rank is nothing: the flag exists only where it does something.
        grad_reduce=param.grad_reduce if plan.request.tp > 1 else None,
    )


@functools.lru_cache(maxsize=256)
def _row_blocks(blocks: tuple[tuple[tuple[int, int], ...], ...]) -> list[list[list[int]]] | None:
    """A parameter's row blocks as the file lists them (experts of a layer share theirs; the
    model copies the lists it validates)."""
    return [[list(r) for r in block] for block in blocks] or None


def _param_entries(plan: Plan, checked: bool = True) -> list[ParamEntry]:
    """Dense matrix buffer, then the expert buffer of each EP rank, then AdamW; buffer order
    (`checked`: as `_entry`)."""
    entries = [
        _entry(plan, e.param, bucket.index, e.offset, e.numel, None, checked)
        for layout in (plan.dense.layout,)
        for bucket in layout.buckets
        for e in bucket.entries
    ]
    if plan.expert is not None:
        by_slot: dict[tuple[int, int], int] = {}
        for param, slot in plan.expert_slot.items():
            ep_rank = plan.ep_rank(param)
            if ep_rank is not None:
                by_slot[(slot, ep_rank)] = param
        for ep_rank in range(plan.request.ep):
            for bucket in plan.expert.layout.buckets:
                for e in bucket.entries:
                    entry = _entry(plan, by_slot[(e.param, ep_rank)], bucket.index, e.offset, e.numel, ep_rank, checked)
                    entries.append(entry)
    entries += [
        _entry(plan, e.param, bucket.index, e.offset, e.numel, None, checked)
        for bucket in plan.adamw_layout.buckets
        for e in bucket.entries
    ]
    return entries


def _score(loads: tuple[float, ...] | list[float], total: float, bound: float, padding: float | None) -> StrategyScore:
    maximum, dp = max(loads, default=0.0), max(len(loads), 1)
    mean = sum(loads) / dp
    return StrategyScore(
        load=list(loads),
        max=maximum,
        mean=mean,
        imbalance=_ratio(maximum, mean, 1.0),
        gap=_ratio(maximum, bound, 1.0) - 1.0,
        redundancy=_ratio(sum(loads), total, 1.0),
        padding_overhead=padding,
    )


def _buckets(buffer: BufferPlan) -> list[BucketEntry]:
    buckets = []
    for bucket, cuts, collective in zip(buffer.layout.buckets, buffer.cuts, buffer.collectives):
        slices = slice_sizes(cuts)
        buckets.append(
            BucketEntry(
                index=bucket.index,
                numel=bucket.numel,
                cuts=list(cuts),
                slice_bytes=[GRAD_BYTES_PER_ELEMENT * s for s in slices],
                padding_overhead=_ratio(buffer.num_ranks * max(slices), bucket.numel, 1.0),
                collective=collective,
            )
        )
    return buckets


def _dp_metrics(plan: Plan, dense: list[BucketEntry], expert: list[BucketEntry]) -> DpMetrics:
    req = plan.request
    dp, tp, ep = req.dp, req.tp, req.ep
    index_of = {param.name: index for index, param in enumerate(plan.model.params)}
    state = [sum(plan.state_bytes[index_of[t.name]] for t in tasks) for tasks in plan.tasks]
    adamw_cost = make_cost_model(req.cost, req.optimizer).adamw_cost
    adamw_bytes = adamw_slice_bytes_per_element(plan.model.params)
    adamw_load = [0.0] * dp
    for bucket in plan.adamw_layout.buckets:
        # Every TP rank updates its own slice of its own AdamW buffer: the group does tp of them.
        for rank, elements in enumerate(slice_sizes(equal_cuts(bucket.numel, dp))):
            adamw_load[rank] += tp * adamw_cost(elements)
            state[rank] += tp * adamw_bytes * elements
    loads = list(plan.loads)
    total = sum(loads)
    buffers = [b for b in (plan.dense, plan.expert) if b is not None]
    padded = sum(bucket.numel for b in buffers for bucket in b.layout.buckets)
    worst = sum(b.num_ranks * max(slice_sizes(cuts)) for b in buffers for cuts in b.cuts)
    canzona = _score(loads, total, plan.lower_bound, _ratio(worst, padded, 1.0))
    slice_bytes = [0] * dp
    for entry in dense:
        slice_bytes = [so_far + size for so_far, size in zip(slice_bytes, entry.slice_bytes)]
    for entry in expert:
        slice_bytes = [so_far + entry.slice_bytes[r // ep] for r, so_far in enumerate(slice_bytes)]
    return DpMetrics(
        method=plan.dense.method,
        load=loads,
        max=canzona.max,
        mean=canzona.mean,
        imbalance=canzona.imbalance,
        lower_bound=plan.lower_bound,
        gap=canzona.gap,
        slice_bytes=slice_bytes,
        state_bytes=state,
        adamw_load=adamw_load,
        padding_overhead=canzona.padding_overhead or 1.0,
        max_padding_overhead=max((b.padding_overhead for b in dense + expert), default=1.0),
        baselines={b.name: _baseline_score(b, total, plan.lower_bound) for b in plan.baselines},
    )


def _baseline_score(baseline: BaselineLoads, total: float, bound: float) -> StrategyScore:
    return _score(baseline.loads, total, bound, baseline.padding_overhead)


def _tp_section(plan: Plan) -> TpSection:
    req = plan.request
    ranks = []
    for dp_rank, groups in enumerate(plan.chosen_groups):
        tasks = plan.tasks[dp_rank]
        entries = []
        for index, group in enumerate(groups):
            stats = group_stats(tasks, group, req.tp, req.group_bytes)
            entries.append(
                TpGroup(
                    index=index,
                    params=[tasks[t].name for t in group.tasks],
                    hosts=list(group.hosts),
                    host_loads=list(stats.host_loads),
                    host_bytes=list(stats.host_bytes),
                    makespan=stats.makespan,
                    saturation=stats.saturation,
                    teams=[
                        TeamEntry(param=tasks[t].name, hosts=list(team.hosts), load=team.cost)
                        for t, team in zip(group.tasks, group.teams)
                        if team is not None
                    ],
                )
            )
        ranks.append(TpRankPlan(dp_rank=dp_rank, groups=entries))
    return TpSection(mode=req.tp_mode, group_bytes=req.group_bytes, ranks=ranks, update=plan.tp_update)


def _pieces_of(tasks: Sequence[Task], groups: Sequence[MicroGroup]) -> list[float]:
    """One DP rank's indivisible units of optimizer work: a matrix update on one device, or one
    team member's share of a cooperatively hosted matrix."""
    return [cost for group in groups for _, cost, _ in group.placements(tasks)]


def _tp_metrics(plan: Plan) -> TpMetrics:
    # Only the chosen mode is recorded: the others' figures could not be re-checked without
    # re-planning (docs/schedule-format.md).
    chosen = tp_score(plan, plan.chosen_groups)
    bound = plan.device_lower_bound
    return TpMetrics(
        mode=plan.request.tp_mode,
        num_groups=chosen.num_groups,
        critical_time=chosen.critical_time,
        critical_lower_bound=max(
            (
                max(sum(t.cost for t in tasks) / plan.request.tp, max(_pieces_of(tasks, groups)))
                for tasks, groups in zip(plan.tasks, plan.chosen_groups)
                if tasks
            ),
            default=0.0,
        ),
        efficiency=chosen.efficiency,
        worst_device_load=chosen.worst_device_load,
        device_imbalance=chosen.device_imbalance,
        max_saturation=chosen.max_saturation,
        modes={plan.request.tp_mode: TpModeScore(**vars(chosen))},
        cooperative=sum(team is not None for rank in plan.chosen_groups for group in rank for team in group.teams),
        device_lower_bound=bound,
        device_gap=chosen.worst_device_load / bound - 1 if bound else 0.0,
    )


class _Searches(TypedDict, total=False):
    """`Metrics`' fields of the automatic searches (absent: no search)."""

    alpha_search: list[AlphaTrial]
    bucket_search: BucketSearch


def _searches(search: AutoSearch | None) -> _Searches:
    """The metrics of the automatic searches that chose α and the bucket size."""
    out: _Searches = {}
    if search is None:
        return out
    if search.alpha:
        out["alpha_search"] = [
            AlphaTrial(alpha=t.value, predicted_step_s=t.step_s, predicted_iteration_s=t.iteration_s)
            for t in search.alpha
        ]
    if search.bucket:
        out["bucket_search"] = BucketSearch(
            reason=search.bucket_reason,
            trials=[
                BucketTrial(
                    bucket_size=int(t.value),
                    num_buckets=t.num_buckets,
                    predicted_step_s=t.step_s,
                    predicted_iteration_s=t.iteration_s,
                )
                for t in search.bucket
            ],
        )
    return out


def compile_schedule(plan: Plan | FsdpPlan, search: AutoSearch | None = None) -> Schedule:
    """The schedule file of a plan (deterministic); `search`: what `--alpha auto` and
    `--bucket-size auto` tried."""
    if isinstance(plan, FsdpPlan):
        return compile_fsdp(plan)
    dp = _dp_section(plan)
    fingerprint = compute_fingerprint(
        model_parameters((p.name, p.shape, p.dtype, p.tp_dim, p.parent) for p in plan.model.params)
    )
    schedule = Schedule(
        schema_version=SCHEMA_VERSION,
        request=plan.request.to_request(plan.model),
        fingerprint=fingerprint,
        digest="",
        params=_param_entries(plan),
        dp=dp,
        tp=_tp_section(plan),
        metrics=Metrics(
            dp=_dp_metrics(plan, dp.buckets, dp.expert_buckets),
            tp=_tp_metrics(plan),
            device=_device_metrics(plan, [*dp.buckets, *dp.expert_buckets, *dp.adamw_buckets]),
            solver=SolverMetrics(**vars(plan.solver)) if plan.solver else None,
            **_searches(search),
        ),
    )
    return sealed(schedule)


def simulation_schedule(plan: Plan) -> Schedule:
    """What the simulator reads of a plan's schedule (the request, the parameters, the DP
    buckets, the TP groups), without what a file needs besides (its metrics, pydantic's
    checks, the fingerprint, the digest): to price candidate plans, never to write."""
    return Schedule.model_construct(
        schema_version=SCHEMA_VERSION,
        request=plan.request.to_request(plan.model),
        fingerprint="",
        digest="",
        params=_param_entries(plan, checked=False),
        dp=_dp_section(plan),
        tp=_tp_section(plan),
        metrics=None,
    )


def _dp_section(plan: Plan) -> DpSection:
    """Every buffer's buckets: matrices (dense, experts) with the plan's cuts, AdamW equal."""
    adamw_buckets = [
        AdamwBucketEntry(index=b.index, numel=b.numel, cuts=list(equal_cuts(b.numel, plan.request.dp)))
        for b in plan.adamw_layout.buckets
    ]
    experts = _buckets(plan.expert) if plan.expert is not None else []
    return DpSection(buckets=_buckets(plan.dense), expert_buckets=experts, adamw_buckets=adamw_buckets)


def _device_metrics(plan: Plan, buckets: list[Any]) -> list[DeviceMetrics]:
    """Every device's figures, with its predicted peak memory (the bucket buffer holds every
    bucket whole on every device)."""
    buffer, largest = sum(b.numel for b in buckets), max((b.numel for b in buckets), default=0)
    owned = [sum(task.size for task in tasks) // GRAD_BYTES_PER_ELEMENT for tasks in plan.tasks]
    return [
        DeviceMetrics(
            **vars(figure),
            peak_bytes=predicted_peak_bytes(
                figure.state_bytes,
                buffer,
                largest,
                tp_transient_bytes(plan.tp_update, plan.request.group_bytes, owned[figure.dp_rank]),
                plan.request.dp,
            ),
        )
        for figure in device_figures(plan, plan.chosen_groups)
    ]
