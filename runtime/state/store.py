"""What a step changes on one rank: step counts, matrix optimizer states, AdamW moments and fp32
main copies. Updated in place by the step (`canzona.runtime.update`), exported and imported in
logical form by `canzona.runtime.state.logical`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from canzona.runtime.plan import RankPlan
from canzona.runtime.rules.cooperative import held_shape
from canzona.runtime.rules.optimizers import MatrixRule, State, init_matrix_state
from canzona.runtime.rules.precision import MainCopies, allocate

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class OptimizerState:
    """One rank's optimizer state. `matrix[i]`: the submatrix states of hosted matrix i (created
    at its first step); `adamw`: the moments of this rank's AdamW slices (indexed like
    `RankPlan.adamw` offsets); `param_steps[i]`: the steps entry i has taken (a parameter
    without a gradient on every rank skips a step)."""

    step: int
    param_steps: list[int]
    adamw: dict[str, Tensor]
    main: MainCopies
    matrix: dict[int, list[State]] = field(default_factory=dict)


def fresh_state(plan: RankPlan) -> OptimizerState:
    """Zero moments, no matrix state yet, main copies to be built at the first step."""
    moments = {name: torch.zeros(plan.adamw_numel, dtype=torch.float32, device=plan.device) for name in ADAMW_MOMENTS}
    return OptimizerState(step=0, param_steps=[0] * len(plan.names), adamw=moments, main=allocate(plan))


def matrix_template(plan: RankPlan, rule: MatrixRule, param: int) -> list[State]:
    """Fresh submatrix states of hosted matrix `param` (a team member's: of its slice)."""
    task = plan.tasks[param]
    if task.team:  # a team member's slice (`canzona.runtime.rules.cooperative`)
        rows, cols = held_shape(task, plan.place.tp_rank)
        return [rule.init_state(rows, cols, plan.device)]
    return init_matrix_state(rule, task.shape, task.row_blocks, plan.device)
