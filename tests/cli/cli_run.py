"""Running the `canzona` command in-process for the CLI tests."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest

from canzona.cli.main import main


def make_checkout(folder: Path) -> Path:
    """Make `folder` look like the root of a canzona checkout (where `plan` writes into the
    schedule library `schedules/`); returns its library folder."""
    (folder / "pyproject.toml").write_text('[project]\nname = "canzona"\n', encoding="utf-8")
    (folder / "schedules").mkdir(exist_ok=True)
    return folder / "schedules"


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`canzona ARGS`: (exit code, stdout, stderr)."""
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


# The functions that do a command's real work: a refusal of bad options must come before them.
PLANNING = ("canzona.cli.sources:load_source", "canzona.planner.predict.auto_alpha:plan_for_request")


def _forbid(target: str) -> mock._patch:  # type: ignore[type-arg]
    module, name = target.split(":")
    message = f"{name} ran: the refusal came after the work started, not before it"
    return mock.patch.object(importlib.import_module(module), name, side_effect=AssertionError(message))


def refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str, before: Sequence[str] = ()) -> str:
    """`canzona ARGS` must be bad input: exit 2, nothing on stdout, one plain `canzona: error:`
    line (no errno text, traceback or temporary file name) holding every needle. `before`:
    "module:function" names of the work the refusal must precede (they must not run; bounded
    by work done, not by the clock). Returns the line."""
    with ExitStack() as stack:
        for target in before:
            stack.enter_context(_forbid(target))
        code, out, err = run(args, capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("canzona: error: ") and err.count("\n") == 1, err
    assert "Errno" not in err and "Traceback" not in err and ".canzona-tmp" not in err, err
    for needle in needles:
        assert needle in err, err
    return err
