"""The validator's rules for the figures a replicated (ZeRO-1) schedule records, each
recomputed from the file's parameters, buffers, micro-groups and request: loads, bounds and
gaps, padding, slice and state bytes, AdamW loads, the baselines, the chosen TP mode's figures,
every device's figures (`canzona.schedules.validate_devices`), and what the solver and the
automatic searches report (`check_records`, shared with FSDP files). Called by `validate.schedule_problem` after the
buffer and micro-group rules; raises `checks.Problem` like the other rules.
"""

from __future__ import annotations

import re
from math import prod
from typing import Any

from canzona.schedules.bounds import dp_lower_bound
from canzona.schedules.checks import REL_TOL, close, dp_rank_of, expect, fail
from canzona.schedules.costs import (
    BUILT_IN_COSTS,
    adamw_cost,
    param_state_bytes,
)
from canzona.schedules.figures import (
    BASELINE_PADDING,
    Member,
    baseline_loads,
)
from canzona.schedules.geometry import (
    PARAM_ALIGNMENT,
    padded_bucket_numel,
    round_up,
    slice_sizes,
)
from canzona.schedules.limits import ADAMW, MATRIX, TP_MODES
from canzona.schedules.models import ParamEntry, Schedule, StrategyScore
from canzona.schedules.searches import DEFAULT_ALPHAS, DEFAULT_BUCKET_SIZES, alpha_winner, bucket_winner
from canzona.schedules.splits import as_blocks, submatrices
from canzona.schedules.teams import placements
from canzona.schedules.validate_devices import adamw_bytes, check_devices

CP_SAT_STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "MODEL_INVALID", "UNKNOWN", "SKIPPED")
_METHOD = re.compile(r"[a-z0-9+(). -]{1,200}")  # the partition methods' labels (dp.py, free_order.py, plan.py)


def check_metrics(schedule: Schedule) -> None:
    """Every figure of a replicated schedule."""
    req = schedule.request
    loads = [0.0] * req.dp
    dense_costs, expert_loads = [], [0.0] * req.dp
    for e in schedule.params:
        if e.optimizer == MATRIX:
            rank = dp_rank_of(e, req.ep)
            loads[rank] += e.cost
            if e.ep_rank is None:
                dense_costs.append(e.cost)
            else:
                expert_loads[rank] += e.cost
    _check_dp_metrics(schedule, loads, dense_costs, expert_loads)
    states = param_states(schedule)
    adamw = _adamw_elements(schedule)
    _check_memory(schedule, states, adamw)
    check_baselines(schedule, _baselines(schedule))
    _check_tp_metrics(schedule)
    check_devices(schedule, states, adamw)
    check_records(schedule)


def param_states(schedule: Schedule) -> dict[str, float]:
    """Every parameter's optimizer state bytes, recomputed from its shape, dtype, row blocks and
    the request's optimizer settings."""
    known: dict[tuple[Any, ...], float] = {}
    out = {}
    for e in schedule.params:
        subs = () if e.optimizer == ADAMW else tuple(submatrices(e.shape, as_blocks(e.row_blocks)))
        key = (e.dtype, tuple(e.shape), subs)
        if key not in known:
            known[key] = param_state_bytes(prod(e.shape), e.dtype, subs, schedule.request.optimizer)
        out[e.name] = known[key]
    return out


def _adamw_elements(schedule: Schedule) -> list[list[int]]:
    """Per AdamW bucket, every DP rank's slice size (the cuts are the stock equal split)."""
    return [slice_sizes(bucket.cuts) for bucket in schedule.dp.adamw_buckets]


def check_lengths(schedule: Schedule) -> None:
    """Per-DP-rank figures hold one non-negative value per DP rank."""
    req, m = schedule.request, schedule.metrics.dp
    for label, values in (
        ("load", m.load),
        ("slice_bytes", m.slice_bytes),
        ("state_bytes", m.state_bytes),
        ("adamw_load", m.adamw_load),
    ):
        if len(values) != req.dp or min(values) < 0:
            fail(f"metrics.dp.{label} must hold {req.dp} non-negative values, one per DP rank")
    if not _METHOD.fullmatch(m.method):
        fail(f"metrics.dp.method {m.method[:40]!r} is not a partition method's label")


def _check_dp_metrics(
    schedule: Schedule, loads: list[float], dense_costs: list[float], expert_loads: list[float]
) -> None:
    req, m = schedule.request, schedule.metrics.dp
    check_lengths(schedule)
    for rank, (recorded, derived) in enumerate(zip(m.load, loads)):
        expect(f"metrics.dp.load[{rank}]", recorded, derived, f"the costs of the matrices DP rank {rank} owns")
    total = sum(loads)
    bound = dp_lower_bound([e.cost for e in schedule.params if e.optimizer == MATRIX], req.dp)
    if not close(m.lower_bound, bound):
        # Files written before the plan-independent bound recorded the partition's own one.
        base = expert_loads if req.ep > 1 else [0.0] * req.dp
        former = max(total / req.dp, max(dense_costs, default=0.0) + min(base), max(base))
        expect(
            "metrics.dp.lower_bound",
            m.lower_bound,
            former if close(m.lower_bound, former) else bound,
            "the pairing bound of every matrix's cost over D ranks",
        )
    check_score("metrics.dp", m, m.lower_bound, total)
    section = schedule.dp
    slice_bytes = [0] * req.dp
    for bucket in section.buckets:
        for rank in range(req.dp):
            slice_bytes[rank] += bucket.slice_bytes[rank]
    for bucket in section.expert_buckets:
        for rank in range(req.dp):
            slice_bytes[rank] += bucket.slice_bytes[rank // req.ep]
    if list(m.slice_bytes) != slice_bytes:
        fail("metrics.dp.slice_bytes disagree with the buckets' slice_bytes")
    matrix_buckets = [(b, req.dp) for b in section.buckets] + [(b, req.dp // req.ep) for b in section.expert_buckets]
    padded = sum(b.numel for b, _ in matrix_buckets)
    worst = sum(ranks * max(slice_sizes(b.cuts)) for b, ranks in matrix_buckets)
    expect(
        "metrics.dp.padding_overhead",
        m.padding_overhead,
        (worst / padded if padded else 1.0) or 1.0,
        "the buckets' D x largest slice / padded size",
    )
    expect(
        "metrics.dp.max_padding_overhead",
        m.max_padding_overhead,
        max((b.padding_overhead for b, _ in matrix_buckets), default=1.0),
        "the largest bucket padding_overhead",
    )


def _check_memory(schedule: Schedule, states: dict[str, float], adamw: list[list[int]]) -> None:
    """metrics.dp.state_bytes (the matrices a DP rank owns, and its TP group's AdamW slices)
    and, for built-in cost models, metrics.dp.adamw_load."""
    req, m = schedule.request, schedule.metrics.dp
    state = [0.0] * req.dp
    for e in schedule.params:
        if e.optimizer == MATRIX:
            state[dp_rank_of(e, req.ep)] += states[e.name]
    per_element, work = adamw_bytes(schedule), [0.0] * req.dp
    for sizes in adamw:
        for rank, elements in enumerate(sizes):
            state[rank] += req.tp * per_element * elements
            work[rank] += req.tp * adamw_cost(req.cost, elements) if req.cost in BUILT_IN_COSTS else 0.0
    for rank in range(req.dp):
        expect(
            f"metrics.dp.state_bytes[{rank}]",
            m.state_bytes[rank],
            state[rank],
            "the optimizer state of the matrices it owns and of its TP group's AdamW slices",
        )
        if req.cost in BUILT_IN_COSTS:
            expect(
                f"metrics.dp.adamw_load[{rank}]",
                m.adamw_load[rank],
                work[rank],
                f"the {req.cost} cost of its TP group's AdamW slices",
            )


def _registration_layout(members: list[ParamEntry], ranks: int) -> list[tuple[int, list[Member]]]:
    """The buffer the baselines are scored on: each bucket's members packed in reverse
    registration order (what a free-order file's buckets were before the planner reordered them)."""
    by_bucket: dict[int, list[ParamEntry]] = {}
    for e in sorted(members, key=lambda entry: -entry.index):
        by_bucket.setdefault(e.bucket, []).append(e)
    layout = []
    for bucket in sorted(by_bucket):
        fill, packed = 0, []
        for e in by_bucket[bucket]:
            offset = round_up(fill, PARAM_ALIGNMENT)
            packed.append((offset, e.numel, e.cost, e.name))
            fill = offset + e.numel
        layout.append((padded_bucket_numel(fill, ranks), packed))
    return layout


def _baselines(schedule: Schedule) -> dict[str, list[float]]:
    """Every baseline's per-DP-rank loads: the dense buffer over DP, plus the expert buffer over
    the expert-DP group (one EP rank's experts; every EP rank's alike) under expert parallelism."""
    req = schedule.request
    dense = [e for e in schedule.params if e.optimizer == MATRIX and e.ep_rank is None]
    loads = baseline_loads(_registration_layout(dense, req.dp), req.dp)
    if req.ep == 1:
        return loads
    experts = [e for e in schedule.params if e.optimizer == MATRIX and e.ep_rank == 0]
    expert = baseline_loads(_registration_layout(experts, req.dp // req.ep), req.dp // req.ep)
    return {
        name: [load + expert[name][rank // req.ep] for rank, load in enumerate(values)]
        for name, values in loads.items()
    }


def check_baselines(
    schedule: Schedule, derived: dict[str, list[float]], padding: dict[str, float | None] = BASELINE_PADDING
) -> None:
    """The baselines are the strategies canzona is compared with, in order, with `derived`
    loads and `padding`; their figures follow from their loads."""
    m, dp = schedule.metrics.dp, schedule.request.dp
    if list(m.baselines) != list(derived):
        fail(f"metrics.dp.baselines must be {', '.join(derived)}, in that order")
    total = sum(m.load)
    for name, score in m.baselines.items():
        if len(score.load) != dp:
            fail(f"metrics.dp.baselines.{name}.load must hold {dp} values, one per DP rank")
        for rank, (recorded, value) in enumerate(zip(score.load, derived[name])):
            expect(f"metrics.dp.baselines.{name}.load[{rank}]", recorded, value, f"the {name} strategy on this buffer")
        if score.padding_overhead != padding[name]:
            fail(f"metrics.dp.baselines.{name}.padding_overhead must be {padding[name]} (how {name} moves gradients)")
        check_score(f"metrics.dp.baselines.{name}", score, m.lower_bound, total)


def check_score(label: str, score: StrategyScore | Any, bound: float, total: float) -> None:
    """max, mean, imbalance (>= 1), gap and (for baselines) redundancy of one load vector."""
    maximum, mean = max(score.load), sum(score.load) / len(score.load)
    expect(f"{label}.max", score.max, maximum, "its per-rank loads")
    expect(f"{label}.mean", score.mean, mean, "its per-rank loads")
    expect(f"{label}.imbalance", score.imbalance, maximum / mean if mean else 1.0, "max / mean")
    if score.imbalance < 1 - REL_TOL:
        fail(f"{label}.imbalance {score.imbalance!r} is below 1")
    expect(f"{label}.gap", score.gap, (maximum / bound if bound else 1.0) - 1.0, "max / lower_bound - 1")
    if hasattr(score, "redundancy"):
        expect(
            f"{label}.redundancy", score.redundancy, sum(score.load) / total if total else 1.0, "sum / canzona's sum"
        )


def check_modes(schedule: Schedule, chosen: dict[str, float]) -> None:
    """metrics.tp: the request's mode, its figures (`chosen`, recomputed) and its entry in
    `modes`. Other modes' entries (files written before only the chosen mode was recorded) must
    name a TP mode; readers drop them (nothing can re-check them without re-planning)."""
    req, m = schedule.request, schedule.metrics.tp
    if m.mode != req.tp_mode or req.tp_mode not in m.modes or not set(m.modes) <= set(TP_MODES):
        fail("metrics.tp.mode must be the request's tp_mode, with an entry in metrics.tp.modes (of TP modes only)")
    for key, derived in chosen.items():
        expect(f"metrics.tp.{key}", float(getattr(m, key)), derived, "the tp section")
    for key in (*(k for k in chosen if k != "cooperative"), "worst_device_load", "device_imbalance"):
        expect(
            f"metrics.tp.modes.{req.tp_mode}.{key}",
            float(getattr(m.modes[req.tp_mode], key)),
            float(getattr(m, key)),
            f"metrics.tp.{key}",
        )
    for mode, score in m.modes.items():
        if (
            min(score.critical_time, score.worst_device_load, score.max_saturation) < 0
            or score.device_imbalance < 1 - REL_TOL
            or not 0 <= score.efficiency <= 1 + REL_TOL
        ):
            fail(
                f"metrics.tp.modes.{mode}: times, loads and saturation must be >= 0, device_imbalance >= 1 and "
                "efficiency in [0, 1]"
            )


def _check_tp_metrics(schedule: Schedule) -> None:
    req, m, ranks = schedule.request, schedule.metrics.tp, schedule.tp.ranks
    costs = {e.name: e.cost for e in schedule.params}
    spans = [sum(g.makespan for g in plan.groups) for plan in ranks]
    work = sum(costs[name] for plan in ranks for g in plan.groups for name in g.params)
    check_modes(
        schedule,
        {
            "num_groups": float(sum(len(plan.groups) for plan in ranks)),
            "critical_time": max(spans, default=0.0),
            "efficiency": work / (req.tp * sum(spans)) if sum(spans) else 1.0,
            "max_saturation": max((g.saturation for plan in ranks for g in plan.groups), default=0.0),
            "cooperative": float(sum(len(g.teams) for plan in ranks for g in plan.groups)),
        },
    )
    entries = {e.name: e for e in schedule.params}
    bound = max(
        (
            max(
                sum(costs[n] for g in plan.groups for n in g.params) / req.tp,
                max(cost for g in plan.groups for _, cost, _ in placements(g, entries)),
            )
            for plan in ranks
            if plan.groups
        ),
        default=0.0,
    )
    expect(
        "metrics.tp.critical_lower_bound",
        m.critical_lower_bound,
        bound,
        "max over DP ranks of max(cost / P, largest piece: a task, or a team member's share)",
    )


def check_records(schedule: Schedule) -> None:
    """What CP-SAT and the automatic searches report (`metrics.solver`, `alpha_search`,
    `bucket_search`), against what the file's own figures and the searches' rules give."""
    _check_solver(schedule)
    _check_alpha_search(schedule)
    _check_bucket_search(schedule)


def _check_solver(schedule: Schedule) -> None:
    """The DP answer CP-SAT returned is the plan's (its objective is metrics.dp.max, its bound
    between metrics.dp.lower_bound and that) and was accepted exactly when the method says so;
    CP-SAT refines groups of 2+ matrices only. Its bound itself is CP-SAT's proof, which only
    a re-run reproduces."""
    s, m = schedule.metrics.solver, schedule.metrics.dp
    if s is None:
        return
    if s.dp_status not in CP_SAT_STATUSES:
        fail(f"metrics.solver.dp_status {s.dp_status[:40]!r} is not a CP-SAT status ({', '.join(CP_SAT_STATUSES)})")
    if s.dp_accepted != m.method.endswith("+cp-sat"):
        fail("metrics.solver.dp_accepted must say whether metrics.dp.method ends with +cp-sat")
    if s.dp_status == "SKIPPED":
        if (s.dp_objective, s.dp_bound, s.dp_accepted) != (0.0, 0.0, False):
            fail("metrics.solver: a SKIPPED DP refinement has objective and bound 0 and was not accepted")
    else:
        expect("metrics.solver.dp_objective", s.dp_objective, m.max, "metrics.dp.max (the answer kept)")
        if not m.lower_bound * (1 - REL_TOL) <= s.dp_bound <= s.dp_objective * (1 + REL_TOL):
            fail("metrics.solver.dp_bound must lie between metrics.dp.lower_bound and dp_objective")
    matrices = sum(1 for e in schedule.params if e.optimizer == MATRIX)
    if not s.tp_groups_improved <= s.tp_groups_refined <= matrices // 2:
        fail("metrics.solver: tp_groups_improved <= tp_groups_refined <= half the matrices (groups of 2+)")


def _check_alpha_search(schedule: Schedule) -> None:
    trials, req = schedule.metrics.alpha_search, schedule.request
    if trials is None:
        return
    if [t.alpha for t in trials] != list(DEFAULT_ALPHAS):
        fail(
            "metrics.alpha_search must hold the trials of alpha "
            f"{', '.join(f'{a:g}' for a in DEFAULT_ALPHAS)}, in order"
        )
    if len({t.predicted_iteration_s is None for t in trials}) > 1 or any(
        t.predicted_step_s <= 0 or (t.predicted_iteration_s or 1.0) <= 0 for t in trials
    ):
        fail("metrics.alpha_search: every trial needs a positive step time, and all or none an iteration time")
    times = [t.predicted_step_s if t.predicted_iteration_s is None else t.predicted_iteration_s for t in trials]
    chosen = DEFAULT_ALPHAS[alpha_winner(times)]
    if req.alpha != chosen:
        fail(f"request.alpha {req.alpha:g} is not the alpha metrics.alpha_search's predictions pick ({chosen:g})")


def dense_buckets(schedule: Schedule, bucket_size: int) -> int:
    """How many buckets the dense matrix buffer has at `bucket_size` (the geometry's rule)."""
    count, fill = 0, 0
    for e in sorted(schedule.params, key=lambda entry: -entry.index):
        if e.optimizer != MATRIX or e.ep_rank is not None:
            continue
        fill = round_up(fill, PARAM_ALIGNMENT) + e.numel
        if fill >= bucket_size:
            count, fill = count + 1, 0
    return count + (1 if fill else 0)


def _check_bucket_search(schedule: Schedule) -> None:
    search, req = schedule.metrics.bucket_search, schedule.request
    if search is None:
        return
    sizes = [t.bucket_size for t in search.trials]
    if sizes != list(DEFAULT_BUCKET_SIZES):
        fail("metrics.bucket_search must hold the trials of the standard bucket sizes, in order")
    counts = [dense_buckets(schedule, size) for size in sizes]
    if [t.num_buckets for t in search.trials] != counts:
        fail(f"metrics.bucket_search: the trials' bucket counts must be the geometry's ({counts})")
    if any(t.predicted_step_s <= 0 or t.predicted_iteration_s <= 0 for t in search.trials):
        fail("metrics.bucket_search: every trial needs positive predicted times")
    chosen, reason = bucket_winner(sizes, counts, [t.predicted_iteration_s for t in search.trials])
    if req.bucket_size != sizes[chosen] or search.reason != reason:
        fail(
            f"request.bucket_size and metrics.bucket_search.reason must be what the trials' predictions pick "
            f"({sizes[chosen]}: {reason})"
        )
