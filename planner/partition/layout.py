"""Megatron ZeRO-1 gradient buffers of a model: alignment, buckets, padding.

The rules (defined once in `canzona.schedules.geometry`, which the schedule validator checks
files against): parameters are packed in reverse registration order, each starting at a
multiple of 64 elements; a bucket closes once it holds at least `bucket_size` elements and its
end is padded to a multiple of lcm(D, 128). Matrix-optimizer and AdamW parameters live in
separate buffers. Sizes are local: a TP-sharded parameter occupies its shard's element count.
Every DP rank updates equal slices of the AdamW buffer (`adamw_elements`, `adamw_loads`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from canzona.planner.partition.costs import CostModel
from canzona.planner.spec import ADAMW, DTYPE_BYTES, MATRIX, ModelSpec, PlanError
from canzona.schedules.geometry import (  # the one home of the geometry; re-exported here
    BUCKET_END_ALIGNMENT,
    DEFAULT_BUCKET_SIZE,
    GRAD_BYTES_PER_ELEMENT,
    PARAM_ALIGNMENT,
    equal_cuts,
    padded_bucket_numel,
    round_up,
    slice_owner,
    slice_sizes,
)

__all__ = [
    "BUCKET_END_ALIGNMENT",
    "DEFAULT_BUCKET_SIZE",
    "GRAD_BYTES_PER_ELEMENT",
    "PARAM_ALIGNMENT",
    "Bucket",
    "BufferEntry",
    "BufferLayout",
    "adamw_elements",
    "adamw_loads",
    "build_buffer",
    "build_layouts",
    "equal_cuts",
    "owners_to_cuts",
    "param_bytes",
    "slice_owner",
    "slice_sizes",
]


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
    buckets: list[Bucket] = []
    entries: list[BufferEntry] = []
    fill = 0
    for index in reversed(range(len(model.params))):
        param = model.params[index]
        if param.optimizer != kind or (include is not None and not include(index)):
            continue
        offset = round_up(fill, PARAM_ALIGNMENT)
        numel = param.local_numel(tp)
        entries.append(BufferEntry(index, len(buckets), offset, numel))
        fill = offset + numel
        if fill >= bucket_size:
            buckets.append(Bucket(len(buckets), tuple(entries), padded_bucket_numel(fill, dp)))
            entries, fill = [], 0
    if entries:
        buckets.append(Bucket(len(buckets), tuple(entries), padded_bucket_numel(fill, dp)))
    return BufferLayout(kind, tuple(buckets))


def build_layouts(model: ModelSpec, tp: int, dp: int, bucket_size: int) -> dict[str, BufferLayout]:
    """Both buffers of the model: the matrix-optimizer one and the AdamW one."""
    return {kind: build_buffer(model, kind, tp, dp, bucket_size) for kind in (MATRIX, ADAMW)}


def adamw_elements(layout: BufferLayout, dp: int) -> list[int]:
    """Per DP rank, the elements of its equal slices of the AdamW buffer `layout` (on each of
    its devices: TP shards)."""
    elements = [0] * dp
    for bucket in layout.buckets:
        elements = [total + size for total, size in zip(elements, slice_sizes(equal_cuts(bucket.numel, dp)))]
    return elements


def param_bytes(model: ModelSpec, bucket: Bucket) -> int:
    """Bytes per element of a bucket's parameters (a bucket holds one dtype): what its gather moves."""
    return DTYPE_BYTES[model.params[bucket.entries[0].param].dtype]


def adamw_loads(layout: BufferLayout, dp: int, cost: CostModel) -> list[float]:
    """Per DP rank, the AdamW cost each of its devices pays (fixed by the layout, not the plan)."""
    return [cost.adamw_cost(elements) for elements in adamw_elements(layout, dp)]


def owners_to_cuts(
    owners: tuple[int, ...], offsets: tuple[int, ...], bucket_numel: int, num_ranks: int
) -> tuple[int, ...]:
    """Cut offsets (D + 1 of them) of one bucket from its items' owners (non-decreasing): rank
    r's slice starts at its first item, or where the next rank's does."""
    starts = (*offsets, bucket_numel)
    return (0, *[starts[bisect.bisect_left(owners, rank)] for rank in range(1, num_ranks)], bucket_numel)
