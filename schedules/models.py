"""The schedule file's data model: frozen, strict pydantic models (`extra="forbid"`), one per
section of the file. Reading, sealing and writing a schedule live in `canzona.schedules.format`,
which re-exports these; the validators type against them here, so nothing imports back into
`format` (docs/schedule-format.md describes every field).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from canzona.schedules.limits import (
    DEFAULT_BUCKET_COLLECTIVE,
    DEFAULT_GRAM_RESTART,
    DEFAULT_NS_COEFFICIENTS,
    MAX_FILE_INT,
    STANDARD_NS,
)

SCHEMA_VERSION = 2


class _Strict(BaseModel):
    # strict: a value of another type is refused, never converted ("16", 16.0 or true for an
    # integer; an integer is still accepted for a float, as JSON does not tell them apart).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


Count = Annotated[int, Field(ge=0, le=MAX_FILE_INT)]
"""A non-negative integer of the file (sizes, offsets, ranks, bytes), bounded so arithmetic on
it stays cheap and every consumer can turn it into a float."""


class ModelSource(_Strict):
    """Which model was planned: a preset name, a file (with its sha256), or a live model's
    factory `py:MODULE:FACTORY` (with the sha256 of its description)."""

    name: str
    source: str
    sha256: str | None = None


class OptimizerSettings(_Strict):
    """The matrix optimizer and its settings: those its cost model used, and Muon's Newton–Schulz
    coefficient schedule (a name of `canzona.schedules.coefficients`; files written before the
    field hold none: "simple", the one schedule there was), method (`standard` or `gram`, with
    the iteration `gram_restart` restarts after) and precision (`ns_dtype`); files written
    before those hold none: the standard iteration in the runtime's default precision."""

    name: str
    ns_steps: Count
    block_size: Count
    precondition_frequency: Count
    max_precond_dim: Count
    ns_coefficients: str = DEFAULT_NS_COEFFICIENTS
    ns_method: str = STANDARD_NS
    gram_restart: Count = DEFAULT_GRAM_RESTART
    ns_dtype: str = "auto"


class TrainingSettings(_Strict):
    """The training iteration a simulator search assumed: sequences per step over all DP
    ranks, tokens per sequence, micro-batches per DP rank (null: one sequence each)."""

    global_batch: int = Field(ge=1, le=MAX_FILE_INT)
    seq_len: int = Field(ge=1, le=MAX_FILE_INT)
    micro_batches: int | None = Field(default=None, ge=1, le=MAX_FILE_INT)


class Request(_Strict):
    """Everything needed to regenerate the schedule. `bucket_device` is set when the bucket
    size was chosen by the simulator on that device; `training` is what the `alpha_device` /
    `bucket_device` searches assumed. `names` is the naming convention a preset or a Hugging
    Face config was expanded to; `sequence_parallel` marks every norm's gradient as partial
    over TP; `dtype`, when set, is the dtype every parameter was planned in (`--dtype`, over
    the source's own). `sharding` is how parameters lie over DP: "replicated" (ZeRO-1, the DP section's
    buckets and owners) or "fsdp" (FSDP2 `fully_shard`: every parameter is sharded over the DP
    shard dim, the matrices' micro-groups span DP shard x TP); `dp_replicate` > 1 is HSDP, dp =
    dp_replicate x shard ranks. `coop` is the cooperative hosting mode (off, auto, force);
    `tp_update` how the TP update was asked for (auto, hosted, replicated: `TpSection.update`)."""

    model: ModelSource
    tp: int = Field(ge=1, le=MAX_FILE_INT)
    dp: int = Field(ge=1, le=MAX_FILE_INT)
    optimizer: OptimizerSettings
    cost: str
    alpha: float = Field(ge=0.0, le=1.0)
    bucket_size: int = Field(ge=1, le=MAX_FILE_INT)
    split_qkv: str
    split_fc1: bool
    router_optimizer: str
    names: str = "megatron"
    sequence_parallel: bool = False
    dtype: Literal["fp32", "bf16", "fp16"] | None = None
    tp_mode: str
    group_bytes: int = Field(ge=1, le=MAX_FILE_INT)
    ep: int = Field(default=1, ge=1, le=MAX_FILE_INT)
    solver: str = "greedy"
    time_limit: float = Field(default=10.0, gt=0)
    seed: int = Field(default=0, ge=-MAX_FILE_INT, le=MAX_FILE_INT)
    alpha_device: str | None = None
    bucket_device: str | None = None
    training: TrainingSettings | None = None
    sharding: str = "replicated"
    dp_replicate: int = Field(default=1, ge=1, le=MAX_FILE_INT)
    coop: str = "off"
    order: str = "registration"
    tp_update: str = "auto"
    canzona_version: str


class ParamEntry(_Strict):
    """One parameter, in buffer order. `offset`/`numel` are its local shard in the bucket;
    `owner` is the DP rank updating it (null for AdamW, which uses the equal split);
    `index` is its registration position (the order of `named_parameters()`).
    `row_blocks` (matrix optimizer only; null = the whole matrix): per submatrix the optimizer
    updates separately, the [start, stop) row ranges of the gathered matrix (TP shards
    concatenated along `tp_dim` in TP-rank order) whose concatenation is that submatrix.
    `ep_rank` (expert parallelism only): the EP rank holding this expert; its `bucket`/`offset`
    refer to `dp.expert_buckets` and `owner` is an expert-data-parallel rank
    (DP rank = owner · ep + ep_rank).
    `param` / `slice` (grouped 3-D expert tensors only): this entry is expert `slice` of the
    parameter `param` (dim 0 indexes experts), named `param[slice]`, with the slice's 2-D
    `shape` and `tp_dim`; the E slices of one tensor have consecutive indices.
    `grad_reduce` ("tp"; TP > 1, replicated parameters only): each TP rank's gradient is a
    partial sum, which the runtime sums over the TP group."""

    name: str
    index: Count
    shape: list[Count]
    tp_dim: Count | None
    dtype: str
    optimizer: str
    bucket: Count
    offset: Count
    numel: Count
    owner: Count | None
    cost: float
    row_blocks: list[list[list[Count]]] | None = None
    ep_rank: Count | None = None
    param: str | None = None
    slice: Count | None = None
    grad_reduce: str | None = None


class BucketEntry(_Strict):
    """One bucket of the matrix buffer: padded size, D + 1 cuts, the slices they make, and the
    collective that reduces and gathers it over its DP group (`BUCKET_COLLECTIVES`: "ring", a
    native reduce-scatter / all-gather over slices padded to the largest; "rooted", one reduce to
    and one broadcast from each non-empty slice's owner, a native ring where the slices are
    equal; "all_to_all"). Files written before the field hold no value: "rooted", what the
    runtime did with every bucket then."""

    index: Count
    numel: Count
    cuts: list[Count]
    slice_bytes: list[Count]
    padding_overhead: float
    collective: str = DEFAULT_BUCKET_COLLECTIVE


class AdamwBucketEntry(_Strict):
    """One bucket of the AdamW buffer (stock equal split)."""

    index: Count
    numel: Count
    cuts: list[Count]


class DpSection(_Strict):
    """The DP partition of every buffer: dense matrices (over DP), experts under expert
    parallelism (over the expert-data-parallel group, dp / ep ranks), AdamW (equal split)."""

    buckets: list[BucketEntry]
    expert_buckets: list[BucketEntry] = []
    adamw_buckets: list[AdamwBucketEntry]


class TeamEntry(_Strict):
    """A matrix hosted cooperatively (Muon only): the TP ranks (ascending; its `hosts` entry
    among them) that each hold an equal slice of its long side in that order and run
    Newton–Schulz together, and the cost each pays."""

    param: str
    hosts: list[Count]
    load: float


class TpGroup(_Strict):
    """One micro-group of a DP rank, in execution order. `params[i]` is updated on TP rank
    `hosts[i]`, or by its team if `teams` names it; per TP rank: summed task cost (a team's
    `load` on each member) and bytes of gathered full fp32 gradients (1/k of a teamed one)."""

    index: Count
    params: list[str]
    hosts: list[Count]
    host_loads: list[float]
    host_bytes: list[Count]
    makespan: float
    saturation: float
    teams: list[TeamEntry] = []


class TpRankPlan(_Strict):
    """The micro-groups of the matrices one DP rank owns (shared by its TP ranks)."""

    dp_rank: Count
    groups: list[TpGroup]


class TpSection(_Strict):
    """TP micro-group schedule: the mode that built it and the per-host byte capacity, and how
    the update runs: "hosted" (each matrix on its micro-group's host, as `ranks` say) or
    "replicated" (every TP rank all-gathers and updates every matrix its DP rank owns, the
    micro-groups unused)."""

    mode: str
    group_bytes: Count
    ranks: list[TpRankPlan]
    update: str = "hosted"


class StrategyScore(_Strict):
    """DP figures of one baseline strategy, in cost units (`load`: per DP rank)."""

    load: list[float]
    max: float
    mean: float
    imbalance: float
    gap: float
    redundancy: float
    padding_overhead: float | None


class DpMetrics(_Strict):
    """Per-rank compute and memory of the matrix-optimizer partition, and the baselines."""

    method: str
    load: list[float]
    max: float
    mean: float
    imbalance: float
    lower_bound: float
    gap: float
    slice_bytes: list[Count]
    state_bytes: list[float]
    adamw_load: list[float]
    padding_overhead: float
    max_padding_overhead: float
    baselines: dict[str, StrategyScore]


class TpModeScore(_Strict):
    """Headline TP figures of one micro-group mode on the same DP partition."""

    num_groups: Count
    critical_time: float
    efficiency: float
    worst_device_load: float
    device_imbalance: float
    max_saturation: float


class TpMetrics(_Strict):
    """efficiency = sum of task costs / (P · sum over groups of makespan), over all DP ranks;
    critical_time = the largest sum of group makespans of one DP rank (cost units), and
    critical_lower_bound = max over DP ranks of max(its cost / P, its largest piece: a task, or a
    team member's share of a cooperatively hosted task);
    cooperative = how many matrices the chosen mode hosts cooperatively (by a team).
    device_lower_bound = max(total device load / (D · P), the largest indivisible piece: one
    matrix update on one device, or one team member's share of a cooperatively hosted
    matrix); device_gap = worst_device_load / device_lower_bound - 1 (both absent in
    files written before they were recorded)."""

    mode: str
    num_groups: Count
    critical_time: float
    critical_lower_bound: float
    efficiency: float
    worst_device_load: float
    device_imbalance: float
    max_saturation: float
    modes: dict[str, TpModeScore]
    cooperative: Count = 0
    device_lower_bound: float | None = None
    device_gap: float | None = None


class DeviceMetrics(_Strict):
    """One device (global rank = dp_rank · tp + tp_rank): its optimizer compute, state bytes,
    bytes it sends / receives per step in the TP all-to-alls, and (`peak_bytes`, plans for
    `CanzonaOptimizer`) its predicted peak optimizer memory above parameters and gradients
    (`costs.predicted_peak_bytes`)."""

    rank: Count
    dp_rank: Count
    tp_rank: Count
    load: float
    state_bytes: float
    bytes_sent: Count
    bytes_received: Count
    peak_bytes: float | None = None


class SolverMetrics(_Strict):
    """What the optional CP-SAT refinement did. Its limit is deterministic work (CP-SAT's
    deterministic time), so the same request and seed give the same file; wall time is
    reported by the CLI, not recorded."""

    dp_status: str
    dp_objective: float
    dp_bound: float
    dp_accepted: bool
    tp_groups_refined: Count
    tp_groups_improved: Count


class AlphaTrial(_Strict):
    """One α tried by `--alpha auto`: canzona's predicted step (and iteration) time with it."""

    alpha: float
    predicted_step_s: float
    predicted_iteration_s: float | None = None


class BucketTrial(_Strict):
    """One bucket size tried by `--bucket-size auto`: the matrix buffer's bucket count and
    canzona's predicted step and iteration time with it."""

    bucket_size: Count
    num_buckets: Count
    predicted_step_s: float
    predicted_iteration_s: float


class BucketSearch(_Strict):
    """`--bucket-size auto` on `request.bucket_device` with `request.training`: every size
    tried and why the chosen one (`request.bucket_size`) won."""

    reason: str
    trials: list[BucketTrial]


class Metrics(_Strict):
    """Everything CI diffs. `alpha_search` is set when α was chosen by the simulator on
    `request.alpha_device` (then `request.alpha` is the chosen value); `bucket_search` when
    the bucket size was, on `request.bucket_device`."""

    dp: DpMetrics
    tp: TpMetrics
    device: list[DeviceMetrics]
    solver: SolverMetrics | None = None
    alpha_search: list[AlphaTrial] | None = None
    bucket_search: BucketSearch | None = None


class Schedule(_Strict):
    """A whole schedule file. `digest` seals everything else in it (`schedule_digest`)."""

    schema_version: Count
    request: Request
    fingerprint: str
    digest: str
    params: list[ParamEntry]
    dp: DpSection
    tp: TpSection
    metrics: Metrics
