"""`canzona render`: a picture of a plan (matplotlib, an optional extra).

Three panels: each DP rank's matrix-optimizer load for canzona and every baseline; canzona's
compute per device, coloured by TP rank; and the micro-group pipeline of the DP rank that
finishes last, simulated on a hardware model (`--device`), in time.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from canzona.cli.options import DEVICE_HELP, SCHEDULE_HELP, device_option, output_path, schedule_path, write_output
from canzona.cli.wording import echo, plural, table_unit
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import check_output, write_target

if TYPE_CHECKING:  # loaded by the command itself: `canzona -h` stays fast
    from canzona.schedules.format import Schedule

MISSING = "canzona render needs matplotlib: pip install 'canzona[render]'"
FLOOR = 1e-2  # an idle rank drawn on the log axis
MARKED_RANKS = 64  # up to this many DP ranks, every point gets a marker
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8, "borderaxespad": 0.0}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ScheduleError(MISSING) from error
    return plt


def _image_format(path: Path) -> str:
    """The image format the file name asks for; ScheduleError before any work for one
    matplotlib cannot write."""
    from matplotlib.backend_bases import FigureCanvasBase

    kind = path.suffix[1:].lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if kind not in known:
        raise ScheduleError(
            f"cannot write {str(path)!r}: .{kind} is not an image format; use .png, .svg or .pdf "
            f"(or {', '.join(sorted(set(known) - {'png', 'svg', 'pdf'}))})"
        )
    return kind


def _strategy_panel(ax: Any, schedule: Schedule) -> None:
    from matplotlib.ticker import MaxNLocator

    dp = schedule.metrics.dp
    bound = dp.lower_bound or 1.0
    ranks = list(range(len(dp.load)))
    marker = "." if len(ranks) <= MARKED_RANKS else None
    # canzona is a wide pale band under the baselines, so a baseline as balanced as it (often
    # layer-wise) stays visible on top instead of hiding beneath it.
    ratios = [max(load / bound, FLOOR) for load in dp.load]
    ax.plot(
        ranks,
        ratios,
        "-",
        color="black",
        lw=8,
        alpha=0.25,
        solid_capstyle="butt",
        zorder=1,
        label=f"canzona (max {dp.max / bound:.3f})",
    )
    styles = {"dp-sc": ":", "zero1-gather": "-.", "start-owner": "-", "layer-wise": "--"}
    for name, score in dp.baselines.items():
        loads = [max(load / bound, FLOOR) for load in score.load]
        ax.plot(
            ranks,
            loads,
            styles.get(name, "-"),
            marker=marker,
            lw=1.5,
            zorder=3,
            label=f"{name} (max {score.max / bound:.2f})",
        )
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        title=f"matrix-optimizer load per DP rank / lower bound (idle ranks drawn at {FLOOR:g})",
        xlabel="DP rank",
        ylabel="load / lower bound",
    )
    ax.legend(title="strategy (max / bound)", **LEGEND_OUTSIDE)


def _tp_colours(tp: int) -> list[Any]:
    """One colour per TP rank: the default cycle up to 10 ranks, a colour map beyond."""
    from matplotlib import colormaps

    if tp <= 10:
        return [f"C{rank}" for rank in range(tp)]
    cmap = colormaps["tab20" if tp <= 20 else "viridis"]
    return [cmap(rank / max(tp - 1, 1)) if tp > 20 else cmap(rank) for rank in range(tp)]


def _device_panel(ax: Any, schedule: Schedule) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    devices, tp = schedule.metrics.device, schedule.request.tp
    mean = sum(d.load for d in devices) / len(devices)
    colours = _tp_colours(tp)
    ax.bar(
        [d.rank for d in devices],
        [d.load / mean if mean else 0.0 for d in devices],
        color=[colours[d.tp_rank] for d in devices],
        width=0.9,
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set(
        title="canzona compute per device (1 = mean)", xlabel="device (dp_rank * tp + tp_rank)", ylabel="load / mean"
    )
    shown = range(tp) if tp <= 16 else sorted({0, tp // 4, tp // 2, 3 * tp // 4, tp - 1})
    ax.legend(
        handles=[Patch(color=colours[rank], label=f"TP rank {rank}") for rank in shown],
        title=f"colour: TP rank of {tp}" + ("" if tp <= 16 else " (some shown)"),
        **LEGEND_OUTSIDE,
    )


def busiest_pipeline(schedule: Schedule, device: str) -> tuple[int, list[Any], list[list[float]], float, str]:
    """The DP rank whose micro-group pipeline ends last on `device`: its rank, its events
    (`pipeline_events`), each group's per-host compute seconds, the pipeline's length and the
    hardware model's name."""
    from canzona.cli.simulate_cmd import optimizer_config, schedule_device
    from canzona.planner.predict.step import build_instance, micro_group_times, pipeline_events

    chosen = schedule_device(schedule, device)
    inst = build_instance(schedule, chosen.hardware, chosen.time_model(optimizer_config(schedule)))
    best: tuple[float, int, list[Any], list[list[float]]] = (-1.0, 0, [], [])
    for rank in schedule.tp.ranks:
        timed = [micro_group_times(inst, group.params, group.hosts, group.teams) for group in rank.groups]
        events = pipeline_events([times for times, _ in timed])
        end = max((event.end for event in events), default=0.0)
        if end > best[0]:
            best = (end, rank.dp_rank, events, [loads for _, loads in timed])
    return best[1], best[2], best[3], max(best[0], 0.0), chosen.hardware.name


def _timeline_panel(ax: Any, schedule: Schedule, device: str) -> dict[str, Any]:
    from matplotlib.patches import Patch

    dp_rank, events, host_loads, seconds, hardware = busiest_pipeline(schedule, device)
    unit, scale = table_unit(seconds)
    tp = schedule.request.tp
    for event in events:
        colour = f"C{event.group % 10}"
        if event.kind == "compute":
            for host, busy in enumerate(host_loads[event.group]):
                if busy:
                    ax.barh(host, busy / scale, left=event.start / scale, color=colour, edgecolor="white", lw=0.3)
        else:  # the TP group's all-to-alls share one network lane above the hosts
            ax.barh(
                tp,
                (event.end - event.start) / scale,
                left=event.start / scale,
                color=colour,
                alpha=0.6,
                hatch="//" if event.kind == "gather" else "..",
                edgecolor="black",
                lw=0.3,
            )
    ax.set_yticks(range(tp + 1), [f"TP {host}" for host in range(tp)] + ["all-to-all"])
    ax.set(
        title=f"micro-group timeline of DP rank {dp_rank}, simulated on {hardware}: "
        f"{plural(len(host_loads), 'micro-group')} in {seconds / scale:.3g} {unit}",
        xlabel=f"time ({unit})",
        ylabel="TP host",
    )
    ax.legend(
        handles=[
            Patch(facecolor="C0", label="host update (colour: micro-group)"),
            Patch(facecolor="white", edgecolor="black", hatch="//", label="gather all-to-all"),
            Patch(facecolor="white", edgecolor="black", hatch="..", label="scatter all-to-all"),
        ],
        **LEGEND_OUTSIDE,
    )
    return {"dp_rank": dp_rank, "device": hardware, "seconds": seconds, "num_groups": len(host_loads)}


def draw(plt: Any, schedule: Schedule, device: str) -> tuple[Any, dict[str, Any]]:
    """The figure of a schedule (three panels), and what its timeline shows."""
    figure, axes = plt.subplots(3, 1, figsize=(13, 12), constrained_layout=True)
    req = schedule.request
    figure.suptitle(f"{req.model.name}  tp {req.tp} x dp {req.dp}  {req.optimizer.name}  alpha {req.alpha:g}")
    try:
        _strategy_panel(axes[0], schedule)
        _device_panel(axes[1], schedule)
        timeline = _timeline_panel(axes[2], schedule, device)
    except BaseException:
        plt.close(figure)
        raise
    return figure, timeline


def render(
    file: Annotated[str, typer.Argument(metavar="SCHEDULE", help=SCHEDULE_HELP)],
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="FILE", help="Image to write (.png, .svg, .pdf; no suffix: .png).")
    ] = "plan.png",
    device: Annotated[str, typer.Option(help=DEVICE_HELP + " Times the micro-group timeline.")] = "h100",
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
) -> None:
    """Draw per-rank loads of canzona and every baseline, per-device load, and the simulated
    micro-group timeline of the DP rank that finishes last."""
    target = output_path(output)
    write_target(target)  # a folder is refused as such, not turned into folder.png beside it
    target = target if target.suffix else target.with_suffix(".png")  # what matplotlib would write
    device = device_option(device)
    source = schedule_path(file)
    check_output(target, [source], "--output")
    plt = _pyplot()
    kind = _image_format(target)
    from canzona.schedules.format import read_schedule

    schedule = read_schedule(source)
    if schedule.request.sharding == "fsdp":
        raise ScheduleError(
            f"{file}: render draws the DP buckets and TP micro-groups of replicated schedules; for an FSDP "
            "schedule see `canzona show` and `canzona simulate`"
        )
    figure, timeline = draw(plt, schedule, device)
    image = io.BytesIO()
    try:
        figure.savefig(image, format=kind, dpi=110)
    finally:
        plt.close(figure)
    write_output(target, image.getvalue())
    if as_json:
        echo(
            json.dumps(
                {"output": str(target), "format": kind, "bytes": len(image.getvalue()), "timeline": timeline}, indent=2
            )
        )
    else:
        echo(f"wrote {target}")
