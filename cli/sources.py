"""Where the CLI's models come from: the planner's sources (presets, Hugging Face configs,
parameter lists) and live models, `py:MODULE:FACTORY`, which the runtime's `describe` module
builds on the meta device and describes. Only live models import torch, and only here."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from importlib.machinery import PathFinder
from pathlib import Path
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
    module = live_module(source)
    return [module] if module.endswith(".py") else []


def live_module(source: str) -> str:
    """The MODULE part of `py:MODULE:FACTORY` (a dotted name or a `.py` path)."""
    return source.removeprefix(PY_PREFIX).rpartition(":")[0]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(root)) for root in roots)


def require_code_inside(source: str, roots: Sequence[Path]) -> None:
    """Refuse (PlanError, one line) to run the live model `source` unless its module's file lies
    inside one of `roots` (symlinks resolved). A `.py` path is taken as `describe` loads it
    (relative to the working directory); a dotted module must be a package or file below the
    working directory, which is what `describe` imports it from, and must not be a module that
    is already loaded from elsewhere (such as `os`)."""
    module = live_module(source)
    cwd = Path.cwd()
    if module.endswith(".py"):
        found = Path(module) if Path(module).is_file() else None
    else:
        parts = module.split(".")
        loaded = sys.modules.get(parts[0])
        origin = getattr(loaded, "__file__", None)
        if loaded is not None and (origin is None or not _inside(Path(origin), [cwd])):
            found = None  # a built-in or already-imported module would be what actually runs
        else:
            stem = cwd.joinpath(*parts) if all(part.isidentifier() for part in parts) else None
            found = (
                next((c for c in (stem.with_suffix(".py"), stem / "__init__.py") if c.is_file()), None)
                if stem
                else None
            )
    if found is None or not _inside(found, roots if module.endswith(".py") else [cwd]):
        where = " or ".join(repr(str(root)) for root in dict.fromkeys(roots if module.endswith(".py") else [cwd]))
        raise PlanError(
            f"live model module {module!r} is not a file inside {where}: --allow-code runs only code of "
            "the checked folder or the current project"
        )


def check_live_source(source: str) -> None:
    """Refuse (PlanError, one line, in `describe`'s words), before torch is imported, which takes
    seconds, a live model that cannot load: not `py:MODULE:FACTORY`, a `.py` file that does not
    exist, or a module whose top-level package cannot be found (nothing is imported to tell)."""
    module, _, factory = source.removeprefix(PY_PREFIX).rpartition(":")
    if not is_live(source) or not module or not factory:
        raise PlanError(
            "a live model is py:MODULE:FACTORY (e.g. py:mypkg.models:make_model or "
            f"py:models.py:make_model), got {source!r}"
        )
    if module.endswith(".py"):
        if not Path(module).is_file():
            raise PlanError(f"no such model file {module!r}")
        return
    top = module.split(".")[0]
    found = top in sys.modules or PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None
    if not found and importlib.util.find_spec(top) is None:
        raise PlanError(f"cannot import {module!r}: No module named {top!r}")


def describe_source(source: str, sequence_parallel: bool = False) -> ModuleDescription:
    """The description of the live model `source` (PlanError on any problem, one line)."""
    check_live_source(source)
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
    with its factory as source and its description's sha256; its fused matrices are split as
    `options` says (`split_qkv`, `split_fc1`)."""
    if not is_live(source):
        return planner_sources.load_model(source, tp, options)
    description = describe_source(source, options.sequence_parallel)
    if tp > 1 and description.tp is None:
        raise PlanError(
            f"live model {source!r} shows no TP layout, so at --tp {tp} its parameters would be planned as whole "
            "matrices: build it as it trains, with DTensor parameters on a mesh dim named 'tp' (parallelize_module) or "
            "Megatron-core's tensor-parallel layers at that TP size (a fake process group gives either without a "
            "cluster: docs/models.md), or plan its config.json / a parameter list"
        )
    data = description.to_data()
    # The description already marked the norms (it sees the modules); the names rule is not rerun.
    return planner_sources.model_from_data(
        data, description.name, source, description.sha256, tp, replace(options, sequence_parallel=False)
    )
