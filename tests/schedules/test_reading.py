"""The safe reader: what a schedule file may not contain, refused fast, in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules import format as fmt
from canzona.schedules.format import Schedule, ScheduleError, dump_schedule, parse_schedule, read_schedule


@cache
def text() -> str:
    return dump_schedule(compile_schedule(make_plan(load_model("qwen3-0.6b", 1), PlanRequest("qwen3-0.6b", 1, 2))))


def refused(document: str, *needles: str) -> str:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(document, "plan.yaml")
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("plan.yaml: ")
    for needle in needles:
        assert needle in message, message
    return message


def alias_bomb(levels: int = 9) -> str:
    """The issue's 478-byte bomb: each level a list of nine aliases of the previous one."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, levels)]
    return "\n".join(lines) + "\n"


PROBE = """
import resource, sys, time
from canzona.schedules.format import ScheduleError, parse_schedule
document = sys.stdin.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    parse_schedule(document, "x.yaml")
    print("accepted")
except ScheduleError as error:
    print(error)
print(time.perf_counter() - started)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.parametrize(
    "document, needles",
    [
        (alias_bomb(), ("aliases",)),
        # Deep flow nesting: our scanner or, first, libyaml's own depth limit refuses it (which
        # one depends on the libyaml version; what matters is the refusal and its bounds).
        ("a: " + "[" * 30_000 + "]" * 30_000 + "\n", ()),  # segfaulted libyaml's composer
        ("a: " + "[" * 20_000 + "\n", ()),
        ("a: " + "{b: " * 1_000 + "\n", ()),  # once a RecursionError
    ],
    ids=["alias-bomb", "30k-brackets", "20k-brackets", "1k-mappings"],
)
def test_bombs_are_refused_within_100_mb(document: str, needles: tuple[str, ...]) -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], input=document, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    message, seconds, grown_kib = result.stdout.splitlines()
    assert message != "accepted" and message.startswith("x.yaml: "), message  # one line, naming the file
    assert all(needle in message for needle in needles), message
    assert float(seconds) < 60  # only a hang, or an expansion the memory bound would also catch, reaches it
    assert int(grown_kib) < 100 * 1024  # ru_maxrss is in KiB on Linux: the work bound


@pytest.mark.parametrize(
    "snippet, needle",
    [
        ("extra: &anchor 1\n", "anchors"),
        ("extra: !!binary aGVsbG8=\n", "tags"),
        ("extra: !!python/object/apply:os.system [echo]\n", "tags"),
        ("extra: !custom 3\n", "tags"),
        ("<<: {schema_version: 2}\n", "merge keys"),
        ("? [complex, key]\n: 1\n", "plain names"),
        ("schema_version: 2\n", "appears twice"),
    ],
)
def test_yaml_tricks_are_refused(snippet: str, needle: str) -> None:
    refused(text() + snippet, needle)


def test_a_duplicate_key_inside_the_request_is_refused() -> None:
    refused(text().replace("  tp: 1\n", "  tp: 1\n  tp: 4\n", 1), "'tp' appears twice", "line ")


def test_directives_and_multiple_documents_are_refused() -> None:
    refused("%TAG !e! tag:example.com,2000:\n---\n" + text(), "%TAG")
    refused(text() + "---\nschema_version: 2\n", "not valid YAML")


@pytest.mark.parametrize(
    "pattern, replacement, needles",
    [
        (r'"cost": [0-9.e+]+', '"cost": NaN', ["params.0.cost", "finite"]),
        (r'"cost": [0-9.e+]+', '"cost": 1e999', ["params.0.cost", "finite"]),
        (r"alpha: 1.0", "alpha: .nan", ["request.alpha", "finite"]),
        (r"(?m)^    max: .*$", "    max: .inf", ["metrics.dp.max", "finite"]),
        (r"  tp: 1\n", "  tp: " + "1" * 5000 + "\n", ["4300 digits"]),
        (r'"offset": \d+', '"offset": ' + "1" * 5000, ["line 2", "4300 digits"]),
        (r'"offset": \d+', '"offset": ' + "9" * 1000, ["params.0.offset", "less than or equal"]),
        (r'"cost": ', '"deep": ' + "[" * 30_000 + "]" * 30_000 + ', "cost": ', ["line 2", "not one JSON object"]),
        (r"\}\n", "} trailing words\n", ["line 2", "optionally followed by a # comment"]),
        (r"\}\n", "}#no-space\n", ["line 2", "optionally followed by a # comment"]),
        (r'"owner": ', '"owner" ', ["line 2", "not one JSON object"]),
        (r"canzona_version: .*", "canzona_version: 2001-01-01", ["not plain data"]),
    ],
    ids=[
        "row-nan",
        "row-inf",
        "nan",
        "inf",
        "5000-digits",
        "5000-digits-row",
        "1000-digits",
        "deep-row",
        "row-junk",
        "comment-without-space",
        "row-syntax",
        "timestamp",
    ],
)
def test_unusual_values_fail_in_one_line(pattern: str, replacement: str, needles: list[str]) -> None:
    document, count = re.subn(pattern, replacement, text(), count=1)
    assert count == 1
    line = next(i for i, row in enumerate(text().splitlines(), 1) if row.startswith("- {"))
    refused(document, *[needle.replace("line 2", f"line {line}") for needle in needles])


def test_rows_mixed_with_block_entries_are_refused() -> None:
    document = text().replace("\nfingerprint", "\n- plain entry\nfingerprint", 1)
    lines = text().splitlines()
    first_row = next(i for i, row in enumerate(lines) if row.startswith("- {"))
    mixed = "\n".join(lines[: first_row + 1] + ["- name: block"] + lines[first_row + 1 :])
    refused(mixed, "mixed")
    refused(document)


def test_size_limit_and_special_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(text())
    monkeypatch.setattr(fmt, "MAX_SCHEDULE_BYTES", len(text()) - 1)
    with pytest.raises(ScheduleError, match="larger than"):
        read_schedule(path)
    monkeypatch.undo()
    assert isinstance(read_schedule(path), Schedule)
    if os.path.exists("/dev/zero"):
        with pytest.raises(ScheduleError, match="not a regular file"):
            read_schedule("/dev/zero")
    path.write_bytes(b"schema_version: 2\n\xff\n")
    with pytest.raises(ScheduleError, match="not UTF-8"):
        read_schedule(path)


def test_json_and_yaml_readings_agree_on_every_library_row_shape() -> None:
    """The reader hands pydantic exactly what a full YAML parse of the file would give."""
    import yaml

    from canzona.schedules import reading

    data = json.loads(reading.schedule_json(text()).json)
    assert data == yaml.safe_load(text())


def test_the_schedules_package_imports_neither_planner_nor_runtime() -> None:
    code = (
        "import sys, canzona.schedules.format, canzona.schedules.validate, canzona.schedules.files, "
        "canzona.schedules.library, canzona.schedules.reshard; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'typer', 'ortools') "
        "or m.startswith(('canzona.planner', 'canzona.runtime', 'canzona.cli'))]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
