"""The global gradient norm for clipping, over the DP-reduced gradients in the bucket buffer.

Each rank counts the entries of its own DP slices (`RankPlan.norm_spans`: a TP-replicated
parameter only on TP rank 0), so every element of the model is counted once across DP and TP;
the partial sums meet in one all-reduce per group.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import wait
from canzona.runtime.plan import RankPlan


def global_norm(
    plan: RankPlan, send: Tensor, norm_type: float, groups: tuple[dist.ProcessGroup, ...], timeout: timedelta | None
) -> Tensor:
    """The norm of the whole DP-mean gradient (every element once), on every rank of `groups`."""
    norms = [torch.linalg.vector_norm(send[start:stop], norm_type) for start, stop in plan.norm_spans]
    zero = torch.zeros((), dtype=torch.float32, device=plan.device)
    if math.isinf(norm_type):
        local, op = torch.stack(norms).max() if norms else zero, dist.ReduceOp.MAX
    else:
        local, op = torch.stack(norms).pow(norm_type).sum() if norms else zero, dist.ReduceOp.SUM
    total = local.reshape(1).clone()
    for group in groups:
        if dist.get_world_size(group) > 1:
            wait(dist.all_reduce(total, op=op, group=group, async_op=True), timeout, "the gradient-norm all-reduce")
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
