"""The validator's rules for a replicated (ZeRO-1) schedule's per-device figures
(`metrics.device`): each device's load, optimizer state, predicted peak memory and traffic under
the schedule's TP update (its micro-groups, or a replicated update), and the device balance
figures of `metrics.tp` that follow from them. `check_device_balance` serves FSDP files too.
Raises `checks.Problem` like the other rules.
"""

from __future__ import annotations

from math import prod
from typing import Any

from canzona.schedules.checks import REL_TOL, close, dp_rank_of, expect, fail
from canzona.schedules.costs import (
    BUILT_IN_COSTS,
    adamw_bytes_per_element,
    predicted_peak_bytes,
    tp_transient_bytes,
)
from canzona.schedules.figures import bucket_traffic, micro_group_traffic, replicated_update_traffic
from canzona.schedules.geometry import DTYPE_BYTES, GRAD_BYTES_PER_ELEMENT
from canzona.schedules.limits import ADAMW, HOSTED, MATRIX
from canzona.schedules.models import ParamEntry, Schedule
from canzona.schedules.teams import placements


def adamw_bytes(schedule: Schedule) -> int:
    """State bytes per element of an AdamW slice (two moments, and a main copy if any AdamW
    parameter is bf16/fp16)."""
    return adamw_bytes_per_element([e.dtype for e in schedule.params if e.optimizer == ADAMW])


def _owned(schedule: Schedule) -> list[list[ParamEntry]]:
    """Per DP rank, the matrices it owns (its micro-groups' or its replicated update's)."""
    owned: list[list[ParamEntry]] = [[] for _ in range(schedule.request.dp)]
    for e in schedule.params:
        if e.optimizer == MATRIX:
            owned[dp_rank_of(e, schedule.request.ep)].append(e)
    return owned


def _hosted(schedule: Schedule, states: dict[str, float]) -> tuple[list[float], list[float]]:
    """Per device (dp_rank · tp + tp_rank): the summed load and state of the matrices it
    updates (a team member: its share; under a replicated update, every matrix of its DP rank)."""
    tp = schedule.request.tp
    load, state = [0.0] * (tp * schedule.request.dp), [0.0] * (tp * schedule.request.dp)
    if schedule.tp.update != HOSTED:
        for dp_rank, entries in enumerate(_owned(schedule)):
            for device in range(dp_rank * tp, (dp_rank + 1) * tp):
                load[device] = sum(e.cost for e in entries)
                state[device] = sum(states[e.name] for e in entries)
        return load, state
    for plan in schedule.tp.ranks:
        for group in plan.groups:
            for host, value in enumerate(group.host_loads):
                load[plan.dp_rank * tp + host] += value
            teams = {team.param: team.hosts for team in group.teams}
            for name, host in zip(group.params, group.hosts):
                members = teams.get(name, (host,))
                for member in members:
                    state[plan.dp_rank * tp + member] += states[name] / len(members)
    return load, state


def device_traffic(schedule: Schedule, legacy: bool = False) -> list[tuple[int, int]]:
    """Every device's (sent, received) bytes per step: its DP rank's share of every bucket's
    reduction and gather, and its TP rank's part of the TP update (`_tp_traffic`). `legacy`: a
    bucket that records no collective is counted as files from before per-bucket collectives
    counted every bucket (`_collective`)."""
    req, section = schedule.request, schedule.dp
    first: dict[tuple[str, int], str] = {}  # the dtype a bucket's parameters are gathered in: its first member's
    for e in schedule.params:
        kind = "adamw" if e.optimizer == ADAMW else "dense" if e.ep_rank is None else "expert" if e.ep_rank == 0 else ""
        if e.offset == 0 and kind:
            first[(kind, e.bucket)] = e.dtype
    sent, received = [0] * req.dp, [0] * req.dp
    for kind, buckets in (
        ("dense", section.buckets),
        ("expert", section.expert_buckets),
        ("adamw", section.adamw_buckets),
    ):
        for bucket in buckets:
            pairs = bucket_traffic(
                bucket.numel, bucket.cuts, DTYPE_BYTES[first[(kind, bucket.index)]], _collective(bucket, legacy)
            )
            if kind == "expert":  # an expert-DP rank's share is that of each of its DP ranks (dp_rank // ep)
                pairs = [pairs[rank // req.ep] for rank in range(req.dp)]
            sent = [a + b for a, (b, _) in zip(sent, pairs)]
            received = [a + b for a, (_, b) in zip(received, pairs)]
    out = []
    for dp_rank, moved in enumerate(_tp_traffic(schedule)):
        out += [(sent[dp_rank] + s, received[dp_rank] + r) for s, r in moved]
    return out


def _tp_traffic(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per DP rank, each TP rank's (sent, received) bytes of the TP update: the micro-group
    all-to-alls, or a replicated update's all-gather."""
    req = schedule.request
    if schedule.tp.update != HOSTED:
        return [
            replicated_update_traffic(
                ((GRAD_BYTES_PER_ELEMENT * prod(e.shape), e.tp_dim is None) for e in owned), req.tp
            )
            for owned in _owned(schedule)
        ]
    shapes = {e.name: (prod(e.shape), e.tp_dim is None) for e in schedule.params}
    out = []
    for plan in schedule.tp.ranks:
        parts = []
        for group in plan.groups:
            teams = {team.param: team.hosts for team in group.teams}
            for name, host in zip(group.params, group.hosts):
                members = teams.get(name, [host])
                parts += [
                    (member, GRAD_BYTES_PER_ELEMENT * shapes[name][0], len(members), shapes[name][1])
                    for member in members
                ]
        out.append(micro_group_traffic(parts, req.tp))
    return out


def _collective(bucket: Any, legacy: bool) -> str:
    """The collective a bucket's traffic is counted in: the one it records (absent: the
    default, "rooted"); AdamW buckets are cut equally, where every form moves the same. Under
    `legacy` an absent one counts as every other rank's slice moved ("all_to_all"'s count), as
    files written before buckets recorded a collective counted it."""
    if legacy and "collective" not in bucket.model_fields_set:
        return "all_to_all"
    return str(getattr(bucket, "collective", "ring"))


def check_devices(schedule: Schedule, states: dict[str, float], adamw: list[list[int]]) -> None:
    """Every device's load, state, predicted peak and traffic (`metrics.device`), and the TP
    figures derived from the device loads; `states`: each parameter's state bytes; `adamw`:
    per AdamW bucket, each DP rank's slice elements."""
    req, devices = schedule.request, schedule.metrics.device
    if [(d.rank, d.dp_rank, d.tp_rank) for d in devices] != [
        (r, r // req.tp, r % req.tp) for r in range(req.tp * req.dp)
    ]:
        fail(f"metrics.device must list ranks 0..{req.tp * req.dp - 1} as dp_rank * tp + tp_rank, in order")
    if any(d.load < 0 or d.state_bytes < 0 for d in devices):
        fail("metrics.device: loads and state bytes must be non-negative")
    hosted, held = _hosted(schedule, states)
    elements = [0] * req.dp
    for sizes in adamw:
        for rank, size in enumerate(sizes):
            elements[rank] += size
    per_element, traffic = adamw_bytes(schedule), device_traffic(schedule)
    if any((d.bytes_sent, d.bytes_received) != traffic[d.rank] for d in devices):
        legacy = device_traffic(schedule, legacy=True)
        if all((d.bytes_sent, d.bytes_received) == legacy[d.rank] for d in devices):
            traffic = legacy
    sizes = [b.numel for b in (*schedule.dp.buckets, *schedule.dp.expert_buckets)]
    sizes += [b.numel for b in schedule.dp.adamw_buckets]
    buffer, largest = sum(sizes), max(sizes, default=0)
    owned = [sum(prod(e.shape) for e in entries) for entries in _owned(schedule)]
    for d in devices:
        if req.cost in BUILT_IN_COSTS:
            expect(
                f"metrics.device[{d.rank}].load",
                d.load,
                hosted[d.rank] + schedule.metrics.dp.adamw_load[d.dp_rank] / req.tp,
                "its hosted matrices plus its share of metrics.dp.adamw_load",
            )
        expect(
            f"metrics.device[{d.rank}].state_bytes",
            d.state_bytes,
            held[d.rank] + per_element * elements[d.dp_rank],
            "the state of the matrices it updates (a team member: its share) and of its AdamW slice",
        )
        if d.peak_bytes is not None:
            expect(
                f"metrics.device[{d.rank}].peak_bytes",
                d.peak_bytes,
                predicted_peak_bytes(
                    d.state_bytes,
                    buffer,
                    largest,
                    tp_transient_bytes(schedule.tp.update, req.group_bytes, owned[d.dp_rank]),
                    req.dp,
                ),
                "the bucket buffer, its state and a step's transients",
            )
        if (d.bytes_sent, d.bytes_received) != traffic[d.rank]:
            fail(
                f"metrics.device[{d.rank}]: bytes sent and received are {d.bytes_sent} and {d.bytes_received}, but its "
                f"buckets' collectives and micro-groups move {traffic[d.rank][0]} and {traffic[d.rank][1]}"
            )
    _check_device_bound(schedule, [d.load for d in devices])


def _largest_piece(schedule: Schedule) -> float:
    entries = {e.name: e for e in schedule.params}
    return max(
        (cost for plan in schedule.tp.ranks for g in plan.groups for _, cost, _ in placements(g, entries)), default=0.0
    )


def _device_figures(schedule: Schedule, loads: list[float]) -> tuple[float, float] | None:
    """worst_device_load and device_imbalance from the device loads; the file's
    (device_lower_bound, device_gap), or None when it records no device lower bound (the two
    come together)."""
    m = schedule.metrics.tp
    mean = sum(loads) / len(loads)
    expect("metrics.tp.worst_device_load", m.worst_device_load, max(loads), "metrics.device")
    expect("metrics.tp.device_imbalance", m.device_imbalance, max(loads) / mean if mean else 1.0, "metrics.device")
    bound, gap = m.device_lower_bound, m.device_gap
    if bound is None or gap is None:
        if (bound, gap) != (None, None):
            fail("metrics.tp: device_lower_bound and device_gap come together")
        return None
    return bound, gap


def _check_device_bound(schedule: Schedule, loads: list[float]) -> None:
    """worst_device_load and device_imbalance from the device loads; device_lower_bound lies
    between what the file alone proves (the mean of the matrices' own work plus every device's
    AdamW, the largest AdamW load) and the worst device (no plan beats the bound, this one
    included); device_gap from it. (The bound also counts the smallest share a team can give
    each matrix, which the planner prices; `canzona check` regenerates it exactly.) Files
    written before the plan-independent bound recorded max(mean, largest hosted piece)."""
    m, req = schedule.metrics.tp, schedule.request
    mean = sum(loads) / len(loads)
    figures = _device_figures(schedule, loads)
    if figures is None:
        return
    bound, gap = figures
    adamw = [schedule.metrics.dp.adamw_load[d.dp_rank] / req.tp for d in schedule.metrics.device]
    work = sum(e.cost for e in schedule.params if e.optimizer == MATRIX)
    floor = max((work + sum(adamw)) / len(adamw), max(adamw)) if req.cost in BUILT_IN_COSTS else 0.0
    if not floor * (1 - REL_TOL) <= bound <= m.worst_device_load * (1 + REL_TOL):
        former = max(mean, _largest_piece(schedule))
        if not close(bound, former):
            fail(
                f"metrics.tp.device_lower_bound {bound!r} is not between the mean work per device {floor!r} and "
                f"the worst device load {m.worst_device_load!r}"
            )
    expect(
        "metrics.tp.device_gap",
        gap,
        m.worst_device_load / bound - 1 if bound else 0.0,
        "metrics.tp.worst_device_load / device_lower_bound - 1",
    )


def check_device_balance(schedule: Schedule, loads: list[float], largest: float) -> None:
    """worst_device_load and device_imbalance from the device loads; device_lower_bound =
    max(mean device load, `largest` piece: a matrix, or a team member's share); device_gap."""
    m = schedule.metrics.tp
    mean = sum(loads) / len(loads)
    figures = _device_figures(schedule, loads)
    if figures is None:
        return
    recorded_bound, gap = figures
    bound = max(mean, largest)
    expect(
        "metrics.tp.device_lower_bound",
        recorded_bound,
        bound,
        "max(mean of metrics.device loads, largest piece hosted in the tp section)",
    )
    expect(
        "metrics.tp.device_gap",
        gap,
        m.worst_device_load / bound - 1 if bound else 0.0,
        "metrics.tp.worst_device_load / device_lower_bound - 1",
    )
