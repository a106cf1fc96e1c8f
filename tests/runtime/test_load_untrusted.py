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
def test_load_schedule_refuses_consistently_edited_files(
    schedule: Schedule, tmp_path: Path, edit: Any, needle: str
) -> None:
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


@pytest.mark.parametrize(
    "change",
    [
        {"ns_steps": 1},
        {"name": "soap"},
        {"name": "shampoo"},
        {"block_size": 64},
        {"precondition_frequency": 2},
        {"max_precond_dim": 8},
    ],
)
def test_load_schedule_refuses_resealed_optimizer_settings(
    schedule: Schedule, tmp_path: Path, change: dict[str, Any]
) -> None:
    """Issue 27: the runtime would execute the new settings while every cost, metric and
    micro-group was computed for the old ones."""
    data = schedule.model_dump(mode="json")
    data["request"]["optimizer"].update(change)
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sealed(Schedule.model_validate(data))))
    with pytest.raises(ScheduleError) as excinfo:
        load_schedule(path)
    assert "request" in str(excinfo.value) and "\n" not in str(excinfo.value)


def _swapped_shape_rank(rank: int, world: int) -> list[str]:
    """A DTensor [16, 8] split on dim 0 over TP 2 against entries whose shape and tp_dim were
    swapped ([8, 16] on dim 1): the local shard is [8, 8] either way."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from canzona.runtime.binding import placement_problems
    from canzona.schedules.format import ParamEntry

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    weight = distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)])
    common = dict(
        name="up.weight", index=0, dtype="fp32", optimizer="matrix", bucket=0, offset=0, numel=64, owner=0, cost=1.0
    )
    swapped = ParamEntry(shape=[8, 16], tp_dim=1, **common)
    same = ParamEntry(shape=[16, 8], tp_dim=0, **common)
    assert tuple(weight.to_local().shape) == (8, 8)
    return placement_problems(swapped, weight, 2) + ["--"] + placement_problems(same, weight, 2)


@pytest.mark.slow
def test_a_dtensors_full_shape_is_checked_against_the_schedule() -> None:
    from rt_harness import run_ranks

    for problems in run_ranks(_swapped_shape_rank, 2, timeout=60):
        swapped, same = problems[: problems.index("--")], problems[problems.index("--") + 1 :]
        assert any("full shape [16, 8], the schedule says [8, 16]" in p for p in swapped), swapped
        assert same == []


def test_load_schedule_errors_carry_no_terminal_escapes(schedule: Schedule, tmp_path: Path) -> None:
    """A row key spelled with JSON escapes in a pure-ASCII file (clear the screen, set the
    window title, ring the bell): the runtime's error names it printably, as `canzona show` does."""
    text = dump_schedule(schedule)
    row = next(line for line in text.splitlines() if line.lstrip().startswith('- {"name"'))
    hostile = row.replace('{"name"', '{"\\u001b[2J\\u001b]0;x\\u0007k": 1, "name"', 1)
    path = tmp_path / "escapes.yaml"
    path.write_text(text.replace(row, hostile), encoding="ascii")
    with pytest.raises(ScheduleError) as error:
        load_schedule(path)
    message = str(error.value)
    assert not any(ord(char) < 32 or ord(char) == 127 for char in message), repr(message)
    assert "\\x1b" in message and "\\x07" in message, message  # named, escaped
