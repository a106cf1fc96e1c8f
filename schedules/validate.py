"""The semantic validator of a schedule: everything execution depends on, re-derived from the
file's own parameters and request, and every recorded figure recomputed where the file holds
what it is computed from (costs and state sizes for the built-in cost models, row blocks from
the request's split options, traffic, baselines, the searches' choices).

Pure (no torch, no planner) and used by every reader: `format.parse_schedule` runs it on every
file the runtime or a CLI command loads. `schedule_problem` returns one line naming the first
inconsistency, or None. The rules are listed in docs/schedule-format.md ("Invariants"). Every
rule's work is linear in the file (or in the request's layout, which the limits bound): no
per-row work grows with another row's size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from math import lcm, prod
from typing import Any

from canzona.schedules.checks import Problem, check_group, close, dp_rank_of, expect, fail
from canzona.schedules.costs import BUILT_IN_COSTS, adamw_cost, matrix_cost
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
    tp_slot_shape,
)
from canzona.schedules.limits import (
    ADAMW,
    BUCKET_COLLECTIVES,
    COOP_MODES,
    FSDP,
    GRAD_REDUCE_AXES,
    MATRIX,
    MAX_PARAM_DIMS,
    MAX_PARAM_NUMEL,
    MAX_PARAMS,
    NAMING_CONVENTIONS,
    OPTIMIZER_CLASSES,
    QKV_SPLITS,
    TP_UPDATE_REQUESTS,
    TP_UPDATES,
    choice_problem,
    cost_problem,
    optimizer_problem,
    request_problem,
    sharding_problem,
    unused_settings_problem,
)
from canzona.schedules.models import BucketEntry, ParamEntry, Schedule
from canzona.schedules.splits import (
    as_blocks,
    derived_problem,
    expanded_by_canzona,
    listed_problem,
    submatrices,
)
from canzona.schedules.validate_fsdp import check_fsdp
from canzona.schedules.validate_metrics import check_metrics


def schedule_problem(schedule: Schedule) -> str | None:
    """The first inconsistency of `schedule` (one line), or None when it is executable as
    recorded and its figures agree with its plan."""
    try:
        _check_request(schedule)
        _check_params(schedule)
        if schedule.request.sharding == FSDP:
            check_fsdp(schedule)
            return None
        _check_buffers(schedule)
        _check_tp_section(schedule)
        check_metrics(schedule)
    except Problem as problem:
        return str(problem)
    return None


# ---------------------------------------------------------------------------------------------
# Request and parameters


def _check_request(schedule: Schedule) -> None:
    req, opt = schedule.request, schedule.request.optimizer
    problem = (
        request_problem(
            tp=req.tp,
            dp=req.dp,
            ep=req.ep,
            alpha=req.alpha,
            bucket_size=req.bucket_size,
            group_bytes=req.group_bytes,
            tp_mode=req.tp_mode,
            solver=req.solver,
            time_limit=req.time_limit,
            seed=req.seed,
            order=req.order,
        )
        or optimizer_problem(opt)
        or unused_settings_problem(opt.name, opt.model_dump(exclude={"name"}))
        or cost_problem(req.cost)
        or choice_problem("split_qkv", req.split_qkv, QKV_SPLITS)
        or choice_problem("router_optimizer", req.router_optimizer, OPTIMIZER_CLASSES)
        or choice_problem("names", req.names, NAMING_CONVENTIONS)
        or sharding_problem(req.sharding, req.dp, req.dp_replicate, req.ep)
        or choice_problem("coop", req.coop, COOP_MODES)
        or choice_problem("tp_update", req.tp_update, TP_UPDATE_REQUESTS)
    )
    if problem:
        fail(f"request: {problem}")
    if not 1 <= len(schedule.params) <= MAX_PARAMS:
        fail(f"the schedule lists {len(schedule.params)} parameters (canzona plans 1 to {MAX_PARAMS})")
    if req.dtype is not None and any(e.dtype != req.dtype for e in schedule.params):
        fail(f"request.dtype is {req.dtype}, but not every parameter is")
    if (req.alpha_device is None) != (schedule.metrics.alpha_search is None):
        fail("request.alpha_device and metrics.alpha_search must be given together (alpha auto)")
    if (req.bucket_device is None) != (schedule.metrics.bucket_search is None):
        fail("request.bucket_device and metrics.bucket_search must be given together (bucket size auto)")
    if (req.training is None) != (req.alpha_device is None and req.bucket_device is None):
        fail(
            "request.training is what an automatic search (alpha_device, bucket_device) assumed: given exactly with one"
        )
    if (req.solver == "ilp") != (schedule.metrics.solver is not None):
        fail("metrics.solver is what CP-SAT did: present exactly when request.solver is ilp")


def _check_params(schedule: Schedule) -> None:
    names = [e.name for e in schedule.params]
    if len(set(names)) != len(names):
        fail(f"parameter {_first_repeat(names)!r} appears twice")
    if sorted(e.index for e in schedule.params) != list(range(len(names))):
        fail("parameter indices are not 0..N-1 (each once)")
    req = schedule.request
    for entry in schedule.params:
        _check_entry(entry, req.tp, req.dp, req.ep)
    _check_slices(schedule)
    _check_row_blocks(schedule)
    _check_costs(schedule)
    if req.ep > 1:
        per_rank: dict[int, int] = defaultdict(int)
        for entry in schedule.params:
            if entry.ep_rank is not None:
                per_rank[entry.ep_rank] += 1
        if sorted(per_rank) != list(range(req.ep)) or len(set(per_rank.values())) != 1:
            fail(f"ep {req.ep}: every EP rank must hold the same number of expert matrices (found {dict(per_rank)})")
    elif schedule.dp.expert_buckets:
        fail("dp.expert_buckets is only for expert parallelism (ep > 1)")


def _first_repeat(names: Sequence[str]) -> str:
    seen: set[str] = set()
    return next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]


def _check_shape(e: ParamEntry, tp: int) -> None:
    """Check the parameter's shape, element count and TP split."""
    if not 1 <= len(e.shape) <= MAX_PARAM_DIMS or min(e.shape) < 1 or max(e.shape) > MAX_PARAM_NUMEL:
        fail(f"parameter {e.name!r}: invalid shape {e.shape[: MAX_PARAM_DIMS + 1]}")
    numel = prod(e.shape)
    if numel > MAX_PARAM_NUMEL:
        fail(f"parameter {e.name!r}: invalid shape {e.shape} (more than {MAX_PARAM_NUMEL} elements)")
    # TP may shard a dim unevenly (torch.chunk), but not through the head blocks of row_blocks
    if e.tp_dim is not None and (e.tp_dim >= len(e.shape) or (e.row_blocks and e.shape[e.tp_dim] % tp)):
        fail(f"parameter {e.name!r}: tp_dim {e.tp_dim} cannot be split {tp} ways for shape {e.shape}")


def _check_entry(e: ParamEntry, tp: int, dp: int, ep: int) -> None:
    if e.optimizer not in OPTIMIZER_CLASSES:
        fail(f"parameter {e.name!r}: unknown optimizer {e.optimizer!r} (expected {' or '.join(OPTIMIZER_CLASSES)})")
    if e.dtype not in DTYPE_BYTES:
        fail(f"parameter {e.name!r}: unknown dtype {e.dtype!r} (expected one of {', '.join(DTYPE_BYTES)})")
    _check_shape(e, tp)
    local = prod(tp_slot_shape(e.shape, e.tp_dim, tp))
    if e.numel != local:
        fail(f"parameter {e.name!r}: numel {e.numel}, but a TP slot of {e.shape} has {local} elements")
    if e.cost < 0:
        fail(f"parameter {e.name!r}: negative cost {e.cost!r}")
    if e.grad_reduce is not None and (e.grad_reduce not in GRAD_REDUCE_AXES or e.tp_dim is not None or tp == 1):
        fail(
            f"parameter {e.name!r}: grad_reduce {e.grad_reduce!r} is only for a parameter replicated over TP "
            f"(tp_dim null) when tp > 1, reduced over one of {', '.join(GRAD_REDUCE_AXES)}"
        )
    if (e.param is None) != (e.slice is None):
        fail(f"parameter {e.name!r}: param and slice (an expert slice of a grouped tensor) go together")
    if e.optimizer == ADAMW:
        if e.owner is not None or e.row_blocks is not None or e.ep_rank is not None:
            fail(f"parameter {e.name!r}: AdamW parameters have no owner, row blocks or EP rank")
        return
    if len(e.shape) != 2:
        fail(f"parameter {e.name!r}: the matrix optimizer needs a 2-D shape, got {e.shape}")
    if e.ep_rank is not None and (ep == 1 or e.ep_rank >= ep):
        fail(f"parameter {e.name!r}: ep_rank {e.ep_rank} is not an EP rank (ep {ep}; ep_rank is only for ep > 1)")
    ranks = dp if e.ep_rank is None else dp // ep
    if e.owner is None or e.owner >= ranks:
        group = "a DP rank" if e.ep_rank is None else f"an expert-DP rank (dp / ep = {ranks})"
        fail(f"parameter {e.name!r}: owner {e.owner} is not {group}")


def _check_row_blocks(schedule: Schedule) -> None:
    """Row blocks tile the rows exactly, in canonical form (null for one submatrix in gathered
    order; no block holds two adjacent ranges), and are what the request's split options give
    (`splits`). Identical blocks of equal matrices are checked once."""
    req = schedule.request
    derived = expanded_by_canzona(req.model.source, req.model.sha256, req.names)
    shapes = {e.name: e.shape for e in schedule.params}
    # keyed by the ranges as written (any length), as they are not checked yet
    tiled: set[tuple[int, tuple[tuple[tuple[int, ...], ...], ...]]] = set()
    verdicts: dict[tuple[Any, ...], Any] = {}
    for e in schedule.params:
        written = tuple(tuple(tuple(r) for r in block) for block in e.row_blocks) if e.row_blocks else ()
        if e.row_blocks is not None and (e.shape[0], written) not in tiled:
            _row_blocks_problem(f"parameter {e.name!r}", e.row_blocks, e.shape[0])
            tiled.add((e.shape[0], written))
        if e.optimizer != MATRIX:
            continue
        blocks = as_blocks(e.row_blocks)
        if derived:
            problem = derived_problem(
                e.name, e.shape, blocks, req.tp, req.names, req.split_qkv, req.split_fc1, shapes.get, verdicts
            )
        else:
            key = ("listed", e.shape[0], req.tp if e.tp_dim == 0 else 1, blocks)
            if key not in verdicts:
                verdicts[key] = listed_problem(
                    blocks, key[1], key[2], req.split_qkv, req.model.source.startswith("py:"), req.split_fc1
                )
            problem = verdicts[key]
        if problem:
            fail(f"parameter {e.name!r}: its row blocks are not what the request gives: {problem}")


def _check_costs(schedule: Schedule) -> None:
    """Every parameter's cost under a built-in cost model, recomputed from its shape, its row
    blocks and the request's optimizer settings (a file whose settings changed after planning
    is refused). Profile costs are measured: the file is their only record."""
    req = schedule.request
    if req.cost not in BUILT_IN_COSTS:
        return
    known: dict[tuple[Any, ...], float] = {}
    for e in schedule.params:
        blocks = as_blocks(e.row_blocks)
        key = (e.optimizer, tuple(e.shape), blocks)
        if key not in known:
            known[key] = (
                adamw_cost(req.cost, prod(e.shape))
                if e.optimizer == ADAMW
                else sum(
                    matrix_cost(req.cost, rows, cols, req.optimizer) for rows, cols in submatrices(e.shape, blocks)
                )
            )
        if not close(e.cost, known[key]):
            opt = req.optimizer
            fail(
                f"parameter {e.name!r}: cost {e.cost!r}, but the {req.cost} cost model gives {known[key]!r} for its "
                f"shape and row blocks under request.optimizer ({opt.name}, ns_steps {opt.ns_steps}, block_size "
                f"{opt.block_size}, precondition_frequency {opt.precondition_frequency}, max_precond_dim "
                f"{opt.max_precond_dim})"
            )


def _check_slices(schedule: Schedule) -> None:
    """Expert slices of a grouped 3-D tensor: named `param[slice]`, matrices, slices 0..E-1 at
    consecutive indices, alike in everything but their slice (shape, dtype, TP dim, row
    blocks, grad_reduce), a tensor name no other parameter has; under expert parallelism each
    on the EP rank holding it (slice // (E / ep))."""
    groups: dict[str, list[ParamEntry]] = defaultdict(list)
    for e in sorted(schedule.params, key=lambda entry: entry.index):
        if e.param is not None:
            if e.optimizer != MATRIX or e.name != f"{e.param}[{e.slice}]":
                fail(f"parameter {e.name!r}: an expert slice is a matrix named {e.param!r}[slice]")
            groups[e.param].append(e)
    names = {e.name for e in schedule.params}
    ep = schedule.request.ep
    for parent, slices in groups.items():
        first = slices[0]
        if parent in names:
            fail(f"grouped tensor {parent!r}: another parameter has its name")
        if [e.slice for e in slices] != list(range(len(slices))) or [e.index for e in slices] != list(
            range(first.index, first.index + len(slices))
        ):
            fail(f"grouped tensor {parent!r}: its slices must be 0..{len(slices) - 1} at consecutive indices")
        alike = (first.shape, first.dtype, first.tp_dim, first.row_blocks, first.grad_reduce)
        if any((e.shape, e.dtype, e.tp_dim, e.row_blocks, e.grad_reduce) != alike for e in slices):
            fail(f"grouped tensor {parent!r}: its slices differ in shape, dtype, tp_dim, row blocks or grad_reduce")
        if ep > 1 and (len(slices) % ep or any(e.ep_rank != e.slice // (len(slices) // ep) for e in slices)):  # type: ignore[operator]
            fail(f"grouped tensor {parent!r}: under ep {ep} its {len(slices)} slices sit on EP rank slice // (E / ep)")


def _row_blocks_problem(label: str, blocks: list[list[list[int]]], rows: int) -> None:
    """The blocks tile `rows` rows exactly once in canonical form: so they hold at most `rows`
    ranges, whatever the file claims."""
    ranges = []
    for block in blocks:
        if not block or any(len(r) != 2 or r[0] >= r[1] for r in block):
            fail(f"{label}: every row block needs [start, stop) ranges with start < stop")
        if any(block[i][1] == block[i + 1][0] for i in range(len(block) - 1)):
            fail(f"{label}: a row block holds adjacent ranges (not canzona's canonical form)")
        ranges += [(r[0], r[1]) for r in block]
    if not blocks:
        fail(f"{label}: row_blocks is empty (null means one submatrix, the gathered matrix)")
    ranges.sort()
    chained = all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    if not chained or ranges[0][0] != 0 or ranges[-1][1] != rows:
        fail(f"{label}: row blocks do not cover its {rows} rows exactly once")
    if len(blocks) == 1 and len(blocks[0]) == 1:
        fail(f"{label}: a single row block over every row is written as row_blocks null")


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
            _check_buffer(
                f"expert (EP rank {ep_rank})", experts, section.expert_buckets, req.dp // req.ep, req.bucket_size
            )
            layouts.add(tuple(sorted((e.bucket, e.offset, e.numel) for e in experts)))
        if len(layouts) > 1:
            fail("the EP ranks' expert buffers are laid out differently")


def _check_order(kind: str, members: list[ParamEntry]) -> None:
    """Inside every bucket, offsets rise along reverse registration order (Megatron's buffer;
    `request.order: free` lets the planner order a bucket's matrices)."""
    last: dict[int, int] = {}
    for e in sorted(members, key=lambda entry: -entry.index):
        if e.offset < last.get(e.bucket, -1):
            fail(
                f"parameter {e.name!r}: {kind} bucket {e.bucket} is not in reverse registration order, "
                "which request.order registration requires"
            )
        last[e.bucket] = e.offset


def _check_buffer(
    kind: str, members: list[ParamEntry], buckets: Sequence[Any], num_ranks: int, bucket_size: int
) -> None:
    for position, bucket in enumerate(buckets):
        if bucket.index != position:
            fail(f"{kind} bucket {position}: index {bucket.index}")
    by_bucket: list[list[ParamEntry]] = [[] for _ in buckets]
    previous = 0
    for e in sorted(members, key=lambda entry: -entry.index):  # buffer order: reverse registration
        if e.bucket >= len(buckets):
            fail(f"parameter {e.name!r}: {kind} bucket {e.bucket} does not exist")
        if not previous <= e.bucket <= previous + 1 or (not by_bucket[0] and e.bucket != 0):
            fail(f"parameter {e.name!r}: {kind} bucket {e.bucket} breaks reverse registration order of buckets")
        previous = e.bucket
        by_bucket[e.bucket].append(e)
    for position, (bucket, bucket_members) in enumerate(zip(buckets, by_bucket)):
        if not bucket_members:
            fail(f"{kind} bucket {position} holds no parameter")
        last = position == len(buckets) - 1
        _check_bucket_close(kind, position, bucket_members, bucket_size, last)
        _check_packing(kind, position, bucket, bucket_members, num_ranks)
        if kind == "AdamW":
            if list(bucket.cuts) != list(equal_cuts(bucket.numel, num_ranks)):
                fail(
                    f"{kind} bucket {position}: cuts must be the stock equal split of {bucket.numel} over "
                    f"{num_ranks} ranks"
                )
        else:
            _check_cuts(kind, position, bucket, bucket_members, num_ranks)


def _check_bucket_close(kind: str, position: int, members: list[ParamEntry], bucket_size: int, last: bool) -> None:
    """A bucket closes at the first parameter that brings it to `bucket_size` elements."""
    sizes = [e.numel for e in members]
    if packed_fill(sizes[:-1]) >= bucket_size:
        fail(f"{kind} bucket {position} should have closed before {members[-1].name!r} (bucket_size {bucket_size})")
    if not last and packed_fill(sizes) < bucket_size:
        fail(
            f"{kind} bucket {position} holds fewer than bucket_size {bucket_size} elements, yet another bucket follows"
        )


def _check_packing(kind: str, position: int, bucket: Any, members: list[ParamEntry], num_ranks: int) -> None:
    """Sorted by offset, parameters are packed at 64-element alignment from 0, and the bucket
    ends at the last one's end padded to a multiple of lcm(D, 128)."""
    end = 0
    for e in sorted(members, key=lambda entry: entry.offset):
        expected = round_up(end, PARAM_ALIGNMENT)
        if e.offset != expected:
            fail(
                f"parameter {e.name!r}: offset {e.offset} in {kind} bucket {position}, but packing puts it at "
                f"{expected}"
            )
        end = e.offset + e.numel
    padded = padded_bucket_numel(end, num_ranks)
    if bucket.numel != padded:
        fail(
            f"{kind} bucket {position}: numel {bucket.numel}, but its parameters end at {end}, padded to a multiple "
            f"of lcm({num_ranks}, {BUCKET_END_ALIGNMENT}) = {lcm(num_ranks, BUCKET_END_ALIGNMENT)} that is {padded}"
        )


def _check_cuts(kind: str, position: int, bucket: BucketEntry, members: list[ParamEntry], num_ranks: int) -> None:
    cuts, numel = bucket.cuts, bucket.numel
    if len(cuts) != num_ranks + 1 or cuts[0] != 0 or cuts[-1] != numel:
        fail(f"{kind} bucket {position}: cuts must be {num_ranks + 1} offsets from 0 to {numel}")
    if list(cuts) != sorted(cuts):
        fail(f"{kind} bucket {position}: cuts are not increasing")
    boundaries = {e.offset for e in members} | {numel}
    stray = next((c for c in cuts[1:-1] if c not in boundaries), None)
    if stray is not None:
        fail(f"{kind} bucket {position}: cut at {stray} is not a parameter boundary")
    for e in members:
        holder = slice_owner(cuts, e.offset)
        if e.owner != holder:
            fail(
                f"parameter {e.name!r}: its shard is not inside its owner's slice (owner {e.owner}, slice of rank "
                f"{holder})"
            )
    slices = slice_sizes(cuts)
    if list(bucket.slice_bytes) != [GRAD_BYTES_PER_ELEMENT * s for s in slices]:
        fail(f"{kind} bucket {position}: slice_bytes disagree with its cuts")
    overhead = num_ranks * max(slices) / numel if numel else 1.0
    expect(f"{kind} bucket {position} padding_overhead", bucket.padding_overhead, overhead, "D x largest slice / numel")
    problem = choice_problem(f"{kind} bucket {position} collective", bucket.collective, BUCKET_COLLECTIVES)
    if problem:
        fail(problem)


# ---------------------------------------------------------------------------------------------
# TP micro-groups


def _check_tp_section(schedule: Schedule) -> None:
    req, section = schedule.request, schedule.tp
    if section.mode != req.tp_mode or section.group_bytes != req.group_bytes:
        fail("the tp section's mode and group_bytes must be the request's tp_mode and group_bytes")
    problem = choice_problem("tp section update", section.update, TP_UPDATES)
    if problem:
        fail(problem)
    if req.tp_update in TP_UPDATES and section.update != req.tp_update:
        fail(f"the tp section's update is {section.update}, but the request asked for {req.tp_update}")
    if [plan.dp_rank for plan in section.ranks] != list(range(req.dp)):
        fail(f"the tp section must list DP ranks 0..{req.dp - 1} in order")
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
                fail(f"{where}: groups must be numbered 0, 1, ... and hold at least one matrix")
            if len(group.params) != len(group.hosts) or any(h >= req.tp for h in group.hosts):
                fail(f"{where}: hosts must be TP ranks, one per parameter")
            listed += group.params
        if len(listed) != len(set(listed)) or set(listed) != owned[plan.dp_rank]:
            fail(f"tp section, DP rank {plan.dp_rank}: groups must list exactly the matrices it owns, once each")
        for position, group in enumerate(plan.groups):
            check_group(
                f"tp section, DP rank {plan.dp_rank} group {position}",
                group,
                entries,
                req.tp,
                req.group_bytes,
                req.tp_mode,
                req.optimizer.name,
            )
