"""Index arithmetic of a schedule: where every element travels. No tensors, no collectives.

The *bucket buffer* is Megatron's gradient buffer: every DP bucket (dense matrix buckets,
expert buckets, then AdamW buckets) whole, one after the other; each parameter's local
(TP-shard) elements are one contiguous run at `DpLayout.flat[param]`. Gradients are packed and
reduced there, bucket by bucket, and updated values gathered there. Bucket b is cut into one
slice per rank of its group; a `Piece` is the part of one parameter inside one slice: a matrix
parameter is one piece (cuts lie on parameter boundaries), an AdamW one may be split by cuts.

Under expert parallelism (schedule `ep` > 1) a layout is built for one EP rank: its expert
buffer holds that EP rank's experts only (every EP rank lays its experts out alike), each expert
bucket is cut over the expert-data-parallel group, the DP ranks `o · ep + ep_rank` for
expert-DP rank o. Other EP ranks' experts are not in the layout.

`DpBucket.reduce_key` / `gather_key` order the buckets the way the collectives are issued (and
the simulator prices them): reductions in the order backward makes buckets ready (the bucket
whose first-registered parameter is registered latest first; ties by buffer, then bucket),
gathers in the order the next forward needs them (the reverse).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from math import prod

from canzona.schedules.checks import dp_rank_of
from canzona.schedules.format import AdamwBucketEntry, BucketEntry, ParamEntry, Schedule
from canzona.schedules.geometry import chunk_bounds, tp_shard_shape
from canzona.schedules.limits import ADAMW, DEFAULT_BUCKET_COLLECTIVE, MATRIX

EXPERT = "expert"  # the expert buffer (a matrix buffer cut over the expert-DP group)


@dataclass(frozen=True)
class Piece:
    """`length` elements of parameter `param` (registration index) from `src` in its flattened
    local tensor, at `pos` in the bucket buffer."""

    param: int
    src: int
    pos: int
    length: int


BUFFER_ORDER = {MATRIX: 0, EXPERT: 1, ADAMW: 2}  # the simulator's order of buffers (dense, expert, AdamW)


@dataclass(frozen=True)
class DpBucket:
    """One DP bucket: its buffer (`kind`) and index there, where it starts in the bucket
    buffer, its n + 1 cuts (bucket coordinates) over the n ranks of its group, the
    registration indices of its parameters, and the DP ranks of its group in group-rank order
    (every DP rank; for an expert bucket the expert-DP group). `lead`: the registration index
    that orders an expert bucket, that of EP rank 0's expert at its start, so that every EP rank
    issues the buckets in one order (the simulator's). `collective`: how the schedule says to
    reduce and gather it (`canzona.schedules.limits.BUCKET_COLLECTIVES`; AdamW buckets, cut
    equally: "ring")."""

    kind: str
    index: int
    base: int
    cuts: tuple[int, ...]
    params: tuple[int, ...]
    dp_ranks: tuple[int, ...] = ()
    lead: int | None = None
    collective: str = DEFAULT_BUCKET_COLLECTIVE

    @property
    def numel(self) -> int:
        """Elements of the bucket (padded)."""
        return self.cuts[-1]

    @property
    def slices(self) -> tuple[int, ...]:
        """Elements of each rank's slice."""
        return tuple(self.cuts[r + 1] - self.cuts[r] for r in range(len(self.cuts) - 1))

    @property
    def equal(self) -> bool:
        """Whether every slice has the same size (a native reduce-scatter / all-gather fits)."""
        return len(set(self.slices)) == 1

    def slice_of(self, dp_rank: int) -> tuple[int, int] | None:
        """[start, stop) of DP rank `dp_rank`'s slice in the bucket buffer (None: not in the group)."""
        if dp_rank not in self.dp_ranks:
            return None
        position = self.dp_ranks.index(dp_rank)
        return self.base + self.cuts[position], self.base + self.cuts[position + 1]

    @property
    def first(self) -> int:
        """The smallest registration index in the bucket (EP rank 0's for an expert bucket):
        backward makes its gradient last and the next forward uses it first (0 for a bucket
        without parameters)."""
        return self.lead if self.lead is not None else min(self.params, default=0)

    def reduce_key(self) -> tuple[int, int, int]:
        """Sort key of the reduction order (readiness during backward)."""
        return -self.first, BUFFER_ORDER[self.kind], self.index

    def gather_key(self) -> tuple[int, int, int]:
        """Sort key of the gather order (first needed by the next forward first)."""
        return self.first, BUFFER_ORDER[self.kind], self.index


@dataclass(frozen=True)
class DpLayout:
    """The DP buffers: the buckets, each parameter's start in the bucket buffer and its bucket
    (position in `buckets`), the pieces of each DP rank's slices (buffer order), and the
    positions of the buckets in reduction and in gather order."""

    buckets: tuple[DpBucket, ...]
    flat: tuple[int, ...]
    bucket_of: tuple[int, ...]
    rank_pieces: tuple[tuple[Piece, ...], ...]
    reduce_order: tuple[int, ...] = ()
    gather_order: tuple[int, ...] = ()

    @cached_property
    def reduce_position(self) -> dict[int, int]:
        """Each bucket's position in the reduction order."""
        return {bucket: position for position, bucket in enumerate(self.reduce_order)}

    @property
    def total(self) -> int:
        """Elements of the whole bucket buffer (every bucket of every buffer, padded)."""
        return self.buckets[-1].base + self.buckets[-1].numel if self.buckets else 0


def local_shape(entry: ParamEntry, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The shape of TP rank `tp_rank`'s shard of `entry` (torch.chunk's rule, as DTensor
    shards: the last ranks' may be shorter, or empty)."""
    return tp_shard_shape(entry.shape, entry.tp_dim, tp, tp_rank)


def buffer_of(entry: ParamEntry) -> str:
    """The DP buffer a parameter lives in: dense matrices, experts (EP rank set) or AdamW."""
    if entry.optimizer == ADAMW:
        return ADAMW
    return MATRIX if entry.ep_rank is None else EXPERT


def local_entries(schedule: Schedule, ep_rank: int = 0) -> list[ParamEntry]:
    """The parameters a rank of EP rank `ep_rank` holds: every dense one and its own experts."""
    return [e for e in schedule.params if e.ep_rank is None or e.ep_rank == ep_rank]


def group_dp_ranks(schedule: Schedule, kind: str, ep_rank: int) -> tuple[int, ...]:
    """The DP ranks a bucket of buffer `kind` is cut over, in group-rank order."""
    dp, ep = schedule.request.dp, schedule.request.ep
    if kind == EXPERT:
        return tuple(o * ep + ep_rank for o in range(dp // ep))
    return tuple(range(dp))


def build_dp_layout(schedule: Schedule, ep_rank: int = 0, tp_rank: int = 0) -> DpLayout:
    """The bucket buffer of `schedule` (bucket cuts of every buffer) on a rank of EP rank
    `ep_rank` (0 without expert parallelism) and TP rank `tp_rank`. A parameter's slot is its
    schedule `numel`; where this rank's TP shard is shorter (uneven TP), its pieces cover the
    shard only and the rest of the slot is padding that nothing reads."""
    entries = local_entries(schedule, ep_rank)
    buckets, flat, bucket_of = _buckets(schedule, entries, ep_rank)
    pieces: list[list[Piece]] = [[] for _ in range(schedule.request.dp)]
    for entry in entries:
        bucket = buckets[bucket_of[entry.index]]
        cuts, stop = bucket.cuts, entry.offset + prod(local_shape(entry, schedule.request.tp, tp_rank))
        first = max(0, bisect_right(cuts, entry.offset) - 1)
        last = min(len(bucket.dp_ranks), bisect_left(cuts, stop))
        for where in range(first, last):
            low, high = max(entry.offset, cuts[where]), min(stop, cuts[where + 1])
            if low < high:
                pieces[bucket.dp_ranks[where]].append(
                    Piece(entry.index, low - entry.offset, bucket.base + low, high - low)
                )
    for rank in pieces:
        rank.sort(key=lambda piece: piece.pos)
    return DpLayout(
        buckets=buckets,
        flat=flat,
        bucket_of=bucket_of,
        rank_pieces=tuple(tuple(rank) for rank in pieces),
        reduce_order=tuple(sorted(range(len(buckets)), key=lambda b: buckets[b].reduce_key())),
        gather_order=tuple(sorted(range(len(buckets)), key=lambda b: buckets[b].gather_key())),
    )


def _buckets(
    schedule: Schedule, entries: list[ParamEntry], ep_rank: int
) -> tuple[tuple[DpBucket, ...], tuple[int, ...], tuple[int, ...]]:
    """Every DP bucket in buffer order, each parameter's start in the bucket buffer and the
    position of its bucket (0 for another EP rank's experts, which are not in the layout)."""
    buffers: dict[str, Sequence[BucketEntry | AdamwBucketEntry]] = {
        MATRIX: schedule.dp.buckets,
        EXPERT: schedule.dp.expert_buckets,
        ADAMW: schedule.dp.adamw_buckets,
    }
    params: dict[tuple[str, int], list[int]] = {}
    for entry in entries:
        params.setdefault((buffer_of(entry), entry.bucket), []).append(entry.index)
    leads: dict[int, int] = {}
    for entry in schedule.params:
        if entry.ep_rank == 0:
            leads[entry.bucket] = min(leads.get(entry.bucket, entry.index), entry.index)
    out: list[DpBucket] = []
    base = 0
    position: dict[tuple[str, int], int] = {}
    for kind in (MATRIX, EXPERT, ADAMW):
        ranks = group_dp_ranks(schedule, kind, ep_rank)
        for index, bucket in enumerate(buffers[kind]):
            position[(kind, index)] = len(out)
            out.append(
                DpBucket(
                    kind,
                    index,
                    base,
                    tuple(bucket.cuts),
                    tuple(sorted(params.get((kind, index), []))),
                    ranks,
                    leads.get(index) if kind == EXPERT else None,
                    bucket.collective if isinstance(bucket, BucketEntry) else "ring",
                )
            )
            base += bucket.cuts[-1]
    flat, bucket_of = [0] * len(schedule.params), [0] * len(schedule.params)
    for entry in entries:
        bucket_of[entry.index] = position[(buffer_of(entry), entry.bucket)]
        flat[entry.index] = out[bucket_of[entry.index]].base + entry.offset
    return tuple(out), tuple(flat), tuple(bucket_of)


@dataclass(frozen=True)
class Task:
    """The update of one matrix: its registration index, host TP rank, full shape, TP dim
    (None: replicated) and TP size, row blocks, the model dtype of the parameter (the
    schedule's name: fp32, bf16, fp16) and, when a team hosts it
    (`canzona.runtime.rules.cooperative`), the team's TP ranks. TP rank r holds its chunk of
    the TP dim by torch.chunk's rule (`shard_box`): the last ranks' may be shorter, or empty."""

    param: int
    host: int
    shape: tuple[int, int]
    tp_dim: int | None
    tp_size: int
    row_blocks: list[list[list[int]]] | None
    dtype: str = "fp32"
    team: tuple[int, ...] = ()  # cooperative hosting: the TP ranks sharing it (`host` among them)

    def shard_box(self, tp_rank: int) -> tuple[tuple[int, int], ...]:
        """Per dim, the [start, stop) of TP rank `tp_rank`'s shard in the full matrix."""
        return tuple(
            chunk_bounds(size, self.tp_size)[tp_rank] if dim == self.tp_dim else (0, size)
            for dim, size in enumerate(self.shape)
        )

    def shard_shape(self, tp_rank: int) -> tuple[int, ...]:
        """The shape of TP rank `tp_rank`'s shard (the full shape when replicated)."""
        return tuple(stop - start for start, stop in self.shard_box(tp_rank))

    def shard_numel(self, tp_rank: int) -> int:
        """Elements of TP rank `tp_rank`'s shard."""
        return prod(self.shard_shape(tp_rank))


def hosts_here(task: Task, rank: int) -> bool:
    """Whether TP rank `rank` updates `task` (its host, or a member of its team)."""
    return rank in task.team if task.team else task.host == rank


def matrix_tasks(schedule: Schedule, names: list[str] | None = None) -> dict[str, Task]:
    """A host-0 task for every matrix parameter (or those in `names`), keyed by name."""
    tp = schedule.request.tp
    wanted = set(names) if names is not None else None
    return {
        e.name: Task(e.index, 0, (e.shape[0], e.shape[1]), e.tp_dim, tp, e.row_blocks, e.dtype)
        for e in schedule.params
        if e.optimizer == MATRIX and (wanted is None or e.name in wanted)
    }


def micro_groups(schedule: Schedule, dp_rank: int) -> list[tuple[Task, ...]]:
    """The micro-groups of `dp_rank` in execution order, each task carrying its host."""
    tasks = matrix_tasks(schedule)
    groups = schedule.tp.ranks[dp_rank].groups
    return [
        tuple(replace(tasks[name], host=host, team=tuple(teams.get(name, ()))) for name, host in zip(g.params, g.hosts))
        for g in groups
        for teams in ({team.param: team.hosts for team in g.teams},)
    ]


def owned_tasks(schedule: Schedule, dp_ranks: list[int], ep_rank: int = 0) -> list[Task]:
    """Every matrix held at EP rank `ep_rank` and updated by one of `dp_ranks`, in buffer
    order (for the baselines)."""
    tasks, ep = matrix_tasks(schedule), schedule.request.ep
    return [
        tasks[e.name]
        for e in local_entries(schedule, ep_rank)
        if e.optimizer == MATRIX and e.owner is not None and dp_rank_of(e, ep) in dp_ranks
    ]
