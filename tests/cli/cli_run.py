"""Running the `canzona` command in-process for the CLI tests."""

from __future__ import annotations

import time
from pathlib import Path

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


def refused(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str, seconds: float | None = 10.0) -> str:
    """`canzona ARGS` must be bad input: exit 2, nothing on stdout, one plain `canzona: error:`
    line (no errno text, traceback or temporary file name) holding every needle, within
    `seconds` (refused before the work, not after it; None: no limit). Returns the line."""
    started = time.perf_counter()
    code, out, err = run(args, capsys)
    if seconds is not None:
        assert time.perf_counter() - started < seconds
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("canzona: error: ") and err.count("\n") == 1, err
    assert "Errno" not in err and "Traceback" not in err and ".canzona-tmp" not in err, err
    for needle in needles:
        assert needle in err, err
    return err
