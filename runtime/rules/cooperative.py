"""Cooperatively hosted matrices (schedule `teams`, Muon only): geometry, subgroups, and the
sharded Newton–Schulz the members run together.

A team of k TP ranks (ascending) splits the gathered matrix along its long side (rows when
it is taller than wide, as Muon transposes it, else columns) into k equal slices; member i
holds slice i: its gradient, its momentum and (for bf16/fp16) its fp32 main copy. The TP
micro-group gather brings each member the part of every rank's shard inside its slice, and
the scatter sends each rank the part of its shard a member computed (`piece_box`).

Muon's update is equivariant under permutations of the long side's rows (every product is
X·Xᵀ, summed over it, or acts on it row by row), so a matrix with one row-block submatrix
(fused fc1) is orthogonalised in gathered order, as the math in canonical order would give,
up to the order of the sums. Per Newton–Schulz iteration the members all-reduce the r × r
Gram X·Xᵀ over the team's process group (plus one scalar for the Frobenius norm); the rest
is local.

Team process groups are created at construction by the team's members only
(`use_local_synchronization`), one per distinct member set of this rank's TP group, in
sorted order (`make_team_groups` says why non-members create a group of their own alongside).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from math import prod

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import wait
from canzona.runtime.rules.newton_schulz import (
    NsCoefficients,
    coefficient_schedule,
    compute_dtype,
    matmul_precision,
)
from canzona.runtime.rules.optimizers import Hyperparameters, State, muon_scale
from canzona.schedules.layout import Task
from canzona.schedules.teams import long_dim

Box = tuple[tuple[int, int], ...]  # per dim: [start, stop)


def slice_box(task: Task, member: int) -> Box:
    """Where team member `member` (position in the team)'s slice lies in the gathered matrix."""
    dim, k = long_dim(task.shape), len(task.team)
    part = task.shape[dim] // k
    return tuple((member * part, (member + 1) * part) if d == dim else (0, size) for d, size in enumerate(task.shape))


def slice_shape(task: Task, member: int) -> tuple[int, ...]:
    """The shape of member `member`'s slice."""
    return tuple(stop - start for start, stop in slice_box(task, member))


def held_shape(task: Task, tp_rank: int) -> tuple[int, ...]:
    """The shape of what TP rank `tp_rank` updates of a task it hosts: its slice in a team,
    else the full matrix."""
    return slice_shape(task, task.team.index(tp_rank)) if task.team else task.shape


def _meet(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _view(tensor: Tensor, box: Box, origin: Box) -> Tensor:
    """The part of `tensor` (which covers `origin`) inside `box`."""
    out = tensor
    for dim, ((start, stop), (base, _)) in enumerate(zip(box, origin)):
        out = out.narrow(dim, start - base, stop - start)
    return out


def piece_numel(task: Task, tp_rank: int, member: int) -> int:
    """Elements rank `tp_rank`'s shard shares with member `member`'s slice (what the gather
    moves from that rank to that member; a replicated matrix moves nothing, see `shard_piece`)."""
    box = _meet(task.shard_box(tp_rank), slice_box(task, member))
    return prod(stop - start for start, stop in box) if box else 0


def shard_piece(task: Task, shard: Tensor, tp_rank: int, member: int) -> Tensor:
    """The part of rank `tp_rank`'s shard (local shape) inside member `member`'s slice."""
    box = _meet(task.shard_box(tp_rank), slice_box(task, member))
    return shard.reshape(-1)[:0] if box is None else _view(shard, box, task.shard_box(tp_rank))


def slice_piece(task: Task, part: Tensor, tp_rank: int, member: int) -> Tensor:
    """The part of member `member`'s slice (slice shape) inside rank `tp_rank`'s shard."""
    box = _meet(task.shard_box(tp_rank), slice_box(task, member))
    return part.reshape(-1)[:0] if box is None else _view(part, box, slice_box(task, member))


def _fill(out: Tensor, frame: Box, parts: Iterable[tuple[Box | None, Tensor]]) -> Tensor:
    """Copy each flat piece into `out` (covering box `frame`) at its box; None boxes hold nothing."""
    for box, piece in parts:
        if box is not None:
            target = _view(out, box, frame)
            target.copy_(piece.view(target.shape))
    return out


def assemble_slice(
    task: Task, member: int, pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Member `member`'s slice from every TP rank's piece (flat, in TP-rank order)."""
    frame = slice_box(task, member)
    out = torch.empty(slice_shape(task, member), dtype=dtype, device=device)
    return _fill(out, frame, ((_meet(task.shard_box(tp_rank), frame), piece) for tp_rank, piece in enumerate(pieces)))


def assemble_shard(
    task: Task, tp_rank: int, pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Rank `tp_rank`'s shard (local shape) from every member's piece (flat, in team order)."""
    frame = task.shard_box(tp_rank)
    out = torch.empty(task.shard_shape(tp_rank), dtype=dtype, device=device)
    return _fill(out, frame, ((_meet(frame, slice_box(task, member)), piece) for member, piece in enumerate(pieces)))


def canonical_chunks(task: Task, member: int, tensor: Tensor) -> list[tuple[tuple[int, int], Tensor]]:
    """`tensor` (member `member`'s slice: its momentum or main copy) as chunks of the logical,
    canonical-order matrix (rows in row-block order): (offsets, a row range of `tensor`)."""
    (row_start, row_stop), (col_start, _) = slice_box(task, member)
    ranges = [(start, stop) for start, stop in task.row_blocks[0]] if task.row_blocks else [(0, task.shape[0])]
    chunks, base = [], 0
    for start, stop in ranges:
        low, high = max(start, row_start), min(stop, row_stop)
        if low < high:
            chunks.append(((base + low - start, col_start), tensor[low - row_start : high - row_start]))
        base += stop - start
    return chunks


def make_team_groups(
    tasks: Sequence[Task], tp_rank: int, tp_group: dist.ProcessGroup, timeout: timedelta | None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A process group per distinct team of this TP group that this rank belongs to.

    Only a team's members create its group (`use_local_synchronization`); torch names such a
    group by its ranks and by how many groups the caller has, so the members must have the
    same count when they create it. Every TP rank therefore walks every team of the TP group
    in one order and, where it is not a member, creates a group of itself instead: the counts
    stay aligned (they are when the TP group's ranks start alike, as the groups a training
    script creates for a DP x TP grid leave them)."""
    teams = sorted({t.team for t in tasks if t.team})
    groups = {}
    for team in teams:
        if tp_rank in team:
            ranks = [dist.get_global_rank(tp_group, member) for member in team]
            groups[team] = dist.new_group(ranks, use_local_synchronization=True, timeout=timeout)
        else:
            dist.new_group([dist.get_rank()], use_local_synchronization=True, timeout=timeout)
    return groups


@dataclass
class Calls:
    """How many of a team update's all-reduces this member has entered (after a failure it
    goes through the rest on zeros, so that the other members finish theirs)."""

    count: int = 0


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup, timeout: timedelta | None, calls: Calls) -> None:
    calls.count += 1
    wait(dist.all_reduce(tensor, group=group, async_op=True), timeout, "a cooperative Newton-Schulz all-reduce")


def team_newton_schulz(
    part: Tensor,
    dim: int,
    steps: int,
    coefficients: NsCoefficients,
    group: dist.ProcessGroup,
    timeout: timedelta | None,
    calls: Calls | None = None,
    eps: float = 1e-7,
    precision: str = "fp32",
) -> Tensor:
    """`newton_schulz` of the matrix whose slices along `dim` (its long side) the team's
    members hold; `part` is this member's, and so is the result (steps + 1 all-reduces). The
    products run in `precision` (a resolved `ns_dtype`), the norm and the summed Gram X·Xᵀ in
    fp32."""
    calls = calls if calls is not None else Calls()
    work = compute_dtype(part)
    x = part.to(work)
    if dim == 0:
        x = x.T
    norm = x.square().sum().reshape(1)
    _all_reduce(norm, group, timeout, calls)
    x = x / (norm.sqrt() + eps)
    x = (x.to(torch.bfloat16) if precision == "bf16" else x).contiguous()
    with matmul_precision(precision, x.device):
        for a, b, c in coefficient_schedule(coefficients, steps):
            gram = (x @ x.T).to(work)
            _all_reduce(gram, group, timeout, calls)
            gram = gram.to(x.dtype)
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a, alpha=1.0)
    x = x.to(work)
    return x.T.contiguous() if dim == 0 else x


def idle(
    task: Task, group: dist.ProcessGroup, steps: int, device: torch.device, timeout: timedelta | None, done: int = 0
) -> None:
    """Take part, with zeros, in the team update's all-reduces after the first `done` (this
    rank's step failed: the other members still complete theirs, and every rank refuses the
    step at the safe point)."""
    rows, calls = min(task.shape), Calls(done)
    if calls.count < 1:
        _all_reduce(torch.zeros(1, device=device), group, timeout, calls)
    while calls.count < steps + 1:
        _all_reduce(torch.zeros(rows, rows, device=device), group, timeout, calls)


def team_muon(
    hp: Hyperparameters,
    state: State,
    grad: Tensor,
    task: Task,
    group: dist.ProcessGroup,
    timeout: timedelta | None,
    calls: Calls | None = None,
) -> Tensor:
    """Muon's update of this member's slice (`Muon.update` with the Newton–Schulz shared by
    the team, the scale of the full matrix)."""
    buf = state["momentum"]
    buf.mul_(hp.momentum).add_(grad)
    direction = grad.add(buf, alpha=hp.momentum) if hp.nesterov else buf
    precision = hp.newton_schulz_run(grad.device)[0]
    schedule = hp.ns_schedule
    ortho = team_newton_schulz(
        direction, long_dim(task.shape), len(schedule), schedule, group, timeout, calls, precision=precision
    )
    return ortho.mul_(muon_scale(task.shape[0], task.shape[1], hp.update_scale, hp.update_scale_factor))
