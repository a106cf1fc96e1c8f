"""The runtime's loader runs the schedule validator: files that once trained wrong, or failed
on every rank with a raw KeyError or IndexError, are refused at load with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from canzona.runtime import load_schedule
from canzona.schedules.format import Schedule, ScheduleError, dump_schedule, sealed, write_schedule

from rt_harness import DATA, make_schedule


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    return make_schedule(DATA / "tiny_moe.json", tp=2, dp=2)


def _matrix(data: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in data["params"] if p["optimizer"] == "matrix")


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: _matrix(d).update(optimizer="AdamW"), "unknown optimizer 'AdamW'"),
        (lambda d: _matrix(d).update(owner=99), "owner 99 is not a DP rank"),
        (lambda d: _matrix(d).update(row_blocks=[[]]), "row block"),
        (lambda d: d["dp"]["buckets"][0].update(numel=d["dp"]["buckets"][0]["numel"] + 10**12), "numel"),
        (lambda d: _matrix(d).update(ep_rank=0), "ep_rank"),
    ],
    ids=["optimizer", "owner", "row-blocks", "numel", "ep-rank"],
)
def test_load_schedule_refuses_consistently_edited_files(schedule: Schedule, tmp_path: Path, edit: Any, needle: str) -> None:
    data = schedule.model_dump(mode="json")
    edit(data)
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sealed(Schedule.model_validate(data))))
    with pytest.raises(ScheduleError) as excinfo:
        load_schedule(path)
    assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_load_schedule_refuses_a_hand_edit(schedule: Schedule, tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    write_schedule(schedule, path)
    path.write_text(path.read_text().replace('"owner": 0', '"owner": 1', 1))
    with pytest.raises(ScheduleError, match="digest does not match"):
        load_schedule(path)
