"""Collectives the runtime needs, built from `all_to_all_single` (works on gloo and NCCL).

Uneven reduce-scatter / all-gather over DP at the schedule's cuts, and an asynchronous
all-to-all for the TP micro-group gather and scatter. A group of size 1 never communicates.
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


def pack(pieces: Sequence[Piece], sources: Sequence[Tensor | None], out: Tensor, base: int = 0) -> None:
    """Copy each piece from its flattened source tensor into `out` at `dst - base`
    (a missing source, e.g. a parameter without a gradient, packs zeros)."""
    for piece in pieces:
        target = out[piece.dst - base : piece.dst - base + piece.length]
        source = sources[piece.param]
        if source is None:
            target.zero_()
        else:
            target.copy_(source[piece.src : piece.src + piece.length])


def unpack(pieces: Sequence[Piece], buffer: Tensor, targets: Sequence[Tensor], base: int = 0) -> None:
    """Copy each piece from `buffer` (at `dst - base`) into its flattened target tensor."""
    for piece in pieces:
        targets[piece.param][piece.src : piece.src + piece.length].copy_(buffer[piece.dst - base : piece.dst - base + piece.length])


def reduce_scatter_mean(send: Tensor, sizes: Sequence[int], rank: int, group: dist.ProcessGroup,
                        timeout: timedelta | None = None) -> Tensor:
    """Uneven reduce-scatter: rank k receives the DP mean of region k (`sizes[k]` elements) of
    `send`. One all_to_all_single with split sizes, then a local sum."""
    world = len(sizes)
    if world == 1:
        return send.clone()
    mine = sizes[rank]
    received = torch.empty(world * mine, dtype=send.dtype)
    work = dist.all_to_all_single(received, send, [mine] * world, list(sizes), group=group, async_op=True)
    wait(work, timeout, "the DP reduce-scatter of gradients")
    return received.view(world, mine).sum(0).div_(world)


def all_gather_uneven(mine: Tensor, sizes: Sequence[int], group: dist.ProcessGroup,
                      timeout: timedelta | None = None) -> Tensor:
    """Uneven all-gather: the concatenation of every rank's region (rank k holds `sizes[k]`)."""
    world = len(sizes)
    if world == 1:
        return mine
    received = torch.empty(sum(sizes), dtype=mine.dtype)
    work = dist.all_to_all_single(received, mine.repeat(world), list(sizes), [mine.numel()] * world, group=group, async_op=True)
    wait(work, timeout, "the DP all-gather of updated parameters")
    return received


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
    received = torch.empty(sum(recv_splits), dtype=send.dtype)
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
