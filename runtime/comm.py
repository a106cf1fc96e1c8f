"""Collectives the runtime needs, built from `all_to_all_single` (works on gloo and NCCL).

Uneven reduce-scatter / all-gather over DP at the schedule's cuts, and an asynchronous
all-to-all for the TP micro-group gather and scatter. A group of size 1 never communicates.
Every buffer is created on the device (and in the dtype) of the tensor it receives for, so the
same code runs on gloo with CPU tensors and on NCCL with CUDA tensors.
Every collective waits at most `timeout` (None: the process group's own timeout) and raises
`CollectiveError` when it fails or times out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import wait
from canzona.runtime.layout import Piece


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


def reduce_scatter_mean(send: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup,
                        timeout: timedelta | None = None) -> Tensor:
    """Uneven reduce-scatter: rank k receives the DP mean of region k (`sizes[k]` elements) of
    `send`. One all_to_all_single with split sizes, then a local sum."""
    world = len(sizes)
    if world == 1:
        return send.clone()
    mine = sizes[rank]
    received = torch.empty(world * mine, dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(received, send, [mine] * world, list(sizes), group=group, async_op=True)
    wait(work, timeout, "the DP reduce-scatter of gradients")
    return received.view(world, mine).sum(0).div_(world)


def all_gather_uneven(mine: Tensor, sizes: Sequence[int], group: dist.ProcessGroup,
                      timeout: timedelta | None = None) -> Tensor:
    """Uneven all-gather: the concatenation of every rank's region (rank k holds `sizes[k]`)."""
    world = len(sizes)
    if world == 1:
        return mine
    received = torch.empty(sum(sizes), dtype=mine.dtype, device=mine.device)
    work = dist.all_to_all_single(received, mine.repeat(world), list(sizes), [mine.numel()] * world, group=group, async_op=True)
    wait(work, timeout, "the DP all-gather of updated parameters")
    return received


DP_COLLECTIVES = ("all_to_all", "rooted")


def _regions(sizes: Sequence[int]) -> list[tuple[int, int]]:
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return [(starts[k], starts[k] + sizes[k]) for k in range(len(sizes))]


def reduce_scatter_rooted(send: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup,
                          timeout: timedelta | None = None) -> Tensor:
    """Uneven reduce-scatter as one rooted reduce per non-empty region, to its owner.

    With all_to_all the owner of a large region receives world − 1 copies of it over its own
    link; a (pipelined) rooted reduce moves the region over every link about once, which is
    what matters when matrix-atomic cuts make regions very uneven."""
    if len(sizes) == 1:
        return send.clone()
    scratch = send.clone()  # reduce overwrites its input on the way
    works = [
        dist.reduce(scratch[start:stop], dst=dist.get_global_rank(group, owner), group=group, async_op=True)
        for owner, (start, stop) in enumerate(_regions(sizes)) if stop > start
    ]
    for work in works:
        wait(work, timeout, "the DP reduce-scatter of gradients (rooted reduces)")
    start, stop = _regions(sizes)[rank]
    return scratch[start:stop].div_(len(sizes))


def all_gather_rooted(mine: Tensor, sizes: Sequence[int], group: dist.ProcessGroup,
                      timeout: timedelta | None = None) -> Tensor:
    """Uneven all-gather as one broadcast per non-empty region, from its owner."""
    if len(sizes) == 1:
        return mine
    rank = dist.get_rank(group)
    out = torch.empty(sum(sizes), dtype=mine.dtype, device=mine.device)
    regions = _regions(sizes)
    out[regions[rank][0] : regions[rank][1]].copy_(mine)
    works = [
        dist.broadcast(out[start:stop], src=dist.get_global_rank(group, owner), group=group, async_op=True)
        for owner, (start, stop) in enumerate(regions) if stop > start
    ]
    for work in works:
        wait(work, timeout, "the DP all-gather of updated parameters (broadcasts)")
    return out


def all_reduce_mean(buffer: Tensor, group: dist.ProcessGroup, timeout: timedelta | None = None) -> Tensor:
    """In-place DP mean of `buffer` (the DP-SC baseline)."""
    world = dist.get_world_size(group)
    if world > 1:
        wait(dist.all_reduce(buffer, group=group, async_op=True), timeout, "the DP all-reduce of gradients")
        buffer.div_(world)
    return buffer


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
