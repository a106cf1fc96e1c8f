"""The built-in cost models and optimizer state sizes, as pure formulas: one definition that
the planner balances by and the schedule validator recomputes every recorded cost and state
figure with (so a file whose optimizer settings were changed after planning is refused).

Costs are in the model's own units: elements for `numel`, floating-point operations for
`flops`. A matrix updated as several submatrices (Q/K/V, heads, gate/up: its row blocks) costs
the sum of its pieces. `profile:FILE` cost models are measured seconds, which only the profile
file holds: the planner's `canzona.planner.partition.profile_cost` prices them.
"""

from __future__ import annotations

from collections.abc import Sequence

from canzona.schedules.limits import (
    DEFAULT_GRAM_RESTART,
    GRAM_MIN_ASPECT,
    GRAM_NS,
    HOSTED,
    STANDARD_NS,
    OptimizerFields,
)

NUMEL, FLOPS = "numel", "flops"
BUILT_IN_COSTS = (NUMEL, FLOPS)  # cost models whose figures a schedule file holds enough to recompute
ADAMW_FLOPS_PER_ELEMENT = 10
ELEMENTWISE_FLOPS_PER_ELEMENT = 10  # momentum / moment updates around the matrix work
ADAMW_STATE_BYTES_PER_ELEMENT = 8
MUON_STATE_BYTES_PER_ELEMENT = 4
MAIN_COPY_BYTES_PER_ELEMENT = 4  # the runtime's fp32 main copy of a bf16/fp16 parameter


Settings = OptimizerFields
"""The matrix optimizer's settings a cost or state size depends on (the planner's
`OptimizerConfig` and a schedule's `request.optimizer` both have them, read-only: both are
frozen)."""


def ns_precision(ns_dtype: str, gpu: bool) -> str:
    """The precision Newton–Schulz products run in under `ns_dtype` on a GPU or not: "auto" is
    bf16 on a GPU and fp32 elsewhere (bf16 products are slow on CPUs); "tf32" is fp32 off a GPU
    (no TF32 products there). The runtime resolves its setting with it too."""
    if ns_dtype == "auto":
        return "bf16" if gpu else "fp32"
    return ns_dtype if gpu or ns_dtype != "tf32" else "fp32"


def update_precision(settings: Settings, gpu: bool = True) -> str:
    """The precision the runtime's matrix products run in for `settings`: Muon's `ns_dtype`
    (`ns_precision`); Shampoo and SOAP fp32."""
    return ns_precision(settings.ns_dtype, gpu) if settings.name == "muon" else "fp32"


def update_label(settings: Settings, gpu: bool = True, counts: tuple[int, int] | None = None) -> str:
    """How the matrix updates run, in words: Muon's Newton–Schulz method and the precision of
    the products (`update_precision`); `counts`: (matrices that run Gram, all of them)."""
    precision = update_precision(settings, gpu)
    if settings.name != "muon":
        return f"{precision} products"
    if settings.ns_method != GRAM_NS:
        return f"standard Newton-Schulz, {precision}"
    restart = f"restart after {settings.gram_restart}" if settings.gram_restart else "no restart"
    squarer = f"at most {GRAM_MIN_ASPECT}x as long as wide"
    where = (
        f"on {counts[0]} of {counts[1]} matrices, the others ({squarer}) standard"
        if counts
        else f"(matrices {squarer}: standard)"
    )
    return f"gram Newton-Schulz {where}, {restart}, {precision}"


def runs_gram(rows: int, cols: int, method: str) -> bool:
    """Whether a rows x cols matrix runs Gram Newton–Schulz under `method`: "gram" does where
    the long side is more than `GRAM_MIN_ASPECT` times the short one; a squarer matrix falls
    back to the standard iteration (Gram's n x n products would cost it more)."""
    return method == GRAM_NS and max(rows, cols) > GRAM_MIN_ASPECT * min(rows, cols)


def methods_run(optimizer: str, rows: int, cols: int) -> tuple[str, ...]:
    """The Newton–Schulz methods a rows x cols matrix can run under `optimizer`: Muon's
    standard one, and Gram where the shape runs it (`runs_gram`; a squarer one falls back to
    the standard iteration); none but the standard one for Shampoo and SOAP (what `calibrate`
    times)."""
    if optimizer == "muon" and runs_gram(rows, cols, GRAM_NS):
        return (STANDARD_NS, GRAM_NS)
    return (STANDARD_NS,)


def standard_ns_flops(r: int, c: int, steps: int) -> float:
    """The standard iteration on an r x c matrix (r <= c): per step X·Xᵀ (2r²c), the
    polynomial's square (2r³) and its product with X (2r²c)."""
    return float(steps * (4 * r * r * c + 2 * r**3))


def gram_ns_flops(r: int, c: int, steps: int, restart: int) -> float:
    """Gram Newton–Schulz on an r x c matrix (r <= c), as the runtime runs it: R = X·Xᵀ
    (2r²c); per step Z = b·R + c·R² (2r³), Q ← Q·(a + Z) (2r³, none on a fresh Q) and, unless
    the next step restarts or this is the last, R ← (a + Z)·R·(a + Z) (two products, 4r³); a
    restart after `restart` steps forms X ← Q·X and R = X·Xᵀ again (4r²c); the end X ← Q·X
    (2r²c)."""
    restarts = 0 < restart < steps
    total = 2 * r * r * c * (2 + 2 * restarts)
    for step in range(steps):
        fresh = step == 0 or (restarts and step == restart)
        updates_gram = step < steps - 1 and not (restarts and step + 1 == restart)
        total += 2 * r**3 * (1 + (not fresh) + 2 * updates_gram)
    return float(total)


def ns_flops(rows: int, cols: int, steps: int, method: str = STANDARD_NS, restart: int = DEFAULT_GRAM_RESTART) -> float:
    """The Newton–Schulz products of one rows x cols matrix under `method` (`runs_gram`
    decides the fallback), in dense-GEMM FLOPs."""
    r, c = min(rows, cols), max(rows, cols)
    if runs_gram(rows, cols, method):
        return gram_ns_flops(r, c, steps, restart)
    return standard_ns_flops(r, c, steps)


def muon_flops(
    rows: int, cols: int, ns_steps: int, method: str = STANDARD_NS, restart: int = DEFAULT_GRAM_RESTART
) -> float:
    """Muon: its Newton–Schulz products (`ns_flops`) plus elementwise work."""
    return ns_flops(rows, cols, ns_steps, method, restart) + ELEMENTWISE_FLOPS_PER_ELEMENT * rows * cols


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


def matrix_flops(rows: int, cols: int, settings: Settings) -> float:
    """FLOPs of one update of a full rows x cols matrix by the configured optimizer."""
    if settings.name == "muon":
        return muon_flops(rows, cols, settings.ns_steps, settings.ns_method, settings.gram_restart)
    if settings.name == "shampoo":
        return shampoo_flops(rows, cols, settings.block_size, settings.precondition_frequency)
    return soap_flops(rows, cols, settings.precondition_frequency, settings.max_precond_dim)


def matrix_cost(model: str, rows: int, cols: int, settings: Settings) -> float:
    """Cost of one matrix-optimizer update of a rows x cols matrix under a built-in model."""
    return float(rows * cols) if model == NUMEL else matrix_flops(rows, cols, settings)


def adamw_cost(model: str, numel: int) -> float:
    """Cost of an AdamW update of `numel` elements under a built-in model (AdamW is
    memory-bound: ~10 FLOPs per element keeps its buffers comparable)."""
    return float(numel) if model == NUMEL else float(ADAMW_FLOPS_PER_ELEMENT * numel)


def matrix_state_bytes(rows: int, cols: int, settings: Settings) -> float:
    """Optimizer state (fp32) of one full matrix, bytes."""
    if settings.name == "muon":
        return float(MUON_STATE_BYTES_PER_ELEMENT * rows * cols)
    if settings.name == "shampoo":
        total = 0.0
        for bm, num_row_blocks in _blocks(rows, settings.block_size):
            for bn, num_col_blocks in _blocks(cols, settings.block_size):
                total += num_row_blocks * num_col_blocks * (8 * (bm * bm + bn * bn) + 4 * bm * bn)
        return total
    sides = sum(side * side for side in (rows, cols) if side <= settings.max_precond_dim)
    return float(8 * rows * cols + 8 * sides)


def main_copy_bytes(dtype: str) -> int:
    """Bytes per element of the fp32 main copy the runtime keeps of a parameter of `dtype`."""
    return 0 if dtype == "fp32" else MAIN_COPY_BYTES_PER_ELEMENT


def adamw_bytes_per_element(dtypes: Sequence[str]) -> int:
    """State bytes per AdamW slice element given the AdamW parameters' dtypes: two fp32
    moments, plus an fp32 main copy when any is bf16/fp16 (the runtime then keeps it over the
    whole slice)."""
    lowp = any(dtype != "fp32" for dtype in dtypes)
    return ADAMW_STATE_BYTES_PER_ELEMENT + (MAIN_COPY_BYTES_PER_ELEMENT if lowp else 0)


def param_state_bytes(numel: int, dtype: str, submatrices: Sequence[tuple[int, int]], settings: Settings) -> float:
    """Optimizer state bytes of a whole parameter of `numel` elements: an AdamW one (no
    submatrices) or a matrix updated as `submatrices`, its fp32 main copy included when the
    parameter is bf16/fp16."""
    main = float(main_copy_bytes(dtype) * numel)
    if not submatrices:
        return float(ADAMW_STATE_BYTES_PER_ELEMENT * numel) + main
    return sum(matrix_state_bytes(rows, cols, settings) for rows, cols in submatrices) + main


REDUCTION_BYTES_PER_ELEMENT = 4  # the runtime reduces gradients in an fp32 bucket buffer


def predicted_peak_bytes(
    state_bytes: float, buffer_elements: int, largest_bucket: int, tp_transient: int, dp: int
) -> float:
    """A device's predicted peak optimizer memory above its parameters and gradients under
    `CanzonaOptimizer`: the fp32 bucket buffer (every DP bucket whole, `buffer_elements`), its
    optimizer state (`state_bytes`: updated matrices' state and main copies, its AdamW slices'),
    and a step's transients: the TP update's (`tp_transient`, see `tp_transient_bytes`), and
    over DP one bucket's collective buffer (fp32). `benchmarks/memory.py` compares it with the
    measured peak."""
    collective = REDUCTION_BYTES_PER_ELEMENT * largest_bucket if dp > 1 else 0
    return float(REDUCTION_BYTES_PER_ELEMENT * buffer_elements + state_bytes + tp_transient + collective)


def tp_transient_bytes(update: str, group_bytes: int, owned_elements: int) -> int:
    """The TP update's transient memory on a device: a hosted update's micro-group (gathered
    gradients and Newton-Schulz workspace), bounded by the capacity `group_bytes`; a replicated
    update's three fp32 copies of every matrix its DP rank owns (`owned_elements` in all: the
    all-gathered shards, the assembled matrices, their updates)."""
    return group_bytes if update == HOSTED else 3 * REDUCTION_BYTES_PER_ELEMENT * owned_elements
