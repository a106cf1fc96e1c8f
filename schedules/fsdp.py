"""Geometry of FSDP2 (`fully_shard`) schedules: which piece of a matrix each device holds, who
sends what to a matrix's host, and the per-device figures every FSDP schedule records.

Shared by the planner (which writes the figures), the validator (which recomputes them) and the
runtime (which moves the pieces), so the three agree by construction. Pure: no torch.

Layout: a DeviceMesh (replicate, shard, tp), dims of size 1 left out; global rank =
dp_rank · tp + tp_rank with dp_rank = replica · shards + shard. The *fragmentation group* of a
device is the shards · tp devices of its replica; inside it, fragment rank = shard · tp + tp_rank.
A parameter's TP shard (split along `tp_dim`) is split again by FSDP2 along dim 0 by
torch.chunk's rule (`geometry.fsdp_rows`). Every replica executes the same micro-groups on its
own fragmentation group (HSDP has already averaged the gradients over the replicas).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

from canzona.schedules.geometry import GRAD_BYTES_PER_ELEMENT, fsdp_rows, tp_shard_shape, tp_slot_shape

REDUNDANT, ROUND_ROBIN = "redundant", "round_robin"
FSDP_BASELINES = (REDUNDANT, ROUND_ROBIN)  # the strategies an FSDP plan is compared with, in order


@dataclass(frozen=True)
class FsdpLayout:
    """The sizes of an FSDP layout: TP ranks, FSDP shard ranks, HSDP replicas."""

    tp: int
    shards: int
    replicas: int = 1

    @classmethod
    def of(cls, tp: int, dp: int, dp_replicate: int) -> FsdpLayout:
        """The layout a request's TP size, DP size and HSDP replicas describe."""
        return cls(tp=tp, shards=dp // dp_replicate, replicas=dp_replicate)

    @property
    def hosts(self) -> int:
        """Devices of one fragmentation group (shards x TP): the possible hosts of a matrix."""
        return self.shards * self.tp

    @property
    def dp(self) -> int:
        """DP ranks (replicas x shards)."""
        return self.shards * self.replicas

    def fragment_of(self, rank: int) -> int:
        """The fragment rank of global rank `rank` inside its fragmentation group."""
        return (rank // self.tp) % self.shards * self.tp + rank % self.tp

    def shard_of(self, fragment: int) -> int:
        """The FSDP shard rank of a fragment rank."""
        return fragment // self.tp


def local_shape(shape: Sequence[int], tp_dim: int | None, tp: int) -> tuple[int, ...]:
    """The shape of a TP slot (`geometry.tp_slot_shape`: the largest TP shard; the whole
    parameter when `tp_dim` is None). The predicted figures price every TP rank at it."""
    return tp_slot_shape(shape, tp_dim, tp)


def shard_shape(shape: Sequence[int], tp_dim: int | None, layout: FsdpLayout, fragment: int) -> tuple[int, ...]:
    """The shape of the piece fragment rank `fragment` holds: its FSDP chunk of dim 0 of its
    TP shard (possibly zero rows; TP shards may be uneven, `geometry.tp_shard_shape`)."""
    local = tp_shard_shape(shape, tp_dim, layout.tp, fragment % layout.tp)
    start, stop = fsdp_rows(local[0], layout.shards)[layout.shard_of(fragment)]
    return (stop - start, *local[1:])


def shard_numel(shape: Sequence[int], tp_dim: int | None, layout: FsdpLayout, fragment: int) -> int:
    """Elements of the piece fragment rank `fragment` holds."""
    return prod(shard_shape(shape, tp_dim, layout, fragment))


def _slot_piece_numel(shape: Sequence[int], tp_dim: int | None, layout: FsdpLayout, fragment: int) -> int:
    """`shard_numel` as the predicted figures price it: the FSDP chunk of a TP slot."""
    local = local_shape(shape, tp_dim, layout.tp)
    start, stop = fsdp_rows(local[0], layout.shards)[layout.shard_of(fragment)]
    return (stop - start) * prod(local[1:])


def sends_to_host(tp_dim: int | None, sender: int, host: int, tp: int) -> bool:
    """Whether `sender` sends its gradient piece to the matrix's `host` in the gather: every
    other fragment rank, except that for a matrix replicated over TP only the host's TP rank
    column is needed (the other TP ranks hold copies of the same pieces)."""
    return sender != host and (tp_dim is not None or sender % tp == host % tp)


def _chunks(shape: Sequence[int], tp_dim: int | None, layout: FsdpLayout) -> tuple[int, int, int, int]:
    """A TP shard's FSDP2 chunks, as (elements of a full chunk, how many shards hold one, the
    elements of the short chunk the next shard holds, the TP shard's elements); the shards
    after that hold nothing (torch.chunk's rule, `geometry.fsdp_rows`)."""
    local = local_shape(shape, tp_dim, layout.tp)
    rows, width = local[0], prod(local[1:])
    chunk = -(-rows // layout.shards)
    full = rows // chunk
    return chunk * width, full, (rows - full * chunk) * width, rows * width


def _spread(totals: list[int], chunks: tuple[int, int, int, int], scale: int) -> None:
    """Add `scale` x each shard's chunk elements to a difference array over shards."""
    chunk, full, short, _ = chunks
    totals[0] += scale * chunk
    totals[full] += scale * (short - chunk)
    totals[full + 1] -= scale * short


def _summed(differences: list[int]) -> list[int]:
    out, running = [], 0
    for value in differences[:-2]:
        running += value
        out.append(running)
    return out


def shard_elements(matrices: Iterable[tuple[Sequence[int], int | None]], layout: FsdpLayout) -> list[int]:
    """Per FSDP shard rank, the elements one of its devices holds of `matrices` (full shape,
    tp_dim): linear in the matrices plus the shards."""
    differences = [0] * (layout.shards + 2)
    for shape, tp_dim in matrices:
        _spread(differences, _chunks(shape, tp_dim, layout), 1)
    return _summed(differences)


def fragment_traffic(
    matrices: Sequence[tuple[Sequence[int], int | None, int]], layout: FsdpLayout
) -> list[tuple[int, int]]:
    """Per fragment rank, (sent, received) bytes per step of the gather and scatter all-to-alls
    (fp32 pieces) of `matrices`, each (full shape, tp_dim, host fragment rank): every other
    fragment rank sends its piece to the host (for a matrix replicated over TP only the host's
    TP rank column, `sends_to_host`), and the host sends every piece, copies included, back.
    Linear in the matrices plus the fragment ranks."""
    tp, shards, b = layout.tp, layout.shards, GRAD_BYTES_PER_ELEMENT
    received_all, sent_all = [0] * (shards + 2), [0] * (shards + 2)
    sent_column = [[0] * (shards + 2) for _ in range(tp)]
    sent, received = [0] * layout.hosts, [0] * layout.hosts
    for shape, tp_dim, host in matrices:
        chunks = _chunks(shape, tp_dim, layout)
        own = b * _slot_piece_numel(shape, tp_dim, layout, host)
        column = b * chunks[3]  # every piece of one TP rank column
        _spread(received_all, chunks, b)
        _spread(sent_all if tp_dim is not None else sent_column[host % tp], chunks, b)
        senders = tp * column if tp_dim is not None else column
        sent[host] += tp * column - 2 * own
        received[host] += senders - 2 * own
    received_by, sent_by = _summed(received_all), _summed(sent_all)
    columns = [_summed(c) for c in sent_column]
    return [
        (sent[f] + sent_by[f // tp] + columns[f % tp][f // tp], received[f] + received_by[f // tp])
        for f in range(layout.hosts)
    ]


def padding_ratio(shape: Sequence[int], tp_dim: int | None, layout: FsdpLayout) -> float:
    """FSDP2's padded size over the real size of a TP shard: shards x chunk rows / rows."""
    rows = local_shape(shape, tp_dim, layout.tp)[0]
    chunk = -(-rows // layout.shards)
    return layout.shards * chunk / rows


def dp_loads(hosted: Sequence[float], layout: FsdpLayout) -> list[float]:
    """Per DP rank, the summed load of its TP ranks (fragment loads; replicas repeat them)."""
    return [sum(hosted[(d % layout.shards) * layout.tp + t] for t in range(layout.tp)) for d in range(layout.dp)]
