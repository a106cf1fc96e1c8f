"""One entry point from a model reference to a validated `ModelSpec`.

A reference is a preset name (case-insensitive), a Hugging Face `config.json` (or a directory
holding one), or a parameter-list file (.yaml/.yml/.json). (A live model, `py:MODULE:FACTORY`,
is described by the runtime's `describe` module into a parameter list; the CLI does that.)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.catalog import PRESETS, check_tp_size, count_params, enumerate_params
from canzona.planner.sources.conventions import HF, MEGATRON, mark_partial_norms
from canzona.planner.sources.hf_config import architecture_from_hf
from canzona.planner.sources.param_file import params_from_data, read_structured_file
from canzona.planner.spec import (
    DEFAULT_MODEL_OPTIONS,
    DTYPE_BYTES,
    ModelOptions,
    ModelSpec,
    ParamSpec,
    PlanError,
    validate_model,
)

__all__ = [
    "NAMES_AUTO",
    "count_params",
    "list_presets",
    "load_model",
    "model_from_data",
    "names_apply",
    "own_names",
    "undeclared_dtype",
]

_FILE_SUFFIXES = (".json", ".yaml", ".yml")
DEFAULT_DTYPE = "bf16"  # presets, and configs that declare no dtype, train in bf16
HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NAMES_AUTO = "auto"
"""`ModelOptions.names` that picks the source's own convention: transformers' names for a
Hugging Face config.json, Megatron-core's for a preset."""


def load_model(source: str, tp: int, options: ModelOptions = DEFAULT_MODEL_OPTIONS) -> ModelSpec:
    """The validated `ModelSpec` of `source` at TP size `tp`.

    `source` is a preset name, a path to a Hugging Face `config.json` (recognised by its
    "architectures" or "model_type" key) or to a directory holding one, or a path to a
    parameter-list file. Files record their path and sha256. Presets and configs expand under
    `options.names` (`NAMES_AUTO`: hf for a config, megatron for a preset); `ModelSpec.names`
    says which. `options.sequence_parallel` marks every norm's gradient as partial over TP.
    Raises a one-line PlanError.
    """
    check_tp_size(source, tp)

    def build(chosen: ModelOptions) -> ModelSpec:
        preset = source.strip().lower()
        if preset in PRESETS:
            names = MEGATRON if chosen.names == NAMES_AUTO else chosen.names
            params = enumerate_params(preset, PRESETS[preset], tp, replace(chosen, names=names))
            return finish(ModelSpec(name=preset, params=params, source=preset, names=names), tp, chosen)
        if _looks_like_path(source):
            return finish(_load_file(source, tp, chosen), tp, chosen)
        raise PlanError(_unknown_model_message(source))

    return built_with_effect(build, options)


SPLIT_OPTIONS = {  # ModelOptions field -> what a model must have for it to change anything
    "split_qkv": "a fused QKV weight (a parameter list marks one with qkv:) or Q, K, V projections to split",
    "split_fc1": "a fused matrix to split into its parts (fc1's [gate; up], a parameter list's fused: N)",
    "router_optimizer": (
        "an MoE router of a preset or Hugging Face config (a parameter list gives each entry's optimizer)"
    ),
}


def built_with_effect(build: Callable[[ModelOptions], ModelSpec], options: ModelOptions) -> ModelSpec:
    """`build(options)`, after checking that each split option away from its default changes
    the model it builds: a schedule never records an option that its plan did not apply
    (PlanError, one line, naming what the option needs)."""
    model = build(options)
    default = ModelOptions()
    for field, needs in SPLIT_OPTIONS.items():
        value = getattr(options, field)
        if (
            value != getattr(default, field)
            and build(replace(options, **{field: getattr(default, field)})).params == model.params
        ):
            spelled = str(value).lower() if isinstance(value, bool) else value
            raise PlanError(f"{field} {spelled} has no effect on {model.name}: it needs {needs}")
    return model


def names_apply(source: str) -> bool:
    """Whether `--names` chooses `source`'s parameter names: a preset or a Hugging Face config
    (a parameter list and a live model name their parameters themselves; a file is read)."""
    if source.strip().lower() in PRESETS:
        return True
    if source.startswith("py:") or not _looks_like_path(source):
        return False
    path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    data, _ = read_structured_file(path)
    return _is_hf_config(data)


def undeclared_dtype(source: str) -> bool:
    """Whether `source` is a Hugging Face config that declares no dtype (planned in the default,
    `DEFAULT_DTYPE`, though transformers builds such a model in fp32)."""
    if source.startswith("py:") or source.strip().lower() in PRESETS or not _looks_like_path(source):
        return False
    path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    data, _ = read_structured_file(path)
    return _is_hf_config(data) and data.get("dtype", data.get("torch_dtype")) in (None, "auto")


def own_names(source: str) -> str:
    """The naming convention `NAMES_AUTO` resolves to for `source`: hf for a Hugging Face
    config, megatron for a preset or a parameter list (a file source is read)."""
    if source.strip().lower() in PRESETS or not _looks_like_path(source):
        return MEGATRON
    path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    data, _ = read_structured_file(path)
    return HF if _is_hf_config(data) else MEGATRON


def model_from_data(data: object, name: str, source: str, sha256: str, tp: int, options: ModelOptions) -> ModelSpec:
    """The validated `ModelSpec` of a parsed parameter list (e.g. a live model's description),
    its fused matrices split as `options` says."""
    _check_parameter_list_names(options)

    def build(chosen: ModelOptions) -> ModelSpec:
        listed, params = params_from_data(data, name, tp, chosen.split_qkv, chosen.split_fc1)
        return finish(ModelSpec(name=listed, params=params, source=source, source_sha256=sha256), tp, chosen)

    return built_with_effect(build, options)


def finish(model: ModelSpec, tp: int, options: ModelOptions) -> ModelSpec:
    """`model` with sequence-parallel norms marked (if asked) and every parameter in
    `options.dtype` (if given), validated at TP size `tp`."""
    if options.sequence_parallel:
        model = replace(model, params=tuple(mark_partial_norms(list(model.params))))
    if options.dtype is not None:
        model = with_dtype(model, options.dtype)
    validate_model(model, tp)
    return model


def with_dtype(model: ModelSpec, dtype: str) -> ModelSpec:
    """`model` with every parameter in `dtype` (PlanError for a dtype canzona does not plan)."""
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return replace(model, params=tuple(replace(p, dtype=dtype) for p in model.params))


def config_dtype(config: dict[str, Any]) -> str:
    """The dtype a Hugging Face config declares (`dtype`, or the older `torch_dtype`) as a
    schedule dtype; bf16 when it declares none (or "auto")."""
    declared = config.get("dtype", config.get("torch_dtype"))
    if declared is None or declared == "auto":
        return DEFAULT_DTYPE
    name = str(declared).removeprefix("torch.")
    if name not in HF_DTYPES:
        raise PlanError(
            f"config.json: dtype {str(declared)[:40]!r} is not one canzona plans ({', '.join(HF_DTYPES)}); "
            "give --dtype bf16, fp16 or fp32"
        )
    return HF_DTYPES[name]


def _check_parameter_list_names(options: ModelOptions) -> None:
    if options.names not in (NAMES_AUTO, MEGATRON):
        raise PlanError(
            f"--names {options.names} applies to presets and Hugging Face configs; a parameter list "
            "(or a live model) names its parameters itself"
        )


def list_presets() -> list[tuple[str, Architecture]]:
    """Every preset as (name, architecture), sorted by name."""
    return sorted(PRESETS.items(), key=lambda item: item[0])


def _looks_like_path(source: str) -> bool:
    path = Path(source)
    return path.exists() or path.suffix.lower() in _FILE_SUFFIXES or len(path.parts) > 1


def _unknown_model_message(source: str) -> str:
    names = sorted(PRESETS)
    close = difflib.get_close_matches(source.strip().lower(), names, n=3)
    if close:
        return f"unknown model {source!r}; did you mean: {', '.join(close)}?"
    return (
        f"unknown model {source!r}; not a file either; presets: {', '.join(names)} "
        "(or give a config.json / parameter-list file)"
    )


def _load_file(source: str, tp: int, options: ModelOptions) -> ModelSpec:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    data, sha256 = read_structured_file(path)
    # A Hugging Face config is named after its model directory.
    default_name = path.resolve().parent.name if path.name == "config.json" else path.stem
    params: tuple[ParamSpec, ...]
    names = MEGATRON
    if _is_hf_config(data):
        name = default_name
        names = HF if options.names == NAMES_AUTO else options.names
        params = enumerate_params(name, architecture_from_hf(data), tp, replace(options, names=names))
        dtype = options.dtype or config_dtype(data)
        params = tuple(replace(p, dtype=dtype) for p in params)
    else:
        _check_parameter_list_names(options)
        name, params = params_from_data(data, default_name, tp, options.split_qkv, options.split_fc1)
    return ModelSpec(name=name, params=params, source=source, source_sha256=sha256, names=names)


def _is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and ("architectures" in data or "model_type" in data)
