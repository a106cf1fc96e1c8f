"""One entry point from a model reference to a validated `ModelSpec`.

A reference is a preset name (case-insensitive), a Hugging Face `config.json` (or a directory
holding one), or a parameter-list file (.yaml/.yml/.json).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from canzona.planner.sources.catalog import PRESETS, Architecture, check_tp_size, count_params, enumerate_params
from canzona.planner.sources.hf_config import architecture_from_hf
from canzona.planner.sources.param_file import params_from_data, read_structured_file
from canzona.planner.spec import ModelOptions, ModelSpec, ParamSpec, PlanError, validate_model

__all__ = ["count_params", "list_presets", "load_model"]

_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def load_model(source: str, tp: int, options: ModelOptions = ModelOptions()) -> ModelSpec:
    """The validated `ModelSpec` of `source` at TP size `tp`.

    `source` is a preset name, a path to a Hugging Face `config.json` (recognised by its
    "architectures" or "model_type" key) or to a directory holding one, or a path to a
    parameter-list file. Files record their path and sha256. Raises a one-line PlanError.
    """
    check_tp_size(source, tp)
    preset = source.strip().lower()
    if preset in PRESETS:
        params = enumerate_params(preset, PRESETS[preset], tp, options)
        model = ModelSpec(name=preset, params=params, source=preset)
    elif _looks_like_path(source):
        model = _load_file(source, tp, options)
    else:
        raise PlanError(_unknown_model_message(source))
    validate_model(model, tp)
    return model


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
    if _is_hf_config(data):
        name = default_name
        params = enumerate_params(name, architecture_from_hf(data), tp, options)
    else:
        name, params = params_from_data(data, default_name, tp)
    return ModelSpec(name=name, params=params, source=source, source_sha256=sha256)


def _is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and ("architectures" in data or "model_type" in data)
