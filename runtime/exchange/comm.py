"""Collectives the runtime needs (gloo and NCCL alike).

Per DP bucket, asynchronous: the gradient reduction (`start_reduce`) and the parameter gather
(`start_gather`), in the form the schedule records for the bucket or one the caller names
(`DP_COLLECTIVES`; DP-SC all-reduces); an asynchronous all-to-all for the TP micro-group
gather and scatter. A group of size 1 never
communicates.
Every buffer is created on the device (and in the dtype) of the tensor it receives for, so the
same code runs on gloo with CPU tensors and on NCCL with CUDA tensors.
Every collective waits at most `timeout` (None: the process group's own timeout) and raises
`CollectiveError` when it fails or times out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import wait
from canzona.schedules.geometry import chunk_bounds
from canzona.schedules.layout import DpBucket
from canzona.schedules.limits import AS_SCHEDULED, DP_COLLECTIVE_MODES

DP_COLLECTIVES = DP_COLLECTIVE_MODES  # "schedule": each bucket as recorded (`DpBucket.collective`)
ALL_REDUCE = "all_reduce"  # DP-SC: every rank keeps the whole mean
RESLICE = "reslice"  # equal slices through the backend's ring, one all-to-all to and from the owners


def bucket_mode(bucket: DpBucket, requested: str) -> str:
    """The form a bucket is reduced and gathered in: its schedule's, or the one `requested`."""
    return bucket.collective if requested == AS_SCHEDULED else requested


def _nothing() -> None:
    return None


def native_for_equal(bucket: DpBucket, group: dist.ProcessGroup) -> bool:
    """Whether a bucket goes through the backend's reduce-scatter / all-gather: its slices are
    equal, and the backend has real ones (gloo builds its reduce-scatter from an all-reduce of a
    copy of the whole bucket, so there one reduce and one broadcast per slice move less and
    allocate nothing)."""
    return bucket.equal and dist.get_backend(group) != dist.Backend.GLOO


@dataclass
class Pending:
    """A bucket's collectives in flight: wait for `works` (at most `timeout`), launch and wait
    for the stage `then` starts, if any, then `land()` puts the result where it belongs. `keep`
    holds send buffers alive until then.

    `then` starts only once `works` are done because it reads their output: gloo may run two
    asynchronous collectives of one group at once, so issue order alone would not do."""

    works: list[dist.Work]
    land: Callable[[], None] = _nothing
    keep: list[Tensor] = field(default_factory=list)
    then: Callable[[], Pending] | None = None

    def wait(self, timeout: timedelta | None, what: str) -> None:
        """Block until the bucket is done, then land it (once)."""
        works, self.works = self.works, []
        for work in works:
            wait(work, timeout, what)
        then, self.then = self.then, None
        if then is not None:
            then().wait(timeout, what)
        land, self.land = self.land, _nothing
        land()
        self.keep.clear()


def start_reduce(
    send: Tensor,
    bucket: DpBucket,
    mode: str,
    rank: int,
    group: dist.ProcessGroup,
    ranks: Sequence[int],
    kept: Sequence[int],
    divisor: int | None = None,
) -> Pending:
    """Launch the DP mean of one bucket of the bucket buffer `send`, in place: once landed, the
    slices of the group ranks `kept` (this rank's own; every slice for DP-SC's `all_reduce`)
    hold the sum over `group` divided by `divisor` (default: the group's size; an expert
    bucket, reduced over the expert-DP group, is divided by the DP size). The rest of the
    bucket is left undefined. `ranks` are the group ranks' global ranks.

    `ring`: one native reduce-scatter over the slices padded to the largest (transient: the
    padded bucket); `rooted`: one reduce to each non-empty slice's owner (a native
    reduce-scatter when the slices are equal, `native_for_equal`); `all_to_all`: one
    all_to_all_single, summed here in rank order (transient: the group's copies of this rank's
    slice); `reslice`: a native reduce-scatter over equal slices, then one all_to_all_single to
    the owners (transient: one equal slice); `all_reduce`: one all-reduce of the bucket."""
    chunk = send[bucket.base : bucket.base + bucket.numel]
    world, cuts = len(bucket.slices), bucket.cuts
    scale = divisor or world

    def scale_kept() -> None:
        for r in kept:
            chunk[cuts[r] : cuts[r + 1]].div_(scale)

    if world == 1:
        return Pending([], scale_kept)
    if mode == ALL_REDUCE:
        return Pending([dist.all_reduce(chunk, group=group, async_op=True)], scale_kept)
    mine = chunk[cuts[rank] : cuts[rank + 1]]
    if mode == "ring" or (mode == RESLICE and bucket.equal):
        return _padded_reduce(chunk, bucket, rank, group, scale)
    if mode == RESLICE:
        return _resliced_reduce(chunk, bucket, rank, group, scale)
    if mode == "all_to_all":
        received = torch.empty(world * mine.numel(), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(
            received, chunk, [mine.numel()] * world, list(bucket.slices), group=group, async_op=True
        )

        def land_sum() -> None:
            mine.copy_(received.view(world, mine.numel()).sum(0)).div_(scale)

        return Pending([work], land_sum, [received])
    if native_for_equal(bucket, group):  # the output may not alias the input on every backend: a slice-sized buffer
        out = torch.empty_like(mine)
        work = dist.reduce_scatter_single(out, chunk, group=group, async_op=True)

        def land_mean() -> None:
            mine.copy_(out).div_(scale)

        return Pending([work], land_mean, [out])
    works = [
        dist.reduce(chunk[cuts[r] : cuts[r + 1]], dst=ranks[r], group=group, async_op=True)
        for r in range(world)
        if cuts[r + 1] > cuts[r]
    ]
    return Pending(works, scale_kept)


def start_gather(
    gathered: Tensor, bucket: DpBucket, mode: str, rank: int, group: dist.ProcessGroup, ranks: Sequence[int]
) -> Pending:
    """Launch the gather of one bucket of the buffer `gathered`, whose slice `rank` already
    holds this rank's values: afterwards every slice holds its owner's. `ring`: one native
    all-gather of the slices padded to the largest; `rooted`: one broadcast from each non-empty
    slice's owner (a native all-gather when the slices are equal, `native_for_equal`);
    `all_to_all`: one all_to_all_single; `reslice`: one all_to_all_single to the equal slices,
    then a native all-gather of them."""
    chunk = gathered[bucket.base : bucket.base + bucket.numel]
    world, cuts = len(bucket.slices), bucket.cuts
    if world == 1:
        return Pending([])
    if mode == "ring" or (mode == RESLICE and bucket.equal):
        return _padded_gather(chunk, bucket, rank, group)
    if mode == RESLICE:
        return _resliced_gather(chunk, bucket, rank, group)
    if mode == "all_to_all" or native_for_equal(bucket, group):
        mine = chunk[cuts[rank] : cuts[rank + 1]].clone()  # the input may not alias the output on every backend
        if mode != "all_to_all":
            return Pending([dist.all_gather_single(chunk, mine, group=group, async_op=True)], keep=[mine])
        send = mine.repeat(world)
        work = dist.all_to_all_single(
            chunk, send, list(bucket.slices), [mine.numel()] * world, group=group, async_op=True
        )
        return Pending([work], keep=[send])
    works = [
        dist.broadcast(chunk[cuts[r] : cuts[r + 1]], src=ranks[r], group=group, async_op=True)
        for r in range(world)
        if cuts[r + 1] > cuts[r]
    ]
    return Pending(works)


def _padded_reduce(chunk: Tensor, bucket: DpBucket, rank: int, group: dist.ProcessGroup, scale: int) -> Pending:
    """A native reduce-scatter of `chunk`'s slices, each padded with zeros to the largest; the
    mean lands in this rank's slice."""
    width, world = max(bucket.slices), len(bucket.slices)
    padded = chunk.new_zeros(world * width)
    for r, size in enumerate(bucket.slices):
        padded[r * width : r * width + size].copy_(chunk[bucket.cuts[r] : bucket.cuts[r + 1]])
    received = chunk.new_empty(width)
    work = dist.reduce_scatter_single(received, padded, group=group, async_op=True)

    def land() -> None:
        chunk[bucket.cuts[rank] : bucket.cuts[rank + 1]].copy_(received[: bucket.slices[rank]]).div_(scale)

    return Pending([work], land, [padded, received])


def _padded_gather(chunk: Tensor, bucket: DpBucket, rank: int, group: dist.ProcessGroup) -> Pending:
    """A native all-gather of every rank's slice of `chunk` padded to the largest, unpadded
    into `chunk` (this rank's slice already holds its values)."""
    width, world = max(bucket.slices), len(bucket.slices)
    send = chunk.new_zeros(width)
    send[: bucket.slices[rank]].copy_(chunk[bucket.cuts[rank] : bucket.cuts[rank + 1]])
    received = chunk.new_empty(world * width)
    work = dist.all_gather_single(received, send, group=group, async_op=True)

    def land() -> None:
        for r, size in enumerate(bucket.slices):
            chunk[bucket.cuts[r] : bucket.cuts[r + 1]].copy_(received[r * width : r * width + size])

    return Pending([work], land, [send, received])


def reslice_splits(bucket: DpBucket, rank: int) -> tuple[list[int], list[int]]:
    """`reslice`'s all-to-all on `rank`, from equal slices (`chunk_bounds`: what a native
    reduce-scatter of the bucket padded to a multiple of the ranks leaves on each) to the
    owners' slices: how many elements of its equal slice each rank's slice holds (what it sends
    to each), and how many of its own slice each rank's equal slice holds (what it receives)."""
    cuts = bucket.cuts
    equal = chunk_bounds(bucket.numel, len(bucket.slices))

    def overlap(start: int, stop: int, other_start: int, other_stop: int) -> int:
        return max(0, min(stop, other_stop) - max(start, other_start))

    sends = [overlap(*equal[rank], cuts[r], cuts[r + 1]) for r in range(len(equal))]
    receives = [overlap(cuts[rank], cuts[rank + 1], *equal[r]) for r in range(len(equal))]
    return sends, receives


def _padded_to_ranks(chunk: Tensor, world: int) -> Tensor:
    """`chunk`, or a copy padded with zeros to a multiple of `world` elements."""
    width = -(-chunk.numel() // world)
    if width * world == chunk.numel():
        return chunk
    padded = chunk.new_zeros(width * world)
    padded[: chunk.numel()].copy_(chunk)
    return padded


def _resliced_reduce(chunk: Tensor, bucket: DpBucket, rank: int, group: dist.ProcessGroup, scale: int) -> Pending:
    """A native reduce-scatter of `chunk` over equal slices, then one all-to-all moving every
    summed element to the owner of its slice; the mean lands in this rank's slice."""
    world = len(bucket.slices)
    whole = _padded_to_ranks(chunk, world)
    piece = chunk.new_empty(whole.numel() // world)
    work = dist.reduce_scatter_single(piece, whole, group=group, async_op=True)
    mine = chunk[bucket.cuts[rank] : bucket.cuts[rank + 1]]

    def to_owners() -> Pending:
        sends, receives = reslice_splits(bucket, rank)
        moved = dist.all_to_all_single(mine, piece[: sum(sends)], receives, sends, group=group, async_op=True)
        return Pending([moved], keep=[piece])

    def land_mean() -> None:
        mine.div_(scale)

    return Pending([work], land_mean, [whole, piece], to_owners)


def _resliced_gather(chunk: Tensor, bucket: DpBucket, rank: int, group: dist.ProcessGroup) -> Pending:
    """One all-to-all moving this rank's slice of `chunk` back to the equal slices, then a
    native all-gather of those into `chunk` (through a padded copy where the slices are not
    all full)."""
    world = len(bucket.slices)
    sends, receives = reslice_splits(bucket, rank)
    width = -(-bucket.numel // world)
    mine = chunk[bucket.cuts[rank] : bucket.cuts[rank + 1]].clone()  # the gather overwrites `chunk`
    piece = chunk.new_zeros(width)
    work = dist.all_to_all_single(piece[: sum(sends)], mine, sends, receives, group=group, async_op=True)

    def gather() -> Pending:
        whole = chunk if width * world == bucket.numel else chunk.new_empty(width * world)
        gathered = dist.all_gather_single(whole, piece, group=group, async_op=True)
        if whole is chunk:
            return Pending([gathered], keep=[piece])

        def unpad() -> None:
            chunk.copy_(whole[: bucket.numel])

        return Pending([gathered], unpad, [piece, whole])

    return Pending([work], keep=[mine, piece], then=gather)


@dataclass
class InFlight:
    """An asynchronous all-to-all: the received buffer is valid after `wait()`."""

    received: Tensor
    work: dist.Work | None
    keep: list[Tensor] = field(default_factory=list)
    timeout: timedelta | None = None
    what: str = "a TP all-to-all"

    def wait(self) -> Tensor:
        """Block until the exchange is done (at most `timeout`); the received buffer."""
        if self.work is not None:
            work, self.work = self.work, None
            wait(work, self.timeout, self.what)
        self.keep.clear()
        return self.received


def start_all_to_all(
    send: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
    timeout: timedelta | None,
    what: str,
) -> InFlight:
    """Launch `all_to_all_single` asynchronously (a group of two or more ranks)."""
    received = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(received, send, recv_splits, send_splits, group=group, async_op=True)
    return InFlight(received, work, [send], timeout, what)


def all_gather_equal(mine: Tensor, group: dist.ProcessGroup, timeout: timedelta | None = None) -> list[Tensor]:
    """Every rank's equally sized `mine`, in rank order (the TP-SC baseline's gather)."""
    world = dist.get_world_size(group)
    if world == 1:
        return [mine]
    out = [torch.empty_like(mine) for _ in range(world)]
    wait(dist.all_gather(out, mine, group=group, async_op=True), timeout, "the TP all-gather of gradients")
    return out
