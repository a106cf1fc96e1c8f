"""The reduced gradients of a step, and the global gradient norm for clipping.

`CanzonaOptimizer.reduce_gradients` produces them (packing and the per-bucket reduction are
`canzona.runtime.exchange.reduction`): local checks (hyperparameters, gradients), one safe point that
also agrees which parameters have a gradient on some rank (a per-parameter MAX riding on the
safe-point all-reduce) and whether main copies must be rebuilt, and the DP reduction. Its
result is kept until the step consumes it, so `clip_grad_norm_` can run it first and see the
true, DP-reduced gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import wait
from canzona.runtime.layout import merged_runs

if TYPE_CHECKING:
    from canzona.runtime.optimizer import CanzonaOptimizer


@dataclass
class Reduced:
    """What the reduction phase leaves for the step: this rank's fp32 DP-mean gradients (in the
    coordinates of the regions it updates) and, per schedule parameter, whether any rank had a
    gradient for it (a parameter no rank has a gradient for is skipped)."""

    grads: Tensor
    active: list[bool]


def norm_runs(opt: CanzonaOptimizer) -> list[tuple[int, int]]:
    """[start, stop) spans of the reduced buffer that count towards the global gradient norm:
    this DP rank's own region, without the TP-replicated parameters unless at TP rank 0 (each
    element of the model once across DP and TP)."""
    start = opt.layout.starts[opt.dp_rank] - opt._base
    region = (start, start + opt.layout.sizes[opt.dp_rank])
    if opt.tp_rank == 0 or all(d is not None for d in opt._tp_dims):
        return [region] if region[1] > region[0] else []
    return merged_runs((piece for piece in opt.layout.rank_pieces[opt.dp_rank] if opt._tp_dims[piece.param] is not None),
                       opt._base)


def global_norm(opt: CanzonaOptimizer, grads: Tensor, norm_type: float) -> Tensor:
    """The norm of the whole DP-mean gradient (every element once), on every rank."""
    parts = [grads[start:stop] for start, stop in opt._norm_runs]
    norms = [torch.linalg.vector_norm(part, norm_type) for part in parts]
    zero = torch.zeros((), dtype=torch.float32, device=opt.device)
    if math.isinf(norm_type):
        local, op = torch.stack(norms).max() if norms else zero, dist.ReduceOp.MAX
    else:
        local, op = torch.stack(norms).pow(norm_type).sum() if norms else zero, dist.ReduceOp.SUM
    total = local.reshape(1).clone()
    for group in (opt.tp_group, opt.dp_group):
        if dist.get_world_size(group) > 1:
            wait(dist.all_reduce(total, op=op, group=group, async_op=True), opt.timeout, "the gradient-norm all-reduce")
    return total[0] if math.isinf(norm_type) else total[0].pow(1.0 / norm_type)


def clip_problem(max_norm: float, norm_type: float) -> str | None:
    """Why clip_grad_norm_'s arguments are unusable, or None."""
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)

    if not (number(max_norm) and math.isfinite(max_norm) and max_norm > 0):
        return f"clip_grad_norm_: max_norm must be a positive finite number, got {max_norm!r}"
    if not (number(norm_type) and norm_type > 0):
        return f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r}"
    return None
