"""Single-process reference optimizer on the unsharded model: the test oracle.

It applies the same formulas (`canzona.runtime.optimizers`) to the full parameters with the
full (already averaged) gradients, with no buffers, cuts, hosts or collectives, so agreement
with `CanzonaOptimizer` checks the whole distributed machinery.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from canzona.schedules.format import Schedule
from canzona.runtime.optimizers import (
    Hyperparameters,
    RowBlock,
    adamw_,
    apply_update,
    init_matrix_state,
    make_rule,
    matrix_update,
)
from canzona.runtime.schedule import MATRIX


class ReferenceOptimizer:
    """Muon / Shampoo / SOAP on the matrices, AdamW on the rest, of full (unsharded) tensors.

    Which parameters are matrices, their row blocks and the matrix optimizer come from
    `schedule`; `row_blocks` overrides the blocks by name, for a full model whose row order is
    not the gathered one (e.g. an unsharded fc1 stored as [gate; up])."""

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], schedule: Schedule,
                 row_blocks: Mapping[str, list[RowBlock] | None] | None = None, **hyperparameters: Any) -> None:
        self.named = list(named_parameters)
        entries = {e.name: e for e in schedule.params}
        missing = [name for name, _ in self.named if name not in entries]
        if missing:
            raise ValueError(f"parameters not in the schedule: {', '.join(missing[:4])}")
        self.hp = Hyperparameters.from_kwargs(hyperparameters).resolved(schedule.request.optimizer)
        self.rule = make_rule(schedule.request.optimizer.name, self.hp)
        overrides = dict(row_blocks or {})
        self.matrix = {name: entries[name].optimizer == MATRIX for name, _ in self.named}
        self.blocks = {name: overrides.get(name, entries[name].row_blocks) for name, _ in self.named}
        for name, tensor in self.named:
            if list(tensor.shape) != entries[name].shape:
                raise ValueError(f"{name}: shape {list(tensor.shape)} is not the full shape {entries[name].shape}")
        self.state: dict[str, Any] = {}
        self.step_count = 0

    def zero_grad(self) -> None:
        """Drop every gradient."""
        for _, tensor in self.named:
            tensor.grad = None

    @torch.no_grad()
    def step(self, grads: Mapping[str, Tensor] | None = None) -> None:
        """One step of every parameter, with `grads` by name (e.g. an fp32 DP mean of
        low-precision gradients) or else each tensor's `.grad` (missing: zero)."""
        self.step_count += 1
        for name, tensor in self.named:
            grad = grads[name] if grads is not None else tensor.grad
            grad = torch.zeros(tensor.shape) if grad is None else grad.float()
            value = tensor.detach().float()
            if self.matrix[name]:
                if name not in self.state:
                    self.state[name] = init_matrix_state(self.rule, (tensor.shape[0], tensor.shape[1]), self.blocks[name])
                update = matrix_update(self.rule, self.state[name], grad, self.blocks[name], self.step_count)
                apply_update(value, update, self.hp.lr, self.hp.weight_decay)
            else:
                if name not in self.state:
                    self.state[name] = (torch.zeros(tensor.numel()), torch.zeros(tensor.numel()))
                exp_avg, exp_avg_sq = self.state[name]
                flat = value.reshape(-1)
                adamw_(flat, grad.reshape(-1), exp_avg, exp_avg_sq, self.step_count, self.hp)
            tensor.copy_(value)
