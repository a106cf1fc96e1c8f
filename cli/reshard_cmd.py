"""`canzona reshard-check OLD NEW`: can an optimizer checkpoint saved under OLD be loaded under
NEW, and how many bytes of optimizer state each rank writes, reads and exchanges.

Exit codes: 0 compatible, 1 not compatible (reasons on stdout and stderr), 2 bad input.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from canzona.cli.options import SCHEDULE_HELP, load_schedule
from canzona.cli.wording import echo

if TYPE_CHECKING:  # loaded by the command itself: `canzona -h` stays fast
    from canzona.schedules.format import Schedule
    from canzona.schedules.reshard import ReshardReport

EXIT_INCOMPATIBLE = 1
UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def human_bytes(count: int) -> str:
    """1536 -> '1.50 KiB'."""
    for size, unit in UNITS:
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def _describe(schedule: Schedule) -> dict[str, Any]:
    req = schedule.request
    return {
        "model": req.model.name,
        "optimizer": req.optimizer.name,
        "dp": req.dp,
        "tp": req.tp,
        "ep": req.ep,
        "alpha": req.alpha,
        "bucket_size": req.bucket_size,
        "fingerprint": schedule.fingerprint,
        "sharding": req.sharding,
        "dp_replicate": req.dp_replicate,
    }


def _rank_rows(loads: list[int], moved: list[int], tp: int, keys: tuple[str, str]) -> list[dict[str, int]]:
    return [
        {"rank": r, "dp_rank": r // tp, "tp_rank": r % tp, keys[0]: loads[r], keys[1]: moved[r]}
        for r in range(len(loads))
    ]


def report_json(old: Schedule, new: Schedule, report: ReshardReport) -> dict[str, Any]:
    """The machine-readable report (bytes are exact integers)."""
    data: dict[str, Any] = {
        "compatible": report.compatible,
        "problems": report.problems,
        "notes": report.notes,
        "old": _describe(old),
        "new": _describe(new),
    }
    if report.compatible:
        data.update(
            state_bytes=report.state_bytes,
            moved_bytes=sum(report.moved_in),
            new_ranks=_rank_rows(report.loads, report.moved_in, new.request.tp, ("loads", "from_other_ranks")),
            old_ranks=_rank_rows(report.writes, report.moved_out, old.request.tp, ("writes", "to_other_ranks")),
            flows=[{"from": s, "to": t, "bytes": n} for s, t, n in report.flows],
        )
    return data


def _table(title: str, rows: list[dict[str, int]], keys: tuple[str, str], headers: tuple[str, str]) -> list[str]:
    lines = [f"{title:>8}  {'dp':>4}  {'tp':>3}  {headers[0]:>11}  {headers[1]:>16}"]
    for row in rows:
        lines.append(
            f"{row['rank']:>8}  {row['dp_rank']:>4}  {row['tp_rank']:>3}  "
            f"{human_bytes(row[keys[0]]):>11}  {human_bytes(row[keys[1]]):>16}"
        )
    return lines


def report_text(data: dict[str, Any]) -> str:
    """The human-readable report."""

    def layout(side: dict[str, Any]) -> str:
        """One schedule in a line."""
        ep = f" (EP {side['ep']})" if side.get("ep", 1) > 1 else ""
        if side.get("sharding") == "fsdp":
            hsdp = f" (HSDP {side['dp_replicate']} replicas)" if side["dp_replicate"] > 1 else ""
            return f"{side['model']}, {side['optimizer']}, FSDP DP {side['dp']}{hsdp} x TP {side['tp']}"
        return (
            f"{side['model']}, {side['optimizer']}, DP {side['dp']}{ep} x TP {side['tp']}, alpha {side['alpha']:g}, "
            f"buckets {side['bucket_size']}"
        )

    lines = [
        f"compatible: {'yes' if data['compatible'] else 'no'}",
        f"old: {layout(data['old'])}",
        f"new: {layout(data['new'])}",
    ]
    lines += [f"problem: {problem}" for problem in data["problems"]]
    lines += [f"note: {note}" for note in data["notes"]]
    if data["compatible"]:
        lines.append(
            f"optimizer state: {human_bytes(data['state_bytes'])}; {human_bytes(data['moved_bytes'])} changes rank"
        )
        lines += [
            "",
            *_table("new rank", data["new_ranks"], ("loads", "from_other_ranks"), ("loads", "from other ranks")),
        ]
        lines += [
            "",
            *_table("old rank", data["old_ranks"], ("writes", "to_other_ranks"), ("writes", "to other ranks")),
        ]
    return "\n".join(lines)


def reshard_check(
    old: Annotated[
        str, typer.Argument(metavar="OLD", help="The schedule the checkpoint was saved under. " + SCHEDULE_HELP)
    ],
    new: Annotated[str, typer.Argument(metavar="NEW", help="The schedule to load it under. " + SCHEDULE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Say whether an optimizer checkpoint saved under OLD loads under NEW, and the bytes of
    optimizer state each rank writes, reads and receives from another rank; exit 1 if it cannot."""
    before, after = load_schedule(old), load_schedule(new)
    from canzona.schedules.reshard import reshard_report

    report = reshard_report(before, after)
    data = report_json(before, after, report)
    echo(json.dumps(data, indent=2) if as_json else report_text(data))
    for problem in report.problems:
        echo(f"canzona: incompatible: {problem}", err=True)
    if not report.compatible:
        raise typer.Exit(EXIT_INCOMPATIBLE)
