"""Per-device figures of a plan: compute load, optimizer state, bytes moved per step.

Global rank = dp_rank · tp + tp_rank. A device's compute is the matrices it hosts plus its
AdamW slice, and so is its state (fp32 main copies of bf16/fp16 parameters included); its
traffic is the DP reduction (fp32 gradients) and gather (parameters) of both buffers, each
bucket in the collective the plan chose for it, plus the TP micro-group all-to-alls (fp32
gradients in, fp32 updates out; the runtime sends new bf16/fp16 values instead for
low-precision matrices, which this counts at fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.planner.partition.costs import adamw_slice_bytes_per_element, make_cost_model
from canzona.planner.partition.layout import BufferLayout, adamw_elements, adamw_loads, equal_cuts, param_bytes
from canzona.planner.partition.tp import MicroGroup, group_stats
from canzona.planner.plan import Plan
from canzona.schedules.figures import bucket_traffic, micro_group_traffic, replicated_update_traffic
from canzona.schedules.limits import HOSTED


@dataclass(frozen=True)
class DeviceFigures:
    """One device's per-step figures."""

    rank: int
    dp_rank: int
    tp_rank: int
    load: float
    state_bytes: float
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True)
class TpScore:
    """Headline figures of one micro-group mode."""

    num_groups: int
    critical_time: float
    efficiency: float
    worst_device_load: float
    device_imbalance: float
    max_saturation: float


def _dp_traffic(
    plan: Plan, layout: BufferLayout, cuts_of: list[tuple[int, ...]], group: int, collectives: tuple[str, ...] = ()
) -> list[tuple[int, int]]:
    """(sent, received) bytes of one buffer's reduction (fp32) and gather (parameter dtype) over
    a data-parallel group of `group` ranks, per rank of that group, each bucket in its
    collective (`collectives`; none given: equal cuts, a native ring)."""
    sent, received = [0] * group, [0] * group
    for position, (bucket, cuts) in enumerate(zip(layout.buckets, cuts_of)):
        collective = collectives[position] if collectives else "ring"
        moved = bucket_traffic(bucket.numel, cuts, param_bytes(plan.model, bucket), collective)
        sent = [total + out for total, (out, _) in zip(sent, moved)]
        received = [total + into for total, (_, into) in zip(received, moved)]
    return list(zip(sent, received))


def _tp_traffic(plan: Plan, groups: tuple[tuple[MicroGroup, ...], ...]) -> dict[tuple[int, int], tuple[int, int]]:
    """(sent, received) bytes of the TP update, per (dp_rank, tp_rank): the micro-group
    all-to-alls, or a replicated update's all-gather."""
    tp = plan.request.tp
    traffic: dict[tuple[int, int], tuple[int, int]] = {}
    for dp_rank, rank_groups in enumerate(groups):
        tasks = plan.tasks[dp_rank]
        if plan.tp_update != HOSTED:
            gathered = replicated_update_traffic(((task.size, task.replicated) for task in tasks), tp)
            traffic.update(((dp_rank, tp_rank), pair) for tp_rank, pair in enumerate(gathered))
            continue
        parts = [
            (member, tasks[index].size, len(team.hosts) if team else 1, tasks[index].replicated)
            for group in rank_groups
            for position, (index, host) in enumerate(zip(group.tasks, group.hosts))
            for team in (group.team(position),)
            for member in (team.hosts if team else (host,))
        ]
        for tp_rank, moved in enumerate(micro_group_traffic(parts, tp)):
            traffic[(dp_rank, tp_rank)] = moved
    return traffic


def _hosted(
    plan: Plan, groups: tuple[tuple[MicroGroup, ...], ...], dp_rank: int, index_of: dict[str, int]
) -> tuple[list[float], list[float]]:
    """Per TP rank of one DP rank, the cost and optimizer state of what it updates (a team
    member its share; under a replicated update, every matrix of the DP rank); `index_of`: each
    parameter's index by name."""
    tp = plan.request.tp
    if plan.tp_update != HOSTED:
        tasks = plan.tasks[dp_rank]
        cost, state = sum(t.cost for t in tasks), sum(plan.state_bytes[index_of[t.name]] for t in tasks)
        return [cost] * tp, [state] * tp
    hosted_cost, hosted_state = [0.0] * tp, [0.0] * tp
    for group in groups[dp_rank]:
        for position, (index, host) in enumerate(zip(group.tasks, group.hosts)):
            task, team = plan.tasks[dp_rank][index], group.team(position)
            for member in team.hosts if team else (host,):
                hosted_cost[member] += team.cost if team else task.cost
                hosted_state[member] += plan.state_bytes[index_of[task.name]] / (len(team.hosts) if team else 1)
    return hosted_cost, hosted_state


def device_loads(plan: Plan, groups: tuple[tuple[MicroGroup, ...], ...]) -> list[float]:
    """Every device's optimizer compute under the given micro-groups (global rank order)."""
    req = plan.request
    adamw = adamw_loads(plan.adamw_layout, req.dp, make_cost_model(req.cost, req.optimizer))
    index_of = {param.name: index for index, param in enumerate(plan.model.params)}
    return [cost + adamw[dp_rank] for dp_rank in range(req.dp) for cost in _hosted(plan, groups, dp_rank, index_of)[0]]


def device_figures(plan: Plan, groups: tuple[tuple[MicroGroup, ...], ...]) -> list[DeviceFigures]:
    """Every device's figures under the given micro-groups."""
    req = plan.request
    elements = adamw_elements(plan.adamw_layout, req.dp)
    adamw = adamw_loads(plan.adamw_layout, req.dp, make_cost_model(req.cost, req.optimizer))
    adamw_bytes = adamw_slice_bytes_per_element(plan.model.params)
    matrix_traffic = _dp_traffic(plan, plan.dense.layout, list(plan.dense.cuts), req.dp, plan.dense.collectives)
    if plan.expert is not None:
        expert = _dp_traffic(
            plan, plan.expert.layout, list(plan.expert.cuts), plan.expert.num_ranks, plan.expert.collectives
        )
        matrix_traffic = [
            (sent + expert[r // req.ep][0], received + expert[r // req.ep][1])
            for r, (sent, received) in enumerate(matrix_traffic)
        ]
    adamw_cuts = [equal_cuts(bucket.numel, req.dp) for bucket in plan.adamw_layout.buckets]
    adamw_traffic = _dp_traffic(plan, plan.adamw_layout, adamw_cuts, req.dp)
    tp_traffic = _tp_traffic(plan, groups)
    figures = []
    index_of = {param.name: index for index, param in enumerate(plan.model.params)}
    for dp_rank in range(req.dp):
        hosted_cost, hosted_state = _hosted(plan, groups, dp_rank, index_of)
        for tp_rank in range(req.tp):
            tp_sent, tp_received = tp_traffic[(dp_rank, tp_rank)]
            figures.append(
                DeviceFigures(
                    rank=dp_rank * req.tp + tp_rank,
                    dp_rank=dp_rank,
                    tp_rank=tp_rank,
                    load=hosted_cost[tp_rank] + adamw[dp_rank],
                    state_bytes=hosted_state[tp_rank] + adamw_bytes * elements[dp_rank],
                    bytes_sent=matrix_traffic[dp_rank][0] + adamw_traffic[dp_rank][0] + tp_sent,
                    bytes_received=matrix_traffic[dp_rank][1] + adamw_traffic[dp_rank][1] + tp_received,
                )
            )
    return figures


def tp_score(plan: Plan, groups: tuple[tuple[MicroGroup, ...], ...]) -> TpScore:
    """Efficiency, critical time, device balance and saturation of one mode's groups."""
    tp, capacity = plan.request.tp, plan.request.group_bytes
    total_cost, makespans, saturation, critical = 0.0, 0.0, 0.0, 0.0
    for dp_rank, rank_groups in enumerate(groups):
        rank_time = 0.0
        for group in rank_groups:
            stats = group_stats(plan.tasks[dp_rank], group, tp, capacity)
            # The matrices' own costs: a team's communication and replicated work are overhead.
            total_cost += sum(plan.tasks[dp_rank][index].cost for index in group.tasks)
            rank_time += stats.makespan
            saturation = max(saturation, stats.saturation)
        makespans += rank_time
        critical = max(critical, rank_time)
    loads = device_loads(plan, groups)
    mean = sum(loads) / len(loads)
    return TpScore(
        num_groups=sum(len(rank_groups) for rank_groups in groups),
        critical_time=critical,
        efficiency=total_cost / (tp * makespans) if makespans else 1.0,
        worst_device_load=max(loads),
        device_imbalance=max(loads) / mean if mean else 1.0,
        max_saturation=saturation,
    )
