"""Cost models: how much optimizer work and state one parameter costs per step.

Costs are in the model's own units (elements for `numel`, floating-point operations for
`flops`); the partitioner balances whatever units it is given. The per-optimizer FLOP
formulas are `muon_flops`, `shampoo_flops` and `soap_flops`.
A parameter split into submatrices (Q/K/V, heads, gate/up) costs the sum of its pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from canzona.planner.spec import ADAMW, ParamSpec, PlanError
from canzona.schedules.limits import COST_MODELS
from canzona.schedules.limits import MATRIX_OPTIMIZERS as OPTIMIZERS

ADAMW_FLOPS_PER_ELEMENT = 10
ELEMENTWISE_FLOPS_PER_ELEMENT = 10  # momentum / moment updates around the matrix work
ADAMW_STATE_BYTES_PER_ELEMENT = 8
MUON_STATE_BYTES_PER_ELEMENT = 4
MAIN_COPY_BYTES_PER_ELEMENT = 4  # the runtime's fp32 main copy of a bf16/fp16 parameter


@dataclass(frozen=True)
class OptimizerConfig:
    """The matrix optimizer and the settings its cost depends on."""

    name: str = "muon"
    ns_steps: int = 5
    block_size: int = 1024
    precondition_frequency: int = 10
    max_precond_dim: int = 10000

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise PlanError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        for field in ("ns_steps", "block_size", "precondition_frequency", "max_precond_dim"):
            if getattr(self, field) < 1:
                raise PlanError(f"optimizer setting {field} must be >= 1")


class CostModel(Protocol):
    """Per-step cost and state size of the optimizers, for one matrix or AdamW slice."""

    name: str

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
        opt = self.optimizer
        if opt.name == "muon":
            return muon_flops(rows, cols, opt.ns_steps)
        if opt.name == "shampoo":
            return shampoo_flops(rows, cols, opt.block_size, opt.precondition_frequency)
        return soap_flops(rows, cols, opt.precondition_frequency, opt.max_precond_dim)

    def adamw_cost(self, numel: int) -> float:
        """AdamW is memory-bound; ~10 FLOPs per element keeps its buffers comparable."""
        return float(ADAMW_FLOPS_PER_ELEMENT * numel)


def muon_flops(rows: int, cols: int, ns_steps: int) -> float:
    """Newton–Schulz: T·(4r²c + 2r³) with r = min, c = max, plus elementwise work."""
    r, c = min(rows, cols), max(rows, cols)
    return float(ns_steps * (4 * r * r * c + 2 * r**3) + ELEMENTWISE_FLOPS_PER_ELEMENT * rows * cols)


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    """(block length, how many) pairs covering `size` in blocks of at most `block`."""
    full, rest = divmod(size, block)
    pairs = [(block, full)] if full else []
    return pairs + ([(rest, 1)] if rest else [])


def shampoo_flops(rows: int, cols: int, block_size: int, frequency: int) -> float:
    """Blocked Shampoo: 4·bm·bn·(bm+bn) per block per step + 11·(bm³+bn³)/f for the roots."""
    total = 0.0
    for bm, num_row_blocks in _blocks(rows, block_size):
        for bn, num_col_blocks in _blocks(cols, block_size):
            per_block = 4 * bm * bn * (bm + bn) + 11 * (bm**3 + bn**3) / frequency
            total += num_row_blocks * num_col_blocks * per_block
    return total + ELEMENTWISE_FLOPS_PER_ELEMENT * rows * cols


def soap_flops(rows: int, cols: int, frequency: int, max_precond_dim: int) -> float:
    """SOAP: per preconditioned side s, 6·mn·s per step + (22/3)·s³/f for the eigenbasis."""
    total = float(ELEMENTWISE_FLOPS_PER_ELEMENT * rows * cols)
    for side in (rows, cols):
        if side <= max_precond_dim:
            total += 6 * rows * cols * side + (22 / 3) * side**3 / frequency
    return total


def matrix_state_bytes(rows: int, cols: int, optimizer: OptimizerConfig) -> float:
    """Optimizer state (fp32) of one full matrix, bytes."""
    if optimizer.name == "muon":
        return float(MUON_STATE_BYTES_PER_ELEMENT * rows * cols)
    if optimizer.name == "shampoo":
        total = 0.0
        for bm, num_row_blocks in _blocks(rows, optimizer.block_size):
            for bn, num_col_blocks in _blocks(cols, optimizer.block_size):
                total += num_row_blocks * num_col_blocks * (8 * (bm * bm + bn * bn) + 4 * bm * bn)
        return total
    sides = sum(side * side for side in (rows, cols) if side <= optimizer.max_precond_dim)
    return float(8 * rows * cols + 8 * sides)


def make_cost_model(name: str, optimizer: OptimizerConfig) -> CostModel:
    """Build the cost model called `name` for `optimizer` (`profile:FILE`: measured seconds)."""
    if name.startswith("profile:"):
        from canzona.planner.predict.profile_cost import profile_cost_model

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


def main_copy_bytes(dtype: str) -> int:
    """Bytes per element of the fp32 main copy the runtime keeps of a parameter of `dtype`."""
    return 0 if dtype == "fp32" else MAIN_COPY_BYTES_PER_ELEMENT


def adamw_slice_bytes_per_element(params: tuple[ParamSpec, ...] | list[ParamSpec]) -> int:
    """State bytes per AdamW slice element: two fp32 moments, plus an fp32 main copy when the
    model has low-precision AdamW parameters (the runtime keeps it over the whole slice then)."""
    lowp = any(p.optimizer == ADAMW and p.dtype != "fp32" for p in params)
    return ADAMW_STATE_BYTES_PER_ELEMENT + (MAIN_COPY_BYTES_PER_ELEMENT if lowp else 0)


def param_state_bytes(param: ParamSpec, optimizer: OptimizerConfig) -> float:
    """Optimizer state bytes of the whole (unsharded) parameter, its fp32 main copy included
    when the parameter is bf16/fp16."""
    main = float(main_copy_bytes(param.dtype) * param.numel)
    if param.optimizer == ADAMW:
        return float(ADAMW_STATE_BYTES_PER_ELEMENT * param.numel) + main
    return sum(matrix_state_bytes(rows, cols, optimizer) for rows, cols in param.submatrices) + main
