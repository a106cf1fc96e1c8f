"""Megatron ZeRO-1 gradient-buffer geometry: alignment, buckets, padding.

Parameters are packed in reverse registration order, each starting at a multiple of 64
elements; a bucket closes once it holds at least `bucket_size` elements and its end is padded
to a multiple of lcm(D, 128). Matrix-optimizer and AdamW parameters live in separate buffers.
Sizes are local: a TP-sharded parameter occupies its shard's element count.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from math import lcm

from canzona.planner.spec import ADAMW, MATRIX, ModelSpec, PlanError

PARAM_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128
DEFAULT_BUCKET_SIZE = 40_000_000
GRAD_BYTES_PER_ELEMENT = 4  # Megatron keeps main gradients in fp32


@dataclass(frozen=True)
class BufferEntry:
    """Where one parameter's local shard sits: `param` indexes `ModelSpec.params`."""

    param: int
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """A bucket of one buffer: its entries in buffer order and its padded size."""

    index: int
    entries: tuple[BufferEntry, ...]
    numel: int

    def boundaries(self) -> tuple[int, ...]:
        """Offsets where a cut may go: every entry's start, and the bucket end."""
        return tuple(entry.offset for entry in self.entries) + (self.numel,)

    def spans(self) -> tuple[int, ...]:
        """Elements from each entry's start to the next boundary (its share of a slice)."""
        bounds = self.boundaries()
        return tuple(bounds[i + 1] - bounds[i] for i in range(len(self.entries)))


@dataclass(frozen=True)
class BufferLayout:
    """One gradient buffer (`kind` is MATRIX or ADAMW) cut into buckets."""

    kind: str
    buckets: tuple[Bucket, ...]

    @property
    def numel(self) -> int:
        """Padded size of the whole buffer."""
        return sum(bucket.numel for bucket in self.buckets)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_buffer(
    model: ModelSpec,
    kind: str,
    tp: int,
    dp: int,
    bucket_size: int,
    include: Callable[[int], bool] | None = None,
) -> BufferLayout:
    """Lay out the parameters of optimizer class `kind` (those `include(index)` accepts, if
    given) in Megatron's bucketed buffer, for a data-parallel group of `dp` ranks."""
    if bucket_size < 1:
        raise PlanError(f"bucket size must be >= 1, got {bucket_size}")
    end_alignment = lcm(dp, BUCKET_END_ALIGNMENT)
    buckets: list[Bucket] = []
    entries: list[BufferEntry] = []
    fill = 0
    for index in reversed(range(len(model.params))):
        param = model.params[index]
        if param.optimizer != kind or (include is not None and not include(index)):
            continue
        offset = _round_up(fill, PARAM_ALIGNMENT)
        numel = param.local_numel(tp)
        entries.append(BufferEntry(index, len(buckets), offset, numel))
        fill = offset + numel
        if fill >= bucket_size:
            buckets.append(Bucket(len(buckets), tuple(entries), _round_up(fill, end_alignment)))
            entries, fill = [], 0
    if entries:
        buckets.append(Bucket(len(buckets), tuple(entries), _round_up(fill, end_alignment)))
    return BufferLayout(kind, tuple(buckets))


def build_layouts(model: ModelSpec, tp: int, dp: int, bucket_size: int) -> dict[str, BufferLayout]:
    """Both buffers of the model: the matrix-optimizer one and the AdamW one."""
    return {kind: build_buffer(model, kind, tp, dp, bucket_size) for kind in (MATRIX, ADAMW)}


def equal_cuts(bucket_numel: int, dp: int) -> tuple[int, ...]:
    """Stock ZeRO-1 cuts: D equal contiguous slices (bucket size is a multiple of D)."""
    return tuple(rank * bucket_numel // dp for rank in range(dp + 1))


def slice_sizes(cuts: tuple[int, ...] | list[int]) -> list[int]:
    """Elements of each rank's slice, from D + 1 cuts."""
    return [cuts[r + 1] - cuts[r] for r in range(len(cuts) - 1)]


def slice_owner(cuts: tuple[int, ...] | list[int], offset: int) -> int:
    """Rank whose slice [cuts[r], cuts[r + 1]) holds `offset` (the last rank for the end)."""
    return min(max(bisect.bisect_right(cuts, offset) - 1, 0), len(cuts) - 2)
