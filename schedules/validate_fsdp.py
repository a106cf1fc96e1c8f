"""The validator's rules for FSDP schedules (`request.sharding: fsdp`): no buffers, one plan of
micro-groups over the fragmentation group, and every metric recomputed with the geometry of
`canzona.schedules.fsdp`. Called by `validate.schedule_problem` after the request and parameter
checks; raises the validator's internal problem like the other rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from canzona.schedules.fsdp import FsdpLayout, dp_loads, padding_ratio, shard_numel
from canzona.schedules.geometry import GRAD_BYTES_PER_ELEMENT
from canzona.schedules.limits import MATRIX
from canzona.schedules.validate import LINEAR_ADAMW_COSTS, _check_group, _check_score, _expect, _fail

if TYPE_CHECKING:
    from canzona.schedules.format import ParamEntry, Schedule


def check_fsdp(schedule: Schedule) -> None:
    """Every FSDP rule: buffers, the micro-groups, the metrics."""
    section = schedule.dp
    if section.buckets or section.expert_buckets or section.adamw_buckets:
        _fail("an FSDP schedule has no DP buckets (FSDP2 shards and reduces every parameter itself)")
    for e in schedule.params:
        if e.bucket or e.offset or (e.optimizer == MATRIX and e.owner != 0):
            _fail(f"parameter {e.name!r}: in an FSDP schedule bucket and offset are 0 and a matrix's owner is 0 "
                  "(its fragmentation group)")
    req = schedule.request
    layout = FsdpLayout.of(req.tp, req.dp, req.dp_replicate)
    hosted = _check_groups(schedule, layout)
    _check_metrics(schedule, layout, hosted)


def _check_groups(schedule: Schedule, layout: FsdpLayout) -> list[float]:
    """The tp section: one plan (DP rank 0) whose groups list every matrix once, hosted by a
    fragment rank. Returns each fragment rank's hosted cost."""
    req, ranks = schedule.request, schedule.tp.ranks
    if schedule.tp.mode != req.tp_mode or schedule.tp.group_bytes != req.group_bytes:
        _fail("the tp section's mode and group_bytes must be the request's tp_mode and group_bytes")
    if [plan.dp_rank for plan in ranks] != [0]:
        _fail("the tp section of an FSDP schedule holds one plan (dp_rank 0) for every fragmentation group")
    entries = {e.name: e for e in schedule.params if e.optimizer == MATRIX}
    listed: list[str] = []
    hosted = [0.0] * layout.hosts
    for position, group in enumerate(ranks[0].groups):
        where = f"tp section group {position}"
        if group.index != position or not group.params:
            _fail(f"{where}: groups must be numbered 0, 1, ... and hold at least one matrix")
        if len(group.params) != len(group.hosts) or any(h >= layout.hosts for h in group.hosts):
            _fail(f"{where}: hosts must be fragment ranks (shards x TP = {layout.hosts}), one per parameter")
        if any(name not in entries for name in group.params):
            _fail(f"{where}: lists a parameter that is not a matrix of the schedule")
        if group.teams:
            _fail(f"{where}: FSDP plans host every matrix on one device (no cooperative teams)")
        listed += group.params
        _check_group(where, group, entries, layout.hosts, req.group_bytes, req.tp_mode, req.optimizer.name)
        for name, host in zip(group.params, group.hosts):
            hosted[host] += entries[name].cost
    if len(listed) != len(set(listed)) or set(listed) != set(entries):
        _fail("tp section: the groups must list every matrix exactly once")
    return hosted


def _check_metrics(schedule: Schedule, layout: FsdpLayout, hosted: list[float]) -> None:
    req, m = schedule.request, schedule.metrics.dp
    for label, values in (("load", m.load), ("slice_bytes", m.slice_bytes), ("state_bytes", m.state_bytes),
                          ("adamw_load", m.adamw_load)):
        if len(values) != req.dp or min(values) < 0:
            _fail(f"metrics.dp.{label} must hold {req.dp} non-negative values, one per DP rank")
    loads = dp_loads(hosted, layout)
    for rank, (recorded, derived) in enumerate(zip(m.load, loads)):
        _expect(f"metrics.dp.load[{rank}]", recorded, derived, f"the matrices DP rank {rank}'s devices host")
    matrices: list[ParamEntry] = [e for e in schedule.params if e.optimizer == MATRIX]
    costs = [e.cost for e in matrices]
    bound = max(sum(costs) / layout.shards, max(costs, default=0.0))
    _expect("metrics.dp.lower_bound", m.lower_bound, bound, "max(total / shards, largest matrix)")
    total = sum(loads)
    _check_score("metrics.dp", m, bound, total)
    for name, score in m.baselines.items():
        if len(score.load) != req.dp or min(score.load) < 0:
            _fail(f"metrics.dp.baselines.{name}.load must hold {req.dp} non-negative values")
        _check_score(f"metrics.dp.baselines.{name}", score, bound, total)
    slice_bytes = [GRAD_BYTES_PER_ELEMENT * sum(shard_numel(e.shape, e.tp_dim, layout, (d % layout.shards) * layout.tp)
                                                for e in matrices) for d in range(req.dp)]
    if list(m.slice_bytes) != slice_bytes:
        _fail("metrics.dp.slice_bytes disagree with the FSDP shards of the matrices")
    real = sum(e.numel for e in matrices)
    padded = sum(padding_ratio(e.shape, e.tp_dim, layout) * e.numel for e in matrices)
    _expect("metrics.dp.padding_overhead", m.padding_overhead, padded / real if real else 1.0,
            "the matrices' FSDP2 padding")
    _expect("metrics.dp.max_padding_overhead", m.max_padding_overhead,
            max((padding_ratio(e.shape, e.tp_dim, layout) for e in matrices), default=1.0), "the largest FSDP2 padding")
    _check_tp_metrics(schedule, layout, costs)
    _check_devices(schedule, layout, hosted)


def _check_tp_metrics(schedule: Schedule, layout: FsdpLayout, costs: list[float]) -> None:
    req, m, groups = schedule.request, schedule.metrics.tp, schedule.tp.ranks[0].groups
    span = sum(g.makespan for g in groups)
    work = sum(sum(g.host_loads) for g in groups)
    chosen = {
        "num_groups": float(len(groups)),
        "critical_time": span,
        "efficiency": work / (layout.hosts * span) if span else 1.0,
        "max_saturation": max((g.saturation for g in groups), default=0.0),
    }
    if m.mode != req.tp_mode or req.tp_mode not in m.modes:
        _fail("metrics.tp.mode must be the request's tp_mode, with an entry in metrics.tp.modes")
    for key, derived in chosen.items():
        _expect(f"metrics.tp.{key}", float(getattr(m, key)), derived, "the tp section")
    for key in (*chosen, "worst_device_load", "device_imbalance"):
        _expect(f"metrics.tp.modes.{req.tp_mode}.{key}", float(getattr(m.modes[req.tp_mode], key)), float(getattr(m, key)),
                f"metrics.tp.{key}")
    bound = max(sum(costs) / layout.hosts, max(costs)) if costs else 0.0
    _expect("metrics.tp.critical_lower_bound", m.critical_lower_bound, bound, "max(cost / (shards x TP), largest task)")
    for mode, score in m.modes.items():
        if score.device_imbalance < 1 - 1e-9 or not 0 <= score.efficiency <= 1 + 1e-9:
            _fail(f"metrics.tp.modes.{mode}: device_imbalance must be >= 1 and efficiency in [0, 1]")


def _check_devices(schedule: Schedule, layout: FsdpLayout, hosted: list[float]) -> None:
    req, devices, m = schedule.request, schedule.metrics.device, schedule.metrics.tp
    world = req.tp * req.dp
    if [(d.rank, d.dp_rank, d.tp_rank) for d in devices] != [(r, r // req.tp, r % req.tp) for r in range(world)]:
        _fail(f"metrics.device must list ranks 0..{world - 1} as dp_rank * tp + tp_rank, in order")
    if any(d.load < 0 or d.state_bytes < 0 for d in devices):
        _fail("metrics.device: loads and state bytes must be non-negative")
    if req.cost in LINEAR_ADAMW_COSTS:
        adamw = schedule.metrics.dp.adamw_load
        for d in devices:
            _expect(f"metrics.device[{d.rank}].load", d.load, hosted[layout.fragment_of(d.rank)] + adamw[d.dp_rank] / req.tp,
                    "its hosted matrices plus its share of metrics.dp.adamw_load")
    loads = [d.load for d in devices]
    mean = sum(loads) / len(loads)
    _expect("metrics.tp.worst_device_load", m.worst_device_load, max(loads), "metrics.device")
    _expect("metrics.tp.device_imbalance", m.device_imbalance, max(loads) / mean if mean else 1.0, "metrics.device")

