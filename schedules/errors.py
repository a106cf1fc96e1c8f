"""The error every schedule reader raises, in a module of its own: commands that only name it
(to turn it into one line and exit 2) load no YAML or pydantic for it."""

from __future__ import annotations

from typing import Any

from canzona.schedules.text import printable


class ScheduleError(ValueError):
    """A schedule file that cannot be read or does not validate (one-line message). The message
    quotes text from the file, so it is made printable here: no reader, the runtime's included,
    can pass a file's terminal escapes on to whoever prints the error."""

    def __init__(self, message: Any = "", *args: Any) -> None:
        super().__init__(printable(str(message)), *args)
