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
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from canzona.schedules import reading, validate
from canzona.schedules.collector import collector_paused
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import OutputError, write_atomic
from canzona.schedules.limits import MAX_SCHEDULE_BYTES
from canzona.schedules.models import (  # noqa: F401 - the data model, re-exported
    SCHEMA_VERSION,
    AdamwBucketEntry,
    AlphaTrial,
    BucketEntry,
    BucketSearch,
    BucketTrial,
    DeviceMetrics,
    DpMetrics,
    DpSection,
    Metrics,
    ModelSource,
    OptimizerSettings,
    ParamEntry,
    Request,
    Schedule,
    SolverMetrics,
    StrategyScore,
    TeamEntry,
    TpGroup,
    TpMetrics,
    TpModeScore,
    TpRankPlan,
    TpSection,
    TrainingSettings,
)
from canzona.schedules.writing import dump_schedule, flow_value  # noqa: F401 - the writer, re-exported


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
    if version is None:
        raise ScheduleError(
            f"{origin}: not a canzona schedule: it has no schema_version (this canzona reads "
            f"{SCHEMA_VERSION}; make one with `canzona plan`)"
        )
    raise ScheduleError(f"{origin}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")


def parse_schedule(text: str, origin: str = "<text>") -> Schedule:
    """Validate YAML text as a schedule: structure (pydantic), fingerprint, digest, and every
    semantic invariant (`validate.schedule_problem`). ScheduleError with one line on any problem."""
    with collector_paused():
        return _parse(text, origin)


def _parse(text: str, origin: str) -> Schedule:
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
    as a whole schedule but without its tables (a file whose rows are damaged still has a
    readable request): what `canzona check --fix` regenerates a file from that no longer
    validates."""
    try:
        request = reading.schedule_skeleton(text).get("request")
        return Request.model_validate_json(json.dumps(request))
    except reading.UnsafeDocument as error:
        raise ScheduleError(f"{origin}: {error}") from None
    except ValidationError as error:
        raise ScheduleError(
            f"{origin}: cannot read its request ({_one_line(error).replace('invalid schedule at ', 'request.')})"
        ) from None


def schedule_text(path: str | os.PathLike[str]) -> str:
    """The text of a schedule file (at most MAX_SCHEDULE_BYTES, UTF-8, a regular file: a FIFO, a
    socket or a device is refused before a byte is read): how every reader opens a schedule."""
    try:
        return reading.read_text(path, MAX_SCHEDULE_BYTES)
    except reading.UnsafeDocument as error:
        raise ScheduleError(f"cannot read schedule {str(path)!r}: {error}") from None


def read_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read and validate a schedule file (`schedule_text`, then `parse_schedule`)."""
    return parse_schedule(schedule_text(path), str(path))
