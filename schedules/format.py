"""The schedule file: a versioned, validated, deterministic YAML document.

Both the planner (which writes it) and the runtime (which executes it) import this module; it
imports neither. A schedule file is untrusted input: `parse_schedule` bounds its size, nesting
and numbers, refuses YAML anchors, aliases and tags before any YAML is composed, verifies the
fingerprint and the digest, and runs the semantic validator (`canzona.schedules.validate`).
The format is described in docs/schedule-format.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from canzona.schedules import reading, validate
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import OutputError, write_atomic
from canzona.schedules.limits import DEFAULT_BUCKET_COLLECTIVE, MAX_FILE_INT, MAX_SCHEDULE_BYTES

SCHEMA_VERSION = 2

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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
    """The matrix optimizer and the settings its cost model used."""

    name: str
    ns_steps: Count
    block_size: Count
    precondition_frequency: Count
    max_precond_dim: Count


class TrainingSettings(_Strict):
    """The training iteration a simulator search assumed: sequences per step over all DP
    ranks, tokens per sequence, micro-batches per DP rank (null: one sequence each)."""

    global_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    micro_batches: int | None = Field(default=None, ge=1)


class Request(_Strict):
    """Everything needed to regenerate the schedule. `bucket_device` is set when the bucket
    size was chosen by the simulator on that device; `training` is what the `alpha_device` /
    `bucket_device` searches assumed. `names` is the naming convention a preset or a Hugging
    Face config was expanded to; `sequence_parallel` marks every norm's gradient as partial
    over TP. `sharding` is how parameters lie over DP: "replicated" (ZeRO-1, the DP section's
    buckets and owners) or "fsdp" (FSDP2 `fully_shard`: every parameter is sharded over the DP
    shard dim, the matrices' micro-groups span DP shard x TP); `dp_replicate` > 1 is HSDP, dp =
    dp_replicate x shard ranks. `coop` is the cooperative hosting mode (off, auto, force)."""

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
    """TP micro-group schedule: the mode that built it and the per-host byte capacity."""

    mode: str
    group_bytes: Count
    ranks: list[TpRankPlan]


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
    and bytes it sends / receives per step in the TP all-to-alls."""

    rank: Count
    dp_rank: Count
    tp_rank: Count
    load: float
    state_bytes: float
    bytes_sent: Count
    bytes_received: Count


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

    bucket_size: int
    num_buckets: int
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


def compute_fingerprint(params: Iterable[tuple[str, Sequence[int], str, int | None]]) -> str:
    """sha256 of the ordered (name, full shape, dtype, tp_dim) list: the model's identity."""
    canonical = json.dumps([[n, list(s), d, t] for n, s, d, t in params], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


PlanningRow = tuple[str, Sequence[int], str, "int | None", "str | None"]
"""(name, shape, dtype, tp_dim, grouped tensor it is a slice of or None), in planning order."""


def model_parameters(rows: Iterable[PlanningRow]) -> list[tuple[str, list[int], str, int | None]]:
    """The model's own parameters (name, full shape, dtype, tp_dim) in registration order, from
    the planning order: the E expert slices of a grouped tensor fold back into the tensor
    [E, *slice shape], with its TP dim one higher."""
    rows = list(rows)
    counts: dict[str, int] = {}
    for row in rows:
        if row[4] is not None:
            counts[row[4]] = counts.get(row[4], 0) + 1
    out: list[tuple[str, list[int], str, int | None]] = []
    for name, shape, dtype, tp_dim, parent in rows:
        if parent is None:
            out.append((name, list(shape), dtype, tp_dim))
        elif not out or out[-1][0] != parent:
            out.append((parent, [counts[parent], *shape], dtype, None if tp_dim is None else tp_dim + 1))
    return out


def registration_order(schedule: Schedule) -> list[ParamEntry]:
    """The schedule's parameters in registration (planning) order."""
    return sorted(schedule.params, key=lambda entry: entry.index)


def schedule_fingerprint(schedule: Schedule) -> str:
    """Recompute the fingerprint from the file's own parameter list (the model's parameters:
    grouped expert slices folded back into their tensors)."""
    return compute_fingerprint(
        model_parameters((e.name, e.shape, e.dtype, e.tp_dim, e.param) for e in registration_order(schedule))
    )


def schedule_digest(schedule: Schedule) -> str:
    """sha256 of the schedule's canonical JSON without the digest: every field at a non-default
    value, in schema order, compact. Fields at their default are left out, so a later format
    version that adds an optional field keeps the digests of older files valid."""
    canonical = schedule.model_dump_json(exclude={"digest"}, exclude_defaults=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def sealed(schedule: Schedule) -> Schedule:
    """The schedule with its digest recomputed (what the planner writes)."""
    return schedule.model_copy(update={"digest": schedule_digest(schedule)})


_ROW_LINE = re.compile(r"^( *)- (__canzona_rows_\d+__)$", re.MULTILINE)
_YAML_UNSAFE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _is_flat(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_flat(item) and not isinstance(item, dict) for item in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _is_table(node: Any) -> bool:
    """A non-empty list of mappings whose values are scalars or lists of scalars."""
    return (
        isinstance(node, list)
        and bool(node)
        and all(isinstance(row, dict) and all(_is_flat(v) for v in row.values()) for row in node)
    )


def flow_value(value: Any) -> str:
    """JSON text of a flat value (scalars, lists, one-level mappings) that YAML reads back as
    the same value: floats spelled as YAML 1.1 reads them (always a dot), characters YAML
    refuses escaped. What table rows are written with, here and in parameter lists."""
    return _flow(value)


def _flow(value: Any) -> str:
    """JSON text of a flat value, with floats spelled as YAML 1.1 reads them (always a dot)."""
    if isinstance(value, str):
        # Not ensure_ascii: JSON would spell non-BMP characters as surrogate pairs, which YAML
        # reads differently. Raw UTF-8 reads the same in both, except characters YAML refuses
        # or reads as line breaks: those get \u escapes, which both read alike.
        return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        text = repr(value).lower()
        return text.replace("e", ".0e") if "." not in text and "e" in text else text
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def dump_schedule(schedule: Schedule) -> str:
    """The YAML text of a schedule (deterministic: same schedule, same bytes).

    Table rows (one parameter, one bucket) are written one per line as JSON objects, which
    YAML reads as flow mappings: the file diffs line by line and loads fast (`parse_schedule`).
    Fields at their default value are left out (as in the digest).
    """
    tables: list[list[dict[str, Any]]] = []

    def extract(node: Any) -> Any:
        if _is_table(node):
            tables.append(node)
            return [f"__canzona_rows_{len(tables) - 1}__"]
        if isinstance(node, dict):
            return {key: extract(value) for key, value in node.items()}
        if isinstance(node, list):
            return [extract(item) for item in node]
        return node

    data = schedule.model_dump(mode="json", exclude_defaults=True)
    skeleton = yaml.dump(extract(data), Dumper=_Dumper, sort_keys=False, width=1 << 16)

    def rows(match: re.Match[str]) -> str:
        indent, table = match.group(1), tables[int(match.group(2)[len("__canzona_rows_") : -2])]
        return "\n".join(f"{indent}- {_flow(row)}" for row in table)

    return _ROW_LINE.sub(rows, skeleton)


def write_schedule(schedule: Schedule, path: str | os.PathLike[str]) -> bool:
    """Write atomically (`files.write_atomic`: temporary file, fsync, rename; umask or the
    existing file's mode; through symlinks). False when the file already held these bytes.
    ScheduleError for a target that is not a regular file; OSError when the disk write fails."""
    text = dump_schedule(schedule)
    try:
        return write_atomic(path, text)
    except OutputError as error:
        raise ScheduleError(str(error)) from None


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].splitlines()[0] if first["msg"] else first["type"]
    return f"invalid schedule at {where}: {message}" if where else f"invalid schedule: {message}"


def check_version(version: Any, origin: str) -> None:
    """ScheduleError unless `version` is the schema version this canzona reads."""
    if version == SCHEMA_VERSION and type(version) is int:
        return
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version < SCHEMA_VERSION:
        raise ScheduleError(
            f"{origin}: schema_version {version} is from an older canzona (this one reads {SCHEMA_VERSION}); "
            "regenerate it with `canzona check --fix FILE` or `canzona plan`"
        )
    raise ScheduleError(f"{origin}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")


def parse_schedule(text: str, origin: str = "<text>") -> Schedule:
    """Validate YAML text as a schedule: structure (pydantic), fingerprint, digest, and every
    semantic invariant (`validate.schedule_problem`). ScheduleError with one line on any problem."""
    try:
        document = reading.schedule_json(text)
    except reading.UnsafeDocument as error:
        raise ScheduleError(f"{origin}: {error}") from None
    check_version(document.version, origin)
    try:
        schedule = Schedule.model_validate_json(document.json)
    except ValidationError as error:
        raise ScheduleError(f"{origin}: {document.locate(error) or _one_line(error)}") from None
    if schedule_fingerprint(schedule) != schedule.fingerprint:
        raise ScheduleError(f"{origin}: fingerprint does not match the parameter list (file edited?)")
    if schedule_digest(schedule) != schedule.digest:
        raise ScheduleError(
            f"{origin}: digest does not match the file's contents (edited by hand?); regenerate it with "
            "`canzona check --fix FILE`"
        )
    problem = validate.schedule_problem(schedule)
    if problem:
        raise ScheduleError(f"{origin}: {problem}")
    return schedule


def read_request(text: str, origin: str = "<text>") -> Request:
    """Only the request of a schedule text (of any schema version that has one), read as safely
    as a whole schedule: what `canzona check --fix` regenerates a file from that no longer
    validates."""
    try:
        document = reading.schedule_json(text)
        request = json.loads(document.json).get("request")
        return Request.model_validate(request)
    except reading.UnsafeDocument as error:
        raise ScheduleError(f"{origin}: {error}") from None
    except ValidationError as error:
        raise ScheduleError(f"{origin}: cannot read its request ({_one_line(error).replace('invalid schedule at ', 'request.')})") from None


def read_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read and validate a schedule file (at most MAX_SCHEDULE_BYTES)."""
    try:
        text = reading.read_text(path, MAX_SCHEDULE_BYTES)
    except reading.UnsafeDocument as error:
        raise ScheduleError(f"cannot read schedule {str(path)!r}: {error}") from None
    return parse_schedule(text, str(path))
