"""The schedule file: round trips, the fast loader, validation errors, atomic writes."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ADAMW, MATRIX, ModelSpec, ParamSpec
from canzona.schedules import format as fmt
from canzona.schedules import reading
from canzona.schedules.format import (
    SCHEMA_VERSION,
    Schedule,
    ScheduleError,
    dump_schedule,
    parse_schedule,
    read_schedule,
    schedule_fingerprint,
    write_schedule,
)


@cache
def preset() -> Schedule:
    request = PlanRequest("qwen3-0.6b", 1, 4, optimizer=OptimizerConfig("muon"), cost="flops", alpha=0.5)
    return compile_schedule(make_plan(load_model("qwen3-0.6b", 1), request))


def toy_model(names: tuple[str, ...] = ("w0", "norm", "w1"), model_name: str = "toy") -> ModelSpec:
    params = []
    for i, name in enumerate(names):
        if i % 3 == 1:
            params.append(ParamSpec(name, (16,), None, ADAMW, dtype="fp32"))
        else:
            params.append(ParamSpec(name, (8 + i, 4), 0, MATRIX, submatrices=((8 + i, 4),)))
    return ModelSpec(model_name, tuple(params), "test")


def toy(names: tuple[str, ...] = ("w0", "norm", "w1"), model_name: str = "toy") -> Schedule:
    request = PlanRequest(model_name, 1, 2, cost="numel", bucket_size=64)
    return compile_schedule(make_plan(toy_model(names, model_name), request))


def edited(schedule: Schedule, edit) -> str:
    """The schedule's text after `edit(data)` on its plain data (re-dumped, flow rows kept)."""
    data = schedule.model_dump(mode="json")
    edit(data)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message.strip()
    for needle in needles:
        assert needle in message


# ---------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_equals_the_model() -> None:
    schedule = preset()
    text = dump_schedule(schedule)
    assert parse_schedule(text) == schedule
    assert dump_schedule(parse_schedule(text)) == text


def test_dump_writes_one_row_per_line() -> None:
    schedule = preset()
    text = dump_schedule(schedule)
    row_lines = [line for line in text.splitlines() if line.lstrip().startswith("- {")]
    rows = [json.loads(line.lstrip()[2:]) for line in row_lines]  # every row is a JSON object
    data = schedule.model_dump(mode="json", exclude_defaults=True)  # fields at their default are left out
    tables = data["params"] + data["dp"]["buckets"] + data["dp"]["adamw_buckets"]
    assert len(rows) >= len(tables)
    assert all(row in rows for row in tables)


def fast(text: str) -> dict:
    """What the safe reader hands to pydantic, as plain data."""
    return json.loads(reading.schedule_json(text).json)


def test_fast_loader_agrees_with_a_full_safe_load() -> None:
    schedule = preset()
    text = dump_schedule(schedule)
    full = yaml.load(text, Loader=yaml.SafeLoader)
    assert fast(text) == full
    assert Schedule.model_validate(full) == schedule
    assert Schedule.model_validate(fast(text)) == schedule


def test_block_style_rows_still_parse() -> None:
    schedule = preset()
    data = yaml.safe_load(dump_schedule(schedule))
    block = yaml.safe_dump(data, sort_keys=False)
    assert "- {" not in block and "- name:" in block
    assert parse_schedule(block) == schedule


# Regression (issue 14): one row that was not plain JSON sent the whole file through a full YAML
# parse, 10x slower. A row is now one JSON object (optionally followed by a # comment) or the
# file is refused with one line naming the row's line.
def test_non_json_flow_rows_are_refused_with_their_line() -> None:
    schedule = toy()
    lines = dump_schedule(schedule).splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("- {"))
    flow = yaml.safe_dump(json.loads(lines[row][2:]), default_flow_style=True, width=1 << 16).strip()
    lines[row] = f"- {flow}"
    assert yaml.safe_load("\n".join(lines)) == yaml.safe_load(dump_schedule(schedule))  # the same YAML
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule("\n".join(lines) + "\n", "plan.yaml")
    assert_one_line_error(excinfo, "plan.yaml", f"line {row + 1}", "JSON")


def test_rows_with_trailing_comments_stay_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = toy()
    lines = [
        f"{line}  # note #{i}" if line.lstrip().startswith("- {") else line
        for i, line in enumerate(dump_schedule(schedule).splitlines())
    ]

    def no_yaml(*args, **kwargs):
        raise AssertionError("rows must never be composed as YAML")

    skeleton_load = reading.yaml.load
    monkeypatch.setattr(
        reading.yaml, "load", lambda text, Loader: no_yaml() if "- {" in text else skeleton_load(text, Loader=Loader)
    )
    assert parse_schedule("\n".join(lines) + "\n") == schedule


def test_crlf_and_bom_still_parse() -> None:
    schedule = toy()
    text = dump_schedule(schedule)
    assert parse_schedule(text.replace("\n", "\r\n")) == schedule
    assert parse_schedule("\ufeff" + text) == schedule


def _with_line_between_rows(text: str, extra: str) -> str:
    lines = text.split("\n")
    second_row = [i for i, line in enumerate(lines) if line.startswith("- {")][1]
    lines.insert(second_row, extra)
    return "\n".join(lines)


# Regression: _load_fast once started a new table after any non-row line, so a comment or blank
# line between two rows left two row tokens in one list and valid YAML was rejected.
@pytest.mark.parametrize("extra", ["# second half", "", "   ", "  # indented comment"])
def test_comment_or_blank_line_between_rows(extra: str) -> None:
    schedule = toy()
    text = _with_line_between_rows(dump_schedule(schedule), extra)
    assert Schedule.model_validate(yaml.load(text, Loader=yaml.SafeLoader)) == schedule
    assert parse_schedule(text) == schedule


def test_read_and_write_round_trip(tmp_path: Path) -> None:
    schedule = toy()
    path = tmp_path / "nested" / "plan.yaml"
    write_schedule(schedule, path)
    assert read_schedule(path) == schedule
    assert path.read_text(encoding="utf-8") == dump_schedule(schedule)
    assert sorted(os.listdir(path.parent)) == ["plan.yaml"]


def test_large_and_small_floats_survive_as_floats() -> None:
    schedule = toy()
    data = schedule.model_dump(mode="json")
    data["params"][0]["cost"] = 1e20
    data["params"][1]["cost"] = 1e-20
    data["metrics"]["dp"]["max"] = 1e20
    data["metrics"]["dp"]["load"][0] = 3e300
    data["dp"]["buckets"][0]["padding_overhead"] = 2.0
    tampered = Schedule.model_validate(data)
    text = dump_schedule(tampered)
    for loaded in (fast(text), yaml.load(text, Loader=yaml.SafeLoader)):
        assert loaded["params"][0]["cost"] == 1e20 and isinstance(loaded["params"][0]["cost"], float)
        assert loaded["params"][1]["cost"] == 1e-20 and isinstance(loaded["params"][1]["cost"], float)
        assert loaded["metrics"]["dp"]["max"] == 1e20 and isinstance(loaded["metrics"]["dp"]["max"], float)
        assert loaded["metrics"]["dp"]["load"][0] == 3e300
        assert isinstance(loaded["dp"]["buckets"][0]["padding_overhead"], float)
    assert Schedule.model_validate_json(reading.schedule_json(text).json) == tampered


finite_floats = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(finite_floats, finite_floats, st.lists(finite_floats, min_size=2, max_size=2))
def test_any_finite_float_round_trips(cost: float, maximum: float, load: list[float]) -> None:
    data = toy().model_dump(mode="json")
    data["params"][0]["cost"] = cost
    data["metrics"]["dp"]["max"] = maximum
    data["metrics"]["dp"]["load"] = load
    schedule = Schedule.model_validate(data)
    text = dump_schedule(schedule)
    assert Schedule.model_validate_json(reading.schedule_json(text).json) == schedule
    full = yaml.load(text, Loader=yaml.SafeLoader)
    assert full == fast(text)
    assert isinstance(full["params"][0]["cost"], float)


# Any character but lone surrogates (which cannot be encoded as UTF-8 at all).
names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(names, min_size=3, max_size=3, unique=True), names)
def test_any_names_round_trip(param_names: list[str], model_name: str) -> None:
    schedule = toy(tuple(param_names), model_name)
    text = dump_schedule(schedule)
    assert parse_schedule(text) == schedule
    assert Schedule.model_validate(yaml.load(text, Loader=yaml.SafeLoader)) == schedule
    assert parse_schedule(_force_fallback(text)) == schedule


def _force_fallback(text: str) -> str:
    """The same document with one row line no longer JSON (a trailing comment)."""
    lines = text.split("\n")
    row = next(i for i, line in enumerate(lines) if line.lstrip().startswith("- {"))
    lines[row] += "  # hand-edited row: not JSON any more"
    return "\n".join(lines)


@pytest.mark.parametrize("char", ["\x7f", "\x85", "\x9f", "\u2028", "\u2029", "\ufeff", "\ufffe", "\t", "\r", "\n"])
def test_special_characters_in_names(char: str) -> None:
    schedule = toy((f"a{char}b", "norm", "w1"))
    text = dump_schedule(schedule)
    assert parse_schedule(text) == schedule
    assert parse_schedule(_force_fallback(text)) == schedule
    assert Schedule.model_validate(yaml.load(text, Loader=yaml.SafeLoader)) == schedule


# Regression: rows were once written with json.dumps(ensure_ascii=True), which spells a
# character beyond U+FFFF as a surrogate pair ("\\ud83d\\ude00"). YAML has no surrogate pairs,
# so a full YAML parse read two lone surrogates (SafeLoader) or failed (libyaml).


def test_non_bmp_name_reads_the_same_with_a_full_yaml_parse() -> None:
    schedule = toy(("w\U0001f600", "norm", "w1"))
    text = dump_schedule(schedule)
    assert parse_schedule(text) == schedule  # the fast path is fine
    assert yaml.load(text, Loader=yaml.SafeLoader) == fast(text)
    assert Schedule.model_validate(yaml.load(text, Loader=yaml.SafeLoader)) == schedule


def test_non_bmp_name_survives_the_fallback_path() -> None:
    schedule = toy(("w\U0001f600", "norm", "w1"))
    assert parse_schedule(_force_fallback(dump_schedule(schedule))) == schedule


# ---------------------------------------------------------------------------------------------
# Validation errors


def test_tampered_fingerprint_is_rejected() -> None:
    schedule = toy()
    text = dump_schedule(schedule).replace(schedule.fingerprint, "0" * 64)
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(text, "plan.yaml")
    assert_one_line_error(excinfo, "fingerprint", "plan.yaml")


def test_tampered_shape_is_rejected() -> None:
    schedule = toy()
    text = dump_schedule(schedule)
    first = schedule.params[0]
    old = f'"shape": [{first.shape[0]}, {first.shape[1]}]'
    assert text.count(old) == 1
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(text.replace(old, f'"shape": [{first.shape[0] + 1}, {first.shape[1]}]'))
    assert_one_line_error(excinfo, "fingerprint")


@pytest.mark.parametrize("field", ["name", "dtype", "tp_dim"])
def test_tampered_identity_fields_are_rejected(field: str) -> None:
    values = {"name": "renamed", "dtype": "fp16", "tp_dim": 1}

    def edit(data):
        data["params"][0][field] = values[field]

    with pytest.raises(ScheduleError, match="fingerprint"):
        parse_schedule(edited(toy(), edit))


def test_reordered_rows_keep_the_fingerprint_but_not_the_digest() -> None:
    schedule = toy()

    def edit(data):
        data["params"].reverse()

    text = edited(schedule, edit)
    assert schedule_fingerprint(Schedule.model_validate(yaml.safe_load(text))) == schedule.fingerprint
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(text, "plan.yaml")
    assert_one_line_error(excinfo, "plan.yaml", "digest", "canzona check --fix")


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(extra=1),
        lambda d: d["params"][0].update(colour="red"),
        lambda d: d["request"].update(temperature=3),
        lambda d: d["metrics"]["dp"]["baselines"]["dp-sc"].update(note="x"),
    ],
)
def test_unknown_field_is_rejected(edit) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(toy(), edit), "x.yaml")
    assert_one_line_error(excinfo, "x.yaml", "invalid schedule")


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["params"][0].pop("owner"),
        lambda d: d["request"].update(dp=0),
        lambda d: d["request"].update(alpha=1.5),
        lambda d: d["params"][0].update(numel="many"),
    ],
)
def test_invalid_values_are_rejected(edit) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(toy(), edit))
    assert_one_line_error(excinfo, "invalid schedule")


@pytest.mark.parametrize("version", [0, 1, 3, "2", None, True])
def test_wrong_schema_version_is_rejected(version) -> None:
    def edit(data):
        data["schema_version"] = version

    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(toy(), edit))
    assert_one_line_error(excinfo, "schema_version", str(SCHEMA_VERSION))


def test_missing_schema_version_is_rejected() -> None:
    with pytest.raises(ScheduleError, match="schema_version"):
        parse_schedule(edited(toy(), lambda d: d.pop("schema_version")))


@pytest.mark.parametrize("text", ["a: [1, 2", "key: {", "\tx: 1\n", "a: 'unterminated\n", "a: b: c\n"])
def test_not_yaml_is_rejected(text: str) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(text, "broken.yaml")
    assert_one_line_error(excinfo, "broken.yaml", "not valid YAML")


@pytest.mark.parametrize("text", ["", "just text\n", "- 1\n- 2\n", "42\n", "null\n", '- {"a": 1}\n'])
def test_not_a_mapping_is_rejected(text: str) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(text, "list.yaml")
    assert_one_line_error(excinfo, "list.yaml", "mapping")


def test_unreadable_paths_are_rejected(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ScheduleError) as excinfo:
        read_schedule(missing)
    assert_one_line_error(excinfo, "missing.yaml")
    with pytest.raises(ScheduleError) as excinfo:
        read_schedule(tmp_path)  # a directory
    assert_one_line_error(excinfo, str(tmp_path))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ScheduleError) as excinfo:
        read_schedule(binary)
    assert_one_line_error(excinfo, "binary.yaml")


def test_read_schedule_reports_validation_errors_with_the_path(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(edited(toy(), lambda d: d.update(schema_version=99)), encoding="utf-8")
    with pytest.raises(ScheduleError) as excinfo:
        read_schedule(path)
    assert_one_line_error(excinfo, str(path), "schema_version")


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


# ---------------------------------------------------------------------------------------------
# Atomic writes


def test_write_is_atomic_when_serialisation_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.yaml"
    write_schedule(toy(), path)
    before = path.read_bytes()

    def explode(schedule):
        raise RuntimeError("boom")

    monkeypatch.setattr(fmt, "dump_schedule", explode)
    with pytest.raises(RuntimeError, match="boom"):
        write_schedule(toy(("a", "b", "c")), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.yaml"]


def test_write_is_atomic_when_the_disk_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.yaml"
    write_schedule(toy(), path)
    before = path.read_bytes()

    def no_sync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fmt.os, "fsync", no_sync)
    with pytest.raises(OSError):
        write_schedule(toy(("a", "b", "c")), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.yaml"]
    assert read_schedule(path) == toy()


def test_write_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    write_schedule(toy(), path)
    other = toy(("a", "b", "c"))
    write_schedule(other, path)
    assert read_schedule(path) == other
    assert os.listdir(tmp_path) == ["plan.yaml"]
