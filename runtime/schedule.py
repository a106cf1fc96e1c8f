"""Loading a schedule and checking it: on its own, against the live model, and across ranks.

`load_schedule` reads a file through the schedule validator (every invariant the executor
relies on, so a bad file fails at load, not in a collective) and adds what this runtime
supports. `agree`
exchanges every rank's verdict with two collectives that every rank reaches, so a mismatch on
one rank raises the same clear error on all of them instead of hanging.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.rules.optimizers import MATRIX_OPTIMIZERS
from canzona.schedules.format import ParamEntry, Schedule, ScheduleError, read_schedule
from canzona.schedules.geometry import chunk_bounds
from canzona.schedules.layout import local_shape
from canzona.schedules.library import resolve_schedule
from canzona.schedules.text import printable
from canzona.schedules.validate import schedule_problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_LISTED = 4


class ScheduleMismatchError(RuntimeError):
    """The schedule does not fit this run (model, world layout, or ranks disagree)."""


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule file, or a library schedule by name (e.g. "qwen3-32b/muon-tp8-dp32"),
    and check every invariant the runtime relies on (ScheduleError). Reading runs the schedule
    validator already; only what this runtime supports is left to check."""
    schedule = read_schedule(resolve_schedule(path))
    problem = _runtime_problem(schedule)
    if problem:
        raise ScheduleError(f"{path}: {problem}")
    return schedule


def tp_shard(tensor: Tensor, tp_dim: int | None, tp: int, tp_rank: int) -> Tensor:
    """TP rank `tp_rank`'s shard of a full tensor (a view; the whole tensor when `tp_dim` is
    None), by torch.chunk's rule but always one of `tp` (torch.chunk may return fewer)."""
    if tp_dim is None:
        return tensor
    start, stop = chunk_bounds(tensor.shape[tp_dim], tp)[tp_rank]
    return tensor.narrow(tp_dim, start, stop - start)


def check_schedule(schedule: Schedule, origin: str = "<schedule>") -> None:
    """Raise ScheduleError (one line) unless the schedule is executable by this runtime: the
    schedule validator's invariants plus what this runtime supports."""
    problem = _runtime_problem(schedule) or schedule_problem(schedule)
    if problem:
        raise ScheduleError(f"{origin}: {problem}")


def _runtime_problem(schedule: Schedule) -> str | None:
    req = schedule.request
    if req.optimizer.name not in MATRIX_OPTIMIZERS:
        return f"unknown matrix optimizer {req.optimizer.name!r}"
    return None


def plan_digest(schedule: Schedule) -> str:
    """sha256 of the whole schedule: two ranks executing different plans would deadlock."""
    return hashlib.sha256(schedule.model_dump_json().encode()).hexdigest()


def tensor_problems(entry: ParamEntry, tensor: Tensor, tp: int, tp_rank: int = 0) -> list[str]:
    """Where TP rank `tp_rank`'s live parameter differs from its schedule entry (local shape,
    dtype, TP dim, layout); empty when it matches."""
    problems = []
    shape = local_shape(entry, tp, tp_rank)
    if tuple(tensor.shape) != shape:
        problems.append(
            f"{entry.name}: local shape {list(tensor.shape)}, schedule expects {list(shape)} "
            f"(full {entry.shape}, tp_dim {entry.tp_dim}, TP rank {tp_rank} of {tp})"
        )
    if DTYPES.get(entry.dtype) != tensor.dtype:
        flag = next((name for name, dtype in DTYPES.items() if dtype == tensor.dtype), None)
        fix = f" (plan with --dtype {flag})" if flag else ""
        problems.append(f"{entry.name}: dtype {tensor.dtype}, schedule says {entry.dtype}{fix}")
    partition_dim = getattr(tensor, "partition_dim", entry.tp_dim)  # Megatron's mark of a TP-split tensor
    if getattr(tensor, "tensor_model_parallel", False) and tp > 1 and partition_dim != entry.tp_dim:
        problems.append(f"{entry.name}: split along dim {partition_dim}, schedule says tp_dim {entry.tp_dim}")
    if not tensor.is_contiguous():
        problems.append(f"{entry.name}: the runtime needs contiguous parameters")
    return problems


def layout_problem(schedule: Schedule, dp_size: int, tp_size: int) -> str | None:
    """A message when the process groups do not have the schedule's DP × TP sizes."""
    req = schedule.request
    if (req.dp, req.tp) != (dp_size, tp_size):
        return f"the schedule is for DP {req.dp} x TP {req.tp}, but the process groups are DP {dp_size} x TP {tp_size}"
    return None


def summary(schedule: Schedule) -> str:
    """A short description of the plan, for error messages."""
    req = schedule.request
    ep = f" (EP {req.ep})" if req.ep > 1 else ""
    return (
        f"model {req.model.name}, DP {req.dp}{ep} x TP {req.tp}, {req.optimizer.name}, "
        f"alpha {req.alpha:g}, buckets {req.bucket_size}"
    )


@dataclass(frozen=True)
class Verdict:
    """What one rank concluded before the first collective of the step."""

    rank: int
    dp_rank: int
    tp_rank: int
    problem: str | None
    fingerprint: str | None
    digest: str | None
    summary: str
    frozen: str | None = None  # the schedule parameters this rank does not optimize (but its experts)
    frozen_experts: str | None = None  # those of its EP rank's experts (expert parallelism)
    ep: int = 1  # the EP size: experts' freezing must agree among the ranks of an EP rank


def verdict_on(
    schedule: Schedule | None, rank: int, dp_rank: int, tp_rank: int, problem: str | None, **more: Any
) -> Verdict:
    """This rank's verdict on `schedule` (None: it could not be loaded); `more`: the other fields."""
    return Verdict(
        rank,
        dp_rank,
        tp_rank,
        problem,
        schedule.fingerprint if schedule else None,
        plan_digest(schedule) if schedule else None,
        summary(schedule) if schedule else "no schedule",
        **more,
    )


def raise_disagreement(grid: list[list[Verdict]]) -> None:
    """The same ScheduleMismatchError on every rank holding this grid of verdicts, if they disagree."""
    message = disagreement(grid)
    if message:
        raise ScheduleMismatchError(printable(message))  # names from the file, shown on a terminal


def agree(verdict: Verdict, dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup) -> None:
    """Exchange verdicts over the TP then the DP group (every rank reaches both collectives)
    and raise the same ScheduleMismatchError on every rank if any rank found a problem, the
    ranks hold different schedules, or the groups are not a DP × TP grid."""
    tp_verdicts: list[Verdict | None] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(tp_verdicts, verdict, group=tp_group)
    grid: list[Any] = [None] * dist.get_world_size(dp_group)  # filled: every DP peer's TP verdicts
    dist.all_gather_object(grid, tp_verdicts, group=dp_group)
    raise_disagreement(grid)


def _ranks(verdicts: list[Verdict]) -> str:
    ranks = sorted(v.rank for v in verdicts)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _by(verdicts: list[Verdict], key: str) -> dict[str | None, list[Verdict]]:
    groups: dict[str | None, list[Verdict]] = {}
    for v in verdicts:
        groups.setdefault(getattr(v, key), []).append(v)
    return groups


def disagreement(grid: list[list[Verdict]]) -> str | None:
    """The error every rank raises for this grid of verdicts ([dp peer][tp peer]), or None."""
    flat = [v for row in grid for v in row]
    failed = _by([v for v in flat if v.problem], "problem")
    if failed:
        listed = list(failed.items())[:MAX_LISTED]
        parts = [f"{_ranks(vs)}: {problem}" for problem, vs in listed]
        return "canzona: the schedule does not fit this run; " + "; ".join(parts)
    fingerprints = _by(flat, "fingerprint")
    if len(fingerprints) > 1:
        parts = [f"{(fp or '?')[:12]} on {_ranks(vs)}" for fp, vs in fingerprints.items()]
        return "canzona: ranks were given schedules for different models (fingerprint " + "; ".join(parts) + ")"
    digests = _by(flat, "digest")
    if len(digests) > 1:
        parts = [f"{vs[0].summary} [{(d or '?')[:12]}] on {_ranks(vs)}" for d, vs in digests.items()]
        return "canzona: ranks were given different schedules: " + "; ".join(parts)
    by_ep_rank = _by_ep_rank(flat)
    for key, group in [("frozen", flat)] + [("frozen_experts", vs) for vs in by_ep_rank]:
        frozen = _by(group, key)
        if len(frozen) > 1:
            parts = [f"{_clip(names or 'none')} on {_ranks(vs)}" for names, vs in frozen.items()]
            return "canzona: ranks optimize different parameters (not optimized: " + "; ".join(parts) + ")"
    for d, row in enumerate(grid):
        if any(v.dp_rank != d or v.tp_rank != t for t, v in enumerate(row)):
            return "canzona: the DP and TP process groups do not form a DP x TP grid"
    return None


def _by_ep_rank(verdicts: list[Verdict]) -> list[list[Verdict]]:
    """The verdicts of each EP rank's ranks (dp_rank mod ep), which hold the same experts."""
    groups: dict[int, list[Verdict]] = {}
    for v in verdicts:
        groups.setdefault(v.dp_rank % max(1, v.ep), []).append(v)
    return list(groups.values())


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
