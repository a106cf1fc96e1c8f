"""`canzona render`: a picture of a plan (matplotlib, an optional extra)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated, Any

import typer

from canzona.schedules.files import check_output, write_atomic
from canzona.schedules.format import Schedule, ScheduleError, read_schedule

MISSING = "canzona render needs matplotlib: pip install 'canzona[render]'"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ScheduleError(MISSING) from error
    return plt


FLOOR = 1e-2  # an idle rank drawn on the log axis


def _strategy_panel(ax: Any, schedule: Schedule) -> None:
    from matplotlib.ticker import MaxNLocator

    dp = schedule.metrics.dp
    bound = dp.lower_bound or 1.0
    ranks = list(range(len(dp.load)))
    styles = {"dp-sc": ":", "zero1-gather": "-.", "start-owner": "-", "layer-wise": "--"}
    for name, score in dp.baselines.items():
        ratios = [max(load / bound, FLOOR) for load in score.load]
        ax.plot(ranks, ratios, styles.get(name, "-"), marker=".", lw=1.5, label=f"{name} (max {score.max / bound:.2f})")
    ratios = [max(load / bound, FLOOR) for load in dp.load]
    ax.plot(ranks, ratios, "o-", color="black", lw=2.5, ms=4, label=f"canzona (max {dp.max / bound:.3f})", zorder=5)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        title=f"matrix-optimizer load per DP rank / lower bound (idle ranks drawn at {FLOOR:g})",
        xlabel="DP rank", ylabel="load / lower bound",
    )
    ax.legend(fontsize=8, ncol=3, loc="best")


def _device_panel(ax: Any, schedule: Schedule) -> None:
    devices = schedule.metrics.device
    mean = sum(d.load for d in devices) / len(devices)
    colours = [f"C{d.tp_rank % 10}" for d in devices]
    from matplotlib.ticker import MaxNLocator

    ax.bar([d.rank for d in devices], [d.load / mean for d in devices], color=colours, width=0.9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set(title=f"canzona compute per device (1 = mean; colour = TP rank of {schedule.request.tp})",
           xlabel="device (dp_rank * tp + tp_rank)", ylabel="load / mean")


def _timeline_panel(ax: Any, schedule: Schedule) -> None:
    ranks = schedule.tp.ranks
    busiest = max(ranks, key=lambda r: (sum(g.makespan for g in r.groups), -r.dp_rank))
    start = 0.0
    for group in busiest.groups:
        for host, load in enumerate(group.host_loads):
            if load:
                ax.barh(host, load, left=start, color=f"C{group.index % 10}", edgecolor="white", lw=0.3)
        start += group.makespan
        ax.axvline(start, color="grey", lw=0.4)
    ax.set_yticks(range(schedule.request.tp))
    ax.set(title=f"micro-group timeline of the busiest DP rank ({busiest.dp_rank}): "
                 f"{len(busiest.groups)} groups, bars = host work, lines = group ends",
           xlabel="cost units", ylabel="TP host")


def render(
    file: Annotated[Path, typer.Argument(help="Schedule file.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Image to write (.png, .svg, .pdf).")] = Path("plan.png"),
) -> None:
    """Draw per-rank loads of canzona and every baseline, per-device load, and the busiest
    DP rank's micro-group timeline."""
    output = output if output.suffix else output.with_suffix(".png")  # what matplotlib would write
    check_output(output, [file], "--output")
    schedule = read_schedule(file)
    plt = _pyplot()
    figure, axes = plt.subplots(3, 1, figsize=(11, 12), constrained_layout=True)
    req = schedule.request
    figure.suptitle(f"{req.model.name}  tp {req.tp} x dp {req.dp}  {req.optimizer.name}  alpha {req.alpha:g}")
    _strategy_panel(axes[0], schedule)
    _device_panel(axes[1], schedule)
    _timeline_panel(axes[2], schedule)
    image = io.BytesIO()
    try:
        figure.savefig(image, format=output.suffix[1:].lower(), dpi=110)
    except ValueError as error:  # an image format matplotlib does not know
        raise ScheduleError(f"cannot write {str(output)!r}: {error}") from None
    finally:
        plt.close(figure)
    write_atomic(output, image.getvalue())
    typer.echo(f"wrote {output}")
