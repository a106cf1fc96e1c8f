"""`canzona diff` and `canzona check`: the CI side of schedules.

diff: headline metrics of two schedules side by side, with a verdict against thresholds.
check: regenerate each schedule from its recorded request and say what went stale.
"""

from __future__ import annotations

import json
import math
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from canzona.cli.options import SCHEDULE_HELP, library_hint, load_schedule, write_output
from canzona.cli.report import predicted_step
from canzona.cli.wording import duration, echo, percent, plural
from canzona.schedules.errors import ScheduleError
from canzona.schedules.library import resolve_schedule
from canzona.schedules.limits import MAX_SCHEDULE_BYTES, PROFILE_PREFIX

if TYPE_CHECKING:  # loaded by the commands themselves: `canzona -h` stays fast
    from canzona.schedules.format import Request, Schedule

EXIT_REGRESSION = 1
EXIT_REFUSED = 2  # bad input, as every command's one-line errors
DEFAULT_TIMEOUT = 120.0  # seconds check may spend regenerating one schedule (the library's largest: ~20 s)
GIB = 1 << 30


@dataclass(frozen=True)
class Metric:
    """A headline figure: how to read it from a schedule (None: the file lacks it), and which
    direction is worse."""

    name: str
    read: Callable[[Schedule], float | None]
    higher_is_worse: bool
    threshold: str | None  # which --max-*-increase option bounds it, if any
    relative: bool  # thresholds on relative (True) or absolute (False) increase


def _max_device(schedule: Schedule, field: str) -> float:
    return max(getattr(device, field) for device in schedule.metrics.device)


def _predicted_step(schedule: Schedule) -> float | None:
    """The predicted step (s) of a schedule planned with α auto, simulated again on the built-in
    hardware model its search used: the file's recorded prediction is the simulator's own, which
    no validator re-checks, so diff never trusts it. None without α auto or for a measured
    profile (diff reads no file a schedule names)."""
    device = schedule.request.alpha_device
    if device is None or device.startswith(PROFILE_PREFIX):
        return None
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.predict.hardware import resolve_device
    from canzona.planner.predict.simulate import simulate

    model = resolve_device(device)
    settings = OptimizerConfig(**schedule.request.optimizer.model_dump())
    return float(simulate(schedule, model.hardware, model.time_model(settings)).get("canzona").step)


METRICS: tuple[Metric, ...] = (
    Metric("dp imbalance", lambda s: s.metrics.dp.imbalance, True, "imbalance", False),
    Metric("dp gap", lambda s: s.metrics.dp.gap, True, "gap", False),
    Metric("padding overhead", lambda s: s.metrics.dp.padding_overhead, True, None, True),
    Metric("tp efficiency", lambda s: s.metrics.tp.efficiency, False, None, False),
    Metric("tp groups", lambda s: float(s.metrics.tp.num_groups), True, None, True),
    Metric("device imbalance", lambda s: s.metrics.tp.device_imbalance, True, "imbalance", False),
    Metric("worst device load", lambda s: s.metrics.tp.worst_device_load, True, None, True),
    Metric("cooperative matrices", lambda s: float(s.metrics.tp.cooperative), False, None, False),
    Metric("device gap", lambda s: s.metrics.tp.device_gap, True, "gap", False),
    Metric("max state GiB/device", lambda s: _max_device(s, "state_bytes") / GIB, True, "memory", True),
    Metric("max sent GiB/device", lambda s: _max_device(s, "bytes_sent") / GIB, True, None, True),
    Metric("max received GiB/device", lambda s: _max_device(s, "bytes_received") / GIB, True, None, True),
    Metric("predicted step s", _predicted_step, True, None, True),
)


@dataclass(frozen=True)
class Row:
    """One metric of a diff (`old`/`new`/`delta` None where a file lacks the metric)."""

    name: str
    old: float | None
    new: float | None
    delta: float | None
    verdict: str  # "better", "worse", "same", "REGRESSION", or "missing"


def compare(old: Schedule, new: Schedule, limits: dict[str, float]) -> list[Row]:
    """Every headline metric with its delta; a bounded metric past its limit is a regression;
    a metric one file lacks is "missing" (never better). ScheduleError on a non-finite value."""
    rows = []
    for metric in METRICS:
        before, after = metric.read(old), metric.read(new)
        for value in (before, after):
            if value is not None and not math.isfinite(value):
                raise ScheduleError(f"{metric.name} is {value}, not a finite number")
        if before is None or after is None:
            if before is not None or after is not None:  # e.g. a predicted step only one file has
                rows.append(Row(metric.name, before, after, None, "missing"))
            continue
        delta = after - before
        worse = delta > 0 if metric.higher_is_worse else delta < 0
        change = abs(delta) / abs(before) if metric.relative and before else abs(delta)
        verdict = "same" if abs(delta) <= 1e-12 * max(abs(before), 1.0) else ("worse" if worse else "better")
        if verdict == "worse" and metric.threshold is not None and change > limits[metric.threshold] + 1e-12:
            verdict = "REGRESSION"
        rows.append(Row(metric.name, before, after, delta, verdict))
    return rows


def _format(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.4e}"


def diff_text(old_path: str, new_path: str, rows: list[Row]) -> str:
    """The side-by-side table (columns named by file name, or in full where those are equal)."""
    names = [Path(old_path).name, Path(new_path).name]
    header = ["metric", *(names if names[0] != names[1] else [old_path, new_path]), "delta", "verdict"]
    body = [
        [r.name, _format(r.old), _format(r.new), "-" if r.delta is None else f"{r.delta:+.4g}", r.verdict] for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *body])


def diff(
    old: Annotated[str, typer.Argument(metavar="OLD", help="Baseline: " + SCHEDULE_HELP)],
    new: Annotated[str, typer.Argument(metavar="NEW", help="Candidate: " + SCHEDULE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    max_imbalance_increase: Annotated[
        float, typer.Option(help="Allowed absolute increase of DP/device imbalance.")
    ] = 0.0,
    max_gap_increase: Annotated[
        float, typer.Option(help="Allowed absolute increase of the DP gap and of the device gap.")
    ] = 0.0,
    max_memory_increase: Annotated[
        float, typer.Option(help="Allowed relative increase of max state per device.")
    ] = 0.0,
    same_model: Annotated[bool, typer.Option("--same-model", help="Fail (exit 2) if the models differ.")] = False,
) -> None:
    """Compare two schedules' headline metrics; exit 1 on a regression past the thresholds."""
    for name, value in (
        ("imbalance", max_imbalance_increase),
        ("gap", max_gap_increase),
        ("memory", max_memory_increase),
    ):
        if not math.isfinite(value) or value < 0:
            raise ScheduleError(f"--max-{name}-increase must be a finite number >= 0, got {value}")
    before, after = load_schedule(old), load_schedule(new)
    models = model_difference(before, after)
    if same_model and models:
        raise ScheduleError(f"different models: {before.request.model.name} vs {after.request.model.name}")
    if models:  # still compared, and a regression still fails: a CI gate stays a gate
        echo(
            f"canzona: note: the schedules are for {models}: every figure compares two models, not two plans of "
            "one model (--same-model refuses such a pair)",
            err=True,
        )
    limits = {"imbalance": max_imbalance_increase, "gap": max_gap_increase, "memory": max_memory_increase}
    modes = (before.request.sharding, before.request.dp_replicate), (after.request.sharding, after.request.dp_replicate)
    if modes[0] != modes[1]:
        echo(
            f"canzona: note: the sharding modes differ (OLD {_mode(*modes[0])}, NEW {_mode(*modes[1])}): the DP "
            "figures are per DP rank of each mode (owners and buckets vs FSDP hosts)",
            err=True,
        )
    rows = compare(before, after, limits)
    if as_json:
        echo(json.dumps([vars(row) for row in rows], indent=2))
    else:
        echo(diff_text(old, new, rows))
    failed = [row for row in rows if row.verdict == "REGRESSION"]
    for row in failed:
        echo(f"canzona: regression: {row.name} {_format(row.old)} -> {_format(row.new)}", err=True)
    if failed:
        raise typer.Exit(EXIT_REGRESSION)


def model_difference(old: Schedule, new: Schedule) -> str | None:
    """How two schedules' models differ, as `different models (OLD a, NEW b)` (None: the same
    model). The model's identity, not the fingerprint: TP size changes the padded vocab shapes."""
    a, b = old.request.model, new.request.model
    if a == b:
        return None
    if a.name != b.name:
        return f"different models (OLD {a.name}, NEW {b.name})"
    if a.source != b.source:
        return f"different sources of {a.name} (OLD {a.source}, NEW {b.source})"
    return f"different versions of {a.name}'s source {a.source} (its sha256 differs)"


def _mode(sharding: str, replicate: int) -> str:
    return f"{sharding}, HSDP {replicate} replicas" if replicate > 1 else sharding


LIBRARY_README = "README.md"
SKIPPED_FOLDERS = {"profiles"}  # calibration profiles live next to the schedules


def schedule_files(paths: list[Path]) -> list[Path]:
    """Files named directly (or by library name), plus every *.yaml below named folders
    (profiles excluded)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(
                p for p in path.rglob("*.yaml") if not SKIPPED_FOLDERS & set(p.relative_to(path).parts[:-1])
            )
        elif resolve_schedule(path).exists():
            found.append(resolve_schedule(path))
        else:
            raise ScheduleError(
                f"no such schedule or folder, nor a library schedule: {str(path)!r}" + library_hint(str(path))
            )
    return found


def regenerate(path: Path, request: Request) -> Schedule:
    """Plan again from a file's recorded request (a model file is looked up as recorded, then
    next to the schedule; a live model is described again, which runs its code: callers gate
    that with `gate_code`)."""
    from dataclasses import replace

    from canzona.cli.sources import is_live, load_source
    from canzona.planner.compile import compile_schedule
    from canzona.planner.predict.auto_alpha import plan_for_request
    from canzona.planner.request import PlanRequest

    recorded = request.model.source
    source = recorded
    if request.model.sha256 is not None and not is_live(recorded) and not Path(recorded).exists():
        source = str(path.parent / recorded)
    planner_request = PlanRequest.from_request(request, source)
    planner_request.validate()
    spec = replace(load_source(source, planner_request.tp, planner_request.options), source=recorded)
    return compile_schedule(*plan_for_request(spec, planner_request))


class Overtime(Exception):
    """check's deadline passed while regenerating a schedule."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise Overtime in this thread once `seconds` pass (SIGALRM; the planner is Python and a
    CP-SAT solve waits interruptibly, so it stops within moments). Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise Overtime()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def regenerate_within(path: Path, request: Request, seconds: float) -> Schedule:
    """`regenerate`, refused (one line) when its request cannot be planned or planning it takes
    longer than `seconds`."""
    from canzona.planner.spec import PlanError

    try:
        with deadline(seconds):
            return regenerate(path, request)
    except Overtime:
        raise Refused(
            f"regenerating it takes longer than {seconds:g} s (check's --timeout); "
            "regenerate it with `canzona plan`, or give check more time"
        ) from None
    except (PlanError, ScheduleError) as error:
        raise Refused(f"its request cannot be planned: {error}") from None


def staleness(old: Schedule, new: Schedule) -> str | None:
    """What differs in content between a checked-in schedule and its regeneration, or None."""
    if old.fingerprint != new.fingerprint:
        return "stale fingerprint: the model's parameters changed"
    if old.request.model.sha256 != new.request.model.sha256:
        live = old.request.model.source.startswith("py:")
        return "the live model's description changed (sha256)" if live else "the model file changed (sha256)"
    moved = sum(
        a.owner != b.owner or a.offset != b.offset or a.bucket != b.bucket for a, b in zip(old.params, new.params)
    )
    if moved or old.params != new.params or old.dp != new.dp:
        return f"different assignment ({moved} parameters moved or re-laid out)"
    if old.tp != new.tp:
        return "different micro-groups"
    if old.metrics != new.metrics:
        return "different metrics"
    if old.request.model_copy(update={"canzona_version": ""}) != new.request.model_copy(update={"canzona_version": ""}):
        return "different request"
    if old.request.canzona_version != new.request.canzona_version:
        return f"written by canzona {old.request.canzona_version} (this is {new.request.canzona_version})"
    return None


class Refused(ValueError):
    """A schedule `check` will not regenerate (one line): invalid, or it would run code."""


@dataclass(frozen=True)
class CodePolicy:
    """Whether `check` may run a live model's code (`--allow-code`), and from where: the
    folders being checked and the current project."""

    allowed: bool
    roots: tuple[Path, ...]


def gate_code(request: Request, policy: CodePolicy) -> None:
    """Refused unless regenerating `request` runs no code, or the policy allows that code."""
    from canzona.cli.sources import is_live, require_code_inside
    from canzona.planner.spec import PlanError

    source = request.model.source
    if not is_live(source):
        return
    if not policy.allowed:
        raise Refused(
            f"its model is a live model ({source}): it cannot be regenerated without running code; "
            "pass --allow-code for your own files, or plan from a described parameter list "
            "(`canzona describe`)"
        )
    try:
        require_code_inside(source, policy.roots)
    except PlanError as error:
        raise Refused(str(error)) from None


def check_file(
    path: Path, policy: CodePolicy, fix: bool = False, seconds: float = DEFAULT_TIMEOUT
) -> tuple[str | None, Schedule]:
    """Why `path` differs from the regeneration of its recorded request (None: byte-identical),
    and that regeneration. The file is read (`schedule_text`, as every reader does) and
    validated (digest included) before anything is regenerated: an invalid one is Refused,
    except under `fix`, which rewrites it from its request when that request can be read. A
    live model is regenerated only as `policy` allows; regeneration gets `seconds`."""
    from canzona.schedules.format import dump_schedule, parse_schedule, schedule_text

    try:
        text = schedule_text(path)
    except ScheduleError as error:
        raise Refused(str(error).replace(f"schedule {str(path)!r}: ", "schedule: ")) from None
    try:
        old: Schedule | None = parse_schedule(text, str(path))
        request, invalid = old.request, None  # type: ignore[union-attr]
    except ScheduleError as error:
        invalid = str(error).removeprefix(f"{path}: ")
        if not fix:
            raise Refused(f"invalid ({invalid}); `canzona check --fix` rewrites it from its request") from None
        old, request = None, _readable_request(text, path)
    gate_code(request, policy)
    new = regenerate_within(path, request, seconds)
    if invalid is not None:
        return f"invalid ({invalid})", new
    reason = staleness(old, new)  # type: ignore[arg-type]
    if reason is None and dump_schedule(new) != text:
        reason = "formatting: same content, but not the bytes canzona writes"
    return reason, new


def _readable_request(text: str, path: Path) -> Request:
    from canzona.schedules.format import read_request

    try:
        return read_request(text, str(path))
    except ScheduleError as error:
        raise Refused(str(error).removeprefix(f"{path}: ")) from None


def library_rows(files: list[Path], root: Path) -> list[dict[str, Any]]:
    """Each schedule's headline metrics (what `canzona table` shows), named below `root`."""
    from canzona.schedules.format import read_schedule

    rows = []
    for path in files:
        s = read_schedule(path)
        r, dp = s.request, s.metrics.dp
        rows.append(
            {
                "schedule": path.relative_to(root).with_suffix("").as_posix(),
                "model": r.model.name,
                "tp": r.tp,
                "dp": r.dp,
                "ep": r.ep,
                "optimizer": r.optimizer.name,
                "alpha": r.alpha,
                "dp_imbalance": dp.imbalance,
                "gap": dp.gap,
                "padding_overhead": dp.padding_overhead,
                "tp_efficiency": s.metrics.tp.efficiency,
                "num_groups": s.metrics.tp.num_groups,
                "max_state_gib": _max_device(s, "state_bytes") / GIB,
                "predicted_step": predicted_step(s),
                "sharding": r.sharding,
                "dp_replicate": r.dp_replicate,
            }
        )
    return rows


def library_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `library_rows`."""
    lines = [
        (
            "| schedule | model | layout | optimizer | alpha | predicted step (h100) | step / its bound "
            "| DP imbalance | gap | padding | TP efficiency | groups | max state GiB/device |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        layout = f"tp{r['tp']} dp{r['dp']}" + (f" ep{r['ep']}" if r["ep"] > 1 else "")
        if r["sharding"] == "fsdp":
            layout += " fsdp" if r["dp_replicate"] == 1 else f" hsdp{r['dp_replicate']}"
        step = r["predicted_step"]
        predicted = f"{duration(step['step_s'])} | {step['over_bound']:.3f}x" if step else "- | -"
        lines.append(
            f"| `{r['schedule']}` | {r['model']} | {layout} | {r['optimizer']} | {r['alpha']:g} | {predicted} "
            f"| {r['dp_imbalance']:.4f} | {percent(r['gap'])} | {r['padding_overhead']:.2f}x "
            f"| {r['tp_efficiency']:.3f} | {r['num_groups']} | {r['max_state_gib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def folder_table(folder: Path) -> str:
    """The markdown table of every schedule below `folder`."""
    return library_table(library_rows(schedule_files([folder]), folder))


TABLE_BEGIN = "<!-- canzona table: begin (generated by `canzona table schedules --update`) -->"
TABLE_END = "<!-- canzona table: end -->"


def _with_table(readme: str, table: str) -> str:
    start, stop = readme.find(TABLE_BEGIN), readme.find(TABLE_END)
    if start < 0 or stop < start:
        raise ScheduleError(f"the library README has no '{TABLE_BEGIN}' ... '{TABLE_END}' markers")
    return readme[: start + len(TABLE_BEGIN)] + "\n" + table + readme[stop:]


def table(
    folder: Annotated[Path, typer.Argument(help="Schedule library folder.")] = Path("schedules"),
    update: Annotated[
        bool, typer.Option("--update", help=f"Rewrite the table inside FOLDER/{LIBRARY_README}.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON (not with --update).")] = False,
) -> None:
    """Print the library's metrics table (markdown), or update it in the library README."""
    from canzona.schedules.reading import UnsafeDocument, read_text

    if not folder.is_dir():
        raise ScheduleError(
            f"table reads a folder of schedules; {str(folder)!r} is {'a file' if folder.exists() else 'missing'}"
        )
    if update and as_json:
        raise ScheduleError("--json prints the table; --update writes it into the README: give one")
    readme = folder / LIBRARY_README
    if update and not readme.is_file():
        raise ScheduleError(f"--update rewrites the table inside {str(readme)!r}, which does not exist")
    rows = library_rows(schedule_files([folder]), folder)
    if as_json:
        echo(json.dumps(rows, indent=2))
    elif not update:
        echo(library_table(rows), nl=False)
    else:
        try:
            text = read_text(readme, MAX_SCHEDULE_BYTES)
        except UnsafeDocument as error:
            raise ScheduleError(f"cannot read {str(readme)!r}: {error}") from None
        write_output(readme, _with_table(text, library_table(rows)))
        echo(f"updated {readme}")


def check(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="[SCHEDULE|FOLDER]...", help="Schedules (files or library names) or folders (default: schedules)."
        ),
    ] = None,
    fix: Annotated[
        bool, typer.Option("--fix", help="Rewrite stale files (atomically), and invalid ones from their request.")
    ] = False,
    allow_code: Annotated[
        bool,
        typer.Option(
            "--allow-code",
            help=(
                "Regenerate schedules of live models (py:MODULE:FACTORY) by importing and calling their factory: "
                "this RUNS the code the file names. Only for your own files; the module must lie inside a checked "
                "folder or the current directory."
            ),
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON report: every file's status and reason.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds to regenerate one schedule; a slower one is refused (exit 2).")
    ] = DEFAULT_TIMEOUT,
) -> None:
    """Regenerate each schedule from its recorded request and compare bytes; exit 1 if any
    differs (content or formatting), 2 if any is invalid, names a live model (code is run only
    with --allow-code) or takes longer than --timeout to regenerate. A file is validated, digest
    included, before anything is regenerated."""
    if not math.isfinite(timeout) or timeout <= 0:
        raise ScheduleError(f"--timeout must be a finite number of seconds > 0, got {timeout}")
    roots = paths or [Path("schedules")]
    files = schedule_files(roots)
    policy = CodePolicy(
        allow_code, (Path.cwd(), *(root if root.is_dir() else resolve_schedule(root).parent for root in roots))
    )
    results = [_check_one(path, fix, policy, timeout) for path in files]
    results += [result for root in roots if (result := _check_readme(root, fix)) is not None]
    stale = sum(1 for result in results if result["status"] == "stale")
    refused = [result for result in results if result["status"] == "refused"]
    if as_json:
        echo(
            json.dumps(
                {
                    "files": results,
                    "stale": stale,
                    "fixed": sum(r["status"] == "fixed" for r in results),
                    "refused": len(refused),
                },
                indent=2,
            )
        )
    else:
        for result in results:
            if result["status"] == "refused":
                continue
            label = {"fresh": "fresh ", "stale": "STALE ", "fixed": "fixed "}[result["status"]]
            echo(f"{label} {result['path']}" + (f": {result['reason']}" if result["reason"] else ""))
    for result in refused:
        echo(f"canzona: error: {result['path']}: {result['reason']}", err=True)
    if stale:
        echo(f"canzona: {plural(stale, 'stale file')}; run `canzona check --fix`", err=True)
    if refused:
        raise typer.Exit(EXIT_REFUSED)
    if stale:
        raise typer.Exit(EXIT_REGRESSION)


def _check_one(path: Path, fix: bool, policy: CodePolicy, seconds: float) -> dict[str, Any]:
    try:
        reason, new = check_file(path, policy, fix, seconds)
    except Refused as error:
        return {"path": str(path), "status": "refused", "reason": str(error)}
    if reason is not None and fix:
        from canzona.schedules.format import dump_schedule

        write_output(path, dump_schedule(new))
    return {"path": str(path), "status": "fresh" if reason is None else "fixed" if fix else "stale", "reason": reason}


def _check_readme(root: Path, fix: bool) -> dict[str, Any] | None:
    from canzona.schedules.reading import UnsafeDocument, read_text

    readme = root / LIBRARY_README
    if not (root.is_dir() and readme.exists()):
        return None
    try:
        text = read_text(readme, MAX_SCHEDULE_BYTES)
        wanted = _with_table(text, folder_table(root))
    except UnsafeDocument as error:
        return {"path": str(readme), "status": "refused", "reason": f"cannot read it: {error}"}
    except ScheduleError as error:  # a schedule of the folder is refused above, with its reason
        return {"path": str(readme), "status": "refused", "reason": f"its metrics table cannot be made ({error})"}
    if wanted == text:
        return {"path": str(readme), "status": "fresh", "reason": None}
    if fix:
        write_output(readme, wanted)
        return {"path": str(readme), "status": "fixed", "reason": "metrics table"}
    return {"path": str(readme), "status": "stale", "reason": "metrics table differs from `canzona table`"}
