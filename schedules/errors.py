"""The error every schedule reader raises, in a module of its own: commands that only name it
(to turn it into one line and exit 2) load no YAML or pydantic for it."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule file that cannot be read or does not validate (one-line message)."""
