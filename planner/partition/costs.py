"""Cost models: how much optimizer work and state one parameter costs per step.

Costs are in the model's own units (elements for `numel`, floating-point operations for
`flops`); the partitioner balances whatever units it is given. The formulas themselves live in
`canzona.schedules.costs`, which the schedule validator recomputes every recorded cost with.
A parameter split into submatrices (Q/K/V, heads, gate/up) costs the sum of its pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from canzona.planner.partition.profile_cost import profile_cost_model
from canzona.planner.spec import ADAMW, OptimizerConfig, ParamSpec, PlanError  # OptimizerConfig: re-exported
from canzona.schedules.costs import (  # noqa: F401 - the formulas, re-exported for the planner
    ELEMENTWISE_FLOPS_PER_ELEMENT,
    FLOPS,
    adamw_bytes_per_element,
    adamw_cost,
    matrix_flops,
    matrix_state_bytes,
    muon_flops,
    shampoo_flops,
    soap_flops,
)
from canzona.schedules.costs import param_state_bytes as shared_state_bytes
from canzona.schedules.limits import COST_MODELS
from canzona.schedules.limits import MATRIX_OPTIMIZERS as OPTIMIZERS  # noqa: F401 - the vocabulary, re-exported


class CostModel(Protocol):
    """Per-step cost and state size of the optimizers, for one matrix or AdamW slice."""

    @property
    def name(self) -> str:
        """The model's name (a simulation reports the time model that priced its compute)."""
        ...

    def matrix_cost(self, rows: int, cols: int) -> float:
        """Cost of one matrix-optimizer update of a full rows x cols matrix."""
        ...

    def adamw_cost(self, numel: int) -> float:
        """Cost of an AdamW update of `numel` elements."""
        ...


@dataclass(frozen=True)
class NumelCost:
    """Cost = element count (the reference implementation's default)."""

    name: str = "numel"

    def matrix_cost(self, rows: int, cols: int) -> float:
        """Elements of the matrix."""
        return float(rows * cols)

    def adamw_cost(self, numel: int) -> float:
        """Elements of the slice."""
        return float(numel)


@dataclass(frozen=True)
class FlopsCost:
    """Floating-point operations of the chosen optimizer's update."""

    optimizer: OptimizerConfig
    name: str = "flops"

    def matrix_cost(self, rows: int, cols: int) -> float:
        """FLOPs of one update of a full rows x cols matrix."""
        return matrix_flops(rows, cols, self.optimizer)

    def adamw_cost(self, numel: int) -> float:
        """AdamW is memory-bound; ~10 FLOPs per element keeps its buffers comparable."""
        return adamw_cost(FLOPS, numel)


def make_cost_model(name: str, optimizer: OptimizerConfig) -> CostModel:
    """Build the cost model called `name` for `optimizer` (`profile:FILE`: measured seconds)."""
    if name.startswith("profile:"):
        return profile_cost_model(name, optimizer)
    if name == "numel":
        return NumelCost()
    if name == "flops":
        return FlopsCost(optimizer)
    raise PlanError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)} or profile:FILE")


def param_cost(param: ParamSpec, model: CostModel) -> float:
    """Per-step cost of updating the whole (unsharded) parameter."""
    if param.optimizer == ADAMW:
        return model.adamw_cost(param.numel)
    return sum(model.matrix_cost(rows, cols) for rows, cols in param.submatrices)


def adamw_slice_bytes_per_element(params: tuple[ParamSpec, ...] | list[ParamSpec]) -> int:
    """State bytes per AdamW slice element: two fp32 moments, plus an fp32 main copy when the
    model has low-precision AdamW parameters (the runtime keeps it over the whole slice then)."""
    return adamw_bytes_per_element([p.dtype for p in params if p.optimizer == ADAMW])


def param_state_bytes(param: ParamSpec, optimizer: OptimizerConfig) -> float:
    """Optimizer state bytes of the whole (unsharded) parameter, its fp32 main copy included
    when the parameter is bf16/fp16."""
    submatrices = () if param.optimizer == ADAMW else param.submatrices
    return shared_state_bytes(param.numel, param.dtype, submatrices, optimizer)
