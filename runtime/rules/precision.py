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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from canzona.runtime.rules.cooperative import held_shape

if TYPE_CHECKING:
    from canzona.runtime.layout import Piece, Task
    from canzona.runtime.optimizer import CanzonaOptimizer


@dataclass
class MainCopies:
    """This rank's fp32 main copies. `matrices`: hosted low-precision matrices (full shape);
    `adamw`: indexed like the AdamW moments (None when no slice holds a low-precision
    parameter; in a model mixing dtypes, the entries of fp32 parameters are unused);
    `stale`: to be rebuilt from the parameters at the next step."""

    matrices: dict[int, Tensor] = field(default_factory=dict)
    adamw: Tensor | None = None
    stale: bool = True


def main_tasks(opt: CanzonaOptimizer) -> list[Task]:
    """The matrices whose main copies this rank's TP group rebuilds together (every optimized
    low-precision matrix its strategy updates here, hosted by any TP rank of the group)."""
    return [t for t in opt._group_tasks() if opt._managed[t.param] and opt._lowp[t.param]]


def adamw_pieces(opt: CanzonaOptimizer) -> list[tuple[Piece, int]]:
    """Every AdamW piece of an optimized parameter in this rank's slices, with its offset in the
    AdamW state vectors, in buffer order."""
    out, offset = [], 0
    for rank in opt._ranks:
        start, stop = opt.layout.adamw_region(rank)
        for piece in opt.layout.rank_pieces[rank]:
            if start <= piece.dst < stop and opt._managed[piece.param]:
                out.append((piece, offset + piece.dst - start))
        offset += stop - start
    return out


def allocate(opt: CanzonaOptimizer) -> MainCopies:
    """Buffers for every main copy this rank keeps (filled at the next step: stale)."""
    hosted = set(opt._hosted)
    matrices = {
        t.param: torch.empty(held_shape(t, opt.tp_rank), dtype=torch.float32, device=opt.device)
        for t in main_tasks(opt) if t.param in hosted
    }
    lowp = any(opt._lowp[piece.param] for piece, _ in opt._adamw_pieces)
    adamw = torch.empty(opt.adamw_state["exp_avg"].numel(), dtype=torch.float32, device=opt.device) if lowp else None
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
        return
    row = 0
    for block in task.row_blocks:
        for start, stop in block:
            out[start:stop].copy_(canonical[row : row + stop - start])
            row += stop - start


def adamw_from_params(opt: CanzonaOptimizer, target: Tensor) -> None:
    """Copy the low-precision AdamW elements this rank updates from the parameters into
    `target` (indexed like the AdamW moments)."""
    for piece, offset in opt._adamw_pieces:
        if opt._lowp[piece.param]:
            flat = opt._param(piece.param).detach().reshape(-1)
            target[offset : offset + piece.length].copy_(flat[piece.src : piece.src + piece.length])


def rebuild(opt: CanzonaOptimizer, mine: bool) -> None:
    """Rebuild the main copies from the parameters (collective over TP: every rank calls it when
    any rank's copies are stale; `mine`: whether this rank's are, else it only sends shards)."""
    tasks = main_tasks(opt)
    full = opt._gather_full(tasks, lambda task: opt._param(task.param).detach().float()) if tasks else {}
    if not mine:
        return
    for param, target in opt.main.matrices.items():
        target.copy_(full[param])
    if opt.main.adamw is not None:
        adamw_from_params(opt, opt.main.adamw)
    opt.main.stale = False
