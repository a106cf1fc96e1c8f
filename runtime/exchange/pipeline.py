"""The micro-group pipeline (docs/concepts.md): per group, one fused all-to-all gathers every
piece of a matrix to the rank that updates it (its host), each host updates the full matrices it
hosts, one fused all-to-all sends every rank its piece of the result, every rank applies its own.
Group g+1's gather is in flight while g computes, and group g's scatter while g+1 computes.

Who holds which piece is a `Geometry`: `TpGeometry` for `CanzonaOptimizer`'s TP group (each TP
rank holds its TP shard; a matrix hosted by a team, `canzona.runtime.rules.cooperative`, travels
in pieces: each member gets, and sends back, only its slice of the long side), and
`canzona.runtime.fsdp.optimizer.FragmentGeometry` for `FsdpOptimizer`'s fragmentation group
(each device holds its FSDP rows of its TP shard).

Callbacks keep this module free of optimizer details:
`grad_of(task)` is this rank's reduced local gradient piece (its shape, fp32),
`update_of(tasks, full_grads)` the host's full results for the matrices of one micro-group it
updates, all at once (so that same-shape matrices are computed as one batch): full shape, an
fp32 update for fp32 parameters, the new values (fp32 main copy) for bf16/fp16 ones, and
`apply(task, piece)` applies this rank's piece of it. `active(task)` leaves out matrices that
take no part in this step (no gradient on any rank); every rank must give the same answer.
Gradients travel in fp32; a micro-group's results travel in its tasks' model dtype when they
share one, else in fp32 (exact for every dtype the runtime takes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.exchange.comm import InFlight, all_gather_equal, start_all_to_all
from canzona.runtime.rules import cooperative
from canzona.runtime.schedule import DTYPES, tp_shard
from canzona.schedules.layout import Task, hosts_here

GradOf = Callable[[Task], Tensor]
UpdateOf = Callable[[Sequence[Task], dict[int, Tensor]], dict[int, Tensor]]
Apply = Callable[[Task, Tensor], None]
Active = Callable[[Task], bool]


def _flat(tensors: list[Tensor], device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def payload_dtype(tasks: Sequence[Task]) -> torch.dtype:
    """The dtype a micro-group's results travel in: the tasks' common model dtype, else fp32."""
    dtypes = {DTYPES[t.dtype] for t in tasks}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def assemble(task: Task, shards: Sequence[Tensor]) -> Tensor:
    """The gathered matrix: the TP shards (each rank's shape) concatenated along the TP dim."""
    return shards[0] if task.tp_dim is None else torch.cat(list(shards), dim=task.tp_dim)


def _padded(flat: Tensor, numel: int) -> Tensor:
    """`flat` followed by zeros up to `numel` elements."""
    return flat if flat.numel() == numel else torch.cat([flat, flat.new_zeros(numel - flat.numel())])


class Geometry(Protocol):
    """Who holds which piece of a matrix in a pipeline's process group of `size` ranks, seen
    from rank `rank`. Pieces travel flat; "pieces" arguments list one per rank of the group
    (empty where that rank sends none)."""

    size: int
    rank: int

    def updates(self, task: Task, rank: int) -> bool:
        """Whether `rank` computes (part of) `task`'s update."""

    def gather_numel(self, task: Task, sender: int, receiver: int) -> int:
        """Elements of `task`'s gradient the gather moves from `sender` to `receiver`."""

    def gather_piece(self, task: Task, grad: Tensor, receiver: int) -> Tensor:
        """What this rank sends `receiver` of its gradient piece `grad`."""

    def assemble(
        self, task: Task, pieces: Sequence[Tensor], grad_of: GradOf, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """On a rank that updates `task`: the gradient it updates from (the full matrix, or a
        team member's slice), from the pieces received and, where needed, its own piece
        `grad_of(task)`."""

    def scatter_numel(self, task: Task, sender: int, receiver: int) -> int:
        """Elements of `task`'s result the scatter moves from `sender` to `receiver`."""

    def scatter_piece(self, task: Task, result: Tensor, receiver: int) -> Tensor:
        """What this rank sends `receiver` of its result of `task`."""

    def received(self, task: Task, pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        """This rank's piece of `task`'s result (its shape), from the pieces received."""


class TpGeometry:
    """The TP group of `CanzonaOptimizer`: TP rank r holds its TP shard of every matrix (all
    of a replicated one); a matrix's host, or each member of its team, updates it."""

    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.rank, self.size = tp_rank, tp_size

    def updates(self, task: Task, rank: int) -> bool:
        """Its host, or a member of its team."""
        return hosts_here(task, rank)

    def gather_numel(self, task: Task, sender: int, receiver: int) -> int:
        """A shard, or a team member's piece of it (a replicated matrix: none, every rank has it)."""
        if task.tp_dim is None or not hosts_here(task, receiver):
            return 0
        return (
            cooperative.piece_numel(task, sender, task.team.index(receiver)) if task.team else task.shard_numel(sender)
        )

    def gather_piece(self, task: Task, grad: Tensor, receiver: int) -> Tensor:
        """The shard, or the receiving member's piece of it."""
        return cooperative.shard_piece(task, grad, self.rank, task.team.index(receiver)) if task.team else grad

    def assemble(
        self, task: Task, pieces: Sequence[Tensor], grad_of: GradOf, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """The full matrix on its host, the slice on a team member (a replicated matrix: from
        this rank's own copy)."""
        if task.tp_dim is None:
            whole = grad_of(task)
            return cooperative.shard_piece(task, whole, 0, task.team.index(self.rank)) if task.team else whole
        if task.team:
            return cooperative.assemble_slice(task, task.team.index(self.rank), pieces, dtype, device)
        return assemble(task, [p.view(task.shard_shape(sender)) for sender, p in enumerate(pieces)])

    def scatter_numel(self, task: Task, sender: int, receiver: int) -> int:
        """The receiver's shard, or the part of it in the sending member's slice."""
        if not hosts_here(task, sender):
            return 0
        return (
            cooperative.piece_numel(task, receiver, task.team.index(sender))
            if task.team
            else task.shard_numel(receiver)
        )

    def scatter_piece(self, task: Task, result: Tensor, receiver: int) -> Tensor:
        """The receiver's shard of the result (of this member's slice, in a team)."""
        if task.team:
            return cooperative.slice_piece(task, result, receiver, task.team.index(self.rank))
        return tp_shard(result, task.tp_dim, self.size, receiver)

    def received(self, task: Task, pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        """This rank's shard: the host's piece, or the team members' pieces put together."""
        if task.team:
            members = [piece for rank, piece in enumerate(pieces) if hosts_here(task, rank)]
            return cooperative.assemble_shard(task, self.rank, members, dtype, device)
        return pieces[task.host].view(task.shard_shape(self.rank))


class MicroGroupPipeline:
    """Executes micro-groups over `group`, whose pieces `geometry` places (module docstring)."""

    def __init__(
        self,
        groups: Sequence[tuple[Task, ...]],
        geometry: Geometry,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout: timedelta | None = None,
        label: str = "TP micro-group",
    ) -> None:
        self.groups, self.geometry, self.group = list(groups), geometry, group
        self.device, self.timeout, self.label = device, timeout, label

    def _hosted(self, tasks: Sequence[Task], rank: int) -> list[Task]:
        return [t for t in tasks if self.geometry.updates(t, rank)]

    def _split(
        self, tasks: Sequence[Task], numel: Callable[[Task, int, int], int], received: Tensor
    ) -> dict[int, list[Tensor]]:
        """Per task, the piece each sender sent this rank (in the order senders pack them)."""
        pieces: dict[int, list[Tensor]] = {t.param: [] for t in tasks}
        offset, none = 0, received[:0]  # one empty view for every pair that moves nothing (most, at large TP)
        for sender in range(self.geometry.size):
            for task in tasks:
                count = numel(task, sender, self.geometry.rank)
                pieces[task.param].append(received[offset : offset + count] if count else none)
                offset += count
        return pieces

    def _start_gather(self, tasks: Sequence[Task], grad_of: GradOf) -> InFlight:
        geometry, me = self.geometry, self.geometry.rank
        pieces, send_splits = [], []
        for receiver in range(geometry.size):
            moved = [(t, count) for t in tasks if (count := geometry.gather_numel(t, me, receiver))]
            pieces += [geometry.gather_piece(t, grad_of(t), receiver) for t, _ in moved]
            send_splits.append(sum(count for _, count in moved))
        send = _flat(pieces, self.device)
        senders = range(geometry.size)
        if not any(geometry.gather_numel(t, a, b) for t in tasks for a in senders for b in senders):
            return InFlight(send, None)  # e.g. only replicated matrices under TP: every rank has them
        recv_splits = [sum(geometry.gather_numel(t, sender, me) for t in tasks) for sender in senders]
        return start_all_to_all(send, send_splits, recv_splits, self.group, self.timeout, f"the {self.label} gather")

    def _full_grads(self, tasks: Sequence[Task], received: Tensor, grad_of: GradOf) -> dict[int, Tensor]:
        """The gradient of every task this rank updates, from the gathered pieces."""
        pieces = self._split(tasks, self.geometry.gather_numel, received)
        return {
            t.param: self.geometry.assemble(t, pieces[t.param], grad_of, received.dtype, self.device)
            for t in self._hosted(tasks, self.geometry.rank)
        }

    def _start_scatter(self, tasks: Sequence[Task], updates: dict[int, Tensor]) -> InFlight:
        geometry, me = self.geometry, self.geometry.rank
        hosted = self._hosted(tasks, me)
        parts = [geometry.scatter_piece(t, updates[t.param], peer) for peer in range(geometry.size) for t in hosted]
        send = _flat(parts, self.device, payload_dtype(tasks))
        send_splits = [sum(geometry.scatter_numel(t, me, peer) for t in hosted) for peer in range(geometry.size)]
        recv_splits = [sum(geometry.scatter_numel(t, sender, me) for t in tasks) for sender in range(geometry.size)]
        return start_all_to_all(send, send_splits, recv_splits, self.group, self.timeout, f"the {self.label} scatter")

    def _apply(self, tasks: Sequence[Task], received: Tensor, apply: Apply) -> None:
        pieces = self._split(tasks, self.geometry.scatter_numel, received)
        for task in tasks:
            apply(task, self.geometry.received(task, pieces[task.param], received.dtype, self.device))

    def run(self, grad_of: GradOf, update_of: UpdateOf, apply: Apply, active: Active) -> None:
        """Run every micro-group: gather(g+1) overlaps compute(g), scatter(g) overlaps compute(g+1)."""
        groups = [kept for kept in (tuple(t for t in tasks if active(t)) for tasks in self.groups) if kept]
        if self.geometry.size == 1:  # every task is hosted here: nothing to gather or scatter
            for tasks in groups:
                results = update_of(tasks, {t.param: grad_of(t) for t in tasks})
                for task in tasks:
                    apply(task, results[task.param])
            return
        if not groups:
            return
        gather = self._start_gather(groups[0], grad_of)
        scatter: tuple[tuple[Task, ...], InFlight] | None = None
        for index, tasks in enumerate(groups):
            received = gather.wait()
            if index + 1 < len(groups):
                gather = self._start_gather(groups[index + 1], grad_of)
            full = self._full_grads(tasks, received, grad_of)
            updates = update_of(self._hosted(tasks, self.geometry.rank), full)
            if scatter is not None:
                self._apply(scatter[0], scatter[1].wait(), apply)
            scatter = (tasks, self._start_scatter(tasks, updates))
        assert scatter is not None
        self._apply(scatter[0], scatter[1].wait(), apply)

    def gather_full(self, tasks: Sequence[Task], shard_of: GradOf) -> dict[int, Tensor]:
        """The full matrix of every task in `tasks` that this rank hosts, assembled from every
        rank's fp32 `shard_of(task)` in one all-to-all (rebuilding fp32 main copies)."""
        chosen = tuple(tasks)
        if self.geometry.size == 1:
            return {t.param: shard_of(t) for t in chosen}
        return self._full_grads(chosen, self._start_gather(chosen, shard_of).wait(), shard_of)


def gather_replicated(
    tasks: Sequence[Task],
    tp_group: dist.ProcessGroup,
    grad_of: GradOf,
    device: torch.device,
    timeout: timedelta | None = None,
) -> dict[int, Tensor]:
    """Every task's full fp32 matrix on every TP rank: one fused all-gather of the sharded ones."""
    sharded = [t for t in tasks if t.tp_dim is not None]
    # every rank sends its shards padded to the largest (TP rank 0's), for one equal all-gather
    slots = [_padded(grad_of(t).reshape(-1), t.shard_numel(0)) for t in sharded]
    gathered = all_gather_equal(_flat(slots, device), tp_group, timeout) if sharded else []
    full, offset = {}, 0
    for task in sharded:
        shards = [g[offset : offset + task.shard_numel(r)].view(task.shard_shape(r)) for r, g in enumerate(gathered)]
        full[task.param] = assemble(task, shards)
        offset += task.shard_numel(0)
    for task in tasks:
        if task.tp_dim is None:
            full[task.param] = grad_of(task)
    return full


def replicated_updates(
    tasks: Sequence[Task],
    tp_rank: int,
    tp_size: int,
    tp_group: dist.ProcessGroup,
    grad_of: GradOf,
    update_of: UpdateOf,
    apply: Apply,
    device: torch.device,
    timeout: timedelta | None,
    active: Active,
) -> None:
    """TP-SC: one fused all-gather of every sharded task's gradient; every TP rank updates every
    full matrix and applies its own shard (P-fold redundant compute and state)."""
    chosen = [t for t in tasks if active(t)]
    full = gather_replicated(chosen, tp_group, grad_of, device, timeout)
    results = update_of(chosen, full)
    for task in chosen:
        apply(task, tp_shard(results[task.param], task.tp_dim, tp_size, tp_rank))
