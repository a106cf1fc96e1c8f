"""Schedules as untrusted input (issue 27), what the commands do with a hostile file: special
files refused by every reader, nothing from a file reaching the terminal unescaped, `check` going
through the same refusal path as `show` (never an internal error, even under --fix), bounded in
time (--timeout; SIGTERM stops a CP-SAT solve at once), and `diff` trusting no forged figure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from canzona.cli.main import main
from canzona.schedules.format import Schedule, dump_schedule, read_schedule, schedule_fingerprint, sealed

from cli_run import refused, run

READERS = ("show", "check", "simulate", "diff", "table", "reshard-check", "render")


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("planned") / "s.yaml"
    assert main(["plan", "--model", "qwen3-0.6b", "--tp", "2", "--dp", "2", "-o", str(target)]) == 0
    return target


def forged(planned: Path, target: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """`planned` after `edit`, re-sealed (fingerprint and digest recomputed)."""
    data = read_schedule(planned).model_dump(mode="json")
    edit(data)
    schedule = Schedule.model_validate(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        dump_schedule(sealed(schedule.model_copy(update={"fingerprint": schedule_fingerprint(schedule)})))
    )
    return target


def arguments(command: str, path: Path, good: Path, tmp_path: Path) -> list[str]:
    return {
        "show": [str(path)],
        "check": [str(path)],
        "simulate": [str(path)],
        "diff": [str(good), str(path)],
        "table": [str(path.parent)],
        "reshard-check": [str(good), str(path)],
        "render": [str(path), "-o", str(tmp_path / "out.png")],
    }[command]


# ---------------------------------------------------------------------------------------------
# Special files: every reader refuses them at once


@pytest.mark.parametrize("command", READERS)
def test_every_reader_refuses_a_fifo_at_once(planned: Path, tmp_path: Path, command: str) -> None:
    folder = tmp_path / "lib"
    folder.mkdir()
    fifo = folder / "s.yaml"
    os.mkfifo(fifo)
    # opening a FIFO with no writer blocks forever: only a reader that opens it reaches the timeout
    result = subprocess.run(
        [sys.executable, "-m", "canzona.cli", command, *arguments(command, fifo, planned, tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == "", result
    assert "not a regular file" in result.stderr and result.stderr.count("\n") == 1, result.stderr


# ---------------------------------------------------------------------------------------------
# Nothing from a file reaches the terminal unescaped

CONTROL = "\x1b[2J\x1b]0;owned\x07\u202e"
UNPRINTABLE = ("\x1b", "\x07", "\u202e")  # ESC, BEL, right-to-left override


@pytest.mark.parametrize("command", ["show", "simulate", "diff", "table", "reshard-check"])
def test_control_characters_from_a_file_are_escaped(
    planned: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def hostile(data: dict[str, Any]) -> None:
        data["request"]["model"]["name"] = f"tiny{CONTROL}"

    path = forged(planned, tmp_path / "lib" / "s.yaml", hostile)
    code, out, err = run([command, *arguments(command, path, planned, tmp_path)], capsys)
    assert code in (0, 1), err
    assert not any(char in out + err for char in UNPRINTABLE), (out + err)[:400]
    if command in ("show", "simulate"):
        assert "tiny\\x1b[2J\\x1b]0;owned\\x07\\u202e" in out


def test_check_escapes_the_writing_canzona_version(
    planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = forged(planned, tmp_path / "s.yaml", lambda d: d["request"].update(canzona_version=f"9{CONTROL}"))
    code, out, err = run(["check", str(path)], capsys)
    assert code == 1 and "written by canzona 9\\x1b[2J" in out
    assert not any(char in out + err for char in UNPRINTABLE)


def test_names_in_show_rank_are_escaped(planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def rename(data: dict[str, Any]) -> None:
        old = data["params"][0]["name"]
        data["params"][0]["name"] = new = f"x{CONTROL}"
        for group in (g for rank in data["tp"]["ranks"] for g in rank["groups"]):
            group["params"] = [new if name == old else name for name in group["params"]]
            for team in group.get("teams", []):
                team["param"] = new if team["param"] == old else team["param"]

    path = forged(planned, tmp_path / "s.yaml", rename)
    for rank in range(4):
        code, out, err = run(["show", str(path), "--rank", str(rank)], capsys)
        assert code == 0 and not any(char in out for char in UNPRINTABLE), err


# ---------------------------------------------------------------------------------------------
# check: the same reader and refusal path as show, never an internal error


def damaged(text: str) -> dict[str, str]:
    row = next(line for line in text.splitlines() if line.startswith("- {"))
    return {
        "truncated": text[: len(text) // 2],
        "truncated-row": text[: text.index(row) + 30],
        "flipped-bit": text[: text.index(row) + 9]
        + chr(ord(text[text.index(row) + 9]) ^ 0x10)
        + text[text.index(row) + 10 :],
        "deep-array": text.replace(
            row, row.replace('"cost": ', '"deep": ' + "[" * 50_000 + "]" * 50_000 + ', "cost": ')
        ),
        "5001-digits": text.replace(row, row.replace('"offset": 0', '"offset": ' + "9" * 5001)),
        "5001-digits-request": text.replace("  dp: 2\n", "  dp: " + "9" * 5001 + "\n"),
        "nul-byte": text.replace(row, row.replace('"bf16"', '"bf\\u0000\x0016"')),
        "request-too-large": text.replace("  dp: 2\n", "  dp: 99999999\n"),
        "no-request": text.replace("request:", "requests:"),
    }


@pytest.mark.parametrize("fix", [False, True], ids=["check", "check-fix"])
def test_check_never_reports_an_internal_error(
    planned: Path, tmp_path: Path, fix: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, text in damaged(planned.read_text()).items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        code, out, err = run(["check", str(path), *(["--fix"] if fix else [])], capsys)
        assert "internal error" not in err and "Traceback" not in err, (name, err)
        assert code in (0, 2), (name, code, err)
        if code == 2:
            assert out == "" and err.startswith("canzona: error: ") and err.count("\n") == 1, (name, err)
        else:  # --fix rewrote it from its request
            assert fix and read_schedule(path) == read_schedule(planned), name
        assert run(["show", str(path)], capsys)[0] == code, name  # show refuses what check refuses


def test_check_bounds_its_regeneration(planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(["check", str(planned), "--timeout", "0.001"], capsys, "takes longer than 0.001 s")  # stopped, not finished
    refused(["check", str(planned), "--timeout", "0"], capsys, "--timeout must be")


@pytest.mark.slow
def test_sigterm_stops_a_cp_sat_regeneration_at_once(tmp_path: Path) -> None:
    """A re-sealed request with the largest solver budget: check regenerates under CP-SAT, and a
    SIGTERM ends it, not the solve's 300 s budget (it used to wait for the solve)."""
    cheap = tmp_path / "cheap.yaml"
    assert (
        main(
            [
                "plan",
                "--model",
                "qwen3-0.6b",
                "--tp",
                "2",
                "--dp",
                "8",
                "--alpha",
                "0.5",
                "--solver",
                "ilp",
                "--time-limit",
                "0.2",
                "-o",
                str(cheap),
            ]
        )
        == 0
    )
    path = forged(cheap, tmp_path / "s.yaml", lambda d: d["request"].update(time_limit=300.0))
    process = subprocess.Popen(
        [sys.executable, "-m", "canzona.cli", "check", str(path), "--timeout", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(4.0)  # reading, validating and the greedy plan are done: CP-SAT is solving
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)  # a solve that ignored it would run its 300 s budget
    assert process.returncode == 143 and err == "canzona: terminated\n"


# ---------------------------------------------------------------------------------------------
# diff trusts no forged figure


def test_diff_refuses_an_old_file_claiming_ten_times_the_state(
    planned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def inflated(data: dict[str, Any]) -> None:
        for device in data["metrics"]["device"]:
            device["state_bytes"] *= 10
        data["metrics"]["dp"]["state_bytes"] = [10 * value for value in data["metrics"]["dp"]["state_bytes"]]

    old = forged(planned, tmp_path / "old.yaml", inflated)
    refused(["diff", str(old), str(planned), "--max-memory-increase", "0.05"], capsys, "state_bytes")
    code, _, _ = run(["diff", str(planned), str(planned), "--max-memory-increase", "0.05"], capsys)
    assert code == 0
