"""The TP micro-group pipeline (docs/concepts.md): per group, one fused all-to-all gathers every shard to
its host, each host updates the full matrices it hosts, one fused all-to-all sends the result
shards back, every rank applies its own. Group g+1's gather is in flight while g computes,
and group g's scatter while g+1 computes. A matrix hosted by a team (`canzona.runtime.rules.cooperative`)
travels in pieces: each member gets, and sends back, only its slice of the long side.

Callbacks keep this module free of optimizer details:
`grad_of(task)` is this rank's reduced local gradient shard (local shape, fp32),
`update_of(tasks, full_grads)` the host's full results for the matrices of one micro-group it
updates, all at once (so that same-shape matrices are computed as one batch): full shape, an
fp32 update for fp32 parameters, the new values (fp32 main copy) for bf16/fp16 ones, and
`apply(task, shard)` applies this rank's shard of it. `active(task)` leaves out matrices that
take no part in this step (no gradient on any rank); every rank must give the same answer.
Gradients travel in fp32; a micro-group's results travel in its tasks' model dtype when they
share one, else in fp32 (exact for every dtype the runtime takes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.rules import cooperative
from canzona.runtime.exchange.comm import InFlight, all_gather_equal, start_all_to_all
from canzona.schedules.layout import Task, hosts_here
from canzona.runtime.schedule import DTYPES, tp_shard

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


def _shard(update: Tensor, task: Task, rank: int, size: int) -> Tensor:
    """TP rank `rank`'s part of a full update (the whole update for a replicated matrix)."""
    return tp_shard(update, task.tp_dim, size, rank)


def assemble(task: Task, shards: Sequence[Tensor]) -> Tensor:
    """The gathered matrix: the TP shards (each rank's shape) concatenated along the TP dim."""
    return shards[0] if task.tp_dim is None else torch.cat(list(shards), dim=task.tp_dim)


def _padded(flat: Tensor, numel: int) -> Tensor:
    """`flat` followed by zeros up to `numel` elements."""
    return flat if flat.numel() == numel else torch.cat([flat, flat.new_zeros(numel - flat.numel())])


def _everything(task: Task) -> bool:
    return True


def _gather_numel(task: Task, sender: int, receiver: int) -> int:
    """Elements of `task` the gather moves from `sender` to `receiver` (a replicated matrix:
    none, every rank has it)."""
    if task.tp_dim is None or not hosts_here(task, receiver):
        return 0
    return cooperative.piece_numel(task, sender, task.team.index(receiver)) if task.team else task.shard_numel(sender)


def _scatter_numel(task: Task, sender: int, receiver: int) -> int:
    """Elements of `task`'s result the scatter moves from `sender` to `receiver`."""
    if not hosts_here(task, sender):
        return 0
    return cooperative.piece_numel(task, receiver, task.team.index(sender)) if task.team else task.shard_numel(receiver)


class MicroGroupPipeline:
    """Executes one DP rank's micro-groups on one of its TP ranks (team members: their slice;
    `team_groups`: this rank's teams' process groups)."""

    def __init__(self, groups: Sequence[tuple[Task, ...]], tp_rank: int, tp_size: int, tp_group: dist.ProcessGroup,
                 device: torch.device, timeout: timedelta | None = None) -> None:
        self.groups = list(groups)
        self.rank = tp_rank
        self.size = tp_size
        self.group = tp_group
        self.device = device
        self.timeout = timeout
        self.team_groups = cooperative.make_team_groups([t for g in self.groups for t in g], tp_rank, tp_group, timeout)

    def _hosted(self, tasks: tuple[Task, ...], host: int) -> list[Task]:
        return [t for t in tasks if hosts_here(t, host)]

    def _start_gather(self, tasks: tuple[Task, ...], grad_of: GradOf) -> InFlight:
        pieces, send_splits = [], []
        for host in range(self.size):
            moved = [(t, count) for t in tasks if (count := _gather_numel(t, self.rank, host))]
            pieces += [cooperative.shard_piece(t, grad_of(t), self.rank, t.team.index(host)) if t.team else grad_of(t)
                       for t, _ in moved]
            send_splits.append(sum(count for _, count in moved))
        send = _flat(pieces, self.device)
        if send.numel() == 0:  # only replicated matrices: every TP rank knows, nobody sends
            return InFlight(send, None)
        recv_splits = [sum(_gather_numel(t, sender, self.rank) for t in tasks) for sender in range(self.size)]
        return start_all_to_all(send, send_splits, recv_splits, self.group, self.timeout, "the TP micro-group gather")

    def _full_grads(self, tasks: tuple[Task, ...], received: Tensor, grad_of: GradOf) -> dict[int, Tensor]:
        """The gradient of every task this rank updates, from the gathered pieces: the full
        matrix on its host, the slice on a team member."""
        pieces: dict[int, list[Tensor]] = {t.param: [] for t in tasks}  # per sender, empty where it sent none
        offset = 0
        for sender in range(self.size):
            for task in tasks:
                count = _gather_numel(task, sender, self.rank)
                pieces[task.param].append(received[offset : offset + count])
                offset += count
        full = {}
        for task in self._hosted(tasks, self.rank):
            if task.tp_dim is None:
                whole = grad_of(task)
                full[task.param] = (cooperative.shard_piece(task, whole, 0, task.team.index(self.rank))
                                    if task.team else whole)
            elif task.team:
                full[task.param] = cooperative.assemble_slice(task, task.team.index(self.rank), pieces[task.param],
                                                              received.dtype, self.device)
            else:
                full[task.param] = assemble(task, [p.view(task.shard_shape(sender)) for sender, p in enumerate(pieces[task.param])])
        return full

    def _start_scatter(self, tasks: tuple[Task, ...], updates: dict[int, Tensor]) -> InFlight:
        hosted = self._hosted(tasks, self.rank)
        dtype = payload_dtype(tasks)
        parts = [
            cooperative.slice_piece(t, updates[t.param], peer, t.team.index(self.rank)) if t.team
            else _shard(updates[t.param], t, peer, self.size)
            for peer in range(self.size) for t in hosted
        ]
        send = _flat(parts, self.device, dtype)
        send_splits = [sum(_scatter_numel(t, self.rank, peer) for t in hosted) for peer in range(self.size)]
        recv_splits = [sum(_scatter_numel(t, sender, self.rank) for t in tasks) for sender in range(self.size)]
        return start_all_to_all(send, send_splits, recv_splits, self.group, self.timeout, "the TP micro-group scatter")

    def _apply(self, tasks: tuple[Task, ...], received: Tensor, apply: Apply) -> None:
        offset, team_pieces = 0, {t.param: [] for t in tasks if t.team}
        for host in range(self.size):
            for task in self._hosted(tasks, host):
                count = _scatter_numel(task, host, self.rank)
                piece = received[offset : offset + count]
                offset += count
                if task.team:
                    team_pieces[task.param].append(piece)
                else:
                    apply(task, piece.view(task.shard_shape(self.rank)))
        for task in tasks:
            if task.team:
                apply(task, cooperative.assemble_shard(task, self.rank, team_pieces[task.param], received.dtype, self.device))

    def run(self, grad_of: GradOf, update_of: UpdateOf, apply: Apply, active: Active = _everything) -> None:
        """Run every micro-group: gather(g+1) overlaps compute(g), scatter(g) overlaps compute(g+1)."""
        groups = [kept for kept in (tuple(t for t in tasks if active(t)) for tasks in self.groups) if kept]
        if self.size == 1:  # every task is hosted here: nothing to gather or scatter
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
            updates = update_of(self._hosted(tasks, self.rank), full)
            if scatter is not None:
                self._apply(scatter[0], scatter[1].wait(), apply)
            scatter = (tasks, self._start_scatter(tasks, updates))
        assert scatter is not None
        self._apply(scatter[0], scatter[1].wait(), apply)

    def gather_full(self, tasks: Sequence[Task], shard_of: GradOf) -> dict[int, Tensor]:
        """The full matrix of every task in `tasks` that this rank hosts, assembled from every
        TP rank's fp32 `shard_of(task)` in one all-to-all (rebuilding fp32 main copies)."""
        chosen = tuple(tasks)
        if self.size == 1:
            return {t.param: shard_of(t) for t in chosen}
        return self._full_grads(chosen, self._start_gather(chosen, shard_of).wait(), shard_of)


def gather_replicated(tasks: Sequence[Task], tp_group: dist.ProcessGroup, grad_of: GradOf, device: torch.device,
                      timeout: timedelta | None = None) -> dict[int, Tensor]:
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


def replicated_updates(tasks: Sequence[Task], tp_rank: int, tp_size: int, tp_group: dist.ProcessGroup,
                       grad_of: GradOf, update_of: UpdateOf, apply: Apply, device: torch.device,
                       timeout: timedelta | None = None, active: Active = _everything) -> None:
    """TP-SC: one fused all-gather of every sharded task's gradient; every TP rank updates every
    full matrix and applies its own shard (P-fold redundant compute and state)."""
    chosen = [t for t in tasks if active(t)]
    full = gather_replicated(chosen, tp_group, grad_of, device, timeout)
    results = update_of(chosen, full)
    for task in chosen:
        apply(task, _shard(results[task.param], task, tp_rank, tp_size))
