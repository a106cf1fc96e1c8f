"""Megatron ZeRO-1 gradient-buffer geometry: the one definition the planner lays buffers out
by and the schedule validator checks them against.

Parameters are packed in reverse registration order, each starting at a multiple of
`PARAM_ALIGNMENT` elements; a bucket closes once it holds at least `bucket_size` elements and
its end is padded to a multiple of lcm(D, `BUCKET_END_ALIGNMENT`), D being the ranks the bucket
is cut over. A bucket is cut into D contiguous slices; slice r is [cuts[r], cuts[r + 1]).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from math import lcm

PARAM_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128
DEFAULT_BUCKET_SIZE = 40_000_000
GRAD_BYTES_PER_ELEMENT = 4  # Megatron keeps main gradients in fp32
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


def padded_bucket_numel(fill: int, num_ranks: int) -> int:
    """A bucket's size: its last element's end padded to a multiple of lcm(D, 128)."""
    return round_up(fill, lcm(num_ranks, BUCKET_END_ALIGNMENT))


def packed_fill(sizes: Sequence[int]) -> int:
    """Elements a bucket holds after packing parameters of `sizes` in that order."""
    fill = 0
    for size in sizes:
        fill = round_up(fill, PARAM_ALIGNMENT) + size
    return fill


@functools.lru_cache(maxsize=4096)
def equal_cuts(bucket_numel: int, num_ranks: int) -> tuple[int, ...]:
    """Stock ZeRO-1 cuts: D equal contiguous slices (bucket size is a multiple of D)."""
    return tuple([rank * bucket_numel // num_ranks for rank in range(num_ranks + 1)])


def slice_sizes(cuts: Sequence[int]) -> list[int]:
    """Elements of each rank's slice, from D + 1 cuts."""
    if type(cuts) is tuple:  # a plan's cuts, priced again by every stage: remembered
        return list(_tuple_slices(cuts))
    return [stop - start for start, stop in zip(cuts, cuts[1:])]


@functools.lru_cache(maxsize=65536)
def _tuple_slices(cuts: tuple[int, ...]) -> tuple[int, ...]:
    return tuple([stop - start for start, stop in zip(cuts, cuts[1:])])


def reslice_moves(slices: Sequence[int]) -> list[tuple[int, int]]:
    """Per rank, (elements sent, elements received) when a bucket held in equal slices
    (`chunk_bounds`: the bucket padded to a multiple of the ranks, as a native reduce-scatter
    cuts it) moves to the owners' `slices` (contiguous from the bucket's start): every element
    goes to the rank whose slice holds it. The way back swaps the two."""
    if not slices:
        return []
    total, moves, start = sum(slices), [], 0
    for size, (equal_start, equal_stop) in zip(slices, chunk_bounds(total, len(slices))):
        stop = start + size
        kept = max(0, min(stop, equal_stop) - max(start, equal_start))
        moves.append((equal_stop - equal_start - kept, size - kept))
        start = stop
    return moves


def slice_owner(cuts: Sequence[int], offset: int) -> int:
    """Rank whose slice [cuts[r], cuts[r + 1]) holds `offset` (the last rank for the end)."""
    return min(max(bisect.bisect_right(cuts, offset) - 1, 0), len(cuts) - 2)


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` chunks of a dim of `size`: torch.chunk's rule, which
    DTensor's `Shard` and FSDP2 follow (chunks of ceil(size / parts); the last ones may be
    shorter or empty)."""
    chunk = -(-size // parts)
    return [(min(size, s * chunk), min(size, (s + 1) * chunk)) for s in range(parts)]


def fsdp_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) rows of dim 0 that each of `shards` FSDP2 ranks holds (`chunk_bounds`;
    FSDP2 pads the short chunks to the chunk size internally)."""
    return chunk_bounds(rows, shards)


def tp_shard_shape(shape: Sequence[int], tp_dim: int | None, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The shape of TP rank `tp_rank`'s shard of a parameter (`chunk_bounds` along `tp_dim`,
    so possibly shorter than the others, or empty; the whole shape when `tp_dim` is None)."""
    if tp_dim is None:
        return tuple(shape)
    size = shape[tp_dim]
    chunk = -(-size // tp)  # chunk_bounds(size, tp)[tp_rank], without the other ranks' bounds
    local = list(shape)
    local[tp_dim] = min(size, (tp_rank + 1) * chunk) - min(size, tp_rank * chunk)
    return tuple(local)


def tp_slot_shape(shape: Sequence[int], tp_dim: int | None, tp: int) -> tuple[int, ...]:
    """The shape every TP rank reserves for its shard in the schedule's buffers: the largest
    shard (TP rank 0's), ceil(size / tp) along `tp_dim`. A shorter shard fills the start of its
    slot and leaves the rest zero."""
    return tp_shard_shape(shape, tp_dim, tp, 0)
