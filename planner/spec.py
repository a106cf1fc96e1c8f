"""Frozen descriptions of a model's parameters and of the matrix optimizer: what the planner reads.

A `ModelSpec` is the parameter list of one model in registration order (the order of
`named_parameters()`), with full (unsharded) shapes. Everything else in the planner is a pure
function of a `ModelSpec` and a request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import prod

from canzona.schedules.geometry import DTYPE_BYTES, tp_slot_shape  # noqa: F401 - DTYPE_BYTES re-exported for the planner
from canzona.schedules.limits import (  # noqa: F401 - the vocabularies a schedule file is checked against
    ADAMW,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GRAM_RESTART,
    DEFAULT_MAX_PRECOND_DIM,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    DEFAULT_PRECONDITION_FREQUENCY,
    GRAD_REDUCE_AXES,
    MATRIX,
    NAMING_CONVENTIONS,
    NS_COEFFICIENT_NAMES,
    NS_DTYPES,
    NS_METHODS,
    OPTIMIZER_CLASSES,
    QKV_SPLITS,
    STANDARD_NS,
    choice_problem,
)
from canzona.schedules.limits import MATRIX_OPTIMIZERS as OPTIMIZERS
from canzona.schedules.splits import fused_row_blocks  # noqa: F401 - the model sources build fc1's blocks with it

DEFAULT_GLOBAL_BATCH = 256  # sequences per optimizer step, over every DP rank (a training setup's default)
DEFAULT_SEQ_LEN = 4096  # tokens per sequence


class PlanError(ValueError):
    """Bad input to the planner: the message is one line, meant for the user."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as Megatron-core registers it.

    `shape` is the full, unsharded shape; `tp_dim` the dim split across tensor-parallel ranks
    (None: replicated on every TP rank). `submatrices` are the full shapes of the pieces the
    matrix optimizer updates independently (e.g. Q, K, V of a fused QKV weight); a parameter
    that is not split has one submatrix equal to its own shape. AdamW parameters have none.
    `expert_index` / `num_experts` mark MoE expert weights: global expert index among the
    layer's `num_experts` (with expert parallelism they live on EP rank
    index // (num_experts / ep) and are planned over the expert-data-parallel group).

    `row_blocks` says where each submatrix's rows lie in the *gathered* matrix (the TP shards
    concatenated along `tp_dim` in TP-rank order): per submatrix, (start, stop) row ranges whose
    concatenation is that submatrix. Empty means one submatrix, the gathered matrix as it is.
    Fused fc1 is why this exists: each TP shard holds [gate shard; up shard], so the gathered
    rows interleave gate and up.

    `parent` marks one expert slice of a grouped 3-D expert tensor (e.g. Hugging Face's
    `experts.gate_up_proj` [E, 2F, H]): the slice is `parent[expert_index]` along dim 0, of
    `num_experts` slices, and `shape` / `tp_dim` are the slice's (the tensor's dims 1 and 2).
    `grad_reduce` ("tp"): the parameter is replicated over TP but each TP rank's gradient is a
    partial sum (e.g. q_norm/k_norm under head sharding, norms under sequence parallelism), which
    the runtime sums over TP.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    optimizer: str
    submatrices: tuple[tuple[int, int], ...] = ()
    dtype: str = "bf16"
    expert_index: int | None = None
    num_experts: int = 0
    row_blocks: tuple[tuple[tuple[int, int], ...], ...] = ()
    parent: str | None = None
    grad_reduce: str | None = None

    @property
    def expert(self) -> bool:
        """Whether this is a MoE expert weight."""
        return self.expert_index is not None

    @functools.cached_property
    def numel(self) -> int:
        """Number of elements of the full parameter (worked out once: layouts ask often)."""
        return prod(self.shape)

    def local_numel(self, tp: int) -> int:
        """Elements of a TP rank's slot for its shard (`geometry.tp_slot_shape`: the largest
        shard when TP does not divide the sharded dim)."""
        return prod(tp_slot_shape(self.shape, self.tp_dim, tp))


@dataclass(frozen=True)
class ModelSpec:
    """A model's parameters in registration order, plus where the description came from.

    `source` is a preset name, a file path or a live model's factory (`py:MODULE:FACTORY`);
    `source_sha256` is set for files (and for a live model, its description's) so a schedule
    can tell whether its input changed. `names` is the naming convention a preset or Hugging
    Face config was expanded to (parameter lists name their parameters themselves: megatron).
    """

    name: str
    params: tuple[ParamSpec, ...]
    source: str
    source_sha256: str | None = None
    names: str = "megatron"

    @property
    def num_params(self) -> int:
        """Total element count of the model (before any padding)."""
        return sum(p.numel for p in self.params)


def validate_model(model: ModelSpec, tp: int) -> None:
    """Raise PlanError unless every parameter is well formed. A TP dim that `tp` does not divide
    is sharded unevenly (torch.chunk's rule), except under a parameter updated as several
    submatrices, which each TP rank must hold whole."""
    seen: set[str] = set()
    if not model.params:
        raise PlanError(f"model {model.name!r} has no parameters")
    for param in model.params:
        if param.name in seen:
            raise PlanError(f"parameter {param.name!r} appears twice")
        seen.add(param.name)
        if not param.shape or any(size < 1 for size in param.shape):
            raise PlanError(f"parameter {param.name!r} has invalid shape {list(param.shape)}")
        if param.optimizer not in OPTIMIZER_CLASSES:
            raise PlanError(f"parameter {param.name!r}: unknown optimizer {param.optimizer!r}")
        if param.optimizer == MATRIX and len(param.shape) != 2:
            raise PlanError(f"parameter {param.name!r}: the matrix optimizer needs a 2-D shape")
        if param.row_blocks:
            _validate_row_blocks(param)
        if param.grad_reduce is not None and (param.grad_reduce not in GRAD_REDUCE_AXES or param.tp_dim is not None):
            raise PlanError(
                f"parameter {param.name!r}: grad_reduce {param.grad_reduce!r} needs a parameter replicated over "
                f"TP (tp_dim null) and one of {', '.join(GRAD_REDUCE_AXES)}"
            )
        if param.tp_dim is not None:
            if not 0 <= param.tp_dim < len(param.shape):
                raise PlanError(f"parameter {param.name!r}: tp_dim {param.tp_dim} out of range")
            if param.shape[param.tp_dim] % tp and (param.row_blocks or len(param.submatrices) > 1):
                raise PlanError(
                    f"tp {tp} does not divide dim {param.tp_dim} (size {param.shape[param.tp_dim]}) of "
                    f"{param.name!r}, whose submatrices each TP rank must hold whole"
                )
    _validate_slices(model.params)


def _validate_slices(params: tuple[ParamSpec, ...]) -> None:
    """The slices of a grouped expert tensor follow each other as parent[0] .. parent[E-1],
    and no other parameter bears a grouped tensor's name."""
    names = {param.name for param in params}

    def is_slice(position: int, parent: str, index: int) -> bool:
        return (
            0 <= position < len(params) and params[position].parent == parent and params[position].expert_index == index
        )

    for position, param in enumerate(params):
        if param.parent is None:
            continue
        index = param.expert_index
        if (
            param.optimizer != MATRIX
            or index is None
            or not 0 <= index < param.num_experts
            or param.name != f"{param.parent}[{index}]"
            or (index > 0 and not is_slice(position - 1, param.parent, index - 1))
            or (index < param.num_experts - 1 and not is_slice(position + 1, param.parent, index + 1))
            or param.parent in names
        ):
            raise PlanError(f"parameter {param.name!r}: not a well-formed expert slice of {param.parent!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """The matrix optimizer and its settings: those its cost depends on, and Muon's
    Newton–Schulz coefficient schedule (`canzona.schedules.coefficients`), method (`standard`,
    `gram`: `canzona.schedules.costs.ns_flops`), Gram restart and precision (`ns_dtype`), which
    the runtime executes and the schedule's digest covers."""

    name: str = "muon"
    ns_steps: int = DEFAULT_NS_STEPS
    block_size: int = DEFAULT_BLOCK_SIZE
    precondition_frequency: int = DEFAULT_PRECONDITION_FREQUENCY
    max_precond_dim: int = DEFAULT_MAX_PRECOND_DIM
    ns_coefficients: str = DEFAULT_NS_COEFFICIENTS
    ns_method: str = STANDARD_NS
    gram_restart: int = DEFAULT_GRAM_RESTART
    ns_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise PlanError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        for field in ("ns_steps", "block_size", "precondition_frequency", "max_precond_dim"):
            if getattr(self, field) < 1:
                raise PlanError(f"optimizer setting {field} must be >= 1")
        if self.gram_restart < 0:
            raise PlanError("optimizer setting gram_restart must be >= 0 (0: never)")
        problem = (
            choice_problem("ns_coefficients", self.ns_coefficients, NS_COEFFICIENT_NAMES)
            or choice_problem("ns_method", self.ns_method, NS_METHODS)
            or choice_problem("ns_dtype", self.ns_dtype, NS_DTYPES)
        )
        if problem:
            raise PlanError(problem)


@dataclass(frozen=True)
class ModelOptions:
    """How the catalog turns an architecture into optimizer work.

    `split_qkv`: "qkv" (default, Megatron) orthogonalises Q, K, V separately; "head" splits
    per attention head; "none" treats the fused matrix as one. `split_fc1` updates the gate and
    up halves of fc1 separately. `router_optimizer` sends MoE routers to "matrix" (Megatron's
    choice) or "adamw". `names`: the naming convention presets and Hugging Face configs expand
    to ("megatron", "hf" or "torchtitan"). `sequence_parallel`: every norm's gradient is a
    partial sum over TP (the model leaves it to the optimizer to sum them). `dtype`: the dtype
    every parameter is planned in ("fp32", "bf16" or "fp16"); None keeps the source's own (a
    config.json's `dtype` / `torch_dtype`, bf16 for a preset or a config without one, each
    entry's for a parameter list or a live model).
    """

    split_qkv: str = "qkv"
    split_fc1: bool = False
    router_optimizer: str = MATRIX
    names: str = "megatron"
    sequence_parallel: bool = False
    dtype: str | None = None


DEFAULT_MODEL_OPTIONS = ModelOptions()  # one instance serves every default: ModelOptions is frozen


def _validate_row_blocks(param: ParamSpec) -> None:
    """Row blocks must match the submatrices and cover every row exactly once."""
    if len(param.row_blocks) != len(param.submatrices):
        raise PlanError(
            f"parameter {param.name!r}: {len(param.row_blocks)} row blocks for {len(param.submatrices)} submatrices"
        )
    ranges: list[tuple[int, int]] = []
    for block, (num_rows, num_cols) in zip(param.row_blocks, param.submatrices):
        if num_cols != param.shape[1] or sum(stop - start for start, stop in block) != num_rows:
            raise PlanError(f"parameter {param.name!r}: row blocks do not match submatrix [{num_rows}, {num_cols}]")
        ranges += block
    ranges.sort()
    chained = all(start < stop for start, stop in ranges) and all(
        ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)
    )
    if not chained or ranges[0][0] != 0 or ranges[-1][1] != param.shape[0]:
        raise PlanError(f"parameter {param.name!r}: row blocks do not cover every row exactly once")
