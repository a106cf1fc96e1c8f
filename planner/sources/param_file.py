"""Parameter-list files: any model the catalog does not know, described name by name.

A file is YAML or JSON holding either a mapping `{name: <model name>, params: [...]}` (plus
optional `tp`: the TP size the list was read from a live model at; planning at another TP size
is refused) or a bare list of entries. Each entry is `{name, shape, tp_dim}` plus optional
`optimizer` ("matrix" or "adamw"), `submatrices` (consecutive row blocks updated separately),
`fused: N` (each TP shard holds N equal row parts, e.g. 2 for fc1's [gate; up]; `split_fused:
true` updates the parts separately; `--split-fc1` sets it on every fused entry), `qkv:
{query_groups, heads, head_dim}` (a fused QKV weight whose rows are grouped per query group as
[q heads, k, v], Megatron's layout; TP shards hold whole groups; `--split-qkv` says how it is
updated: Q, K and V separately, per head, or whole), `expert` ([index, count]), `grouped_experts: true` (a 3-D
tensor [E, rows, cols] whose dim 0 indexes experts: planned as E matrices, `parent[e]`; its
`tp_dim` is 1 or 2, and `fused` / `submatrices` describe each expert's rows), `grad_reduce: tp`
(replicated over TP, but each TP rank's gradient is a partial sum the optimizer must sum), and
`dtype`. Entries are listed in registration order (the order of `named_parameters()`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from canzona.planner.spec import ADAMW, DTYPE_BYTES, MATRIX, ParamSpec, PlanError, fused_row_blocks
from canzona.schedules.limits import MAX_MODEL_FILE_BYTES, MAX_PARAM_DIMS, MAX_PARAMS
from canzona.schedules.reading import UnsafeDocument, read_text, safe_load
from canzona.schedules.splits import qkv_row_blocks
from canzona.schedules.splits import submatrices as splits_submatrices

_ADAMW_NAME_HINTS = ("embed", "output_layer", "lm_head", "norm")


class _QkvLayout(BaseModel):
    """A fused QKV weight's layout: `heads` attention heads of `head_dim` rows in
    `query_groups` groups, each group's rows [its q heads, k, v]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query_groups: Annotated[StrictInt, Field(ge=1)]
    heads: Annotated[StrictInt, Field(ge=1)]
    head_dim: Annotated[StrictInt, Field(ge=1)]

    def row_blocks(self, split_qkv: str) -> tuple[tuple[tuple[int, int], ...], ...]:
        """The row blocks `split_qkv` gives the weight (`canzona.schedules.splits.qkv_row_blocks`)."""
        return qkv_row_blocks(self.query_groups, self.heads // self.query_groups, self.head_dim, split_qkv)


class _Entry(BaseModel):
    """One parameter entry of a file, strictly typed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StrictStr
    shape: list[StrictInt]
    tp_dim: StrictInt | None
    optimizer: Literal["matrix", "adamw"] | None = None
    submatrices: list[tuple[StrictInt, StrictInt]] | None = None
    expert: tuple[StrictInt, StrictInt] | None = None
    fused: StrictInt | None = None
    split_fused: StrictBool = False
    grouped_experts: StrictBool = False
    grad_reduce: Literal["tp"] | None = None
    dtype: StrictStr = "bf16"
    qkv: _QkvLayout | None = None

    @model_validator(mode="after")
    def _check(self) -> _Entry:
        if not self.name:
            raise ValueError("name must not be empty")
        if not self.shape or min(self.shape) < 1 or len(self.shape) > MAX_PARAM_DIMS:
            raise ValueError(
                f"shape {self.shape[: MAX_PARAM_DIMS + 1]} must be a non-empty list of at most {MAX_PARAM_DIMS} "
                "positive sizes"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.tp_dim is not None and not 0 <= self.tp_dim < len(self.shape):
            raise ValueError(f"tp_dim {self.tp_dim} is out of range for shape {self.shape}")
        if self.grouped_experts:
            self._check_grouped()
        elif self.resolved_optimizer == MATRIX and len(self.shape) != 2:
            raise ValueError(f"the matrix optimizer needs a 2-D shape, got {self.shape}")
        if self.grad_reduce is not None and self.tp_dim is not None:
            raise ValueError("grad_reduce is for parameters replicated over TP (tp_dim null)")
        if self.submatrices is not None:
            self._check_submatrices()
        if self.fused is not None or self.split_fused:
            self._check_fused()
        if self.qkv is not None:
            self._check_qkv()
        if self.expert is not None and not 0 <= self.expert[0] < self.expert[1]:
            raise ValueError(f"expert [index, count] {list(self.expert)} needs 0 <= index < count")
        return self

    def _check_grouped(self) -> None:
        if len(self.shape) != 3 or self.optimizer == ADAMW or self.expert is not None:
            raise ValueError(
                f"grouped_experts needs a 3-D shape [experts, rows, cols] updated by the matrix optimizer, "
                f"without expert, got shape {self.shape}"
            )
        if self.tp_dim == 0:
            raise ValueError(
                "tp_dim 0 of grouped experts would split the experts: that is expert parallelism (--ep); "
                "TP splits dim 1 or 2"
            )

    @property
    def matrix_shape(self) -> list[int]:
        """The shape of the matrix (or matrices) the optimizer updates: one expert's for grouped experts."""
        return self.shape[1:] if self.grouped_experts else self.shape

    @property
    def row_dim(self) -> int:
        """The tensor dim holding the matrix rows (1 for grouped experts)."""
        return 1 if self.grouped_experts else 0

    def _check_fused(self) -> None:
        if self.fused is None or self.fused < 2:
            raise ValueError("fused (the number of equal row parts each TP shard holds) must be >= 2")
        if self.resolved_optimizer != MATRIX or self.tp_dim not in (self.row_dim, None) or self.submatrices is not None:
            raise ValueError(
                "fused needs a matrix-optimizer parameter split on dim 0 (dim 1 for grouped experts) or "
                "replicated, without submatrices"
            )
        if self.matrix_shape[0] % self.fused:
            raise ValueError(f"fused {self.fused} does not divide the {self.matrix_shape[0]} rows")

    def _check_qkv(self) -> None:
        layout = self.qkv
        assert layout is not None
        if self.resolved_optimizer != MATRIX or self.grouped_experts or self.tp_dim not in (0, None):
            raise ValueError("qkv needs a 2-D matrix-optimizer parameter split on dim 0 or replicated")
        if self.fused is not None or self.submatrices is not None:
            raise ValueError("qkv describes the weight's rows itself: give it without fused or submatrices")
        if layout.heads % layout.query_groups:
            raise ValueError(f"qkv: {layout.query_groups} query groups do not divide {layout.heads} heads")
        rows = (layout.heads + 2 * layout.query_groups) * layout.head_dim
        if self.shape[0] != rows:
            raise ValueError(
                f"qkv: (heads {layout.heads} + 2 x query_groups {layout.query_groups}) x head_dim "
                f"{layout.head_dim} = {rows} rows, but the shape has {self.shape[0]}"
            )

    def _check_submatrices(self) -> None:
        if self.resolved_optimizer != MATRIX:
            raise ValueError("submatrices are only allowed for matrix-optimizer parameters")
        if not self.submatrices or min(min(s) for s in self.submatrices) < 1:
            raise ValueError("submatrices must be a non-empty list of positive [rows, cols]")
        rows_, cols_ = self.matrix_shape
        if any(cols != cols_ for _, cols in self.submatrices) or sum(rows for rows, _ in self.submatrices) != rows_:
            raise ValueError(
                f"submatrices must be consecutive row blocks of the {self.matrix_shape} matrix "
                "(same column count, rows adding up)"
            )

    @property
    def resolved_optimizer(self) -> str:
        """The explicit optimizer, or the default for this name and shape."""
        if self.optimizer is not None:
            return self.optimizer
        lowered = self.name.lower()
        if self.grouped_experts:
            return MATRIX
        if len(self.shape) != 2 or any(hint in lowered for hint in _ADAMW_NAME_HINTS):
            return ADAMW
        return MATRIX

    def to_specs(self, tp: int = 1, split_qkv: str = "qkv", split_fc1: bool = False) -> list[ParamSpec]:
        """The `ParamSpec`s this entry describes at TP size `tp` (fused row blocks depend on it),
        with a fused QKV weight split as `split_qkv` says and every fused entry split into its
        parts under `split_fc1`: one, or one per expert for grouped experts."""
        shape = tuple(self.matrix_shape)
        tp_dim = self.tp_dim if self.tp_dim is None or not self.grouped_experts else self.tp_dim - 1
        optimizer = self.resolved_optimizer
        submatrices: tuple[tuple[int, int], ...] = ()
        row_blocks: list[tuple[tuple[int, int], ...]] = []
        if optimizer == MATRIX:
            submatrices = tuple(self.submatrices or [shape])  # type: ignore[list-item]
        if self.fused is not None:
            shards = tp if tp_dim == 0 else 1
            if shape[0] % (self.fused * shards):
                raise ValueError(f"tp {tp} x fused {self.fused} does not divide the {shape[0]} rows")
            split = self.split_fused or split_fc1
            row_blocks = list(fused_row_blocks(shape[0], self.fused, shards, split))
            part = (shape[0] // self.fused, shape[1])
            submatrices = (part,) * self.fused if split else (shape,)  # type: ignore[assignment]
        elif self.qkv is not None:
            if tp_dim == 0 and self.qkv.query_groups % tp:
                raise ValueError(
                    f"tp {tp} does not divide its {self.qkv.query_groups} query groups (each TP rank "
                    "holds whole groups)"
                )
            row_blocks = list(self.qkv.row_blocks(split_qkv))
            submatrices = tuple(splits_submatrices(shape, tuple(row_blocks)))
        elif len(submatrices) > 1:
            start = 0
            for rows, _ in submatrices:
                row_blocks.append(((start, start + rows),))
                start += rows
        spec = ParamSpec(
            self.name,
            shape,
            tp_dim,
            optimizer,
            submatrices,
            self.dtype,
            expert_index=self.expert[0] if self.expert else None,
            num_experts=self.expert[1] if self.expert else 0,
            row_blocks=tuple(row_blocks),
            grad_reduce=self.grad_reduce,
        )
        if not self.grouped_experts:
            return [spec]
        count = self.shape[0]
        return [
            replace(spec, name=f"{self.name}[{e}]", parent=self.name, expert_index=e, num_experts=count)
            for e in range(count)
        ]


class _Document(BaseModel):
    """The mapping form of a file: a model name and its entries."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    tp: Annotated[StrictInt, Field(ge=1)] | None = None
    params: list[Any]


def read_structured_file(path: str | Path) -> tuple[Any, str]:
    """Parse a JSON (.json) or YAML (.yaml/.yml) file; return its data and its sha256 hex.

    Raises a one-line PlanError when the file cannot be read or parsed.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise PlanError(f"model file {str(path)!r} must end in .json, .yaml or .yml")
    try:
        text = read_text(path, MAX_MODEL_FILE_BYTES)
    except UnsafeDocument as err:
        raise PlanError(f"cannot read model file {str(path)!r}: {err}") from None
    try:
        data = json.loads(text) if suffix == ".json" else safe_load(text)
    except UnsafeDocument as err:
        raise PlanError(f"cannot parse {str(path)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"cannot parse {str(path)!r}: {err.msg} at line {err.lineno} column {err.colno}") from err
    except RecursionError:
        raise PlanError(f"cannot parse {str(path)!r}: nested too deeply") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise PlanError(f"cannot parse {str(path)!r}: {str(err).split(';')[0]}") from None
    return data, hashlib.sha256(text.encode("utf-8")).hexdigest()


def params_from_data(
    data: Any, default_name: str, tp: int = 1, split_qkv: str = "qkv", split_fc1: bool = False
) -> tuple[str, tuple[ParamSpec, ...]]:
    """The model name and parameters of a parsed parameter-list file, at TP size `tp`, fused
    QKV weights split as `split_qkv` says and fused entries into their parts under `split_fc1`.

    `default_name` names a bare list. Raises PlanError naming the entry index and field of
    the first bad entry.
    """
    if isinstance(data, dict):
        try:
            document = _Document.model_validate(data)
        except ValidationError as err:
            raise PlanError(f"parameter file: {_first_error(err)}") from None
        name, entries = document.name, document.params
        if document.tp is not None and document.tp != tp:
            raise PlanError(
                f"parameter file for {name!r} was read from a model at TP {document.tp} (its 'tp' key); "
                f"plan it with --tp {document.tp}, not {tp}"
            )
    elif isinstance(data, list):
        name, entries = default_name, data
    else:
        raise PlanError(
            "parameter file must hold a list of parameters or a mapping with 'name' and "
            f"'params', got {type(data).__name__}"
        )
    if not entries:
        raise PlanError(f"parameter file for {name!r} lists no parameters")
    if len(entries) > MAX_PARAMS:
        raise PlanError(
            f"parameter file for {name!r} lists {len(entries)} parameters, above canzona's maximum of {MAX_PARAMS}"
        )
    specs = tuple(
        spec for index, raw in enumerate(entries) for spec in _parse_entry(index, raw, tp, split_qkv, split_fc1)
    )
    if len(specs) > MAX_PARAMS:
        raise PlanError(
            f"parameter file for {name!r} lists {len(specs)} matrices and parameters (grouped experts counted "
            f"one per expert), above canzona's maximum of {MAX_PARAMS}"
        )
    return name, specs


def _parse_entry(index: int, raw: Any, tp: int, split_qkv: str, split_fc1: bool) -> list[ParamSpec]:
    label = f" ({raw['name']!r})" if isinstance(raw, dict) and "name" in raw else ""
    try:
        entry = _Entry.model_validate(raw)
        if entry.grouped_experts and entry.shape[0] > MAX_PARAMS:
            raise ValueError(f"{entry.shape[0]} experts is above canzona's maximum of {MAX_PARAMS} parameters")
        return entry.to_specs(tp, split_qkv, split_fc1)
    except ValidationError as err:
        raise PlanError(f"parameter entry {index}{label}: {_first_error(err)}") from None
    except ValueError as err:  # to_spec's checks that depend on tp
        raise PlanError(f"parameter entry {index}{label}: {err}") from None


def _first_error(err: ValidationError) -> str:
    """The first pydantic error as 'field F: message', on one line."""
    first = err.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    message = " ".join(str(first["msg"]).split()).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "missing":
        message = "missing required key"
    elif first["type"] == "model_type":
        message = "must be a mapping with keys name, shape, tp_dim"
    return f"field {field!r}: {message}" if field else message
