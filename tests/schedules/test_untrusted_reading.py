"""Schedules as untrusted input (issue 27), the reader's classes: each with a file built for it,
refused in one line (or read unchanged) within bounded time. Special files (FIFOs, sockets,
devices, directly or through a symlink), placeholder and row-block amplification, duplicate
keys inside table rows, and values of the wrong type or spelled in another YAML way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules import reading
from canzona.schedules.format import (
    Schedule,
    ScheduleError,
    dump_schedule,
    parse_schedule,
    read_schedule,
    schedule_fingerprint,
    sealed,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_qwen3.yaml"


@cache
def tiny() -> Schedule:
    """The tiny example at TP 2 x DP 2 (a parameter list: fc1 fused, QKV whole)."""
    return compile_schedule(make_plan(load_model(str(TINY), 2), PlanRequest(str(TINY), 2, 2)))


# Only a hang, or a pass that grows with the square of these inputs (minutes on them), reaches this
# bound: the refusals take well under a second on any machine, and speed is benchmarks/' business.
HANG_S = 60.0


@cache
def text() -> str:
    return dump_schedule(tiny())


def refused(document: str, *needles: str) -> str:
    started = time.perf_counter()
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(document, "plan.yaml")
    assert time.perf_counter() - started < HANG_S
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("plan.yaml: "), message
    for needle in needles:
        assert needle in message, message
    return message


def resealed(edit: Callable[[dict[str, Any]], Any]) -> str:
    """The tiny file after `edit`, its fingerprint and digest recomputed (a careful forger)."""
    data = tiny().model_dump(mode="json")
    edit(data)
    schedule = Schedule.model_validate(data)
    return dump_schedule(sealed(schedule.model_copy(update={"fingerprint": schedule_fingerprint(schedule)})))


def row_line(fragment: str) -> tuple[int, str]:
    """(line number, text) of the first row holding `fragment`."""
    return next((number, line) for number, line in enumerate(text().splitlines(), 1) if fragment in line)


# ---------------------------------------------------------------------------------------------
# Special files: refused before a byte is read (a FIFO without a writer would block forever)

READ = """
import sys
from canzona.schedules.format import ScheduleError, read_schedule
try:
    read_schedule(sys.argv[1])
    print("accepted")
except ScheduleError as error:
    print(error)
"""


def read_in_a_subprocess(path: Path) -> str:
    """read_schedule(path) in a child, so that a reader that blocks fails the test, not hangs it."""
    result = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("via_symlink", [False, True], ids=["direct", "symlink"])
def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path, via_symlink: bool) -> None:
    fifo = tmp_path / "s.yaml"
    os.mkfifo(fifo)
    path = fifo
    if via_symlink:
        path = tmp_path / "link.yaml"
        path.symlink_to(fifo)
    message = read_in_a_subprocess(path)  # opening it would block: the child's timeout fails the test
    assert message == f"cannot read schedule {str(path)!r}: not a regular file (a FIFO, a socket or a device)"


def test_sockets_and_devices_are_refused(tmp_path: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "s.yaml"))
        assert "not a regular file" in read_in_a_subprocess(tmp_path / "s.yaml")
    finally:
        server.close()
    if os.path.exists("/dev/zero"):
        (tmp_path / "zero.yaml").symlink_to("/dev/zero")
        assert "not a regular file" in read_in_a_subprocess(tmp_path / "zero.yaml")
    assert "a directory" in read_in_a_subprocess(tmp_path)


# ---------------------------------------------------------------------------------------------
# Amplification: no pass that grows with the square of the file


def test_placeholder_tokens_in_a_comment_cost_one_pass() -> None:
    for separator in (" ", ""):  # apart, and run together (overlapping occurrences)
        comment = "# " + separator.join(f"__canzona_rows{serial}_" for serial in range(120_000)) + "\n"
        started = time.perf_counter()
        assert parse_schedule(comment + text()) == tiny()
        assert time.perf_counter() - started < HANG_S


def test_a_placeholder_spelled_with_yaml_escapes_is_refused() -> None:
    """Escapes bring the token back after the reader chose it; splicing must not trust it."""
    refused('schema_version: 2\nparams: ["\\x5f_canzona_rows0_0"]\n', "placeholder")
    refused(text() + 'extra: ["\\x5f_canzona_rows0_0"]\n', "placeholder")


def test_twenty_thousand_matrices_with_distinct_row_blocks_are_checked_in_linear_time() -> None:
    rows = 40_000

    def many(data: dict[str, Any]) -> None:
        template = next(p for p in data["params"] if p["optimizer"] == "matrix")
        data["params"] = [
            dict(
                template,
                name=f"m{i}",
                index=i,
                shape=[rows, 8],
                tp_dim=None,
                numel=rows * 8,
                row_blocks=[[[0, i + 1]], [[i + 1, rows]]],
            )
            for i in range(20_000)
        ]

    refused(resealed(many))


@pytest.mark.parametrize("ranges", [[[0, 1]], [[1, 2]]])
def test_row_blocks_hold_at_most_one_range_per_row(ranges: list[list[int]]) -> None:
    def blocks(data: dict[str, Any]) -> None:
        fc1 = next(p for p in data["params"] if "linear_fc1" in p["name"])
        fc1["row_blocks"] = [ranges * 100_000]

    refused(resealed(blocks), "row block")


# ---------------------------------------------------------------------------------------------
# Duplicate keys inside a table row: a reviewer reading the first would be misled


@pytest.mark.parametrize(
    "duplicate", ['"offset": 8192', '"\\u006fffset": 8192', '"offset" : 8192'], ids=["plain", "escaped", "spaced"]
)
def test_a_key_twice_in_a_row_is_refused_with_its_line(duplicate: str) -> None:
    number, line = row_line('"offset": 4096')
    refused(
        text().replace(line, line.replace('"offset": 4096', '"offset": 4096, ' + duplicate)),
        f"line {number}",
        "'offset' appears twice",
    )


def test_a_key_twice_in_a_nested_object_of_a_row_is_refused() -> None:
    number, line = row_line('"index": 0, "params"')
    nested = line.replace(
        '"index": 0,', '"index": 0, "teams": [{"param": "a", "param": "b", "hosts": [0, 1], "load": 1.0}],'
    )
    refused(text().replace(line, nested), f"line {number}", "'param' appears twice")


# ---------------------------------------------------------------------------------------------
# Wrong types are refused, never converted


@pytest.mark.parametrize(
    "old, new, needles",
    [
        ('"index": 16,', '"index": "16",', ["params.0.index", "integer"]),
        ('"index": 16,', '"index": 16.0,', ["params.0.index", "integer"]),
        ('"shape": [64, 128]', '"shape": ["64", "128"]', ["params.0.shape.0", "integer"]),
        ('"owner": 0,', '"owner": false,', ["params.0.owner"]),
        ("  tp: 2\n", "  tp: '2'\n", ["request.tp", "integer"]),
        ("  tp: 2\n", "  tp: 2.0\n", ["request.tp", "integer"]),
        ("  tp: 2\n", "  tp: 0x2\n", ["tp: '0x2'", "not spelled as canzona writes"]),
        ("  tp: 2\n", "  tp: 0o2\n", ["request.tp", "integer"]),
        ("  dp: 2\n", "  dp: 1_0\n", ["dp: '1_0'", "not spelled"]),
        ("  dp: 2\n", "  dp: +2\n", ["dp: '+2'", "not spelled"]),
        ("  split_fc1: false\n", "  split_fc1: no\n", ["split_fc1: 'no'", "not spelled"]),
        ("  split_fc1: false\n", "  split_fc1: 0\n", ["request.split_fc1", "boolean"]),
        ("  alpha: 1.0\n", "  alpha: '1.0'\n", ["request.alpha", "number"]),
        ("  alpha: 1.0\n", "  alpha: 1.\n", ["alpha: '1.'", "not spelled"]),
    ],
)
def test_values_of_the_wrong_type_are_refused(old: str, new: str, needles: list[str]) -> None:
    document = text().replace(old, new, 1)
    assert document != text(), old
    refused(document, *needles)


def test_files_canzona_writes_still_read_unchanged() -> None:
    """Strict types and canonical spellings accept every file canzona writes (the library is
    checked byte for byte by tests/cli/test_files.py)."""
    assert parse_schedule(text()) == tiny()
    assert dump_schedule(parse_schedule(text())) == text()


def test_read_schedule_of_a_regular_file_still_works(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text())
    assert read_schedule(path) == tiny()


@pytest.mark.parametrize("field", ["global_batch", "seq_len", "micro_batches"])
def test_training_settings_are_bounded_like_every_integer(field: str) -> None:
    """Integers of 2^63 or more are refused everywhere, the simulator's training settings too."""
    settings = {"global_batch": 256, "seq_len": 4096, "micro_batches": 4, field: 10**30}
    line = "  training: {" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}\n"
    document = text().replace("  tp: ", line + "  tp: ", 1)
    refused(document, field)


def test_cr_line_endings_go_through_the_row_reader() -> None:
    """CR LF and lone CR line breaks (an editor's) are read as LF: the rows go through the row
    reader, under its limits, exactly as in the original (same rows, same JSON); NEL, LS and PS
    line breaks, which canzona never writes raw, are refused in one line."""
    original = reading.schedule_json(text())
    for newline in ("\r\n", "\r"):
        document = reading.schedule_json(text().replace("\n", newline))
        assert document.json == original.json and len(document.runs) == len(original.runs) > 0
        assert parse_schedule(text().replace("\n", newline)) == tiny()
    for odd in ("\x85", "\u2028", "\u2029"):
        refused(text().replace("\n", odd, 3), "line break")
