"""A measured cost model: seconds per matrix shape on a named device (`--cost profile:`).

`canzona calibrate` times the runtime's real kernels and writes a profile (YAML, validated
here). `ProfileCost` implements the planner's `CostModel` protocol in **seconds**: a shape the
profile measured (same optimizer settings) costs exactly its measured median; any other shape
costs its flops-model FLOPs divided by the achieved FLOP/s of the nearest measured shape
(distance in log min-side / log max-side: every cost formula is symmetric in rows and cols).
AdamW slices likewise scale by the achieved elements per second of the nearest measured size.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from canzona.planner.spec import OptimizerConfig, PlanError
from canzona.schedules.costs import matrix_flops, runs_gram
from canzona.schedules.limits import DEFAULT_GRAM_RESTART, MAX_MODEL_FILE_BYTES, STANDARD_NS
from canzona.schedules.limits import MATRIX_OPTIMIZERS as OPTIMIZERS
from canzona.schedules.reading import UnsafeDocument, read_text, safe_load

PROFILE_FORMAT = "canzona-profile/1"
PROFILE_PREFIX = "profile:"
ROW_OPTIMIZERS = (*OPTIMIZERS, "adamw")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfileSettings(_Strict):
    """The optimizer settings the kernels were timed with."""

    ns_steps: int = Field(ge=1)
    block_size: int = Field(ge=1)
    precondition_frequency: int = Field(ge=1)
    max_precond_dim: int = Field(ge=1)
    gram_restart: int = Field(default=DEFAULT_GRAM_RESTART, ge=0)


class ProfileRow(_Strict):
    """One timed kernel: a rows x cols matrix update (AdamW: `rows` elements, `cols` = 1).

    `seconds` is the median per-step time; for Shampoo and SOAP it is amortised over the
    refresh period: `step_seconds` + (`refresh_seconds` - `step_seconds`) / frequency. A Muon
    row's `method` is the Newton–Schulz it timed (profiles written before hold standard rows)."""

    optimizer: Literal["muon", "shampoo", "soap", "adamw"]
    method: Literal["standard", "gram"] = "standard"
    rows: int = Field(ge=1)
    cols: int = Field(ge=1)
    seconds: float = Field(gt=0)
    repeats: int = Field(ge=1)
    step_seconds: float | None = Field(default=None, gt=0)
    refresh_seconds: float | None = Field(default=None, gt=0)


class CommFit(_Strict):
    """An α–β fit of measured collectives (e.g. gloo all-to-all on this host): seconds per
    collective step and bytes per second per rank, and what it was measured on."""

    backend: str
    ranks: int = Field(ge=2)
    latency: float = Field(ge=0)
    bandwidth: float = Field(gt=0)


class Contention(_Strict):
    """A kernel run by `processes` processes at once takes `slowdown` times as long as alone."""

    processes: int = Field(ge=2)
    slowdown: float = Field(ge=1)


class TrainingFit(_Strict):
    """Achieved training throughput: forward and backward of one matmul per shape measured
    (`shapes` of them) on `tokens` rows, as model FLOPs (6 · elements · tokens) per second."""

    tokens: int = Field(ge=1)
    shapes: int = Field(ge=1)
    flops_per_second: float = Field(gt=0)


class Profile(_Strict):
    """A calibration profile file."""

    format: Literal["canzona-profile/1"]
    device: str
    device_name: str
    torch: str
    dtype: str
    threads: int = Field(ge=1)
    settings: ProfileSettings
    rows: list[ProfileRow] = Field(min_length=1)
    comm: CommFit | None = None
    contention: list[Contention] = []
    training: TrainingFit | None = None

    @model_validator(mode="after")
    def _has_adamw(self) -> Profile:
        if not any(row.optimizer == "adamw" for row in self.rows):
            raise ValueError("a profile needs at least one adamw row")
        return self

    def slowdown(self, processes: int) -> float:
        """Measured slowdown of `processes` concurrent ranks: linear between measured counts
        (1 process: 1), proportional to the count beyond the last one."""
        points = [(1, 1.0)] + sorted((c.processes, c.slowdown) for c in self.contention)
        if processes <= 1:
            return 1.0
        for (low, low_value), (high, high_value) in zip(points, points[1:]):
            if processes <= high:
                return low_value + (high_value - low_value) * (processes - low) / (high - low)
        last, value = points[-1]
        return value * processes / last

    def optimizers(self) -> list[str]:
        """Matrix optimizers the profile has rows for, in canonical order."""
        return [name for name in OPTIMIZERS if any(row.optimizer == name for row in self.rows)]


def _side_key(rows: int, cols: int) -> tuple[float, float]:
    return math.log(min(rows, cols)), math.log(max(rows, cols))


def _config(settings: ProfileSettings, name: str, method: str = STANDARD_NS) -> OptimizerConfig:
    """The settings a profile's rows of `name` (and Newton–Schulz `method`) were timed with."""
    return OptimizerConfig(
        name,
        settings.ns_steps,
        settings.block_size,
        settings.precondition_frequency,
        settings.max_precond_dim,
        ns_method=method,
        gram_restart=settings.gram_restart,
    )


@dataclass(frozen=True)
class ProfileCost:
    """`CostModel` in seconds from a profile, for one optimizer configuration."""

    profile: Profile
    optimizer: OptimizerConfig
    name: str = "profile"
    _cache: dict[tuple[int, int], float] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.optimizer.name not in self.profile.optimizers():
            have = ", ".join(self.profile.optimizers()) or "none"
            raise PlanError(f"profile has no {self.optimizer.name} rows (it has: {have})")

    def _rows(self, optimizer: str) -> list[ProfileRow]:
        return [row for row in self.profile.rows if row.optimizer == optimizer]

    def _matrix_rows(self, method: str | None = None) -> list[ProfileRow]:
        """The rows that time the kernel of Newton–Schulz `method` (default: the configured
        one) where the profile has them, else the standard ones (scaled by FLOPs like any
        unmeasured shape)."""
        rows = self._rows(self.optimizer.name)
        own = [row for row in rows if row.method == (method or self.optimizer.ns_method)]
        return own or [row for row in rows if row.method == STANDARD_NS]

    def _measured(self, row: ProfileRow) -> OptimizerConfig:
        return _config(self.profile.settings, row.optimizer, row.method)

    def _same_settings(self, row: ProfileRow) -> bool:
        # the precision is the profile's own (`Profile.dtype`), whatever the request names
        return replace(self._measured(row), ns_dtype=self.optimizer.ns_dtype) == self.optimizer

    def matrix_cost(self, rows: int, cols: int) -> float:
        """Seconds of one update of a full rows x cols matrix."""
        key = (min(rows, cols), max(rows, cols))
        if key not in self._cache:
            self._cache[key] = self._matrix_seconds(*key)
        return self._cache[key]

    def _matrix_seconds(self, rows: int, cols: int) -> float:
        # a shape that falls back from Gram runs (and is timed by) the standard kernel
        method = self.optimizer.ns_method if runs_gram(rows, cols, self.optimizer.ns_method) else STANDARD_NS
        candidates = self._matrix_rows(method)
        for row in candidates:
            if (min(row.rows, row.cols), max(row.rows, row.cols)) == (rows, cols) and self._same_settings(row):
                return row.seconds
        target = _side_key(rows, cols)
        nearest = min(candidates, key=lambda row: math.dist(_side_key(row.rows, row.cols), target))
        measured = matrix_flops(nearest.rows, nearest.cols, self._measured(nearest))
        wanted = matrix_flops(rows, cols, self.optimizer)
        return wanted * nearest.seconds / measured

    def adamw_cost(self, numel: int) -> float:
        """Seconds of an AdamW update of `numel` elements (0 for an empty slice)."""
        if numel <= 0:
            return 0.0
        nearest = min(self._rows("adamw"), key=lambda row: abs(math.log(row.rows * row.cols) - math.log(numel)))
        return numel * nearest.seconds / (nearest.rows * nearest.cols)

    def achieved_flops(self) -> float:
        """Median achieved FLOP/s over this optimizer's rows (flops model / measured seconds)."""
        rates = sorted(
            matrix_flops(row.rows, row.cols, self._measured(row)) / row.seconds for row in self._matrix_rows()
        )
        return _median(rates)

    def achieved_adamw_rate(self) -> float:
        """Median AdamW elements per second over the profile's adamw rows."""
        return _median(sorted(row.rows * row.cols / row.seconds for row in self._rows("adamw")))


def _median(values: list[float]) -> float:
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _not_a_profile(data: dict[object, object]) -> str:
    """Why a mapping is not a profile this canzona reads, in words."""
    if "schema_version" in data and "request" in data:
        return "this is a schedule, not a profile; give a file written by `canzona calibrate -o FILE`"
    if "format" not in data:
        return f"not a profile written by `canzona calibrate` (it has no `format: {PROFILE_FORMAT}` line)"
    return f"profile format {data['format']!r} is not supported (this canzona reads {PROFILE_FORMAT!r})"


def parse_profile(text: str, origin: str = "<text>") -> Profile:
    """Validate YAML text as a profile; PlanError with one line on any problem."""
    try:
        data = safe_load(text)
    except UnsafeDocument as error:
        raise PlanError(f"{origin}: {error}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: not a profile (expected a mapping)")
    if data.get("format") != PROFILE_FORMAT:
        raise PlanError(f"{origin}: {_not_a_profile(data)}")
    try:
        return Profile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "profile"
        raise PlanError(f"{origin}: invalid profile at {where}: {first['msg']}") from error


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile file."""
    try:
        text = read_text(path, MAX_MODEL_FILE_BYTES)
    except UnsafeDocument as error:
        raise PlanError(f"cannot read profile {str(path)!r}: {error}") from None
    return parse_profile(text, str(path))


def load_profile(path: str | os.PathLike[str], optimizer: OptimizerConfig | None = None) -> ProfileCost:
    """The cost model (seconds) of the profile at `path` for `optimizer` (default: the
    profile's first matrix optimizer with its recorded settings)."""
    profile = read_profile(path)
    if optimizer is None:
        names = profile.optimizers()
        if not names:
            raise PlanError(f"{path}: profile has no matrix-optimizer rows")
        optimizer = _config(profile.settings, names[0])
    return ProfileCost(profile, optimizer)


@functools.lru_cache(maxsize=16)
def profile_cost_model(name: str, optimizer: OptimizerConfig) -> ProfileCost:
    """`make_cost_model` hook: `name` is 'profile:PATH' (read once per process and settings:
    planning asks for the cost model several times)."""
    if not name.startswith(PROFILE_PREFIX) or not name[len(PROFILE_PREFIX) :]:
        raise PlanError(f"a profile cost model is written profile:PATH, got {name!r}")
    return load_profile(name[len(PROFILE_PREFIX) :], optimizer)


def dump_profile(profile: Profile) -> str:
    """YAML text of a profile (one row per line, stable key order)."""
    data = profile.model_dump(mode="json", exclude_none=True)
    rows = [{k: v for k, v in row.items() if (k, v) != ("method", STANDARD_NS)} for row in data.pop("rows")]
    head = yaml.safe_dump(data, sort_keys=False, width=1 << 16)
    lines = [head.rstrip("\n"), "rows:"] + [f"  - {json.dumps(row)}" for row in rows]
    return "\n".join(lines) + "\n"
