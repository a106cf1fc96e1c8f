"""Loading and checking schedules against live tensors, and verdict agreement (no ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canzona.runtime import load_schedule
from canzona.runtime.groups import resolve_param_groups
from canzona.runtime.rules.optimizers import Hyperparameters
from canzona.runtime.schedule import Verdict, check_schedule, disagreement
from canzona.schedules.format import Schedule, ScheduleError, write_schedule
from canzona.schedules.layout import local_shape

from rt_harness import DATA, make_schedule


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    return make_schedule(DATA / "tiny_moe.json", tp=2, dp=2)


def _live(schedule: Schedule) -> list[tuple[str, torch.Tensor]]:
    entries = sorted(schedule.params, key=lambda e: e.index)
    return [(e.name, torch.zeros(local_shape(e, schedule.request.tp, 0))) for e in entries]


def test_load_schedule_reads_a_planner_file(schedule: Schedule, tmp_path: Path) -> None:
    write_schedule(schedule, tmp_path / "s.yaml")
    assert load_schedule(tmp_path / "s.yaml") == schedule


def test_runtime_import_does_not_load_the_planner() -> None:
    code = (
        "import sys, canzona.runtime; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('typer', 'ortools') "
        "or m.startswith('canzona.planner') or m.startswith('canzona.cli')]; "
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _with_buckets(schedule: Schedule, **changes: object) -> Schedule:
    buckets = [schedule.dp.buckets[0].model_copy(update=changes)] + schedule.dp.buckets[1:]
    return schedule.model_copy(update={"dp": schedule.dp.model_copy(update={"buckets": buckets})})


def _with_first_group(schedule: Schedule, **changes: object) -> Schedule:
    rank = schedule.tp.ranks[0]
    groups = [rank.groups[0].model_copy(update=changes)] + rank.groups[1:]
    ranks = [rank.model_copy(update={"groups": groups})] + schedule.tp.ranks[1:]
    return schedule.model_copy(update={"tp": schedule.tp.model_copy(update={"ranks": ranks})})


def test_structural_checks(schedule: Schedule) -> None:
    check_schedule(schedule)
    numel = schedule.dp.buckets[0].numel
    with pytest.raises(ScheduleError, match="cuts must be 3 offsets"):
        check_schedule(_with_buckets(schedule, cuts=[0, numel]))
    with pytest.raises(ScheduleError, match="not increasing"):
        check_schedule(_with_buckets(schedule, cuts=[0, numel + 64, numel]))
    first = schedule.tp.ranks[0].groups[0]
    with pytest.raises(ScheduleError, match="hosts must be TP ranks"):
        check_schedule(_with_first_group(schedule, hosts=[5] * len(first.params)))
    with pytest.raises(ScheduleError, match="exactly the matrices it owns"):
        check_schedule(_with_first_group(schedule, params=first.params[1:], hosts=first.hosts[1:]))


def test_owner_must_hold_its_matrix(schedule: Schedule) -> None:
    params = [
        e.model_copy(update={"owner": 1 - e.owner}) if e.optimizer == "matrix" and e.owner is not None else e
        for e in schedule.params
    ]
    with pytest.raises(ScheduleError, match="not inside its owner's slice|exactly the matrices"):
        check_schedule(schedule.model_copy(update={"params": params}))


def _problems(schedule: Schedule, params: list) -> list[str]:
    hp = Hyperparameters().resolved(schedule.request.optimizer)
    entries = {e.name: e for e in schedule.params}
    return resolve_param_groups(params, entries, schedule.request.tp, schedule.request.optimizer.name, hp).problems


def test_parameter_problems_name_what_differs(schedule: Schedule) -> None:
    live = [(name, torch.nn.Parameter(tensor)) for name, tensor in _live(schedule)]
    assert _problems(schedule, live) == []
    assert _problems(schedule, live[:-1]) == [], "a subset is fine: the rest is not optimized"
    renamed = [("other", live[0][1])] + live[1:]
    assert "not in the schedule: other" in _problems(schedule, renamed)[0]
    swapped = [live[1], live[0]] + live[2:]
    assert "the schedule registers them the other way round" in _problems(schedule, swapped)[0]
    reshaped = live[:1] + [(live[1][0], torch.nn.Parameter(torch.zeros(3, 3)))] + live[2:]
    assert "local shape [3, 3]" in _problems(schedule, reshaped)[0]
    halfs = [(n, torch.nn.Parameter(t.detach().half())) for n, t in live]
    assert "dtype torch.float16" in _problems(schedule, halfs)[0]
    assert "plan with --dtype fp16" in _problems(schedule, halfs)[0]  # names the flag that fixes it
    name, tensor = next((n, t) for n, t in live if n.endswith("linear_proj.weight"))
    tensor.tensor_model_parallel, tensor.partition_dim = True, 0  # type: ignore[attr-defined]
    assert any("split along dim 0" in p for p in _problems(schedule, live))


def _verdict(
    rank: int, problem: str | None = None, fingerprint: str = "f", digest: str = "d", dp: int = 0, tp: int = 0
) -> Verdict:
    return Verdict(rank, dp, tp, problem, fingerprint, digest, f"plan {digest}")


def test_disagreement_messages() -> None:
    grid = [[_verdict(0, tp=0), _verdict(1, tp=1)], [_verdict(2, dp=1), _verdict(3, dp=1, tp=1)]]
    assert disagreement(grid) is None
    grid[1][1] = _verdict(3, "model does not match", dp=1, tp=1)
    assert disagreement(grid) == "canzona: the schedule does not fit this run; rank 3: model does not match"
    grid[1][1] = _verdict(3, digest="other", dp=1, tp=1)
    message = disagreement(grid)
    assert (
        message is not None and "different schedules" in message and "ranks 0, 1, 2" in message and "rank 3" in message
    )
    grid[1][1] = _verdict(3, fingerprint="g", dp=1, tp=1)
    assert "different models" in (disagreement(grid) or "")
    grid[1][1] = _verdict(3, dp=0, tp=1)
    assert "grid" in (disagreement(grid) or "")


def test_load_schedule_runs_the_validator_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a file runs the schedule validator; the runtime adds only its own check (the
    validator takes about 0.4 s on the largest library file, at every rank's launch)."""
    import canzona.runtime.schedule as runtime_schedule
    import canzona.schedules.validate as validate

    calls: list[str] = []
    original = validate.schedule_problem

    def counted(schedule: Schedule) -> str | None:
        calls.append(schedule.request.model.name)
        return original(schedule)

    monkeypatch.setattr(validate, "schedule_problem", counted)
    monkeypatch.setattr(runtime_schedule, "schedule_problem", counted)
    load_schedule("qwen3-8b/muon-tp2-dp4")
    assert calls == ["qwen3-8b"]


def test_load_schedule_by_library_name_and_errors() -> None:
    from canzona.runtime import load_schedule
    from canzona.schedules.format import ScheduleError
    from canzona.schedules.library import library_names

    assert "qwen3-32b/muon-tp8-dp32" in library_names()
    schedule = load_schedule("qwen3-32b/muon-tp8-dp32")
    assert (schedule.request.model.name, schedule.request.tp, schedule.request.dp) == ("qwen3-32b", 8, 32)
    with pytest.raises(ScheduleError, match="cannot read schedule 'qwen3-32b/nope'"):
        load_schedule("qwen3-32b/nope")
    moe = load_schedule("qwen3-30b-a3b/muon-tp2-dp16-ep8")  # expert parallelism loads (and executes)
    assert moe.request.ep == 8 and moe.dp.expert_buckets
