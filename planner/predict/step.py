"""The step model the simulator is built from: the micro-group pipeline, the schedule as the
simulator sees it (`Instance`), each strategy's DP collectives and predicted step
(`StrategyTime`, `combine`), and canzona's own step (`canzona_time`).

`canzona.planner.predict.simulate` composes it with the baselines
(`canzona.planner.predict.sim_baselines`) and the training iteration
(`canzona.planner.predict.iteration`), which build on it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from canzona.planner.partition.collectives import (
    GRAD_BYTES,
    Exchange,
    Link,
    all_gather,
    all_reduce,
    bucket_exchange,
    bucket_seconds,
    layout_links,
    phase_seconds,
    reduce_scatter,
)
from canzona.planner.partition.cooperative import Shape, team_flops
from canzona.planner.partition.costs import CostModel, OptimizerConfig, muon_flops
from canzona.planner.partition.layout import slice_sizes
from canzona.planner.predict.hardware import Hardware, ThroughputCost
from canzona.planner.spec import DTYPE_BYTES, PlanError
from canzona.schedules.format import BucketEntry, ParamEntry, Schedule, TeamEntry
from canzona.schedules.limits import AS_SCHEDULED, DP_COLLECTIVE_MODES, HOSTED, MATRIX
from canzona.schedules.splits import as_blocks, submatrices

DENSE, EXPERT, ADAMW_BUFFER = "dense", "expert", "adamw"  # the DP buffers, as bucket keys name them


# --------------------------------------------------------------------------------------------
# The micro-group pipeline


@dataclass(frozen=True)
class GroupTimes:
    """One micro-group: its gather all-to-all, its compute (busiest host), its scatter."""

    gather: float
    compute: float
    scatter: float


@dataclass(frozen=True)
class Event:
    """One interval of the timeline: `kind` is gather, compute or scatter of group `group`."""

    kind: str
    group: int
    start: float
    end: float


def pipeline_events(groups: Sequence[GroupTimes]) -> list[Event]:
    """The timeline of `MicroGroupPipeline.run`: one network queue (collectives of the TP group
    run in issue order) and one compute stream. Issue order: gather 0; then per group g: wait
    gather g, issue gather g+1, compute g, wait scatter g−1, issue scatter g."""
    events: list[Event] = []
    network_free = 0.0

    def issue(kind: str, index: int, at: float, seconds: float) -> float:
        nonlocal network_free
        start = max(at, network_free)
        network_free = start + seconds
        events.append(Event(kind, index, start, network_free))
        return network_free

    if not groups:
        return events
    gather_end = issue("gather", 0, 0.0, groups[0].gather)
    scatter_end = 0.0
    clock = 0.0
    for index, group in enumerate(groups):
        clock = max(clock, gather_end)
        if index + 1 < len(groups):
            gather_end = issue("gather", index + 1, clock, groups[index + 1].gather)
        events.append(Event("compute", index, clock, clock + group.compute))
        clock = max(clock + group.compute, scatter_end)
        scatter_end = issue("scatter", index, clock, group.scatter)
    return events


def pipeline_seconds(groups: Sequence[GroupTimes], overlap: bool = True) -> float:
    """Seconds of the micro-group phase, pipelined or (overlap=False) group after group."""
    if not overlap:
        return sum(g.gather + g.compute + g.scatter for g in groups)
    return max((event.end for event in pipeline_events(groups)), default=0.0)


# --------------------------------------------------------------------------------------------
# The schedule as the simulator sees it


@dataclass(frozen=True)
class Matrix:
    """One matrix parameter: predicted update seconds, its fp32 bytes (local TP shard and
    full), whether TP replicates it, and where it sits in its buffer."""

    name: str
    seconds: float
    shard_bytes: int
    full_bytes: int
    replicated: bool
    bucket: int
    offset: int
    numel: int
    param_bytes: int
    owner: int
    ep_rank: int | None
    shape: tuple[int, int] = (1, 1)


@dataclass(frozen=True)
class Buffer:
    """One matrix buffer over a DP group: bucket sizes, the schedule's cuts, per bucket its
    matrices in buffer order, and the collective canzona's runtime issues for it (as the
    schedule records it, or the one `dp_collectives=` names for every bucket)."""

    link: Link
    numel: tuple[int, ...]
    cuts: tuple[tuple[int, ...], ...]
    entries: tuple[tuple[Matrix, ...], ...]
    param_bytes: tuple[int, ...]
    collectives: tuple[str, ...]


@dataclass(frozen=True)
class Instance:
    """Everything the strategies price: links, buffers (dense; experts per EP rank), AdamW
    bucket sizes and cuts, seconds per matrix and per AdamW slice, and how canzona's DP
    collectives run (fused, parameter element size, overlapped with backward/forward; each
    bucket's collective is its buffer's)."""

    tp: int
    dp: int
    ep: int
    dp_link: Link
    expert_link: Link
    tp_link: Link
    dense: Buffer
    experts: tuple[Buffer, ...]
    adamw_numel: tuple[int, ...]
    adamw_cuts: tuple[tuple[int, ...], ...]
    adamw_param_bytes: int
    matrices: dict[str, Matrix] = field(repr=False)
    time_model: CostModel = field(repr=False)
    fused: bool = False
    publish_bytes: int | None = None
    overlap_grad: bool = True
    overlap_param: bool = False
    ns_steps: int = 5
    ns_method: str = "standard"
    gram_restart: int = 2

    def adamw_elements(self, dp_rank: int) -> int:
        """Elements of this DP rank's equal AdamW slices (per device: TP shards are local)."""
        return sum(cuts[dp_rank + 1] - cuts[dp_rank] for cuts in self.adamw_cuts)

    def gather_bytes(self, param_bytes: int) -> int:
        """Bytes per element of the parameter all-gather."""
        return self.publish_bytes or param_bytes


def entry_seconds(entry: ParamEntry, time_model: CostModel) -> float:
    """Seconds of one update of a schedule's matrix, priced as the submatrices it is updated as
    (its row blocks, or itself)."""
    return sum(
        time_model.matrix_cost(rows, cols) for rows, cols in submatrices(entry.shape, as_blocks(entry.row_blocks))
    )


def _matrix(entry: ParamEntry, time_model: CostModel) -> Matrix:
    full = math.prod(entry.shape)
    return Matrix(
        name=entry.name,
        seconds=entry_seconds(entry, time_model),
        shard_bytes=GRAD_BYTES * entry.numel,
        full_bytes=GRAD_BYTES * full,
        replicated=entry.tp_dim is None,
        bucket=entry.bucket,
        offset=entry.offset,
        numel=entry.numel,
        param_bytes=DTYPE_BYTES[entry.dtype],
        owner=entry.owner if entry.owner is not None else 0,
        ep_rank=entry.ep_rank,
        shape=(entry.shape[0], entry.shape[1]),
    )


def _buffer(link: Link, buckets: Sequence[BucketEntry], matrices: Sequence[Matrix], dp_collectives: str) -> Buffer:
    entries: list[list[Matrix]] = [[] for _ in buckets]
    for matrix in matrices:
        entries[matrix.bucket].append(matrix)
    for bucket in entries:
        bucket.sort(key=lambda m: m.offset)
    return Buffer(
        link=link,
        numel=tuple(b.numel for b in buckets),
        cuts=tuple(tuple(b.cuts) for b in buckets),
        entries=tuple(tuple(bucket) for bucket in entries),
        param_bytes=tuple(bucket[0].param_bytes if bucket else 2 for bucket in entries),
        collectives=tuple(b.collective if dp_collectives == AS_SCHEDULED else dp_collectives for b in buckets),
    )


def build_instance(
    schedule: Schedule,
    hardware: Hardware,
    time_model: CostModel,
    fused: bool = False,
    publish_bytes: int | None = None,
    dp_collectives: str = AS_SCHEDULED,
    overlap_grad: bool = True,
    overlap_param: bool = False,
) -> Instance:
    """The simulator's view of a schedule on a hardware model (options as `simulate` takes them)."""
    req = schedule.request
    if dp_collectives not in DP_COLLECTIVE_MODES:
        raise PlanError(f"unknown DP collectives {dp_collectives!r}; choose one of {', '.join(DP_COLLECTIVE_MODES)}")
    dp_link, expert_link, tp_link = layout_links(hardware.network, req.tp, req.dp, req.ep)
    matrices = [_matrix(e, time_model) for e in schedule.params if e.optimizer == MATRIX]
    dense = _buffer(dp_link, schedule.dp.buckets, [m for m in matrices if m.ep_rank is None], dp_collectives)
    experts = (
        tuple(
            _buffer(expert_link, schedule.dp.expert_buckets, [m for m in matrices if m.ep_rank == e], dp_collectives)
            for e in range(req.ep)
        )
        if schedule.dp.expert_buckets
        else ()
    )
    adamw = [e for e in schedule.params if e.optimizer != MATRIX]
    return Instance(
        tp=req.tp,
        dp=req.dp,
        ep=req.ep,
        dp_link=dp_link,
        expert_link=expert_link,
        tp_link=tp_link,
        dense=dense,
        experts=experts,
        adamw_numel=tuple(b.numel for b in schedule.dp.adamw_buckets),
        adamw_cuts=tuple(tuple(b.cuts) for b in schedule.dp.adamw_buckets),
        adamw_param_bytes=DTYPE_BYTES[adamw[0].dtype] if adamw else 2,
        matrices={m.name: m for m in matrices},
        time_model=time_model,
        fused=fused,
        publish_bytes=publish_bytes,
        overlap_grad=overlap_grad,
        overlap_param=overlap_param,
        ns_steps=req.optimizer.ns_steps,
        ns_method=req.optimizer.ns_method,
        gram_restart=req.optimizer.gram_restart,
    )


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Local:
    """One DP rank's local stage: its length, each TP rank's busy compute, its TP comm."""

    seconds: float
    compute: tuple[float, ...]
    tp_comm: float


@dataclass(frozen=True)
class BucketSync:
    """One bucket's DP collective (a gradient reduction or a parameter gather): the buffer
    (`DENSE`, `EXPERT` or `ADAMW_BUFFER`), the bucket's index in it, the exchange, and the
    collective it runs as (`BUCKET_COLLECTIVES`)."""

    buffer: str
    bucket: int
    exchange: Exchange
    collective: str = "ring"


@dataclass(frozen=True)
class DpPhases:
    """A strategy's DP collectives in issue order, and what they overlap as its authors run it.

    `reduce`: per bucket, once backward has produced the bucket's gradients (during backward
    when `overlap_grad`, else after it). `fetch`: after every reduction, before the local
    stage. `publish`: after the local stage, never overlapped. `gather`: per bucket, after
    `publish` (waited for by the next forward's modules when `overlap_param`, else before
    the step returns)."""

    reduce: tuple[BucketSync, ...]
    fetch: tuple[Exchange, ...] = ()
    publish: tuple[Exchange, ...] = ()
    gather: tuple[BucketSync, ...] = ()
    overlap_grad: bool = True
    overlap_param: bool = False

    def before(self, fused: bool) -> float:
        """Seconds of every DP collective before the local stage, nothing overlapped."""
        return phase_seconds([s.exchange for s in self.reduce] + list(self.fetch), fused)

    def after(self, fused: bool) -> float:
        """Seconds of every DP collective after the local stage, nothing overlapped."""
        return phase_seconds(list(self.publish) + [s.exchange for s in self.gather], fused)


@dataclass(frozen=True)
class StrategyTime:
    """Predicted step of one strategy. `compute`, `comm` (every collective it takes part in,
    hidden or not) and `exposed_comm` (= step − compute) are the critical device's: the one
    the final DP collective waits for (global rank = dp_rank · tp + tp_rank). `phases`: its
    DP collectives, for the iteration model."""

    name: str
    description: str
    step: float
    compute: float
    comm: float
    exposed_comm: float
    dp_comm: float
    tp_comm: float
    critical_device: int
    phases: DpPhases = field(repr=False, compare=False, default=DpPhases(()))

    @property
    def optimizer_stage(self) -> float:
        """The step without its DP collectives (Megatron overlaps those with backward and
        forward): reduced gradients to updated local shards on the slowest device."""
        return self.step - self.dp_comm


def combine(
    name: str, description: str, tp: int, phases: DpPhases, locals_: Sequence[Local], fused: bool = False
) -> StrategyTime:
    """Step time from the DP collectives and every DP rank's local stage."""
    best = (-1.0, -1.0, 0, 0)
    for dp_rank, local in enumerate(locals_):
        for tp_rank, compute in enumerate(local.compute):
            if (local.seconds, compute) > best[:2]:
                best = (local.seconds, compute, dp_rank, tp_rank)
    seconds, compute, dp_rank, tp_rank = best
    seconds, compute = max(seconds, 0.0), max(compute, 0.0)
    before, after = phases.before(fused), phases.after(fused)
    step = before + seconds + after
    tp_comm = locals_[dp_rank].tp_comm if locals_ else 0.0
    return StrategyTime(
        name=name,
        description=description,
        step=step,
        compute=compute,
        comm=before + after + tp_comm,
        exposed_comm=step - compute,
        dp_comm=before + after,
        tp_comm=tp_comm,
        critical_device=dp_rank * tp + tp_rank,
        phases=phases,
    )


# --------------------------------------------------------------------------------------------
# canzona (with and without micro-group overlap)


def team_seconds(inst: Instance, matrix: Matrix, k: int) -> float:
    """Seconds of one member of a k-host team (`canzona.planner.partition.cooperative`): the
    matrix's seconds scaled by the team's share of the FLOPs, plus the Gram all-reduces (one
    r x r fp32 per Newton-Schulz iteration, one norm) over k ranks of the TP link."""
    rows, cols = matrix.shape
    shape = Shape(rows, cols, None)
    # a team runs its own sharded standard iteration, whatever the method the matrix is priced by
    priced = muon_flops(rows, cols, inst.ns_steps, inst.ns_method, inst.gram_restart)
    share = team_flops(shape, k, inst.ns_steps) / priced
    link = Link(inst.tp_link.name, k, inst.tp_link.bandwidth, inst.tp_link.latency)
    gram = all_reduce(link, min(rows, cols) ** 2, GRAD_BYTES).seconds()
    return matrix.seconds * share + inst.ns_steps * gram + all_reduce(link, 1, GRAD_BYTES).seconds()


def micro_group_times(
    inst: Instance, names: Sequence[str], hosts: Sequence[int], teams: Sequence[TeamEntry] = ()
) -> tuple[GroupTimes, list[float]]:
    """One micro-group's gather, compute and scatter, and each TP rank's compute in it. A
    team member receives (sends back) 1/k of every other rank's shard."""
    p = inst.tp
    loads = [0.0] * p
    g_sent, g_recv, s_sent, s_recv = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    team_of = {team.param: team.hosts for team in teams}
    for name, host in zip(names, hosts):
        matrix = inst.matrices[name]
        members = team_of.get(name, [host])
        seconds = team_seconds(inst, matrix, len(members)) if len(members) > 1 else matrix.seconds
        piece = (matrix.full_bytes if matrix.replicated else matrix.shard_bytes) / len(members)
        for member in members:
            loads[member] += seconds
            for rank in range(p):
                if rank == member:
                    if not matrix.replicated:
                        g_recv[rank] += (p - 1) * piece
                    s_sent[rank] += (p - 1) * piece
                else:
                    if not matrix.replicated:
                        g_sent[rank] += piece
                    s_recv[rank] += piece
    gather = Exchange("all-to-all", inst.tp_link, tuple(g_sent), tuple(g_recv)).seconds()
    scatter = Exchange("all-to-all", inst.tp_link, tuple(s_sent), tuple(s_recv)).seconds()
    return GroupTimes(gather, max(loads), scatter), loads


def dp_sync(
    inst: Instance,
    cuts_of: Sequence[tuple[int, ...]],
    buffer: Buffer,
    gather: bool,
    name: str = DENSE,
    equal: bool = False,
) -> list[BucketSync]:
    """Reduce-scatter (gather=False) or all-gather of one matrix buffer at the given cuts, one
    collective per bucket (the buffer's; `equal`: stock equal cuts, a native ring)."""
    out = []
    for bucket, cuts in enumerate(cuts_of):
        elem_bytes = inst.gather_bytes(buffer.param_bytes[bucket]) if gather else GRAD_BYTES
        collective = "ring" if equal else buffer.collectives[bucket]
        exchange = bucket_exchange(buffer.link, slice_sizes(cuts), elem_bytes, gather, collective)
        out.append(BucketSync(name, bucket, exchange, collective))
    return out


def adamw_sync(inst: Instance, gather: bool) -> list[BucketSync]:
    """Stock equal reduce-scatter or all-gather of the AdamW buffer, one per bucket."""
    out = []
    for bucket, cuts in enumerate(inst.adamw_cuts):
        slices = slice_sizes(cuts)
        exchange = (
            all_gather(inst.dp_link, slices, inst.gather_bytes(inst.adamw_param_bytes))
            if gather
            else reduce_scatter(inst.dp_link, slices, GRAD_BYTES)
        )
        out.append(BucketSync(ADAMW_BUFFER, bucket, exchange))
    return out


def schedule_sync(inst: Instance, gather: bool) -> list[BucketSync]:
    """The schedule's uneven DP collectives of every buffer (dense, experts, AdamW)."""
    syncs = dp_sync(inst, inst.dense.cuts, inst.dense, gather)
    if inst.experts:
        syncs += dp_sync(inst, inst.experts[0].cuts, inst.experts[0], gather, EXPERT)
    return syncs + adamw_sync(inst, gather)


def schedule_phases(inst: Instance) -> DpPhases:
    """The DP collectives of canzona's geometry, overlapped as the caller asked (the runtime's
    `overlap_grad_reduce` and `overlap_param_gather`)."""
    return DpPhases(
        reduce=tuple(schedule_sync(inst, gather=False)),
        gather=tuple(schedule_sync(inst, gather=True)),
        overlap_grad=inst.overlap_grad,
        overlap_param=inst.overlap_param,
    )


# --------------------------------------------------------------------------------------------
# The replicated (synchronous, TP-SC) update: every TP rank updates every matrix of its DP rank

Work = tuple[float, int]  # (update seconds, sharded fp32 bytes to all-gather over TP)


def matrix_work(matrices: Sequence[Matrix]) -> Work:
    """The update seconds of `matrices` and the fp32 bytes a TP all-gather moves for them."""
    return sum(m.seconds for m in matrices), sum(m.shard_bytes for m in matrices if not m.replicated)


def by_schedule(buffer: Buffer, n: int) -> list[list[Matrix]]:
    """Each of `n` ranks' matrices of `buffer`, as the schedule's owners say."""
    ranks: list[list[Matrix]] = [[] for _ in range(n)]
    for bucket in buffer.entries:
        for matrix in bucket:
            ranks[matrix.owner].append(matrix)
    return ranks


def synchronous_locals(
    inst: Instance,
    dense: Sequence[Work],
    experts: Sequence[Sequence[Work]],
    adamw: Callable[[int], int] | None = None,
) -> list[Local]:
    """Every DP rank's local stage when every TP rank updates every matrix the rank has
    (`dense[rank]`, and its EP rank's `experts`): one fused TP all-gather, the updates, then
    AdamW on `adamw(rank)` elements (default: the rank's equal slices)."""
    elements = adamw or inst.adamw_elements
    locals_ = []
    for rank in range(inst.dp):
        seconds, shard = dense[rank]
        if experts:
            extra = experts[rank % inst.ep][rank // inst.ep]
            seconds, shard = seconds + extra[0], shard + extra[1]
        gather = all_gather(inst.tp_link, [shard] * inst.tp, 1).seconds()
        compute = seconds + inst.time_model.adamw_cost(elements(rank))
        locals_.append(Local(gather + compute, (compute,) * inst.tp, gather))
    return locals_


def replicated_locals(inst: Instance) -> list[Local]:
    """Every DP rank's local stage under a replicated TP update of the schedule's owners."""
    dense = [matrix_work(ms) for ms in by_schedule(inst.dense, inst.dp)]
    experts = [[matrix_work(ms) for ms in by_schedule(buffer, inst.dp // inst.ep)] for buffer in inst.experts]
    return synchronous_locals(inst, dense, experts)


def canzona_locals(inst: Instance, schedule: Schedule, overlap: bool = True) -> list[Local]:
    """Every DP rank's local stage under canzona: its micro-groups pipelined (back to back
    without `overlap`), then AdamW; under a replicated TP update, `replicated_locals`."""
    if schedule.tp.update != HOSTED:
        return replicated_locals(inst)
    locals_ = []
    for dp_rank, rank_plan in enumerate(schedule.tp.ranks):
        compute, groups = [0.0] * inst.tp, []
        for group in rank_plan.groups:
            times, loads = micro_group_times(inst, group.params, group.hosts, group.teams)
            groups.append(times)
            compute = [a + b for a, b in zip(compute, loads)]
        adamw = inst.time_model.adamw_cost(inst.adamw_elements(dp_rank))
        phase = pipeline_seconds(groups, overlap)
        tp_comm = sum(g.gather + g.scatter for g in groups)
        locals_.append(Local(phase + adamw, tuple(c + adamw for c in compute), tp_comm))
    return locals_


def canzona_parts(inst: Instance, schedule: Schedule) -> tuple[dict[str, float], Local]:
    """`canzona_time`'s step in parts, each bucket priced without listing every rank's bytes:
    the seconds of each matrix buffer's buckets by collective form (reduce plus gather, keyed
    "<buffer> buckets, <form>"), of the AdamW buffer ("AdamW buffer"), and the critical DP
    rank's local stage. The step is the parts' sum plus that stage's seconds."""
    parts: dict[str, float] = {}
    buffers = [(DENSE, inst.dense)] + ([(EXPERT, inst.experts[0])] if inst.experts else [])
    for name, buffer in buffers:
        for cuts, param_bytes, collective in zip(buffer.cuts, buffer.param_bytes, buffer.collectives):
            key = f"{name} buckets, {collective}"
            seconds = bucket_seconds(
                buffer.link, slice_sizes(cuts), GRAD_BYTES, inst.gather_bytes(param_bytes), collective
            )
            parts[key] = parts.get(key, 0.0) + seconds
    parts["AdamW buffer"] = sum(s.exchange.seconds() for gather in (False, True) for s in adamw_sync(inst, gather))
    return parts, critical_local(canzona_locals(inst, schedule))


def critical_local(locals_: Sequence[Local]) -> Local:
    """The DP rank's local stage that sets the step: the longest (ties: the busiest device)."""
    return max(locals_, key=lambda stage: (stage.seconds, max(stage.compute)))


def canzona_time(inst: Instance, schedule: Schedule, overlap: bool = True) -> StrategyTime:
    """canzona as the runtime executes it; overlap=False runs each micro-group back to back."""
    locals_ = canzona_locals(inst, schedule, overlap)
    phases = schedule_phases(inst)
    if schedule.tp.update != HOSTED:
        return combine(
            "canzona" if overlap else "canzona-no-overlap",
            "uneven reduce-scatter at the schedule's cuts; replicated TP update (one fused "
            "all-gather, every TP rank updates every owned matrix); AdamW on equal slices; "
            "uneven all-gather",
            inst.tp,
            phases,
            locals_,
            inst.fused,
        )
    if overlap:
        return combine(
            "canzona",
            "uneven reduce-scatter at the schedule's cuts; TP micro-groups (fused "
            "all-to-all gather, host update, fused all-to-all scatter) pipelined as the runtime "
            "issues them; AdamW on equal slices; uneven all-gather",
            inst.tp,
            phases,
            locals_,
            inst.fused,
        )
    return combine(
        "canzona-no-overlap",
        "canzona with each micro-group's gather, compute and scatter run back to back (no pipelining)",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def default_time_model(schedule: Schedule, hardware: Hardware) -> CostModel:
    """Throughput-based seconds for the schedule's optimizer on `hardware`."""
    opt = schedule.request.optimizer
    return ThroughputCost(hardware, OptimizerConfig(**opt.model_dump()))
