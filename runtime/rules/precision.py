"""fp32 main copies of low-precision parameters (Megatron-style mixed precision).

A bf16 or fp16 parameter is updated through an fp32 copy, kept only where the update happens:
each hosted matrix in full on its host TP rank, and the AdamW elements of this rank's slices.
Gradients are reduced and used in fp32 and the optimizer state is fp32; the new value is cast
to the model dtype once and travels in it. An fp32 parameter is its own main copy.

The copies are (re)built from the parameters at the first safe point of the next step after
construction, after `reload_model_params()` and after loading a state that lacks them; every
rank agrees there, so the TP gather that rebuilds a hosted matrix is entered by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from canzona.runtime.plan import RankPlan
from canzona.runtime.rules.cooperative import held_shape
from canzona.runtime.rules.optimizers import put_rows
from canzona.schedules.layout import Task

GatherFull = Callable[[Sequence[Task], Callable[[Task], Tensor]], dict[int, Tensor]]


@dataclass
class MainCopies:
    """This rank's fp32 main copies. `matrices`: hosted low-precision matrices (full shape, or a
    team member's slice); `adamw`: indexed like the AdamW moments (None when no slice holds a
    low-precision parameter; in a model mixing dtypes, the entries of fp32 parameters are
    unused); `stale`: to be rebuilt from the parameters at the next step."""

    matrices: dict[int, Tensor] = field(default_factory=dict)
    adamw: Tensor | None = None
    stale: bool = True


def main_tasks(plan: RankPlan) -> list[Task]:
    """The matrices whose main copies this rank's TP group rebuilds together (every optimized
    low-precision matrix its strategy updates here, hosted by any TP rank of the group)."""
    return [t for tasks in plan.groups for t in tasks if plan.bound[t.param] is not None and plan.lowp(t.param)]


def allocate(plan: RankPlan) -> MainCopies:
    """Buffers for every main copy this rank keeps (filled at the next step: stale)."""
    matrices = {
        t.param: torch.empty(
            held_shape(plan.tasks[t.param], plan.place.tp_rank), dtype=torch.float32, device=plan.device
        )
        for t in main_tasks(plan)
        if t.param in plan.tasks
    }
    lowp = any(plan.optimized(piece.param) and plan.lowp(piece.param) for piece in plan.adamw)
    adamw = torch.empty(plan.adamw_numel, dtype=torch.float32, device=plan.device) if lowp else None
    return MainCopies(matrices, adamw, stale=True)


def to_canonical(main: Tensor, task: Task) -> Tensor:
    """A matrix main copy with its rows in canonical order (its submatrices one after the other,
    as the row blocks list them), so that it does not depend on TP; a copy."""
    if not task.row_blocks:
        return main.clone()
    return torch.cat([main[start:stop] for block in task.row_blocks for start, stop in block])


def from_canonical(canonical: Tensor, task: Task, out: Tensor) -> None:
    """Write a canonical-order main copy back in the gathered (TP) row order."""
    if not task.row_blocks:
        out.copy_(canonical)
    else:
        put_rows(out, [span for block in task.row_blocks for span in block], canonical)


def adamw_from_params(plan: RankPlan, target: Tensor) -> None:
    """Copy the low-precision AdamW elements this rank updates from the parameters into
    `target` (indexed like the AdamW moments)."""
    for piece in plan.adamw:
        if plan.optimized(piece.param) and plan.lowp(piece.param):
            flat = plan.value(piece.param).detach().reshape(-1)
            target[piece.offset : piece.offset + piece.length].copy_(flat[piece.src : piece.src + piece.length])


def rebuild(plan: RankPlan, main: MainCopies, gather_full: GatherFull, mine: bool) -> None:
    """Rebuild the main copies from the parameters, micro-group by micro-group, so the gathered
    matrices in flight never exceed a group's capacity (collective over TP: every rank calls
    it when any rank's copies are stale; `mine`: whether this rank's are, else it only sends
    shards)."""
    wanted = {t.param for t in main_tasks(plan)}
    for tasks in plan.groups:
        chosen = [t for t in tasks if t.param in wanted]
        if not chosen:
            continue
        full = gather_full(chosen, lambda task: plan.value(task.param).float())
        for param, matrix in full.items():
            if mine and param in main.matrices:
                main.matrices[param].copy_(matrix)
        del full
    if mine and main.adamw is not None:
        adamw_from_params(plan, main.adamw)
    if mine:
        main.stale = False
