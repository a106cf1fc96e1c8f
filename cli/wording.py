"""Plain wording for the terminal: counts with the right plural, percentages without a negative
zero, times in the unit a person reads them in, and text that is always printable (`echo`)."""

from __future__ import annotations

import math

import typer

from canzona.schedules.text import printable


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 micro-group`, `2 micro-groups`; `many` for irregular plurals (matrix -> matrices)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def percent(fraction: float, digits: int = 2) -> str:
    """`0.0123` -> `1.23%`; a value that rounds to zero never prints as `-0.00%`."""
    text = f"{100 * fraction:.{digits}f}"
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    return text + "%"


# A table of times is printed in one unit: the first whose threshold its largest value is below.
TABLE_UNITS = ((1.0, "ms", 1e-3), (120.0, "s", 1.0), (2 * 3600.0, "min", 60.0), (math.inf, "h", 3600.0))


def table_unit(largest_seconds: float) -> tuple[str, float]:
    """(unit name, seconds per unit) for a table whose largest time is `largest_seconds`:
    ms below a second, s below two minutes, min below two hours, else h."""
    for limit, name, scale in TABLE_UNITS:
        if largest_seconds < limit:
            return name, scale
    return TABLE_UNITS[-1][1], TABLE_UNITS[-1][2]  # NaN: never in practice


def duration(seconds: float) -> str:
    """One time as people say it: `557 ms`, `12.3 s`, `12 min 5 s`, `2 h 14 min`."""
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def echo(message: object = "", err: bool = False, nl: bool = True) -> None:
    """typer.echo of `printable(message)`: how every command writes to the terminal, so that
    nothing a schedule file holds reaches it unescaped."""
    typer.echo(printable(str(message)), err=err, nl=nl)
