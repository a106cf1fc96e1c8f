"""A schedule file is untrusted: no reader runs code that a file names.

`check` regenerates a schedule from its recorded request; for a live model
(`py:MODULE:FACTORY`) that would import and call the module. These tests hand every reader
files whose request names hostile code (a module that writes a marker file, `os:abort`, an
absolute path outside the project) with and without a valid digest, and assert that nothing
runs: no marker, no dead process, exit 2 with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from canzona.cli.main import main
from canzona.schedules.format import read_schedule, sealed, write_schedule

from cli_run import run

HOSTILE = """
from pathlib import Path
Path(MARKER).write_text("imported")


def make():
    Path(MARKER).write_text("called")
    raise SystemExit(7)
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("planned") / "s.yaml"
    # No row blocks (tp 1, QKV as one matrix): a file a live model's plan could be, so that a
    # re-sealed source is a consistent file and only the code gate stands in the way.
    assert (
        main(["plan", "--model", "qwen3-0.6b", "--tp", "1", "--dp", "4", "--split-qkv", "none", "-o", str(target)]) == 0
    )
    return target


def hostile_module(folder: Path, marker: Path) -> Path:
    """A module that leaves `marker` behind if anything imports it or calls its factory."""
    folder.mkdir(parents=True, exist_ok=True)
    module = folder / "evil.py"
    module.write_text(HOSTILE.replace("MARKER", repr(str(marker))))
    return module


def with_source(planned: Path, target: Path, source: str, valid_digest: bool) -> Path:
    """`planned` with its request's model source replaced: re-sealed (a valid file) or edited
    by hand as the issue's `sed` did (the digest no longer matches)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if valid_digest:
        schedule = read_schedule(planned)
        model = schedule.request.model.model_copy(update={"source": source})
        write_schedule(
            sealed(schedule.model_copy(update={"request": schedule.request.model_copy(update={"model": model})})),
            target,
        )
    else:
        lines = planned.read_text().splitlines(keepends=True)
        lines = [f"    source: {source}\n" if line.startswith("    source: ") else line for line in lines]
        target.write_text("".join(lines))
    return target


def one_line_refusal(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith("canzona: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("valid_digest", [True, False], ids=["resealed", "hand-edited"])
@pytest.mark.parametrize("where", ["beside", "elsewhere"])
def test_check_runs_no_module_a_file_names(
    planned: Path, tmp_path: Path, valid_digest: bool, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    library = tmp_path / "lib"
    module = hostile_module(library if where == "beside" else tmp_path / "elsewhere", marker)
    schedule = with_source(planned, library / "s.yaml", f"py:{module}:make", valid_digest)
    code, out, err = run(["check", str(library)], capsys)
    needle = "cannot be regenerated without running code" if valid_digest else "invalid (digest"
    one_line_refusal(code, out, err, needle)
    assert not marker.exists()
    if where == "elsewhere":  # even the opt-in runs nothing outside the checked folder and the project
        code, out, err = run(["check", "--allow-code", str(schedule)], capsys)
        one_line_refusal(code, out, err, "is not a file inside" if valid_digest else "invalid (digest")
        assert not marker.exists()


def test_allow_code_runs_a_module_beside_the_schedule(
    planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The opt-in does what it says (so the refusals above are the gate's, not an accident)."""
    marker = tmp_path / "marker"
    library = tmp_path / "lib"
    module = hostile_module(library, marker)
    schedule = with_source(planned, library / "s.yaml", f"py:{module}:make", valid_digest=True)
    code, out, err = run(["check", "--allow-code", str(schedule)], capsys)
    assert marker.read_text() == "called"
    assert code == 2 and out == "" and err.count("\n") == 1  # SystemExit(7) from the factory: one line


@pytest.mark.parametrize("valid_digest", [True, False], ids=["resealed", "hand-edited"])
@pytest.mark.parametrize("allow_code", [False, True], ids=["default", "allow-code"])
def test_check_never_calls_os_abort(planned: Path, tmp_path: Path, valid_digest: bool, allow_code: bool) -> None:
    """`py:os:abort` would kill the process (exit 134): a subprocess, so a failure cannot kill pytest."""
    schedule = with_source(planned, tmp_path / "lib" / "s.yaml", "py:os:abort", valid_digest)
    command = [sys.executable, "-m", "canzona.cli", "check", *(["--allow-code"] if allow_code else []), str(schedule)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "CANZONA_DEBUG": "0"}
    )
    assert result.returncode == 2 and result.stdout == "", (result.returncode, result.stdout, result.stderr)
    assert result.stderr.startswith("canzona: error: ") and result.stderr.count("\n") == 1, result.stderr


def test_issue_reproduction_exits_2_and_runs_nothing(tmp_path: Path) -> None:
    """The reported commands, as a user types them: plan, edit the source with sed, check."""
    evil = tmp_path / "evil.py"
    marker = tmp_path / "marker"
    evil.write_text(HOSTILE.replace("MARKER", repr(str(marker))))
    cli = [sys.executable, "-m", "canzona.cli"]
    subprocess.run(
        [*cli, "plan", "--model", "qwen3-0.6b", "--tp", "1", "--dp", "4", "-o", "lib/s.yaml"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(["sed", "-i", f"s#source: .*#source: py:{evil}:make#", "lib/s.yaml"], cwd=tmp_path, check=True)
    result = subprocess.run([*cli, "check", "lib"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result
    assert not marker.exists()


@pytest.mark.parametrize("command", ["show", "diff", "simulate", "reshard-check", "table"])
def test_other_readers_never_run_code(
    planned: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    library = tmp_path / "lib"
    module = hostile_module(library, marker)
    schedule = with_source(planned, library / "s.yaml", f"py:{module}:make", valid_digest=True)
    args = {
        "show": [str(schedule)],
        "diff": [str(planned), str(schedule)],
        "simulate": [str(schedule)],
        "reshard-check": [str(planned), str(schedule)],
        "table": [str(library)],
    }[command]
    code, _, err = run([command, *args], capsys)
    assert code == (1 if command == "reshard-check" else 0), err  # reshard-check: "different models"
    assert not marker.exists()
