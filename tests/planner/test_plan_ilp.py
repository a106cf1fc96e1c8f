"""`--solver ilp` at the plan level: never worse than greedy, deterministic, optional."""

from __future__ import annotations

import sys

import pytest

from canzona.cli.main import main
from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules.format import dump_schedule

pytest.importorskip("ortools")


def schedule(solver: str, **kwargs: object):
    request = PlanRequest("qwen3-0.6b", 2, 4, alpha=0.0, bucket_size=8_000_000, solver=solver, time_limit=2.0, **kwargs)
    return compile_schedule(make_plan(load_model("qwen3-0.6b", 2), request))


def test_ilp_never_worse_than_greedy_and_records_its_report() -> None:
    greedy, ilp = schedule("greedy", order="registration"), schedule("ilp")  # ilp: registration by default
    assert ilp.request.order == "registration"
    assert ilp.metrics.dp.max <= greedy.metrics.dp.max * (1 + 1e-12)
    assert ilp.metrics.tp.critical_time <= greedy.metrics.tp.critical_time * (1 + 1e-12)
    report = ilp.metrics.solver
    assert report is not None and greedy.metrics.solver is None
    assert report.dp_status in {"OPTIMAL", "FEASIBLE"}
    assert report.dp_bound <= ilp.metrics.dp.max * (1 + 1e-9)
    assert report.dp_accepted == ("cp-sat" in ilp.metrics.dp.method)
    assert ilp.request.solver == "ilp" and ilp.request.time_limit == 2.0


def test_ilp_output_is_byte_identical_for_the_same_seed() -> None:
    assert dump_schedule(schedule("ilp", seed=7)) == dump_schedule(schedule("ilp", seed=7))


def test_ilp_without_ortools_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    for name in [m for m in sys.modules if m == "ortools" or m.startswith("ortools.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ortools", None)
    target = tmp_path / "x.yaml"
    code = main(["plan", "--model", "qwen3-0.6b", "--dp", "2", "--solver", "ilp", "-o", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "canzona: error: --solver ilp needs OR-Tools: pip install 'canzona[ilp]'"
    assert not target.exists()
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(target)]) == 0  # greedy needs none
