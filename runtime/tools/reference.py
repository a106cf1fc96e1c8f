"""Single-process reference optimizer on the unsharded model: the test oracle.

It applies the same formulas (`canzona.runtime.rules.optimizers`) to the full parameters with the
full (already averaged) gradients, with no buffers, cuts, hosts or collectives, so agreement
with `CanzonaOptimizer` checks the whole distributed machinery. With `dtype=torch.float64` it
computes everything in fp64 (gradients, state and main copies of every parameter), the yardstick
the runtime's fp32 rounding is measured against. It takes the same parameter
groups (so LR schedulers drive it the same way), keeps an fp32 main copy of every bf16/fp16
parameter (made from its value at construction), skips a parameter without a gradient (no
decay, no state change, its step count stays) and clips like `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.binding import model_entries, slices_of
from canzona.runtime.groups import group_hyperparameters, resolve_param_groups
from canzona.runtime.rules.optimizers import (
    Hyperparameters,
    RowBlocks,
    adamw_,
    apply_update,
    init_matrix_state,
    make_rule,
    matrix_update,
)
from canzona.schedules.format import Schedule
from canzona.schedules.limits import MATRIX


class ReferenceOptimizer(torch.optim.Optimizer):
    """Muon / Shampoo / SOAP on the matrices, AdamW on the rest, of full (unsharded) tensors.

    `params` as for `CanzonaOptimizer` (named parameters or groups of (name, tensor) pairs).
    Which parameters are matrices, their row blocks and the matrix optimizer come from
    `schedule`; `row_blocks` overrides the blocks by name, for a full model whose row order is
    not the gathered one (e.g. an unsharded fc1 stored as [gate; up]). A grouped 3-D expert
    tensor is passed whole, as the model registers it, and updated as its E slices, each with
    its own state, as the schedule lists them."""

    def __init__(
        self,
        params: Iterable[Any],
        schedule: Schedule,
        row_blocks: Mapping[str, RowBlocks | None] | None = None,
        dtype: torch.dtype = torch.float32,
        **defaults: Any,
    ) -> None:
        entries = {e.name: e for e in schedule.params}
        self.slices = {name: [e.name for e in group] for name, group in slices_of(schedule.params).items()}
        self.rule_name = schedule.request.optimizer.name
        self.dtype = dtype
        self.hp = Hyperparameters.from_kwargs(defaults).resolved(schedule.request.optimizer)
        resolved = resolve_param_groups(list(params), model_entries(schedule.params), 1, self.rule_name, self.hp)
        if resolved.problems:
            raise ValueError("; ".join(resolved.problems))
        super().__init__(resolved.groups, {"lr": self.hp.lr, "weight_decay": self.hp.weight_decay})
        overrides = dict(row_blocks or {})
        self.blocks = {name: overrides.get(name, entries[name].row_blocks) for name in entries}
        self.matrix = {name: entry.optimizer == MATRIX for name, entry in model_entries(schedule.params).items()}
        for group in self.param_groups:
            for tensor in group["params"]:
                state = self.state[tensor]
                state["step"] = 0
                if tensor.dtype != dtype:
                    state["main"] = tensor.detach().to(dtype).clone()
        self.step_count = 0

    def _named(self) -> Iterable[tuple[dict[str, Any], str, Tensor]]:
        for group in self.param_groups:
            for name, tensor in zip(group["param_names"], group["params"]):
                yield group, name, tensor

    def _grads(self, grads: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
        if grads is not None:
            return {name: grads[name] for _, name, _ in self._named() if name in grads}
        return {name: tensor.grad for _, name, tensor in self._named() if tensor.grad is not None}

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, grads: MutableMapping[str, Tensor] | None = None, norm_type: float = 2.0
    ) -> Tensor:
        """torch's clip_grad_norm_ over `grads` (by name, scaled in place) or the `.grad`s."""
        found = self._grads(grads)
        norms = [torch.linalg.vector_norm(g.to(self.dtype), norm_type) for g in found.values()]
        if math.isinf(norm_type):
            total = torch.stack(norms).max()
        else:
            total = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in found.values():
            grad.mul_(coefficient)
        return total

    # the reference takes gradients by name, not torch.optim's closure
    @torch.no_grad()
    def step(self, grads: Mapping[str, Tensor] | None = None) -> None:  # type: ignore[override]
        """One step of every parameter with a gradient: `grads` by name (e.g. an fp32 DP mean
        of low-precision gradients), or else each tensor's `.grad`."""
        self.step_count += 1
        found = self._grads(grads)
        for group, name, tensor in self._named():
            if name not in found:
                continue
            hp = group_hyperparameters(group, self.hp, self.rule_name)
            state = self.state[tensor]
            state["step"] += 1
            grad = found[name].to(self.dtype)
            value = state["main"] if "main" in state else tensor.detach()
            if self.matrix[name]:
                rule = make_rule(self.rule_name, hp)
                pieces = self.slices.get(name)
                targets = [(name, value, grad)] if pieces is None else list(zip(pieces, value, grad))
                states = state.setdefault("matrix", {})
                for piece, piece_value, piece_grad in targets:
                    if piece not in states:
                        states[piece] = init_matrix_state(
                            rule,
                            (piece_value.shape[0], piece_value.shape[1]),
                            self.blocks[piece],
                            tensor.device,
                            self.dtype,
                        )
                    update = matrix_update(rule, states[piece], piece_grad, self.blocks[piece], state["step"])
                    apply_update(piece_value, update, hp.lr, hp.weight_decay)
            else:
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros(tensor.numel(), dtype=self.dtype, device=tensor.device)
                    state["exp_avg_sq"] = torch.zeros(tensor.numel(), dtype=self.dtype, device=tensor.device)
                adamw_(value.view(-1), grad.reshape(-1), state["exp_avg"], state["exp_avg_sq"], state["step"], hp)
            if "main" in state:
                tensor.copy_(value)
