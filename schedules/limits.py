"""What canzona accepts: the vocabularies and the limits of a request, one definition shared
by the planner (which refuses a request before any work) and the schedule validator (which
refuses a file whose request no planner run could have had).

The maxima keep every command fast and bounded: the planner's work grows with DP × buckets
and with the number of parameters, and a schedule lists TP × DP devices.
"""

from __future__ import annotations

import math
from typing import Protocol

from canzona.schedules.coefficients import DEFAULT_NS_COEFFICIENTS, NS_COEFFICIENT_NAMES

MATRIX = "matrix"  # optimizer class of parameters the matrix optimizer (Muon, Shampoo, SOAP) updates
ADAMW = "adamw"  # optimizer class of parameters AdamW updates element-wise
OPTIMIZER_CLASSES = (MATRIX, ADAMW)
MATRIX_OPTIMIZERS = ("muon", "shampoo", "soap")
COST_MODELS = ("numel", "flops")
PROFILE_PREFIX = "profile:"
TP_MODES = ("rollback", "fixed", "sorted", "heap")
COOP_MODES = ("off", "auto", "force")  # cooperative hosting of dominant Muon matrices
# How a DP rank's TP group updates the matrices it owns: each on one host TP rank (or team), which
# gathers it and scatters the update back ("hosted", the micro-groups), or on every TP rank after
# one fused all-gather, nothing scattered ("replicated", TP-SC's synchronous update).
HOSTED, REPLICATED_UPDATE = "hosted", "replicated"
TP_UPDATES = (HOSTED, REPLICATED_UPDATE)
TP_UPDATE_REQUESTS = ("auto", *TP_UPDATES)  # auto: the planner's objective picks one
ORDERS = ("registration", "free")  # a bucket's parameter order: Megatron's, or the planner's
# How one bucket of a matrix buffer is reduced and gathered over its DP group: a native ring
# reduce-scatter / all-gather over slices padded to the largest, one rooted reduce / broadcast
# per non-empty slice (a native ring where the slices are equal), one all_to_all_single, or a
# native ring over equal slices with one all-to-all between those and the owners' slices.
BUCKET_COLLECTIVES = ("rooted", "ring", "all_to_all", "reslice")
DEFAULT_BUCKET_COLLECTIVE = "rooted"  # what a bucket without the field means (files before it)
AS_SCHEDULED = "schedule"  # a runtime or simulator option: each bucket in its schedule's collective
DP_COLLECTIVE_MODES = (AS_SCHEDULED, *BUCKET_COLLECTIVES)
SOLVERS = ("greedy", "ilp")
QKV_SPLITS = ("none", "qkv", "head")
# parameter names of presets and HF configs: Megatron-core with Transformer Engine's layer spec (the
# default) or its local spec, transformers, torchtitan
NAMING_CONVENTIONS = ("megatron", "megatron-local", "hf", "torchtitan")
GRAD_REDUCE_AXES = ("tp",)  # axes over which a parameter's gradient can arrive as a partial sum
REPLICATED, FSDP = "replicated", "fsdp"
SHARDINGS = (REPLICATED, FSDP)  # how the parameters lie over DP: replicated (ZeRO-1) or FSDP2 (fully_shard)

MAX_TP = 256
MAX_DP = 8192
MAX_EP = 1024
MAX_DEVICES = 131072  # TP x DP
MAX_PARAMS = 65536  # parameters of one model
MAX_PARAM_NUMEL = 1 << 40  # elements of one parameter
MAX_PARAM_DIMS = 8  # dims of one parameter's shape
MAX_BUCKET_SIZE = 1 << 40
MAX_GROUP_BYTES = 1 << 50
DEFAULT_GROUP_MB = 2048  # MiB of gathered fp32 gradients a host holds per micro-group
MAX_TIME_LIMIT = 300.0  # CP-SAT deterministic seconds (for the DP cuts, and again for all TP groups)
MAX_SEED = (1 << 31) - 1
MAX_NS_STEPS = 100
# How Muon's Newton–Schulz runs: the standard iteration on the n x m matrix, or Gram
# Newton–Schulz on the n x n Gram matrix (schedules/costs.py; the runtime's kernels), which a
# matrix no more than GRAM_MIN_ASPECT times as long as wide falls back from to the standard one.
STANDARD_NS, GRAM_NS = "standard", "gram"
NS_METHODS = (STANDARD_NS, GRAM_NS)
GRAM_MIN_ASPECT = 2
DEFAULT_GRAM_RESTART = 2  # Gram Newton–Schulz restarts after this many iterations (0: never)
# The precision Muon's Newton–Schulz products run in: bf16 operands (fp32 accumulation), TF32
# products of fp32 operands (CUDA; fp32 elsewhere), fp32; auto: bf16 on CUDA, fp32 elsewhere.
NS_DTYPES = ("auto", "bf16", "tf32", "fp32")
MAX_PRECONDITION_FREQUENCY = 1_000_000
MAX_BLOCK_SIZE = 1 << 20  # Shampoo block side, and SOAP's max_precond_dim
MAX_SCHEDULE_BYTES = 64 << 20
MAX_MODEL_FILE_BYTES = 64 << 20
MAX_NESTING = 32  # YAML nesting levels a schedule's skeleton (or a model file) may have
MAX_EXPANDED_NODES = 4_000_000  # YAML values a model file, profile or shapes list may expand to
MAX_FILE_INT = (1 << 63) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bounded_int_problem(label: str, value: object, maximum: int, what: str, minimum: int = 1) -> str | None:
    """`label` must be an integer in [minimum, maximum]; `what` names the maximum's reason."""
    if not _is_int(value):
        return f"{label} must be an integer, got {value!r}"
    if value < minimum:  # type: ignore[operator]
        return f"{label} must be >= {minimum}, got {value}"
    if value > maximum:  # type: ignore[operator]
        return f"{label} {value} is above canzona's maximum of {maximum} {what}"
    return None


def finite_problem(label: str, value: float, low: float, high: float, *, low_open: bool = False) -> str | None:
    """`label` must be a finite number in [low, high] (or (low, high] with `low_open`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return f"{label} must be a finite number, got {value!r}"
    if value < low or (low_open and value == low):
        return f"{label} must be {'>' if low_open else '>='} {low:g}, got {value:g}"
    if value > high:
        return f"{label} must be <= {high:g}, got {value:g}"
    return None


def layout_problem(tp: object, dp: object, ep: object) -> str | None:
    """TP, DP and EP sizes within canzona's maxima (EP dividing DP)."""
    problem = (
        bounded_int_problem("tp", tp, MAX_TP, "TP ranks")
        or bounded_int_problem("dp", dp, MAX_DP, "DP ranks")
        or bounded_int_problem("ep", ep, MAX_EP, "EP ranks")
    )
    if problem:
        return problem
    if tp * dp > MAX_DEVICES:  # type: ignore[operator]
        return f"tp x dp = {tp * dp} devices is above canzona's maximum of {MAX_DEVICES}"  # type: ignore[operator]
    if dp % ep:  # type: ignore[operator]
        return f"ep {ep} does not divide dp {dp}"
    return None


def sharding_problem(sharding: object, dp: object, dp_replicate: object, ep: object) -> str | None:
    """A known sharding mode; FSDP's replicate size (HSDP) divides dp; no EP under FSDP."""
    problem = choice_problem("sharding", sharding, SHARDINGS) or bounded_int_problem(
        "dp replicate", dp_replicate, MAX_DP, "DP ranks"
    )
    if problem:
        return problem
    if sharding == REPLICATED and dp_replicate != 1:
        return f"dp replicate {dp_replicate} (HSDP) needs FSDP sharding (--fsdp)"
    if sharding == FSDP and dp % dp_replicate:  # type: ignore[operator]
        return f"dp replicate {dp_replicate} does not divide dp {dp} (HSDP: dp = replicate x shard)"
    if sharding == FSDP and ep != 1:
        return f"ep {ep} with FSDP sharding is not supported (plan expert parallelism without --fsdp)"
    return None


def settings_problem(
    name: str,
    ns_steps: object,
    block_size: object,
    precondition_frequency: object,
    max_precond_dim: object,
    ns_coefficients: object = DEFAULT_NS_COEFFICIENTS,
    *,
    ns_method: object = STANDARD_NS,
    gram_restart: object = DEFAULT_GRAM_RESTART,
    ns_dtype: object = "auto",
) -> str | None:
    """A known matrix optimizer with settings in range."""
    if name not in MATRIX_OPTIMIZERS:
        return f"unknown matrix optimizer {name!r}; choose one of {', '.join(MATRIX_OPTIMIZERS)}"
    return (
        bounded_int_problem("ns_steps", ns_steps, MAX_NS_STEPS, "Newton-Schulz steps")
        or choice_problem("ns_coefficients", ns_coefficients, NS_COEFFICIENT_NAMES)
        or choice_problem("ns_method", ns_method, NS_METHODS)
        or bounded_int_problem("gram_restart", gram_restart, MAX_NS_STEPS, "Newton-Schulz steps", minimum=0)
        or choice_problem("ns_dtype", ns_dtype, NS_DTYPES)
        or bounded_int_problem("block_size", block_size, MAX_BLOCK_SIZE, "(Shampoo block side)")
        or bounded_int_problem("precondition_frequency", precondition_frequency, MAX_PRECONDITION_FREQUENCY, "steps")
        or bounded_int_problem("max_precond_dim", max_precond_dim, MAX_BLOCK_SIZE, "(preconditioner side)")
    )


class OptimizerFields(Protocol):
    """The optimizer settings a request holds (the planner's `OptimizerConfig` and a schedule's
    `request.optimizer` both have them)."""

    @property
    def name(self) -> str: ...
    @property
    def ns_steps(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def precondition_frequency(self) -> int: ...
    @property
    def max_precond_dim(self) -> int: ...
    @property
    def ns_coefficients(self) -> str: ...
    @property
    def ns_method(self) -> str: ...
    @property
    def gram_restart(self) -> int: ...
    @property
    def ns_dtype(self) -> str: ...


def optimizer_problem(opt: OptimizerFields) -> str | None:
    """`settings_problem` of a request's optimizer settings, given as one object."""
    return settings_problem(
        opt.name,
        opt.ns_steps,
        opt.block_size,
        opt.precondition_frequency,
        opt.max_precond_dim,
        opt.ns_coefficients,
        ns_method=opt.ns_method,
        gram_restart=opt.gram_restart,
        ns_dtype=opt.ns_dtype,
    )


DEFAULT_NS_STEPS, DEFAULT_BLOCK_SIZE, DEFAULT_PRECONDITION_FREQUENCY, DEFAULT_MAX_PRECOND_DIM = 5, 1024, 10, 10000
SETTING_DEFAULTS: dict[str, object] = {
    "ns_steps": DEFAULT_NS_STEPS,
    "block_size": DEFAULT_BLOCK_SIZE,
    "precondition_frequency": DEFAULT_PRECONDITION_FREQUENCY,
    "max_precond_dim": DEFAULT_MAX_PRECOND_DIM,
    "ns_coefficients": DEFAULT_NS_COEFFICIENTS,
    "ns_method": STANDARD_NS,
    "gram_restart": DEFAULT_GRAM_RESTART,
    "ns_dtype": "auto",
}
SETTING_USERS = {  # setting -> the matrix optimizers it changes
    "ns_steps": ("muon",),
    "ns_coefficients": ("muon",),
    "ns_method": ("muon",),
    "gram_restart": ("muon",),
    "ns_dtype": ("muon",),
    "block_size": ("shampoo",),
    "precondition_frequency": ("shampoo", "soap"),
    "max_precond_dim": ("soap",),
}


def recorded_settings(name: str, values: dict[str, object]) -> dict[str, object]:
    """The settings a schedule records for optimizer `name`: those it does not use at their
    defaults (`plan` refuses setting them, so a file that differs was edited)."""
    return {key: value if name in SETTING_USERS[key] else SETTING_DEFAULTS[key] for key, value in values.items()}


def unused_settings_problem(name: str, values: dict[str, object]) -> str | None:
    """A setting optimizer `name` does not use, recorded at another value than its default."""
    for key, users in SETTING_USERS.items():
        if name not in users and values.get(key) != SETTING_DEFAULTS[key]:
            return (
                f"{key} {values.get(key)} has no effect on {name} (only {' and '.join(users)} use it): "
                f"a schedule records it at its default {SETTING_DEFAULTS[key]}"
            )
    return None


def choice_problem(label: str, value: object, choices: tuple[str, ...]) -> str | None:
    """`value` must be one of `choices`."""
    if value in choices:
        return None
    return f"unknown {label} {value!r}; choose one of {', '.join(choices)}"


def cost_problem(cost: object) -> str | None:
    """numel, flops, or profile:FILE."""
    if isinstance(cost, str) and (
        cost in COST_MODELS or (cost.startswith(PROFILE_PREFIX) and len(cost) > len(PROFILE_PREFIX))
    ):
        return None
    return f"unknown cost model {cost!r}; choose one of {', '.join(COST_MODELS)} or profile:FILE"


def alpha_problem(alpha: float) -> str | None:
    """α must be a number in [0, 1]."""
    if finite_problem("alpha", alpha, 0.0, 1.0):
        return f"alpha must be in [0, 1], got {alpha!r}"
    return None


def request_problem(
    *,
    tp: object,
    dp: object,
    ep: object,
    alpha: float,
    bucket_size: object,
    group_bytes: object,
    tp_mode: object,
    solver: object,
    time_limit: float,
    seed: object,
    order: object = "registration",
) -> str | None:
    """Every numeric and named setting of a planning request, as the planner accepts them."""
    return (
        layout_problem(tp, dp, ep)
        or choice_problem("order", order, ORDERS)
        or (
            "--order free does not combine with --solver ilp (CP-SAT refines registration-order plans)"
            if order == "free" and solver == "ilp"
            else None
        )
        or alpha_problem(alpha)
        or bounded_int_problem("bucket size", bucket_size, MAX_BUCKET_SIZE, "elements")
        or bounded_int_problem("group capacity", group_bytes, MAX_GROUP_BYTES, "bytes")
        or choice_problem("TP mode", tp_mode, TP_MODES)
        or choice_problem("solver", solver, SOLVERS)
        or finite_problem("time limit", time_limit, 0.0, MAX_TIME_LIMIT, low_open=True)
        or bounded_int_problem("seed", seed, MAX_SEED, "(CP-SAT seeds are 31-bit)", minimum=0)
    )
