"""A schedule that does not fit the run fails on every rank with one clear error, quickly
(no rank is left waiting in a collective)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from canzona.runtime import CanzonaOptimizer, ScheduleMismatchError
from canzona.schedules.format import Schedule, write_schedule

from rt_harness import DATA, LONG_TIMEOUT, REFUSAL_S, make_groups, make_schedule, run_ranks_raw
from rt_oracle import full_params, ordered, shard

MODEL = DATA / "tiny_moe.json"


def _build(rank: int, schedule: Schedule | str, dp: int, tp: int, tamper: str | None = None) -> str:
    """Build the optimizer on this rank; 'built' or the error's message."""
    dp_group, tp_group = make_groups(dp, tp, LONG_TIMEOUT)
    spec = schedule if isinstance(schedule, Schedule) else make_schedule(MODEL, 2, 2)
    full = full_params(spec)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank % tp, tp))) for e in ordered(spec)]
    if tamper == "shape":
        params[3] = (params[3][0], torch.nn.Parameter(torch.zeros(7, 7)))
    elif tamper == "unknown":
        params[0] = ("bogus.weight", params[0][1])
    CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group)
    return "built"


def _expect_everywhere(outcomes: dict[int, tuple[str, Any]], *fragments: str) -> None:
    for rank, (status, message) in outcomes.items():
        assert status == "error", f"rank {rank}: {status} {message}"
        assert ScheduleMismatchError.__name__ in message or "ScheduleError" in message, message
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {message}"


def _wrong_model_on_rank_3(rank: int, world: int, schedule: Schedule) -> str:
    return _build(rank, schedule, 2, 2, tamper="shape" if rank == 3 else None)


def _unknown_parameter(rank: int, world: int, schedule: Schedule) -> str:
    return _build(rank, schedule, 2, 2, tamper="unknown")


def _dp4_layout(rank: int, world: int, schedule: Schedule) -> str:
    return _build(rank, schedule, 4, 1)


def _different_schedule_on_rank_2(rank: int, world: int, schedules: list[Schedule]) -> str:
    return _build(rank, schedules[rank == 2], 2, 2)


def _paths(rank: int, world: int, paths: list[str]) -> str:
    return _build(rank, paths[rank], 2, 2)


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    return make_schedule(MODEL, 2, 2)


def _run(fn: Any, *args: Any) -> dict[int, tuple[str, Any]]:
    started = time.monotonic()
    outcomes = run_ranks_raw(fn, 4, *args, timeout=2 * REFUSAL_S + 60)
    assert time.monotonic() - started < REFUSAL_S, "a mismatch must not wait for a collective timeout"
    return outcomes


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_wrong_model_on_one_rank_fails_everywhere(schedule: Schedule) -> None:
    outcomes = _run(_wrong_model_on_rank_3, schedule)
    _expect_everywhere(outcomes, "rank 3: parameters do not match the schedule", "local shape [7, 7]")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_unknown_parameter_fails_everywhere(schedule: Schedule) -> None:
    _expect_everywhere(_run(_unknown_parameter, schedule), "ranks 0, 1, 2, 3", "not in the schedule: bogus.weight")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_wrong_world_layout_fails_everywhere(schedule: Schedule) -> None:
    _expect_everywhere(
        _run(_dp4_layout, schedule), "the schedule is for DP 2 x TP 2, but the process groups are DP 4 x TP 1"
    )


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_one_rank_with_a_different_schedule_fails_everywhere(schedule: Schedule) -> None:
    other = make_schedule(MODEL, 2, 2, alpha=0.0)
    outcomes = _run(_different_schedule_on_rank_2, [schedule, other])
    _expect_everywhere(outcomes, "different schedules", "alpha 1,", "on ranks 0, 1, 3", "alpha 0,", "on rank 2")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_unreadable_schedule_on_one_rank_fails_everywhere(schedule: Schedule, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    write_schedule(schedule, good)
    paths = [str(good)] * 4
    paths[1] = str(tmp_path / "missing.yaml")
    _expect_everywhere(_run(_paths, paths), "rank 1: cannot read schedule")
