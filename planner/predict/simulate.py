"""Predict one optimizer step of a schedule, and of every baseline, on a hardware model.

A step runs from unreduced gradients to updated parameters on every device, in three stages:
DP collectives before (gradient reduce-scatter / all-reduce, spill-over fetches), a local
stage per device (TP collectives, matrix updates, AdamW), DP collectives after (parameter
all-gather / broadcasts). DP collectives synchronise their group, so

    step = Σ before + max over devices of the local stage + Σ after.

Collectives follow an α–β model on the busiest rank of the group (links are full duplex):

    seconds = steps · α + max over ranks of max(bytes sent, bytes received) / bandwidth

with steps = n − 1 for reduce-scatter, all-gather and all-to-all (ring / pairwise exchange),
2(n − 1) for a ring all-reduce (each rank moves 2(n − 1)/n of the buffer), ⌈log2 n⌉ for a
pipelined broadcast (each rank moves the buffer once), and 1 for a point-to-point round.
Per-rank bytes are the schedule's own: an uneven reduce-scatter, done as the runtime does it
(all_to_all with split sizes; NCCL's reduce_scatter would pad every slice to the largest, the
same bytes on the busiest rank), makes rank r receive (n − 1)·slice_r, so a bucket landing on
one rank costs its link the whole bucket n − 1 times. A group whose ranks span nodes uses the
inter-node bandwidth, otherwise the intra-node one. Gradients move in fp32 (Megatron's main
grads; the runtime's TP exchanges), parameters in their dtype.

Compute comes from a seconds cost model (`ThroughputCost`: flops model / achieved FLOP/s, or a
measured `ProfileCost`). The TP micro-group pipeline is simulated event by event, in the order
`MicroGroupPipeline.run` issues it. Baselines are in `canzona.planner.predict.sim_baselines`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from canzona.planner.partition.costs import CostModel, OptimizerConfig
from canzona.planner.partition.layout import slice_sizes
from canzona.planner.predict.hardware import Hardware, ThroughputCost
from canzona.planner.spec import DTYPE_BYTES
from canzona.schedules.format import BucketEntry, ParamEntry, Schedule

GRAD_BYTES = 4  # fp32 gradients and updates on the wire
MATRIX = "matrix"
STEP_FACTORS = {"reduce-scatter": 1, "all-gather": 1, "all-to-all": 1, "all-reduce": 2}


@dataclass(frozen=True)
class Link:
    """The network of one process group: its size, per-rank bandwidth and α."""

    name: str
    size: int
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Exchange:
    """One collective: its kind and the bytes every rank of the group sends and receives."""

    kind: str
    link: Link
    sent: tuple[float, ...]
    received: tuple[float, ...]
    latency_steps: int | None = None

    def steps(self) -> int:
        """How many α the collective pays."""
        n = self.link.size
        if self.latency_steps is not None:
            return self.latency_steps
        if self.kind == "broadcast":
            return math.ceil(math.log2(n))
        return 1 if self.kind == "p2p" else STEP_FACTORS[self.kind] * (n - 1)

    def seconds(self) -> float:
        """α–β time of the collective on its busiest rank (0 for a group of one or no bytes)."""
        volume = max(max(self.sent, default=0.0), max(self.received, default=0.0))
        if self.link.size <= 1 or volume <= 0:
            return 0.0
        return self.steps() * self.link.latency + volume / self.link.bandwidth


def reduce_scatter(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven reduce-scatter: rank r gets slice r summed over the group."""
    total, n = sum(slices), link.size
    return Exchange("reduce-scatter", link, tuple(float((total - s) * elem_bytes) for s in slices),
                    tuple(float((n - 1) * s * elem_bytes) for s in slices))


def all_gather(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven all-gather: every rank gets every slice."""
    total, n = sum(slices), link.size
    return Exchange("all-gather", link, tuple(float((n - 1) * s * elem_bytes) for s in slices),
                    tuple(float((total - s) * elem_bytes) for s in slices))


def all_reduce(link: Link, numel: int, elem_bytes: int) -> Exchange:
    """Ring all-reduce of `numel` elements: every rank moves 2(n − 1)/n of the buffer each way."""
    n = link.size
    volume = 2 * (n - 1) * numel * elem_bytes / n if n > 1 else 0.0
    return Exchange("all-reduce", link, (volume,), (volume,))  # every rank alike: one entry


def broadcast(link: Link, nbytes: float) -> Exchange:
    """Pipelined broadcast of `nbytes` from one rank: every rank moves them once."""
    return Exchange("broadcast", link, (nbytes,), (nbytes,))  # every rank alike: one entry


def phase_seconds(exchanges: Sequence[Exchange], fused: bool = False) -> float:
    """Seconds of collectives run one after another. `fused`: collectives of the same kind on
    the same group become one (per-rank bytes summed, α paid once), as the runtime fuses
    every bucket into one exchange; broadcasts (different roots) never fuse."""
    if not fused:
        return sum(exchange.seconds() for exchange in exchanges)
    merged: dict[tuple[str, Link], Exchange] = {}
    rest: list[Exchange] = []
    for ex in exchanges:
        key = (ex.kind, ex.link)
        if ex.kind == "broadcast":
            rest.append(ex)
        elif key in merged:
            old = merged[key]
            merged[key] = Exchange(ex.kind, ex.link, tuple(a + b for a, b in zip(old.sent, ex.sent)),
                                   tuple(a + b for a, b in zip(old.received, ex.received)),
                                   max(old.steps(), ex.steps()))
        else:
            merged[key] = ex
    return sum(ex.seconds() for ex in (*merged.values(), *rest))


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


@dataclass(frozen=True)
class Buffer:
    """One matrix buffer over a DP group: bucket sizes, the schedule's cuts, and per bucket
    its matrices in buffer order."""

    link: Link
    numel: tuple[int, ...]
    cuts: tuple[tuple[int, ...], ...]
    entries: tuple[tuple[Matrix, ...], ...]
    param_bytes: tuple[int, ...]


@dataclass(frozen=True)
class Instance:
    """Everything the strategies price: links, buffers (dense; experts per EP rank), AdamW
    bucket sizes and cuts, and seconds per matrix and per AdamW slice."""

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
    rooted: bool = False

    def adamw_elements(self, dp_rank: int) -> int:
        """Elements of this DP rank's equal AdamW slices (per device: TP shards are local)."""
        return sum(cuts[dp_rank + 1] - cuts[dp_rank] for cuts in self.adamw_cuts)

    def gather_bytes(self, param_bytes: int) -> int:
        """Bytes per element of the parameter all-gather."""
        return self.publish_bytes or param_bytes


def group_link(hardware: Hardware, name: str, ranks: Sequence[int]) -> Link:
    """A process group's link: inter-node bandwidth if its ranks span nodes."""
    nodes = {rank // hardware.gpus_per_node for rank in ranks}
    bandwidth = hardware.inter_bandwidth if len(nodes) > 1 else hardware.intra_bandwidth
    return Link(name, len(ranks), bandwidth, hardware.latency)


def _links(hardware: Hardware, tp: int, dp: int, ep: int) -> tuple[Link, Link, Link]:
    """DP, expert-DP and TP links; the slowest of the translated groups decides."""
    def worst(name: str, groups: list[list[int]]) -> Link:
        return min((group_link(hardware, name, g) for g in groups), key=lambda link: link.bandwidth)

    dp_groups = [[r * tp + t for r in range(dp)] for t in {0, tp - 1}]
    expert_groups = [[(o * ep + e) * tp + t for o in range(dp // ep)] for t in {0, tp - 1} for e in {0, ep - 1}]
    tp_groups = [[r * tp + t for t in range(tp)] for r in range(dp)]
    return worst("dp", dp_groups), worst("expert-dp", expert_groups), worst("tp", tp_groups)


def submatrices(entry: ParamEntry) -> list[tuple[int, int]]:
    """Shapes the matrix optimizer updates one parameter as (its row blocks, or itself)."""
    if not entry.row_blocks:
        return [(entry.shape[0], entry.shape[1])]
    return [(sum(stop - start for start, stop in block), entry.shape[1]) for block in entry.row_blocks]


def _matrix(entry: ParamEntry, time_model: CostModel) -> Matrix:
    full = math.prod(entry.shape)
    return Matrix(
        name=entry.name,
        seconds=sum(time_model.matrix_cost(rows, cols) for rows, cols in submatrices(entry)),
        shard_bytes=GRAD_BYTES * entry.numel,
        full_bytes=GRAD_BYTES * full,
        replicated=entry.tp_dim is None,
        bucket=entry.bucket,
        offset=entry.offset,
        numel=entry.numel,
        param_bytes=DTYPE_BYTES[entry.dtype],
        owner=entry.owner if entry.owner is not None else 0,
        ep_rank=entry.ep_rank,
    )


def _buffer(link: Link, buckets: Sequence[BucketEntry], matrices: Sequence[Matrix]) -> Buffer:
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
    )


def build_instance(schedule: Schedule, hardware: Hardware, time_model: CostModel, fused: bool = False,
                   publish_bytes: int | None = None, rooted: bool = False) -> Instance:
    """The simulator's view of a schedule on a hardware model."""
    req = schedule.request
    dp_link, expert_link, tp_link = _links(hardware, req.tp, req.dp, req.ep)
    matrices = [_matrix(e, time_model) for e in schedule.params if e.optimizer == MATRIX]
    dense = _buffer(dp_link, schedule.dp.buckets, [m for m in matrices if m.ep_rank is None])
    experts = tuple(
        _buffer(expert_link, schedule.dp.expert_buckets, [m for m in matrices if m.ep_rank == e])
        for e in range(req.ep)
    ) if schedule.dp.expert_buckets else ()
    adamw = [e for e in schedule.params if e.optimizer != MATRIX]
    return Instance(
        tp=req.tp, dp=req.dp, ep=req.ep, dp_link=dp_link, expert_link=expert_link, tp_link=tp_link,
        dense=dense, experts=experts,
        adamw_numel=tuple(b.numel for b in schedule.dp.adamw_buckets),
        adamw_cuts=tuple(tuple(b.cuts) for b in schedule.dp.adamw_buckets),
        adamw_param_bytes=DTYPE_BYTES[adamw[0].dtype] if adamw else 2,
        matrices={m.name: m for m in matrices}, time_model=time_model, fused=fused, publish_bytes=publish_bytes,
        rooted=rooted,
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
class StrategyTime:
    """Predicted step of one strategy. `compute`, `comm` (every collective it takes part in,
    hidden or not) and `exposed_comm` (= step − compute) are the critical device's: the one
    the final DP collective waits for (global rank = dp_rank · tp + tp_rank)."""

    name: str
    description: str
    step: float
    compute: float
    comm: float
    exposed_comm: float
    dp_comm: float
    tp_comm: float
    critical_device: int

    @property
    def optimizer_stage(self) -> float:
        """The step without its DP collectives (Megatron overlaps those with backward and
        forward): reduced gradients to updated local shards on the slowest device."""
        return self.step - self.dp_comm


@dataclass(frozen=True)
class Simulation:
    """Every strategy's predicted step (canzona first) on one hardware model."""

    model: str
    tp: int
    dp: int
    ep: int
    optimizer: str
    hardware: Hardware
    time_model: str
    fused: bool
    rooted: bool
    strategies: tuple[StrategyTime, ...]

    def get(self, name: str) -> StrategyTime:
        """The strategy called `name` (KeyError if absent)."""
        for strategy in self.strategies:
            if strategy.name == name:
                return strategy
        raise KeyError(name)

    def ratios(self) -> dict[str, float]:
        """Each strategy's step time over canzona's."""
        base = self.get("canzona").step
        return {s.name: (s.step / base if base else 1.0) for s in self.strategies}


def combine(name: str, description: str, tp: int, before: float, locals_: Sequence[Local], after: float) -> StrategyTime:
    """Step time from the DP stages and every DP rank's local stage."""
    best = (-1.0, -1.0, 0, 0)
    for dp_rank, local in enumerate(locals_):
        for tp_rank, compute in enumerate(local.compute):
            if (local.seconds, compute) > best[:2]:
                best = (local.seconds, compute, dp_rank, tp_rank)
    seconds, compute, dp_rank, tp_rank = best
    seconds, compute = max(seconds, 0.0), max(compute, 0.0)
    step = before + seconds + after
    tp_comm = locals_[dp_rank].tp_comm if locals_ else 0.0
    return StrategyTime(
        name=name, description=description, step=step, compute=compute, comm=before + after + tp_comm,
        exposed_comm=step - compute, dp_comm=before + after, tp_comm=tp_comm,
        critical_device=dp_rank * tp + tp_rank,
    )


# --------------------------------------------------------------------------------------------
# canzona (with and without micro-group overlap)


def micro_group_times(inst: Instance, names: Sequence[str], hosts: Sequence[int]) -> tuple[GroupTimes, list[float]]:
    """One micro-group's gather, compute and scatter, and each TP rank's compute in it."""
    p = inst.tp
    loads = [0.0] * p
    g_sent, g_recv, s_sent, s_recv = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    for name, host in zip(names, hosts):
        matrix = inst.matrices[name]
        loads[host] += matrix.seconds
        piece = matrix.full_bytes if matrix.replicated else matrix.shard_bytes
        for rank in range(p):
            if rank == host:
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


def rooted(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """An uneven reduce-scatter (all-gather) done as one pipelined tree reduce (broadcast)
    per non-empty slice, rooted at its owner: every link carries the bucket once, whatever
    the cuts, for ⌈log2 n⌉ α per slice."""
    n, volume = link.size, float(sum(slices) * elem_bytes)
    steps = sum(1 for s in slices if s) * math.ceil(math.log2(n)) if n > 1 else 0
    return Exchange("rooted", link, (volume,), (volume,), steps)


def dp_sync(inst: Instance, cuts_of: Sequence[tuple[int, ...]], buffer: Buffer, gather: bool) -> list[Exchange]:
    """Reduce-scatter (gather=False) or all-gather of one matrix buffer at the given cuts."""
    exchanges = []
    for bucket, cuts in enumerate(cuts_of):
        slices = slice_sizes(cuts)
        elem_bytes = inst.gather_bytes(buffer.param_bytes[bucket]) if gather else GRAD_BYTES
        if inst.rooted and len(set(slices)) > 1:
            exchanges.append(rooted(buffer.link, slices, elem_bytes))
        elif gather:
            exchanges.append(all_gather(buffer.link, slices, elem_bytes))
        else:
            exchanges.append(reduce_scatter(buffer.link, slices, elem_bytes))
    return exchanges


def adamw_sync(inst: Instance, gather: bool) -> list[Exchange]:
    """Stock equal reduce-scatter or all-gather of the AdamW buffer."""
    out = []
    for cuts in inst.adamw_cuts:
        slices = slice_sizes(cuts)
        out.append(all_gather(inst.dp_link, slices, inst.gather_bytes(inst.adamw_param_bytes)) if gather
                   else reduce_scatter(inst.dp_link, slices, GRAD_BYTES))
    return out


def schedule_sync(inst: Instance, gather: bool) -> list[Exchange]:
    """The schedule's uneven DP collectives of every buffer (dense, experts, AdamW)."""
    exchanges = dp_sync(inst, inst.dense.cuts, inst.dense, gather)
    if inst.experts:
        exchanges += dp_sync(inst, inst.experts[0].cuts, inst.experts[0], gather)
    return exchanges + adamw_sync(inst, gather)


def canzona_time(inst: Instance, schedule: Schedule, overlap: bool = True) -> StrategyTime:
    """canzona as the runtime executes it; overlap=False runs each micro-group back to back."""
    locals_ = []
    for dp_rank, rank_plan in enumerate(schedule.tp.ranks):
        compute, groups = [0.0] * inst.tp, []
        for group in rank_plan.groups:
            times, loads = micro_group_times(inst, group.params, group.hosts)
            groups.append(times)
            compute = [a + b for a, b in zip(compute, loads)]
        adamw = inst.time_model.adamw_cost(inst.adamw_elements(dp_rank))
        phase = pipeline_seconds(groups, overlap)
        tp_comm = sum(g.gather + g.scatter for g in groups)
        locals_.append(Local(phase + adamw, tuple(c + adamw for c in compute), tp_comm))
    before = phase_seconds(schedule_sync(inst, gather=False), inst.fused)
    after = phase_seconds(schedule_sync(inst, gather=True), inst.fused)
    if overlap:
        return combine("canzona", "uneven reduce-scatter at the schedule's cuts; TP micro-groups (fused "
                       "all-to-all gather, host update, fused all-to-all scatter) pipelined as the runtime "
                       "issues them; AdamW on equal slices; uneven all-gather", inst.tp, before, locals_, after)
    return combine("canzona-no-overlap", "canzona with each micro-group's gather, compute and scatter run "
                   "back to back (no pipelining)", inst.tp, before, locals_, after)


def default_time_model(schedule: Schedule, hardware: Hardware) -> CostModel:
    """Throughput-based seconds for the schedule's optimizer on `hardware`."""
    opt = schedule.request.optimizer
    return ThroughputCost(hardware, OptimizerConfig(opt.name, opt.ns_steps, opt.block_size,
                                                    opt.precondition_frequency, opt.max_precond_dim))


def simulate(schedule: Schedule, hardware: Hardware, time_model: CostModel | None = None, *,
             fused: bool = False, publish_bytes: int | None = None, rooted: bool = False) -> Simulation:
    """Predict one optimizer step of the schedule and of every baseline on `hardware`.

    `time_model` prices compute in seconds (default: the flops model at the hardware's
    throughput). `fused`: every bucket of a buffer moves in one collective (as the runtime
    does) instead of one per bucket (Megatron). `publish_bytes`: element size of the
    parameter all-gather (default: the parameters' dtype; the CPU runtime gathers fp32).
    `rooted`: canzona's uneven collectives as one rooted reduce / broadcast per slice (the
    runtime's `dp_collectives="rooted"`); default: its `all_to_all`, whose busiest receiver
    takes (n − 1) · its slice."""
    from canzona.planner.predict.sim_baselines import baseline_times

    model = time_model or default_time_model(schedule, hardware)
    inst = build_instance(schedule, hardware, model, fused, publish_bytes, rooted)
    strategies = (canzona_time(inst, schedule), canzona_time(inst, schedule, overlap=False), *baseline_times(inst))
    req = schedule.request
    return Simulation(req.model.name, req.tp, req.dp, req.ep, req.optimizer.name, hardware,
                      getattr(model, "name", "seconds"), fused, rooted, strategies)


def predicted_ratios(schedule: Schedule, hardware: Hardware, time_model: CostModel | None = None, *,
                     fused: bool = True, publish_bytes: int | None = 4,
                     names: Sequence[str] = ("canzona", "dp-sc", "tp-sc")) -> dict[str, float]:
    """Predicted step seconds of `names` with the runtime's execution choices (fused DP
    exchange, fp32 parameter all-gather): the simulator side of the CPU cross-check."""
    sim = simulate(schedule, hardware, time_model, fused=fused, publish_bytes=publish_bytes)
    return {name: sim.get(name).step for name in names}
