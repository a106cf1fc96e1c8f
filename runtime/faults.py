"""Failing safely: collectives under a timeout, and one verdict for all ranks at safe points.

A rank that fails between two safe points keeps taking part in the collectives (with dummy
data) and reports its problem at the next safe point, where `settle` makes every rank raise the
same error. A collective that fails or times out (a peer died, hung or left early) raises
`CollectiveError` on the ranks that see it; the others see their own collective fail or time out.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_LISTED = 4


class CollectiveError(RuntimeError):
    """A collective failed or did not finish within the timeout (a peer rank died, hung or
    raised outside a safe point). The process groups may be unusable: restart from a checkpoint."""


class StepFailedError(RuntimeError):
    """A rank failed during an optimizer step; every rank raises this and no rank applied it."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read here (corrupt, incomplete, or another model)."""


def as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    """A timeout in seconds (or a timedelta) as a timedelta; None stays None."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timedelta(seconds=float(timeout))


def first_line(error: BaseException) -> str:
    """'Type: first line' of an error, for a one-line report."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def collective_error(what: str, error: BaseException, timeout: timedelta | None = None) -> CollectiveError:
    """The error raised when the collective `what` failed with `error`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    limit = f", timeout {timeout.total_seconds():g} s" if timeout is not None else ""
    return CollectiveError(
        f"canzona: {what} failed on rank {rank} ({first_line(error)}{limit}); a peer rank died, hung or failed "
        "outside a safe point, so the process groups may be unusable: restart from the last checkpoint"
    )


def wait(work: dist.Work | None, timeout: timedelta | None, what: str) -> None:
    """Wait for an asynchronous collective, at most `timeout` (None: the group's own timeout)."""
    if work is None:
        return
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as error:
        raise collective_error(what, error, timeout) from error


def gather_objects(value: Any, groups: Sequence[dist.ProcessGroup], what: str) -> list[Any]:
    """Every rank's `value` across the grid the groups span (nested: gather over groups[0],
    then gather those lists over groups[1], ...). On NCCL, `all_gather_object` stages the
    pickles on the current CUDA device: call `torch.cuda.set_device(local_rank)` first."""
    gathered: list[Any] = [value]
    try:
        for group in groups:
            if dist.get_world_size(group) > 1:
                out: list[Any] = [None] * dist.get_world_size(group)
                dist.all_gather_object(out, gathered, group=group)
                gathered = [item for part in out for item in part]
    except Exception as error:
        raise collective_error(what, error) from error
    return gathered


def describe(failures: Sequence[tuple[int, str]]) -> str:
    """'rank 1: X; ranks 2, 3: Y' for (rank, problem) pairs."""
    by_problem: dict[str, list[int]] = {}
    for rank, problem in failures:
        by_problem.setdefault(problem, []).append(rank)
    parts = []
    for problem, ranks in list(by_problem.items())[:MAX_LISTED]:
        ranks.sort()
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {problem}")
    if len(by_problem) > MAX_LISTED:
        parts.append(f"and {len(by_problem) - MAX_LISTED} more")
    return "; ".join(parts)


def fail_together(problem: str | None, groups: Sequence[dist.ProcessGroup], point: str, failure: str) -> None:
    """Raise `StepFailedError` on every rank, naming every rank's problem: every rank calls it once the
    ranks know that one of them failed (one exchange of the problems)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    reports = gather_objects((rank, problem), groups, point)
    raise StepFailedError(f"canzona: {failure}; " + describe([(r, p) for r, p in reports if p]))


def settle(
    problem: str | None,
    groups: Sequence[dist.ProcessGroup],
    timeout: timedelta | None,
    point: str,
    failure: str,
    device: torch.device,
    flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """A safe point (`point` names it): if any rank has a problem, every rank raises `StepFailedError`
    with `failure` and every rank's problem. One tiny all-reduce (MAX) per group when nobody
    failed, on `device` (NCCL takes no CPU tensors). `flags` (integers, on any device) ride
    along in the same all-reduce; returned as agreed by every rank: the maximum over all of
    them."""
    head = torch.tensor([1 if problem else 0], dtype=torch.int32, device=device)
    vector = head if flags is None else torch.cat([head, flags.to(device=device, dtype=torch.int32)])
    for group in groups:
        if dist.get_world_size(group) > 1:
            wait(dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout, point)
    if int(vector[0].item()):
        fail_together(problem, groups, point, failure)
    return vector[1:]
