"""The first phase of a step: gradients packed (fp32), agreed on, and reduced over DP.

`reduce_gradients` runs it: local checks (hyperparameters, gradients), one safe point that
also agrees which parameters have a gradient on some rank (a per-parameter MAX riding on the
safe-point all-reduce) and whether main copies must be rebuilt, then the DP reduce-scatter. Its
result is kept until the step consumes it, so `clip_grad_norm_` can run it first and see the
true, DP-reduced gradient. (A later version can start the reduction bucket by bucket from
backward hooks; the packing below already works piece by piece.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime import comm
from canzona.runtime.faults import wait

if TYPE_CHECKING:
    from canzona.runtime.optimizer import CanzonaOptimizer


@dataclass
class Reduced:
    """What the reduction phase leaves for the step: this rank's fp32 DP-mean gradients (in the
    coordinates of the regions it updates) and, per schedule parameter, whether any rank had a
    gradient for it (a parameter no rank has a gradient for is skipped)."""

    grads: Tensor
    active: list[bool]


def pack_gradients(opt: CanzonaOptimizer) -> tuple[str | None, list[bool]]:
    """Pack this rank's gradients (cast to fp32 once) into the exchange buffer. Returns a
    problem (a missing `grad_attr`, a wrong shape, a non-finite value with `check_finite`) as
    one line, and per schedule parameter whether this rank has a gradient for it."""
    grads: list[Tensor | None] = [None] * len(opt.names)
    for index in opt._managed_indices:
        param = opt._param(index)
        if not hasattr(param, opt.grad_attr):
            return f"grad_attr {opt.grad_attr!r}: no such attribute on {opt.names[index]}", []
        grad = getattr(param, opt.grad_attr)
        if grad is None:
            continue
        if tuple(grad.shape) != tuple(param.shape):
            return f"the gradient of {opt.names[index]} has shape {list(grad.shape)}, the parameter {list(param.shape)}", []
        grads[index] = grad.detach().reshape(-1)
    comm.pack(opt._managed_pieces, grads, opt._send)
    if opt.check_finite and not bool(torch.isfinite(opt._send).all()):
        bad = [opt.names[i] for i, g in enumerate(grads) if g is not None and not bool(torch.isfinite(g).all())]
        return f"non-finite gradient in {', '.join(bad[:3]) or 'the gradient buffer'}", []
    return None, [grad is not None for grad in grads]


def norm_runs(opt: CanzonaOptimizer) -> list[tuple[int, int]]:
    """[start, stop) spans of the reduced buffer that count towards the global gradient norm:
    this DP rank's own region, without the TP-replicated parameters unless at TP rank 0 (each
    element of the model once across DP and TP)."""
    start = opt.layout.starts[opt.dp_rank] - opt._base
    region = (start, start + opt.layout.sizes[opt.dp_rank])
    if opt.tp_rank == 0 or all(d is not None for d in opt._tp_dims):
        return [region] if region[1] > region[0] else []
    runs: list[tuple[int, int]] = []
    for piece in opt.layout.rank_pieces[opt.dp_rank]:
        if opt._tp_dims[piece.param] is None:
            continue
        low = piece.dst - opt._base
        if runs and runs[-1][1] == low:
            runs[-1] = (runs[-1][0], low + piece.length)
        else:
            runs.append((low, low + piece.length))
    return runs


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
