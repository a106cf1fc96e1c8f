"""Collectives the runtime needs (gloo and NCCL alike).

Per DP bucket, asynchronous: the gradient reduction (`start_reduce`) and the parameter gather
(`start_gather`), in the form the schedule records for the bucket or one the caller names
(`DP_COLLECTIVES`; DP-SC all-reduces); an asynchronous all-to-all for the TP micro-group gather
and scatter. A group of size 1 never
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
from canzona.runtime.layout import DpBucket, Piece
from canzona.schedules.limits import AS_SCHEDULED, DP_COLLECTIVE_MODES


def pack(pieces: Sequence[Piece], sources: Sequence[Tensor | None], out: Tensor, base: int = 0,
         zero_missing: bool = True) -> None:
    """Copy each piece from its flattened source tensor into `out` at `dst - base`, casting to
    `out`'s dtype. A missing source (a parameter without a gradient) packs zeros, or is left
    alone with `zero_missing=False`."""
    for piece in pieces:
        target = out[piece.dst - base : piece.dst - base + piece.length]
        source = sources[piece.param]
        if source is not None:
            target.copy_(source[piece.src : piece.src + piece.length])
        elif zero_missing:
            target.zero_()


def unpack(pieces: Sequence[Piece], buffer: Tensor, targets: Sequence[Tensor | None], base: int = 0) -> None:
    """Copy each piece from `buffer` (at `dst - base`) into its flattened target tensor
    (casting to its dtype); pieces whose target is None are skipped."""
    for piece in pieces:
        target = targets[piece.param]
        if target is not None:
            target[piece.src : piece.src + piece.length].copy_(buffer[piece.dst - base : piece.dst - base + piece.length])


DP_COLLECTIVES = DP_COLLECTIVE_MODES  # "schedule": each bucket as recorded (`DpBucket.collective`)
ALL_REDUCE = "all_reduce"  # DP-SC: every rank keeps the whole mean


def bucket_mode(bucket: DpBucket, requested: str) -> str:
    """The form a bucket is reduced and gathered in: its schedule's, or the one `requested`."""
    return bucket.collective if requested == AS_SCHEDULED else requested


def _nothing() -> None:
    return None


@dataclass
class Pending:
    """A bucket's collectives in flight: wait for `works` (at most `timeout`), then `land()`
    puts the result where it belongs. `keep` holds send buffers alive until then."""

    works: list[dist.Work]
    land: Callable[[], None] = _nothing
    keep: list[Tensor] = field(default_factory=list)

    def wait(self, timeout: timedelta | None, what: str) -> None:
        """Block until the bucket is done, then land it (once)."""
        works, self.works = self.works, []
        for work in works:
            wait(work, timeout, what)
        land, self.land = self.land, _nothing
        land()
        self.keep.clear()


def start_reduce(send: Tensor, bucket: DpBucket, mode: str, rank: int, group: dist.ProcessGroup,
                 ranks: Sequence[int], dests: dict[int, Tensor], divisor: int | None = None) -> Pending:
    """Launch the DP mean of one bucket of the bucket buffer `send` (reduced in place): the sum
    over `group` divided by `divisor` (default: the group's size; an expert bucket, reduced
    over the expert-DP group, is divided by the DP size).

    `dests` maps a group rank to where this rank keeps the mean of that rank's slice (its own
    slice; every slice for DP-SC's `all_reduce`); `ranks` are the group ranks' global ranks.
    `ring`: one native reduce-scatter over the slices padded to the largest; `rooted`: one
    reduce to each non-empty slice's owner (a native reduce-scatter when the slices are equal);
    `all_to_all`: one all_to_all_single, summed here in rank order; `all_reduce`: one
    all-reduce of the bucket."""
    chunk = send[bucket.base : bucket.base + bucket.numel]
    world, cuts = len(bucket.slices), bucket.cuts
    scale = divisor or world

    def land_slices() -> None:  # the (reduced) slices of `chunk` into their destinations
        for r, dest in dests.items():
            dest.copy_(chunk[cuts[r] : cuts[r + 1]]).div_(scale)

    if world == 1:
        return Pending([], land_slices)
    if mode == ALL_REDUCE:
        return Pending([dist.all_reduce(chunk, group=group, async_op=True)], land_slices)
    if mode == "all_to_all":
        mine = bucket.slices[rank]
        received = torch.empty(world * mine, dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(received, chunk, [mine] * world, list(bucket.slices), group=group, async_op=True)

        def land_sum() -> None:
            dests[rank].copy_(received.view(world, mine).sum(0)).div_(scale)

        return Pending([work], land_sum, [received])
    if bucket.equal:
        work = dist.reduce_scatter_single(dests[rank], chunk, group=group, async_op=True)

        def land_mean() -> None:
            dests[rank].div_(scale)

        return Pending([work], land_mean)
    if mode == "ring":
        return _padded_reduce(chunk, bucket, rank, group, dests[rank], scale)
    works = [dist.reduce(chunk[cuts[r] : cuts[r + 1]], dst=ranks[r], group=group, async_op=True)
             for r in range(world) if cuts[r + 1] > cuts[r]]
    return Pending(works, land_slices)


def start_gather(gathered: Tensor, mine: Tensor, bucket: DpBucket, mode: str, rank: int,
                 group: dist.ProcessGroup, ranks: Sequence[int]) -> Pending:
    """Launch the gather of one bucket into the bucket buffer `gathered`: every rank's slice,
    this rank's being `mine`. `ring`: one native all-gather of the slices padded to the
    largest; `rooted`: one broadcast from each non-empty slice's owner (a native all-gather when
    the slices are equal); `all_to_all`: one all_to_all_single."""
    chunk = gathered[bucket.base : bucket.base + bucket.numel]
    world, cuts = len(bucket.slices), bucket.cuts
    if world == 1:
        chunk.copy_(mine)
        return Pending([])
    if mode == "all_to_all":
        send = mine.repeat(world)
        work = dist.all_to_all_single(chunk, send, list(bucket.slices), [mine.numel()] * world, group=group, async_op=True)
        return Pending([work], keep=[send])
    if bucket.equal:
        return Pending([dist.all_gather_single(chunk, mine, group=group, async_op=True)], keep=[mine])
    if mode == "ring":
        return _padded_gather(chunk, mine, bucket, group)
    chunk[cuts[rank] : cuts[rank + 1]].copy_(mine)
    works = [dist.broadcast(chunk[cuts[r] : cuts[r + 1]], src=ranks[r], group=group, async_op=True)
             for r in range(world) if cuts[r + 1] > cuts[r]]
    return Pending(works)


def _padded_reduce(chunk: Tensor, bucket: DpBucket, rank: int, group: dist.ProcessGroup, dest: Tensor,
                   scale: int) -> Pending:
    """A native reduce-scatter of `chunk`'s slices, each padded with zeros to the largest."""
    width, world = max(bucket.slices), len(bucket.slices)
    padded = chunk.new_zeros(world * width)
    for r, size in enumerate(bucket.slices):
        padded[r * width : r * width + size].copy_(chunk[bucket.cuts[r] : bucket.cuts[r + 1]])
    received = chunk.new_empty(width)
    work = dist.reduce_scatter_single(received, padded, group=group, async_op=True)

    def land() -> None:
        dest.copy_(received[: bucket.slices[rank]]).div_(scale)

    return Pending([work], land, [padded, received])


def _padded_gather(chunk: Tensor, mine: Tensor, bucket: DpBucket, group: dist.ProcessGroup) -> Pending:
    """A native all-gather of every rank's slice padded to the largest, unpadded into `chunk`."""
    width, world = max(bucket.slices), len(bucket.slices)
    send = mine.new_zeros(width)
    send[: mine.numel()].copy_(mine)
    received = mine.new_empty(world * width)
    work = dist.all_gather_single(received, send, group=group, async_op=True)

    def land() -> None:
        for r, size in enumerate(bucket.slices):
            chunk[bucket.cuts[r] : bucket.cuts[r + 1]].copy_(received[r * width : r * width + size])

    return Pending([work], land, [send, received])


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


def start_all_to_all(send: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup,
                     timeout: timedelta | None = None, what: str = "a TP all-to-all") -> InFlight:
    """Launch `all_to_all_single` asynchronously (a size-1 group just hands `send` back)."""
    if len(send_splits) == 1:
        return InFlight(send, None)
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
