"""Where the CLI's models come from: the planner's sources (presets, Hugging Face configs,
parameter lists) and live models, `py:MODULE:FACTORY`, which the runtime's `describe` module
builds on the meta device and describes. Only live models import torch, and only here."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from canzona.planner.sources import load as planner_sources
from canzona.planner.spec import ModelOptions, ModelSpec, PlanError

if TYPE_CHECKING:
    from canzona.runtime.tools.describe import ModuleDescription

PY_PREFIX = "py:"


def is_live(source: str) -> bool:
    """Whether `source` names a model factory (`py:MODULE:FACTORY`)."""
    return source.startswith(PY_PREFIX)


def source_files(source: str) -> list[str]:
    """The files a model source reads (for output-path checks): the source itself, or a live
    model's `.py` file."""
    if not is_live(source):
        return [source]
    module = source.removeprefix(PY_PREFIX).rpartition(":")[0]
    return [module] if module.endswith(".py") else []


def describe_source(source: str, sequence_parallel: bool = False) -> ModuleDescription:
    """The description of the live model `source` (PlanError on any problem, one line)."""
    try:
        from canzona.runtime.tools.describe import DescribeError, describe_factory
    except ImportError as error:
        raise PlanError(f"describing a live model needs torch ({error}); install canzona[runtime]") from None
    try:
        return describe_factory(source, sequence_parallel=sequence_parallel)
    except DescribeError as error:
        raise PlanError(str(error)) from error


def load_source(source: str, tp: int, options: ModelOptions) -> ModelSpec:
    """The validated `ModelSpec` of any model source at TP size `tp`. A live model is recorded
    with its factory as source and its description's sha256; `options.split_fc1` splits the
    row parts of its strided (fused) matrices."""
    if not is_live(source):
        return planner_sources.load_model(source, tp, options)
    description = describe_source(source, options.sequence_parallel)
    data = description.to_data()
    if options.split_fc1:
        for entry in data["params"]:
            if "fused" in entry:
                entry["split_fused"] = True
    # The description already marked the norms (it sees the modules); the names rule is not rerun.
    return planner_sources.model_from_data(data, description.name, source, description.sha256, tp, replace(options, sequence_parallel=False))
