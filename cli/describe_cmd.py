"""`canzona describe`: a live model's parameter list, to review, check in and plan from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from canzona.cli.options import Dtype
from canzona.cli.wording import echo
from canzona.planner.spec import PlanError
from canzona.schedules.files import check_output, write_atomic


def describe(
    model: Annotated[str, typer.Option(help="A live model: py:MODULE:FACTORY (built on the meta device, no memory).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Parameter-list YAML to write (default: stdout).")
    ] = None,
    sequence_parallel: Annotated[
        bool, typer.Option("--sequence-parallel", help="Mark every norm's gradient as a partial sum over TP.")
    ] = False,
    dtype: Annotated[
        Dtype | None,
        typer.Option(
            help="Dtype of every parameter, where the model trains in another dtype than the factory builds it in.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Describe a live model as a parameter list: names, global shapes, dtypes, TP dims from
    DTensor placements, grouped 3-D experts, partial gradients."""
    from canzona.cli.sources import describe_source, is_live, source_files

    if not is_live(model):
        raise PlanError(
            f"describe reads a live model: give --model py:MODULE:FACTORY, not {model!r} (presets, "
            "configs and parameter lists plan as they are)"
        )
    if output is not None:
        check_output(output, source_files(model), "--output")
    description = describe_source(model, sequence_parallel)
    if dtype is not None:
        description = description.with_dtype(dtype.value)
    text = description.to_yaml()
    if output is None:
        echo(text, nl=False)
        return
    write_atomic(output, text)
    grouped = sum(p.grouped_experts for p in description.params)
    matrices = sum(p.optimizer == "matrix" for p in description.params)
    tp = f", TP {description.tp}" if description.tp is not None else ""
    echo(
        f"wrote {output}: {len(description.params)} parameters of {description.name} ({matrices} matrices, "
        f"{grouped} grouped expert tensors{tp})"
    )
