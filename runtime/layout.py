"""Index arithmetic of a schedule: where every element travels. No tensors, no collectives.

The DP exchange buffer concatenates, rank by rank, that rank's slice of every bucket (matrix
buckets first, then AdamW buckets). Reduce-scatter sends region k of it to DP rank k; the
all-gather receives region k from DP rank k. A `Piece` is a run of one parameter's local
(TP-shard) elements that is contiguous both in the parameter and in that buffer: a matrix
parameter is one piece (cuts lie on parameter boundaries), an AdamW one may be split by cuts.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace

from canzona.schedules.format import Schedule
from canzona.runtime.schedule import ADAMW, MATRIX, local_shape


@dataclass(frozen=True)
class Piece:
    """`length` elements of parameter `param` (registration index) from `src` in its flattened
    local tensor, at `dst` in the DP exchange buffer."""

    param: int
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class DpLayout:
    """The DP exchange buffer: per-rank region sizes and starts, and every piece in it."""

    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    matrix_sizes: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rank_pieces: tuple[tuple[Piece, ...], ...]

    @property
    def total(self) -> int:
        """Elements of the whole exchange buffer (every bucket of both buffers, padded)."""
        return sum(self.sizes)

    def adamw_region(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s AdamW slices inside the exchange buffer."""
        return self.starts[rank] + self.matrix_sizes[rank], self.starts[rank] + self.sizes[rank]


def build_dp_layout(schedule: Schedule) -> DpLayout:
    """The exchange buffer of `schedule` (bucket cuts of both buffers)."""
    dp = schedule.request.dp
    buffers = {MATRIX: schedule.dp.buckets, ADAMW: schedule.dp.adamw_buckets}
    segment: dict[tuple[str, int, int], int] = {}
    sizes, matrix_sizes = [0] * dp, [0] * dp
    for rank in range(dp):
        for kind in (MATRIX, ADAMW):
            for position, bucket in enumerate(buffers[kind]):
                segment[(kind, position, rank)] = sizes[rank]
                sizes[rank] += bucket.cuts[rank + 1] - bucket.cuts[rank]
            if kind == MATRIX:
                matrix_sizes[rank] = sizes[rank]
    starts = [sum(sizes[:rank]) for rank in range(dp)]
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    for entry in schedule.params:
        cuts = buffers[entry.optimizer][entry.bucket].cuts
        first = max(0, bisect_right(cuts, entry.offset) - 1)
        last = min(dp, bisect_left(cuts, entry.offset + entry.numel))
        for rank in range(first, last):
            low, high = max(entry.offset, cuts[rank]), min(entry.offset + entry.numel, cuts[rank + 1])
            if low < high:
                dst = starts[rank] + segment[(entry.optimizer, entry.bucket, rank)] + low - cuts[rank]
                pieces[rank].append(Piece(entry.index, low - entry.offset, dst, high - low))
    return DpLayout(
        sizes=tuple(sizes),
        starts=tuple(starts),
        matrix_sizes=tuple(matrix_sizes),
        pieces=tuple(p for rank in pieces for p in rank),
        rank_pieces=tuple(tuple(rank) for rank in pieces),
    )


@dataclass(frozen=True)
class Task:
    """The update of one matrix: its registration index, host TP rank, local shape (every TP
    rank's shard has it), full shape, TP dim (None: replicated), row blocks and the model
    dtype of the parameter (the schedule's name: fp32, bf16, fp16)."""

    param: int
    host: int
    local_shape: tuple[int, ...]
    shape: tuple[int, int]
    tp_dim: int | None
    row_blocks: list[list[list[int]]] | None
    dtype: str = "fp32"

    @property
    def numel(self) -> int:
        """Elements of one TP rank's shard."""
        count = 1
        for size in self.local_shape:
            count *= size
        return count


def matrix_tasks(schedule: Schedule, names: list[str] | None = None) -> dict[str, Task]:
    """A host-0 task for every matrix parameter (or those in `names`), keyed by name."""
    tp = schedule.request.tp
    wanted = set(names) if names is not None else None
    return {
        e.name: Task(e.index, 0, local_shape(e, tp), (e.shape[0], e.shape[1]), e.tp_dim, e.row_blocks, e.dtype)
        for e in schedule.params
        if e.optimizer == MATRIX and (wanted is None or e.name in wanted)
    }


def micro_groups(schedule: Schedule, dp_rank: int) -> list[tuple[Task, ...]]:
    """The micro-groups of `dp_rank` in execution order, each task carrying its host."""
    tasks = matrix_tasks(schedule)
    groups = schedule.tp.ranks[dp_rank].groups
    return [
        tuple(replace(tasks[name], host=host) for name, host in zip(g.params, g.hosts))
        for g in groups
    ]


def owned_tasks(schedule: Schedule, dp_ranks: list[int]) -> list[Task]:
    """Every matrix owned by one of `dp_ranks`, in buffer order (for the baselines)."""
    tasks = matrix_tasks(schedule)
    return [tasks[e.name] for e in schedule.params if e.optimizer == MATRIX and e.owner in dp_ranks]
