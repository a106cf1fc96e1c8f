"""The semantic validator of a schedule: everything execution depends on, re-derived from the
file's own parameters and request, and every metric recomputed where the file holds what it is
computed from.

Pure (no torch, no planner) and used by every reader: `format.parse_schedule` runs it on every
file the runtime or a CLI command loads. `schedule_problem` returns one line naming the first
inconsistency, or None. The rules are listed in docs/schedule-format.md ("Invariants").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from math import lcm, prod
from typing import TYPE_CHECKING, Any

from canzona.schedules.bounds import dp_lower_bound
from canzona.schedules.geometry import (
    BUCKET_END_ALIGNMENT,
    DTYPE_BYTES,
    GRAD_BYTES_PER_ELEMENT,
    PARAM_ALIGNMENT,
    equal_cuts,
    packed_fill,
    padded_bucket_numel,
    round_up,
    slice_owner,
    slice_sizes,
)
from canzona.schedules.limits import (
    ADAMW,
    BUCKET_COLLECTIVES,
    FSDP,
    COOP_MODES,
    GRAD_REDUCE_AXES,
    MATRIX,
    MAX_PARAM_NUMEL,
    MAX_PARAMS,
    NAMING_CONVENTIONS,
    OPTIMIZER_CLASSES,
    QKV_SPLITS,
    choice_problem,
    cost_problem,
    request_problem,
    settings_problem,
    sharding_problem,
)
from canzona.schedules.teams import placements, team_problem

if TYPE_CHECKING:
    from canzona.schedules.format import BucketEntry, ParamEntry, Schedule, StrategyScore

# Recomputed sums differ from the planner's only by summation order: about n · 2^-53 relative
# for n ≤ 65536 terms (< 1e-11), so 1e-9 relative flags any edit while never a planner file.
REL_TOL = 1e-9
ABS_TOL = 1e-12
LINEAR_ADAMW_COSTS = ("numel", "flops")  # AdamW cost proportional to elements: device loads add up


class _Problem(Exception):
    """The first inconsistency found (internal: turned into the returned line)."""


def _fail(message: str) -> None:
    raise _Problem(message)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _expect(label: str, recorded: float, derived: float, what: str) -> None:
    if not _close(recorded, derived):
        _fail(f"{label} is {recorded!r}, but {what} gives {derived!r}")


def schedule_problem(schedule: Schedule) -> str | None:
    """The first inconsistency of `schedule` (one line), or None when it is executable as
    recorded and its metrics agree with its plan."""
    try:
        _check_request(schedule)
        _check_params(schedule)
        if schedule.request.sharding == FSDP:
            from canzona.schedules.validate_fsdp import check_fsdp

            check_fsdp(schedule)
            return None
        _check_buffers(schedule)
        _check_tp_section(schedule)
        _check_metrics(schedule)
    except _Problem as problem:
        return str(problem)
    return None


# ---------------------------------------------------------------------------------------------
# Request and parameters


def _check_request(schedule: Schedule) -> None:
    req, opt = schedule.request, schedule.request.optimizer
    problem = (
        request_problem(
            tp=req.tp, dp=req.dp, ep=req.ep, alpha=req.alpha, bucket_size=req.bucket_size,
            group_bytes=req.group_bytes, tp_mode=req.tp_mode, solver=req.solver, time_limit=req.time_limit,
            seed=req.seed, order=req.order,
        )
        or settings_problem(opt.name, opt.ns_steps, opt.block_size, opt.precondition_frequency, opt.max_precond_dim)
        or cost_problem(req.cost)
        or choice_problem("split_qkv", req.split_qkv, QKV_SPLITS)
        or choice_problem("router_optimizer", req.router_optimizer, OPTIMIZER_CLASSES)
        or choice_problem("names", req.names, NAMING_CONVENTIONS)
        or sharding_problem(req.sharding, req.dp, req.dp_replicate, req.ep)
        or choice_problem("coop", req.coop, COOP_MODES)
    )
    if problem:
        _fail(f"request: {problem}")
    if not 1 <= len(schedule.params) <= MAX_PARAMS:
        _fail(f"the schedule lists {len(schedule.params)} parameters (canzona plans 1 to {MAX_PARAMS})")
    if (req.alpha_device is None) != (schedule.metrics.alpha_search is None):
        _fail("request.alpha_device and metrics.alpha_search must be given together (alpha auto)")
    trials = schedule.metrics.alpha_search
    if trials is not None and not any(t.alpha == req.alpha for t in trials):
        _fail(f"metrics.alpha_search does not hold the chosen alpha {req.alpha!r}")
    if trials is not None and any(not 0 <= t.alpha <= 1 or t.predicted_step_s <= 0 for t in trials):
        _fail("metrics.alpha_search: every trial needs alpha in [0, 1] and a positive step time")


def _check_params(schedule: Schedule) -> None:
    names = [e.name for e in schedule.params]
    if len(set(names)) != len(names):
        _fail(f"parameter {_first_repeat(names)!r} appears twice")
    if sorted(e.index for e in schedule.params) != list(range(len(names))):
        _fail("parameter indices are not 0..N-1 (each once)")
    req = schedule.request
    for entry in schedule.params:
        _check_entry(entry, req.tp, req.dp, req.ep)
    _check_row_blocks(schedule)
    _check_slices(schedule)
    if req.ep > 1:
        per_rank = defaultdict(int)
        for entry in schedule.params:
            if entry.ep_rank is not None:
                per_rank[entry.ep_rank] += 1
        if sorted(per_rank) != list(range(req.ep)) or len(set(per_rank.values())) != 1:
            _fail(f"ep {req.ep}: every EP rank must hold the same number of expert matrices (found {dict(per_rank)})")
    elif schedule.dp.expert_buckets:
        _fail("dp.expert_buckets is only for expert parallelism (ep > 1)")


def _first_repeat(names: Sequence[str]) -> str:
    seen: set[str] = set()
    return next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]


def _check_entry(e: ParamEntry, tp: int, dp: int, ep: int) -> None:
    numel = prod(e.shape) if e.shape else 0
    if e.optimizer not in OPTIMIZER_CLASSES:
        _fail(f"parameter {e.name!r}: unknown optimizer {e.optimizer!r} (expected {' or '.join(OPTIMIZER_CLASSES)})")
    if e.dtype not in DTYPE_BYTES:
        _fail(f"parameter {e.name!r}: unknown dtype {e.dtype!r} (expected one of {', '.join(DTYPE_BYTES)})")
    if not e.shape or min(e.shape) < 1 or numel > MAX_PARAM_NUMEL:
        _fail(f"parameter {e.name!r}: invalid shape {e.shape}")
    if e.tp_dim is not None and (e.tp_dim >= len(e.shape) or e.shape[e.tp_dim] % tp):
        _fail(f"parameter {e.name!r}: tp_dim {e.tp_dim} cannot be split {tp} ways for shape {e.shape}")
    local = numel if e.tp_dim is None else numel // tp
    if e.numel != local:
        _fail(f"parameter {e.name!r}: numel {e.numel}, but its TP shard of {e.shape} has {local} elements")
    if e.cost < 0:
        _fail(f"parameter {e.name!r}: negative cost {e.cost!r}")
    if e.grad_reduce is not None and (e.grad_reduce not in GRAD_REDUCE_AXES or e.tp_dim is not None or tp == 1):
        _fail(f"parameter {e.name!r}: grad_reduce {e.grad_reduce!r} is only for a parameter replicated over TP "
              f"(tp_dim null) when tp > 1, reduced over one of {', '.join(GRAD_REDUCE_AXES)}")
    if (e.param is None) != (e.slice is None):
        _fail(f"parameter {e.name!r}: param and slice (an expert slice of a grouped tensor) go together")
    if e.optimizer == ADAMW:
        if e.owner is not None or e.row_blocks is not None or e.ep_rank is not None:
            _fail(f"parameter {e.name!r}: AdamW parameters have no owner, row blocks or EP rank")
        return
    if len(e.shape) != 2:
        _fail(f"parameter {e.name!r}: the matrix optimizer needs a 2-D shape, got {e.shape}")
    if e.ep_rank is not None and (ep == 1 or e.ep_rank >= ep):
        _fail(f"parameter {e.name!r}: ep_rank {e.ep_rank} is not an EP rank (ep {ep}; ep_rank is only for ep > 1)")
    ranks = dp if e.ep_rank is None else dp // ep
    if e.owner is None or e.owner >= ranks:
        group = "a DP rank" if e.ep_rank is None else f"an expert-DP rank (dp / ep = {ranks})"
        _fail(f"parameter {e.name!r}: owner {e.owner} is not {group}")


def _check_row_blocks(schedule: Schedule) -> None:
    """Row blocks tile the rows exactly, in canonical form (null for one submatrix in gathered
    order; no block holds two adjacent ranges). Identical blocks are checked once."""
    checked: dict[int, list[list[list[list[int]]]]] = defaultdict(list)  # rows -> blocks seen
    for e in schedule.params:
        if e.row_blocks is None or e.row_blocks in checked[e.shape[0]]:
            continue
        _row_blocks_problem(f"parameter {e.name!r}", e.row_blocks, e.shape[0])
        checked[e.shape[0]].append(e.row_blocks)


def _check_slices(schedule: Schedule) -> None:
    """Expert slices of a grouped 3-D tensor: named `param[slice]`, matrices, slices 0..E-1 at
    consecutive indices, alike in everything but their slice (shape, dtype, TP dim, row
    blocks, grad_reduce), a tensor name no other parameter has; under expert parallelism each
    on the EP rank holding it (slice // (E / ep))."""
    groups: dict[str, list[ParamEntry]] = defaultdict(list)
    for e in sorted(schedule.params, key=lambda entry: entry.index):
        if e.param is not None:
            if e.optimizer != MATRIX or e.name != f"{e.param}[{e.slice}]":
                _fail(f"parameter {e.name!r}: an expert slice is a matrix named {e.param!r}[slice]")
            groups[e.param].append(e)
    names = {e.name for e in schedule.params}
    ep = schedule.request.ep
    for parent, slices in groups.items():
        first = slices[0]
        if parent in names:
            _fail(f"grouped tensor {parent!r}: another parameter has its name")
        if [e.slice for e in slices] != list(range(len(slices))) or [e.index for e in slices] != list(
            range(first.index, first.index + len(slices))
        ):
            _fail(f"grouped tensor {parent!r}: its slices must be 0..{len(slices) - 1} at consecutive indices")
        alike = (first.shape, first.dtype, first.tp_dim, first.row_blocks, first.grad_reduce)
        if any((e.shape, e.dtype, e.tp_dim, e.row_blocks, e.grad_reduce) != alike for e in slices):
            _fail(f"grouped tensor {parent!r}: its slices differ in shape, dtype, tp_dim, row blocks or grad_reduce")
        if ep > 1 and (len(slices) % ep or any(e.ep_rank != e.slice // (len(slices) // ep) for e in slices)):  # type: ignore[operator]
            _fail(f"grouped tensor {parent!r}: under ep {ep} its {len(slices)} slices sit on EP rank slice // (E / ep)")


def _row_blocks_problem(label: str, blocks: list[list[list[int]]], rows: int) -> None:
    ranges = []
    for block in blocks:
        if not block or any(len(r) != 2 or r[0] >= r[1] for r in block):
            _fail(f"{label}: every row block needs [start, stop) ranges with start < stop")
        if any(block[i][1] == block[i + 1][0] for i in range(len(block) - 1)):
            _fail(f"{label}: a row block holds adjacent ranges (not canzona's canonical form)")
        ranges += [(r[0], r[1]) for r in block]
    if not blocks:
        _fail(f"{label}: row_blocks is empty (null means one submatrix, the gathered matrix)")
    ranges.sort()
    chained = all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    if not chained or ranges[0][0] != 0 or ranges[-1][1] != rows:
        _fail(f"{label}: row blocks do not cover its {rows} rows exactly once")
    if len(blocks) == 1 and len(blocks[0]) == 1:
        _fail(f"{label}: a single row block over every row is written as row_blocks null")


# ---------------------------------------------------------------------------------------------
# Buffers: bucket membership, packing, padding, cuts, owners


def _check_buffers(schedule: Schedule) -> None:
    req, section = schedule.request, schedule.dp
    dense = [e for e in schedule.params if e.optimizer == MATRIX and e.ep_rank is None]
    adamw = [e for e in schedule.params if e.optimizer == ADAMW]
    _check_buffer("matrix", dense, section.buckets, req.dp, req.bucket_size)
    _check_buffer("AdamW", adamw, section.adamw_buckets, req.dp, req.bucket_size)
    _check_order("AdamW", adamw)  # AdamW keeps the stock order and equal split
    if req.order == "registration":
        _check_order("matrix", dense)
        for ep_rank in range(req.ep if req.ep > 1 else 0):
            _check_order(f"expert (EP rank {ep_rank})", [e for e in schedule.params if e.ep_rank == ep_rank])
    if req.ep > 1:
        layouts = set()
        by_rank: list[list[ParamEntry]] = [[] for _ in range(req.ep)]
        for e in schedule.params:
            if e.ep_rank is not None:
                by_rank[e.ep_rank].append(e)
        for ep_rank, experts in enumerate(by_rank):
            _check_buffer(f"expert (EP rank {ep_rank})", experts, section.expert_buckets, req.dp // req.ep, req.bucket_size)
            layouts.add(tuple(sorted((e.bucket, e.offset, e.numel) for e in experts)))
        if len(layouts) > 1:
            _fail("the EP ranks' expert buffers are laid out differently")


def _check_order(kind: str, members: list[ParamEntry]) -> None:
    """Inside every bucket, offsets rise along reverse registration order (Megatron's buffer;
    `request.order: free` lets the planner order a bucket's matrices)."""
    last: dict[int, int] = {}
    for e in sorted(members, key=lambda entry: -entry.index):
        if e.offset < last.get(e.bucket, -1):
            _fail(f"parameter {e.name!r}: {kind} bucket {e.bucket} is not in reverse registration order, "
                  "which request.order registration requires")
        last[e.bucket] = e.offset


def _check_buffer(kind: str, members: list[ParamEntry], buckets: Sequence[Any], num_ranks: int, bucket_size: int) -> None:
    for position, bucket in enumerate(buckets):
        if bucket.index != position:
            _fail(f"{kind} bucket {position}: index {bucket.index}")
    by_bucket: list[list[ParamEntry]] = [[] for _ in buckets]
    previous = 0
    for e in sorted(members, key=lambda entry: -entry.index):  # buffer order: reverse registration
        if e.bucket >= len(buckets):
            _fail(f"parameter {e.name!r}: {kind} bucket {e.bucket} does not exist")
        if not previous <= e.bucket <= previous + 1 or (not by_bucket[0] and e.bucket != 0):
            _fail(f"parameter {e.name!r}: {kind} bucket {e.bucket} breaks reverse registration order of buckets")
        previous = e.bucket
        by_bucket[e.bucket].append(e)
    for position, (bucket, bucket_members) in enumerate(zip(buckets, by_bucket)):
        if not bucket_members:
            _fail(f"{kind} bucket {position} holds no parameter")
        last = position == len(buckets) - 1
        _check_bucket_close(kind, position, bucket_members, bucket_size, last)
        _check_packing(kind, position, bucket, bucket_members, num_ranks)
        if kind == "AdamW":
            if list(bucket.cuts) != list(equal_cuts(bucket.numel, num_ranks)):
                _fail(f"{kind} bucket {position}: cuts must be the stock equal split of {bucket.numel} over {num_ranks} ranks")
        else:
            _check_cuts(kind, position, bucket, bucket_members, num_ranks)


def _check_bucket_close(kind: str, position: int, members: list[ParamEntry], bucket_size: int, last: bool) -> None:
    """A bucket closes at the first parameter that brings it to `bucket_size` elements."""
    sizes = [e.numel for e in members]
    if packed_fill(sizes[:-1]) >= bucket_size:
        _fail(f"{kind} bucket {position} should have closed before {members[-1].name!r} (bucket_size {bucket_size})")
    if not last and packed_fill(sizes) < bucket_size:
        _fail(f"{kind} bucket {position} holds fewer than bucket_size {bucket_size} elements, yet another bucket follows")


def _check_packing(kind: str, position: int, bucket: Any, members: list[ParamEntry], num_ranks: int) -> None:
    """Sorted by offset, parameters are packed at 64-element alignment from 0, and the bucket
    ends at the last one's end padded to a multiple of lcm(D, 128)."""
    end = 0
    for e in sorted(members, key=lambda entry: entry.offset):
        expected = round_up(end, PARAM_ALIGNMENT)
        if e.offset != expected:
            _fail(f"parameter {e.name!r}: offset {e.offset} in {kind} bucket {position}, but packing puts it at {expected}")
        end = e.offset + e.numel
    padded = padded_bucket_numel(end, num_ranks)
    if bucket.numel != padded:
        _fail(f"{kind} bucket {position}: numel {bucket.numel}, but its parameters end at {end}, padded to a multiple "
              f"of lcm({num_ranks}, {BUCKET_END_ALIGNMENT}) = {lcm(num_ranks, BUCKET_END_ALIGNMENT)} that is {padded}")


def _check_cuts(kind: str, position: int, bucket: BucketEntry, members: list[ParamEntry], num_ranks: int) -> None:
    cuts, numel = bucket.cuts, bucket.numel
    if len(cuts) != num_ranks + 1 or cuts[0] != 0 or cuts[-1] != numel:
        _fail(f"{kind} bucket {position}: cuts must be {num_ranks + 1} offsets from 0 to {numel}")
    if any(cuts[r] > cuts[r + 1] for r in range(num_ranks)):
        _fail(f"{kind} bucket {position}: cuts are not increasing")
    boundaries = {e.offset for e in members} | {numel}
    stray = next((c for c in cuts[1:-1] if c not in boundaries), None)
    if stray is not None:
        _fail(f"{kind} bucket {position}: cut at {stray} is not a parameter boundary")
    for e in members:
        holder = slice_owner(cuts, e.offset)
        if e.owner != holder:
            _fail(f"parameter {e.name!r}: its shard is not inside its owner's slice (owner {e.owner}, slice of rank {holder})")
    slices = slice_sizes(cuts)
    if list(bucket.slice_bytes) != [GRAD_BYTES_PER_ELEMENT * s for s in slices]:
        _fail(f"{kind} bucket {position}: slice_bytes disagree with its cuts")
    overhead = num_ranks * max(slices) / numel if numel else 1.0
    _expect(f"{kind} bucket {position} padding_overhead", bucket.padding_overhead, overhead, "D x largest slice / numel")
    problem = choice_problem(f"{kind} bucket {position} collective", bucket.collective, BUCKET_COLLECTIVES)
    if problem:
        _fail(problem)


# ---------------------------------------------------------------------------------------------
# TP micro-groups


def dp_rank_of(entry: ParamEntry, ep: int) -> int:
    """The DP rank whose micro-groups update a matrix (owner · ep + ep_rank for experts)."""
    assert entry.owner is not None
    return entry.owner if entry.ep_rank is None else entry.owner * ep + entry.ep_rank


def _check_tp_section(schedule: Schedule) -> None:
    req, section = schedule.request, schedule.tp
    if section.mode != req.tp_mode or section.group_bytes != req.group_bytes:
        _fail("the tp section's mode and group_bytes must be the request's tp_mode and group_bytes")
    if [plan.dp_rank for plan in section.ranks] != list(range(req.dp)):
        _fail(f"the tp section must list DP ranks 0..{req.dp - 1} in order")
    owned: list[set[str]] = [set() for _ in range(req.dp)]
    entries = {}
    for e in schedule.params:
        if e.optimizer == MATRIX:
            owned[dp_rank_of(e, req.ep)].add(e.name)
            entries[e.name] = e
    for plan in section.ranks:
        listed: list[str] = []
        for position, group in enumerate(plan.groups):
            where = f"tp section, DP rank {plan.dp_rank} group {position}"
            if group.index != position or not group.params:
                _fail(f"{where}: groups must be numbered 0, 1, ... and hold at least one matrix")
            if len(group.params) != len(group.hosts) or any(h >= req.tp for h in group.hosts):
                _fail(f"{where}: hosts must be TP ranks, one per parameter")
            listed += group.params
        if len(listed) != len(set(listed)) or set(listed) != owned[plan.dp_rank]:
            _fail(f"tp section, DP rank {plan.dp_rank}: groups must list exactly the matrices it owns, once each")
        for position, group in enumerate(plan.groups):
            _check_group(f"tp section, DP rank {plan.dp_rank} group {position}", group, entries, req.tp,
                         req.group_bytes, req.tp_mode, req.optimizer.name)


def _check_group(where: str, group: Any, entries: dict[str, ParamEntry], tp: int, capacity: int, mode: str,
                 optimizer: str) -> None:
    host_of = dict(zip(group.params, group.hosts))
    if len({team.param for team in group.teams}) != len(group.teams):
        _fail(f"{where}: a matrix has two teams")
    for team in group.teams:
        problem = (f"{team.param!r} is not in the group" if team.param not in host_of
                   else team_problem(team, entries[team.param], host_of[team.param], tp, optimizer))
        if problem:
            _fail(f"{where}: team of {team.param!r}: {problem}")
    loads, sizes, counts = [0.0] * tp, [0] * tp, [0] * tp
    for host, cost, size in placements(group, entries):
        loads[host] += cost
        sizes[host] += size
        counts[host] += 1
    if len(group.host_loads) != tp or not all(_close(a, b) for a, b in zip(group.host_loads, loads)):
        _fail(f"{where}: host_loads disagree with its matrices' costs")
    if list(group.host_bytes) != sizes:
        _fail(f"{where}: host_bytes disagree with its matrices' gathered fp32 sizes")
    _expect(f"{where} makespan", group.makespan, max(loads), "its largest host load")
    _expect(f"{where} saturation", group.saturation, max(sizes) / capacity, "its largest host bytes / group_bytes")
    if mode == "rollback":
        over = next((h for h in range(tp) if sizes[h] > capacity and counts[h] > 1), None)
        if over is not None:
            _fail(f"{where}: TP host {over} holds {sizes[over]} bytes, over the group capacity {capacity}")


# ---------------------------------------------------------------------------------------------
# Metrics


def _check_metrics(schedule: Schedule) -> None:
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
    _check_tp_metrics(schedule)
    _check_devices(schedule)


def _check_dp_metrics(schedule: Schedule, loads: list[float], dense_costs: list[float], expert_loads: list[float]) -> None:
    req, m = schedule.request, schedule.metrics.dp
    for label, values in (("load", m.load), ("slice_bytes", m.slice_bytes), ("state_bytes", m.state_bytes),
                          ("adamw_load", m.adamw_load)):
        if len(values) != req.dp or min(values) < 0:
            _fail(f"metrics.dp.{label} must hold {req.dp} non-negative values, one per DP rank")
    for rank, (recorded, derived) in enumerate(zip(m.load, loads)):
        _expect(f"metrics.dp.load[{rank}]", recorded, derived, f"the costs of the matrices DP rank {rank} owns")
    total = sum(loads)
    bound = dp_lower_bound([e.cost for e in schedule.params if e.optimizer == MATRIX], req.dp)
    if not _close(m.lower_bound, bound):
        # Files written before the plan-independent bound recorded the partition's own one.
        base = expert_loads if req.ep > 1 else [0.0] * req.dp
        former = max(total / req.dp, max(dense_costs, default=0.0) + min(base), max(base))
        _expect("metrics.dp.lower_bound", m.lower_bound, former if _close(m.lower_bound, former) else bound,
                "the pairing bound of every matrix's cost over D ranks")
    _check_score("metrics.dp", m, m.lower_bound, total)
    section = schedule.dp
    slice_bytes = [sum(b.slice_bytes[r] for b in section.buckets) + sum(b.slice_bytes[r // req.ep] for b in section.expert_buckets)
                   for r in range(req.dp)]
    if list(m.slice_bytes) != slice_bytes:
        _fail("metrics.dp.slice_bytes disagree with the buckets' slice_bytes")
    matrix_buckets = [(b, req.dp) for b in section.buckets] + [(b, req.dp // req.ep) for b in section.expert_buckets]
    padded = sum(b.numel for b, _ in matrix_buckets)
    worst = sum(ranks * max(slice_sizes(b.cuts)) for b, ranks in matrix_buckets)
    _expect("metrics.dp.padding_overhead", m.padding_overhead, (worst / padded if padded else 1.0) or 1.0,
            "the buckets' D x largest slice / padded size")
    _expect("metrics.dp.max_padding_overhead", m.max_padding_overhead,
            max((b.padding_overhead for b, _ in matrix_buckets), default=1.0), "the largest bucket padding_overhead")
    for name, score in m.baselines.items():
        if len(score.load) != req.dp or min(score.load) < 0:
            _fail(f"metrics.dp.baselines.{name}.load must hold {req.dp} non-negative values")
        _check_score(f"metrics.dp.baselines.{name}", score, m.lower_bound, total)


def _check_score(label: str, score: StrategyScore | Any, bound: float, total: float) -> None:
    """max, mean, imbalance (>= 1), gap and (for baselines) redundancy of one load vector."""
    maximum, mean = max(score.load), sum(score.load) / len(score.load)
    _expect(f"{label}.max", score.max, maximum, "its per-rank loads")
    _expect(f"{label}.mean", score.mean, mean, "its per-rank loads")
    _expect(f"{label}.imbalance", score.imbalance, maximum / mean if mean else 1.0, "max / mean")
    if score.imbalance < 1 - REL_TOL:
        _fail(f"{label}.imbalance {score.imbalance!r} is below 1")
    _expect(f"{label}.gap", score.gap, (maximum / bound if bound else 1.0) - 1.0, "max / lower_bound - 1")
    if hasattr(score, "redundancy"):
        _expect(f"{label}.redundancy", score.redundancy, sum(score.load) / total if total else 1.0, "sum / canzona's sum")


def _check_tp_metrics(schedule: Schedule) -> None:
    req, m, ranks = schedule.request, schedule.metrics.tp, schedule.tp.ranks
    costs = {e.name: e.cost for e in schedule.params}
    spans = [sum(g.makespan for g in plan.groups) for plan in ranks]
    work = sum(costs[name] for plan in ranks for g in plan.groups for name in g.params)
    chosen = {
        "num_groups": float(sum(len(plan.groups) for plan in ranks)),
        "critical_time": max(spans, default=0.0),
        "efficiency": work / (req.tp * sum(spans)) if sum(spans) else 1.0,
        "max_saturation": max((g.saturation for plan in ranks for g in plan.groups), default=0.0),
        "cooperative": float(sum(len(g.teams) for plan in ranks for g in plan.groups)),
    }
    if m.mode != req.tp_mode or req.tp_mode not in m.modes:
        _fail("metrics.tp.mode must be the request's tp_mode, with an entry in metrics.tp.modes")
    for key, derived in chosen.items():
        _expect(f"metrics.tp.{key}", float(getattr(m, key)), derived, "the tp section")
    for key in (*(k for k in chosen if k != "cooperative"), "worst_device_load", "device_imbalance"):
        _expect(f"metrics.tp.modes.{req.tp_mode}.{key}", float(getattr(m.modes[req.tp_mode], key)), float(getattr(m, key)),
                f"metrics.tp.{key}")
    entries = {e.name: e for e in schedule.params}
    bound = max((max(sum(costs[n] for g in plan.groups for n in g.params) / req.tp,
                     max(cost for g in plan.groups for _, cost, _ in placements(g, entries))) for plan in ranks if plan.groups),
                default=0.0)
    _expect("metrics.tp.critical_lower_bound", m.critical_lower_bound, bound,
            "max over DP ranks of max(cost / P, largest piece: a task, or a team member's share)")
    for mode, score in m.modes.items():
        if score.device_imbalance < 1 - REL_TOL or not 0 <= score.efficiency <= 1 + REL_TOL:
            _fail(f"metrics.tp.modes.{mode}: device_imbalance must be >= 1 and efficiency in [0, 1]")


def _check_devices(schedule: Schedule) -> None:
    req, devices, m = schedule.request, schedule.metrics.device, schedule.metrics.tp
    if [(d.rank, d.dp_rank, d.tp_rank) for d in devices] != [(r, r // req.tp, r % req.tp) for r in range(req.tp * req.dp)]:
        _fail(f"metrics.device must list ranks 0..{req.tp * req.dp - 1} as dp_rank * tp + tp_rank, in order")
    if any(d.load < 0 or d.state_bytes < 0 for d in devices):
        _fail("metrics.device: loads and state bytes must be non-negative")
    if req.cost in LINEAR_ADAMW_COSTS:
        hosted = _hosted_loads(schedule)
        adamw = schedule.metrics.dp.adamw_load
        for d in devices:
            _expect(f"metrics.device[{d.rank}].load", d.load, hosted[d.rank] + adamw[d.dp_rank] / req.tp,
                    "its hosted matrices plus its share of metrics.dp.adamw_load")
    device_loads = [d.load for d in devices]
    mean = sum(device_loads) / len(device_loads)
    _expect("metrics.tp.worst_device_load", m.worst_device_load, max(device_loads), "metrics.device")
    _expect("metrics.tp.device_imbalance", m.device_imbalance, max(device_loads) / mean if mean else 1.0, "metrics.device")
    _check_device_bound(schedule)


def _check_device_bound(schedule: Schedule) -> None:
    """device_lower_bound lies between what the file alone proves (the mean of the matrices'
    own work plus every device's AdamW, the largest AdamW load) and the worst device (no plan
    beats the bound, this one included); device_gap from it. (The bound also counts the
    smallest share a team can give each matrix, which the planner prices; `canzona check`
    regenerates it exactly.)"""
    m, req = schedule.metrics.tp, schedule.request
    if m.device_lower_bound is None or m.device_gap is None:
        if (m.device_lower_bound, m.device_gap) != (None, None):
            _fail("metrics.tp: device_lower_bound and device_gap come together")
        return
    adamw = [schedule.metrics.dp.adamw_load[d.dp_rank] / req.tp for d in schedule.metrics.device]
    work = sum(e.cost for e in schedule.params if e.optimizer == MATRIX)
    floor = max((work + sum(adamw)) / len(adamw), max(adamw)) if req.cost in LINEAR_ADAMW_COSTS else 0.0
    bound = m.device_lower_bound
    if not floor * (1 - REL_TOL) <= bound <= m.worst_device_load * (1 + REL_TOL):
        _fail(f"metrics.tp.device_lower_bound {bound!r} is not between the mean work per device {floor!r} and "
              f"the worst device load {m.worst_device_load!r}")
    _expect("metrics.tp.device_gap", m.device_gap, m.worst_device_load / bound - 1 if bound else 0.0,
            "metrics.tp.worst_device_load / device_lower_bound - 1")


def _hosted_loads(schedule: Schedule) -> list[float]:
    tp = schedule.request.tp
    hosted = [0.0] * (tp * schedule.request.dp)
    for plan in schedule.tp.ranks:
        for group in plan.groups:
            for host, load in enumerate(group.host_loads):
                hosted[plan.dp_rank * tp + host] += load
    return hosted
