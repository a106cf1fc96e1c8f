"""Megatron ZeRO-1 gradient-buffer geometry: the one definition the planner lays buffers out
by and the schedule validator checks them against.

Parameters are packed in reverse registration order, each starting at a multiple of
`PARAM_ALIGNMENT` elements; a bucket closes once it holds at least `bucket_size` elements and
its end is padded to a multiple of lcm(D, `BUCKET_END_ALIGNMENT`), D being the ranks the bucket
is cut over. A bucket is cut into D contiguous slices; slice r is [cuts[r], cuts[r + 1]).
"""

from __future__ import annotations

import bisect
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


def equal_cuts(bucket_numel: int, num_ranks: int) -> tuple[int, ...]:
    """Stock ZeRO-1 cuts: D equal contiguous slices (bucket size is a multiple of D)."""
    return tuple([rank * bucket_numel // num_ranks for rank in range(num_ranks + 1)])


def slice_sizes(cuts: Sequence[int]) -> list[int]:
    """Elements of each rank's slice, from D + 1 cuts."""
    return [stop - start for start, stop in zip(cuts, cuts[1:])]


def slice_owner(cuts: Sequence[int], offset: int) -> int:
    """Rank whose slice [cuts[r], cuts[r + 1]) holds `offset` (the last rank for the end)."""
    return min(max(bisect.bisect_right(cuts, offset) - 1, 0), len(cuts) - 2)


def fsdp_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """[start, stop) rows of dim 0 that each of `shards` FSDP2 ranks holds: torch.chunk's rule,
    which `fully_shard` follows (chunks of ceil(rows / shards) rows; the last ones may be
    shorter or empty, and FSDP2 pads them to the chunk size internally)."""
    chunk = -(-rows // shards)
    return [(min(rows, s * chunk), min(rows, (s + 1) * chunk)) for s in range(shards)]
