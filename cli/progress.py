"""Progress and warnings on stderr, so stdout stays the result.

On a terminal, slow work shows a rich progress bar (steps known) or a spinner with the elapsed
time (steps unknown); both vanish when the work ends. Elsewhere (CI logs, pipes) a bar would be
noise: instead one plain `canzona: <what>: working, N s` line every HEARTBEAT_S seconds, so a
long plan never looks like a hang in a log, and, for work that asks for it, one `[n/N] what`
line per step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from canzona.cli.wording import echo

Step = Callable[[str], None]
HEARTBEAT_S = 10.0


def interactive() -> bool:
    """Whether stderr is a terminal that can draw a progress bar."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def warn(message: str) -> None:
    """One `canzona: warning: ...` line on stderr."""
    echo(f"canzona: warning: {message}", err=True)


def note(message: str) -> None:
    """One `canzona: ...` line on stderr (what the command is about to do)."""
    echo(f"canzona: {message}", err=True)


@contextmanager
def heartbeat(description: str, every: float = HEARTBEAT_S) -> Iterator[None]:
    """While the body runs, one `canzona: <description>: working, N s` line on stderr every
    `every` seconds (from a daemon thread, stopped when the body ends)."""
    stop, started = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            echo(f"canzona: {description}: working, {time.monotonic() - started:.0f} s", err=True)

    thread = threading.Thread(target=beat, name="canzona-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def progress(description: str, total: int | None = None, *, lines: bool = False) -> Iterator[Step]:
    """Show `total` steps of slow work (None: unknown, a spinner with the elapsed time). Yields
    `step(label)`, called once per finished step with what it was. Off a terminal: a heartbeat
    line every HEARTBEAT_S seconds and, with `lines`, one `[n/N] label` line per step."""
    if not interactive():
        done = 0

        def plain(label: str) -> None:
            nonlocal done
            done += 1
            if lines:
                echo(f"[{done}/{total}] {label}" if total else label, err=True)

        with heartbeat(description, HEARTBEAT_S):
            yield plain
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
        ]
    else:
        columns += [TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{description}: {label}")

        yield advance
