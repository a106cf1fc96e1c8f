"""The validator's rules for FSDP schedules (`request.sharding: fsdp`): no buffers, one plan of
micro-groups over the fragmentation group, and every figure recomputed with the geometry of
`canzona.schedules.fsdp`. Called by `validate.schedule_problem` after the request and parameter
checks; raises `checks.Problem` like the other rules.
"""

from __future__ import annotations

from canzona.schedules.checks import check_group, expect, fail
from canzona.schedules.costs import BUILT_IN_COSTS, adamw_cost
from canzona.schedules.fsdp import (
    FSDP_BASELINES,
    FsdpLayout,
    dp_loads,
    fragment_traffic,
    padding_ratio,
    shard_elements,
)
from canzona.schedules.geometry import GRAD_BYTES_PER_ELEMENT
from canzona.schedules.limits import ADAMW, HOSTED, MATRIX, REPLICATED_UPDATE
from canzona.schedules.models import ParamEntry, Schedule
from canzona.schedules.validate_devices import adamw_bytes, check_device_balance
from canzona.schedules.validate_metrics import (
    check_baselines,
    check_lengths,
    check_modes,
    check_records,
    check_score,
    param_states,
)


def check_fsdp(schedule: Schedule) -> None:
    """Every FSDP rule: buffers, the micro-groups, the figures."""
    section = schedule.dp
    if section.buckets or section.expert_buckets or section.adamw_buckets:
        fail("an FSDP schedule has no DP buckets (FSDP2 shards and reduces every parameter itself)")
    for e in schedule.params:
        if e.bucket or e.offset or (e.optimizer == MATRIX and e.owner != 0):
            fail(
                f"parameter {e.name!r}: in an FSDP schedule bucket and offset are 0 and a matrix's owner is 0 "
                "(its fragmentation group)"
            )
        if e.grad_reduce is not None:
            fail(f"parameter {e.name!r}: FSDP schedules have no grad_reduce (FSDP2 sums TP-partial gradients itself)")
    req = schedule.request
    layout = FsdpLayout.of(req.tp, req.dp, req.dp_replicate)
    hosts = _check_groups(schedule, layout)
    _check_metrics(schedule, layout, hosts)
    check_records(schedule)


def _check_groups(schedule: Schedule, layout: FsdpLayout) -> dict[str, int]:
    """The tp section: one plan (DP rank 0) whose groups list every matrix once, hosted by a
    fragment rank. Returns each matrix's host."""
    req, ranks = schedule.request, schedule.tp.ranks
    if schedule.tp.mode != req.tp_mode or schedule.tp.group_bytes != req.group_bytes:
        fail("the tp section's mode and group_bytes must be the request's tp_mode and group_bytes")
    if schedule.tp.update != HOSTED or req.tp_update == REPLICATED_UPDATE:
        fail("FSDP plans host every matrix on one device: the tp update must be hosted")
    if [plan.dp_rank for plan in ranks] != [0]:
        fail("the tp section of an FSDP schedule holds one plan (dp_rank 0) for every fragmentation group")
    entries = {e.name: e for e in schedule.params if e.optimizer == MATRIX}
    hosts: dict[str, int] = {}
    for position, group in enumerate(ranks[0].groups):
        where = f"tp section group {position}"
        if group.index != position or not group.params:
            fail(f"{where}: groups must be numbered 0, 1, ... and hold at least one matrix")
        if len(group.params) != len(group.hosts) or any(h >= layout.hosts for h in group.hosts):
            fail(f"{where}: hosts must be fragment ranks (shards x TP = {layout.hosts}), one per parameter")
        if any(name not in entries or name in hosts for name in group.params):
            fail(f"{where}: lists a parameter that is not a matrix of the schedule, or one already listed")
        if group.teams:
            fail(f"{where}: FSDP plans host every matrix on one device (no cooperative teams)")
        hosts.update(zip(group.params, group.hosts))
        check_group(where, group, entries, layout.hosts, req.group_bytes, req.tp_mode, req.optimizer.name)
    if len(hosts) != len(entries):
        fail("tp section: the groups must list every matrix exactly once")
    return hosts


def _per_fragment(
    schedule: Schedule, layout: FsdpLayout, hosts: dict[str, int], values: dict[str, float]
) -> list[float]:
    """Per fragment rank, the sum of `values` of the matrices it hosts."""
    out = [0.0] * layout.hosts
    for e in schedule.params:
        if e.optimizer == MATRIX:
            out[hosts[e.name]] += values[e.name]
    return out


def _check_metrics(schedule: Schedule, layout: FsdpLayout, hosts: dict[str, int]) -> None:
    req, m = schedule.request, schedule.metrics.dp
    check_lengths(schedule)
    if m.method != "fsdp":
        fail("metrics.dp.method of an FSDP schedule is fsdp")
    matrices: list[ParamEntry] = [e for e in schedule.params if e.optimizer == MATRIX]
    hosted = _per_fragment(schedule, layout, hosts, {e.name: e.cost for e in matrices})
    loads = dp_loads(hosted, layout)
    for rank, (recorded, derived) in enumerate(zip(m.load, loads)):
        expect(f"metrics.dp.load[{rank}]", recorded, derived, f"the matrices DP rank {rank}'s devices host")
    costs = [e.cost for e in matrices]
    bound = max(sum(costs) / layout.shards, max(costs, default=0.0))
    expect("metrics.dp.lower_bound", m.lower_bound, bound, "max(total / shards, largest matrix)")
    check_score("metrics.dp", m, bound, sum(loads))
    check_baselines(schedule, _baselines(matrices, layout), {name: None for name in FSDP_BASELINES})
    held = shard_elements([(e.shape, e.tp_dim) for e in matrices], layout)
    if list(m.slice_bytes) != [GRAD_BYTES_PER_ELEMENT * held[d % layout.shards] for d in range(req.dp)]:
        fail("metrics.dp.slice_bytes disagree with the FSDP shards of the matrices")
    real = sum(e.numel for e in matrices)
    padded = sum(padding_ratio(e.shape, e.tp_dim, layout) * e.numel for e in matrices)
    expect(
        "metrics.dp.padding_overhead", m.padding_overhead, padded / real if real else 1.0, "the matrices' FSDP2 padding"
    )
    expect(
        "metrics.dp.max_padding_overhead",
        m.max_padding_overhead,
        max((padding_ratio(e.shape, e.tp_dim, layout) for e in matrices), default=1.0),
        "the largest FSDP2 padding",
    )
    _check_tp_metrics(schedule, layout, costs)
    _check_devices(schedule, layout, hosts, hosted)


def _baselines(matrices: list[ParamEntry], layout: FsdpLayout) -> dict[str, list[float]]:
    """Every device gathers and updates every matrix (`redundant`), or matrix i of the
    registration order is hosted by fragment rank i mod (shards x TP) (`round_robin`)."""
    redundant = [layout.tp * sum(e.cost for e in matrices)] * layout.dp
    hosted = [0.0] * layout.hosts
    for position, e in enumerate(sorted(matrices, key=lambda entry: entry.index)):
        hosted[position % layout.hosts] += e.cost
    return dict(zip(FSDP_BASELINES, (redundant, dp_loads(hosted, layout))))


def _check_tp_metrics(schedule: Schedule, layout: FsdpLayout, costs: list[float]) -> None:
    m, groups = schedule.metrics.tp, schedule.tp.ranks[0].groups
    span = sum(g.makespan for g in groups)
    work = sum(sum(g.host_loads) for g in groups)
    check_modes(
        schedule,
        {
            "num_groups": float(len(groups)),
            "critical_time": span,
            "efficiency": work / (layout.hosts * span) if span else 1.0,
            "max_saturation": max((g.saturation for g in groups), default=0.0),
        },
    )
    if m.cooperative:
        fail("metrics.tp.cooperative: FSDP plans have no cooperative teams")
    bound = max(sum(costs) / layout.hosts, max(costs)) if costs else 0.0
    expect("metrics.tp.critical_lower_bound", m.critical_lower_bound, bound, "max(cost / (shards x TP), largest task)")


def _check_devices(schedule: Schedule, layout: FsdpLayout, hosts: dict[str, int], hosted: list[float]) -> None:
    req, devices = schedule.request, schedule.metrics.device
    world = req.tp * req.dp
    if [(d.rank, d.dp_rank, d.tp_rank) for d in devices] != [(r, r // req.tp, r % req.tp) for r in range(world)]:
        fail(f"metrics.device must list ranks 0..{world - 1} as dp_rank * tp + tp_rank, in order")
    if any(d.load < 0 or d.state_bytes < 0 for d in devices):
        fail("metrics.device: loads and state bytes must be non-negative")
    if any(d.peak_bytes is not None for d in devices):
        fail("metrics.device: peak_bytes is predicted for CanzonaOptimizer plans, not for FSDP ones")
    _check_memory(schedule, layout, hosts)
    matrices = [e for e in schedule.params if e.optimizer == MATRIX]
    traffic = fragment_traffic([(e.shape, e.tp_dim, hosts[e.name]) for e in matrices], layout)
    adamw = schedule.metrics.dp.adamw_load
    for d in devices:
        fragment = layout.fragment_of(d.rank)
        if req.cost in BUILT_IN_COSTS:
            expect(
                f"metrics.device[{d.rank}].load",
                d.load,
                hosted[fragment] + adamw[d.dp_rank] / req.tp,
                "its hosted matrices plus its share of metrics.dp.adamw_load",
            )
        if (d.bytes_sent, d.bytes_received) != traffic[fragment]:
            fail(
                f"metrics.device[{d.rank}]: bytes sent and received are {d.bytes_sent} and {d.bytes_received}, but the "
                f"gather and scatter of its fragmentation group move {traffic[fragment][0]} and {traffic[fragment][1]}"
            )
    check_device_balance(schedule, [d.load for d in devices], max((e.cost for e in matrices), default=0.0))


def _check_memory(schedule: Schedule, layout: FsdpLayout, hosts: dict[str, int]) -> None:
    """State bytes per DP rank and per device (hosted matrices plus AdamW pieces) and, for
    built-in cost models, the AdamW loads."""
    req, m, devices = schedule.request, schedule.metrics.dp, schedule.metrics.device
    state = _per_fragment(schedule, layout, hosts, param_states(schedule))
    elements = shard_elements([(e.shape, e.tp_dim) for e in schedule.params if e.optimizer == ADAMW], layout)
    per_element = adamw_bytes(schedule)
    dp_state = dp_loads(state, layout)
    for d in range(req.dp):
        shard = d % layout.shards
        expect(
            f"metrics.dp.state_bytes[{d}]",
            m.state_bytes[d],
            dp_state[d] + layout.tp * per_element * elements[shard],
            "the state of the matrices its devices host and of their AdamW pieces",
        )
        if req.cost in BUILT_IN_COSTS:
            expect(
                f"metrics.dp.adamw_load[{d}]",
                m.adamw_load[d],
                layout.tp * adamw_cost(req.cost, elements[shard]),
                f"the {req.cost} cost of its devices' AdamW pieces",
            )
    for device in devices:
        fragment = layout.fragment_of(device.rank)
        expect(
            f"metrics.device[{device.rank}].state_bytes",
            device.state_bytes,
            state[fragment] + per_element * elements[layout.shard_of(fragment)],
            "the state of its hosted matrices and of its AdamW pieces",
        )
