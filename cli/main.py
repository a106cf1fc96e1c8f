"""The `canzona` command: results on stdout, diagnostics on stderr, one-line errors.

Exit codes: 0 success, 1 internal error, 2 bad input (usage, model, layout, files), 130 / 143
interrupted (SIGINT / SIGTERM; temporary files are removed first).
Set CANZONA_DEBUG=1 to get tracebacks instead of one-line errors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import typing
from enum import Enum
from typing import Annotated, Any

import typer

# Only what the commands' signatures name is loaded here, so `canzona --version` and `-h` start
# in a fraction of a second; each command loads the planner, pydantic and YAML itself.
from canzona.cli import calibrate_cmd, compare, describe_cmd, plan_cmd, render, report, reshard_cmd, simulate_cmd
from canzona.cli.options import SCHEDULE_HELP, load_schedule
from canzona.cli.wording import echo
from canzona.planner.spec import PlanError
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import OutputError

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer depends on click
    # click's own ClickException, which mypy, reading the vendored copy installed here, takes
    # for another one
    from click.exceptions import ClickException  # type: ignore[assignment]

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
KNOWN_ERRORS = (PlanError, ScheduleError, OutputError)


app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text: rich markup would eat "[rows, cols]" and print flags as "<bool>".
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan and inspect canzona schedules for matrix optimizers under DP x TP. "
    "Concepts and file format: docs/README.md.",
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        echo(f"canzona {version('canzona')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print canzona's version and exit.")
    ] = False,
) -> None:
    """Plan and inspect canzona schedules for matrix optimizers under DP x TP."""


@app.command()
def models(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List the built-in model presets with their parameter counts."""
    from canzona.planner.sources.load import count_params, list_presets

    rows = [report.preset_row(name, arch, count_params(arch)) for name, arch in list_presets()]
    echo(json.dumps(rows, indent=2) if as_json else report.presets_table(rows))


app.command()(plan_cmd.plan)


@app.command()
def show(
    file: Annotated[str, typer.Argument(metavar="SCHEDULE", help=SCHEDULE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    rank: Annotated[int | None, typer.Option(help="Show one device (global rank = dp_rank * tp + tp_rank).")] = None,
) -> None:
    """Show a schedule: per-rank loads as bars, imbalance, gap, memory, baselines, TP modes."""
    schedule = load_schedule(file)
    if rank is not None:
        world = schedule.request.tp * schedule.request.dp
        if not 0 <= rank < world:
            raise ScheduleError(f"rank {rank} is outside the world of {world} devices")
        part = report.rank_part(schedule, rank)
        echo(json.dumps(part, indent=2) if as_json else report.rank_text(part))
    elif as_json:
        data = {
            "request": schedule.request.model_dump(mode="json"),
            "predicted_step": report.predicted_step(schedule),
            "metrics": report.metrics_data(schedule),
            "collectives": report.bucket_collectives(schedule),
        }
        echo(json.dumps(data, indent=2))
    else:
        echo(report.show_text(schedule))


app.command()(describe_cmd.describe)
app.command()(compare.diff)
app.command()(compare.check)
app.command()(compare.table)
app.command()(render.render)
app.command()(simulate_cmd.simulate)
app.command()(calibrate_cmd.calibrate)
app.command("reshard-check")(reshard_cmd.reshard_check)


class Terminated(Exception):
    """SIGTERM, raised like KeyboardInterrupt so every `finally` (temporary files) runs."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on `argv` (default: the process's arguments); return the exit code instead
    of exiting. No arguments at all print the help."""
    debug = os.environ.get("CANZONA_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else list(argv)
    previous = (
        signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        result = app(args=args or ["--help"], prog_name="canzona", standalone_mode=False)
    except ClickException as error:
        echo(f"canzona: error: {_usage_message(error, args)}", err=True)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, typer.Abort):  # typer itself turns Ctrl-C into exit code 130
        echo("canzona: interrupted", err=True)
        return EXIT_INTERRUPTED
    except Terminated:
        echo("canzona: terminated", err=True)
        return EXIT_TERMINATED
    except KNOWN_ERRORS as error:
        if debug:
            raise
        echo(f"canzona: error: {error}", err=True)
        return EXIT_BAD_INPUT
    except OSError as error:  # a file the command had to read or write
        if debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        echo(f"canzona: error: {where}{error.strerror or error}", err=True)
        return EXIT_BAD_INPUT
    except Exception as error:
        if debug:
            raise
        echo(f"canzona: internal error: {type(error).__name__}: {error} (CANZONA_DEBUG=1 for details)", err=True)
        return EXIT_INTERNAL
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return result if isinstance(result, int) else 0


def _usage_message(error: ClickException, args: list[str]) -> str:
    """click's message, except for a value an option cannot take: that one in canzona's own
    words (click's and typer's change between versions), naming the option, the value given and
    what it must be, read from the command's own signature."""
    param = getattr(error, "param", None)
    wanted = _wanted(
        getattr(getattr(getattr(error, "ctx", None), "command", None), "callback", None), getattr(param, "name", None)
    )
    options = [o for o in getattr(param, "opts", []) if o.startswith("--")]
    given = _value_given(args, options) if wanted and options else None
    if given is None or wanted is None or _fits(given, wanted):
        return error.format_message()  # the value has the right form: refused for another reason
    return f"{options[0]} {given!r} is not {wanted}"


def _fits(value: str, wanted: str) -> bool:
    """Whether `value` has the form `wanted` describes (then a refusal was for something else)."""
    if wanted.startswith("one of "):
        return value in wanted.removeprefix("one of ").split(", ")
    try:
        (int if wanted == "a whole number" else float)(value)
    except ValueError:
        return False
    return True


def _wanted(command: Any, name: str | None) -> str | None:
    """What `command`'s parameter `name` takes, in words: one of an Enum's values, a whole
    number or a number (None: anything else, or no such parameter)."""
    if command is None or name is None:
        return None
    try:
        hint = typing.get_type_hints(command, include_extras=True).get(name)
    except (NameError, TypeError):
        return None
    pending = [hint]
    while pending:
        current = pending.pop()
        if isinstance(current, type) and issubclass(current, Enum):
            return "one of " + ", ".join(str(member.value) for member in current)
        if current is int:
            return "a whole number"
        if current is float:
            return "a number"
        pending.extend(typing.get_args(current))
    return None


def _value_given(args: list[str], options: list[str]) -> str | None:
    """The last value given to any of `options` on the command line (`--opt v` or `--opt=v`)."""
    found = None
    for position, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in options:
            found = value if equals else (args[position + 1] if position + 1 < len(args) else None)
    return found


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
