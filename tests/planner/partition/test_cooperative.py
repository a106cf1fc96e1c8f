"""Cooperative hosting: the cost model, the planner's decision, and the schedule's teams."""

from __future__ import annotations

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.cooperative import Shape, cooperate, team_comm_seconds, team_cost, team_flops
from canzona.planner.partition.costs import OptimizerConfig, muon_flops
from canzona.planner.partition.tp import MicroGroup, Task
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.planner.spec import PlanError
from canzona.schedules.format import ScheduleError, TeamEntry, dump_schedule, parse_schedule, sealed


def test_team_flops_split_the_long_side_and_repeat_the_gram_products() -> None:
    shape = Shape(51200, 5120, 1)
    assert shape.long_dim == 0 and Shape(512, 2048, None).long_dim == 1
    # One host does exactly Muon's FLOPs; k hosts each do 1/k of the c-proportional work.
    assert team_flops(shape, 1, 5) == pytest.approx(muon_flops(51200, 5120, 5))
    r, c = 5120, 51200
    assert team_flops(shape, 8, 5) == pytest.approx(5 * (4 * r * r * c / 8 + 2 * r**3) + 10 * r * c / 8)
    # Five r x r fp32 Gram all-reduces plus a norm: about 5 * 2 * (7/8) * 105 MB at 450 GB/s.
    assert team_comm_seconds(shape, 8, 5, 8) == pytest.approx(
        5 * (2 * 7 / 8 * 4 * r * r / 450e9 + 14 * 5e-6) + 14 * 5e-6, rel=1e-3
    )
    assert team_cost(shape, 8, 5, 8) > team_flops(shape, 8, 5)


def test_auto_teams_the_dominant_fc1_of_qwen3_32b_and_shortens_the_busiest_device() -> None:
    model = load_model("qwen3-32b", 8)
    off = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32, coop="off")))
    auto = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32)))
    assert off.metrics.tp.cooperative == 0 and off.request.coop == "off"
    assert auto.metrics.tp.cooperative > 0 and auto.request.coop == "auto"
    assert auto.metrics.tp.worst_device_load < 0.6 * off.metrics.tp.worst_device_load
    assert auto.metrics.tp.critical_time < 0.6 * off.metrics.tp.critical_time
    teamed = {team.param.split(".")[-2] for r in auto.tp.ranks for g in r.groups for team in g.teams}
    assert teamed == {"linear_fc1"}
    assert dump_schedule(compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32)))) == dump_schedule(auto)
    assert parse_schedule(dump_schedule(auto)) == auto


def test_teams_only_where_they_help_and_never_for_shampoo_or_numel() -> None:
    model = load_model("qwen3-32b", 8)
    for request in (
        PlanRequest("qwen3-32b", 8, 32, optimizer=OptimizerConfig("shampoo")),
        PlanRequest("qwen3-32b", 8, 32, cost="numel"),
    ):
        assert compile_schedule(make_plan(model, request)).metrics.tp.cooperative == 0
    # Many small matrices per rank: hosting is already balanced, a team only adds communication.
    small = load_model("qwen3-0.6b", 2)
    assert compile_schedule(make_plan(small, PlanRequest("qwen3-0.6b", 2, 2))).metrics.tp.cooperative == 0


def test_force_teams_every_eligible_matrix_over_all_tp_ranks() -> None:
    model = load_model("qwen3-0.6b", 2)
    schedule = compile_schedule(make_plan(model, PlanRequest("qwen3-0.6b", 2, 2, coop="force")))
    eligible = [p for p in model.params if p.optimizer == "matrix" and len(p.submatrices) == 1]
    assert schedule.metrics.tp.cooperative == len(eligible) > 0
    for rank in schedule.tp.ranks:
        assert all(team.hosts == [0, 1] for group in rank.groups for team in group.teams)


def test_cooperate_ties_two_dominant_matrices_and_keeps_the_rest_single() -> None:
    big, small = muon_flops(16384, 4096, 5), muon_flops(1024, 1024, 5)
    tasks = (Task("a", big, 40), Task("b", big, 40), Task("c", small, 4), Task("d", small, 4))
    shapes = {
        "a": Shape(16384, 4096, 0),
        "b": Shape(16384, 4096, 0),
        "c": Shape(1024, 1024, 0),
        "d": Shape(1024, 1024, 0),
    }
    groups = (MicroGroup((0, 1, 2, 3), (0, 1, 2, 3)),)
    (group,) = cooperate(tasks, groups, 4, shapes, 5, "auto", 10**9)
    teams = [t for t in group.teams if t is not None]
    assert len(teams) == 2 and all(len(t.hosts) >= 2 for t in teams)
    assert group.teams[2] is None and group.teams[3] is None
    assert cooperate(tasks, groups, 4, shapes, 5, "off", 10**9) == groups
    assert cooperate(tasks, groups, 4, {}, 5, "auto", 10**9) == groups


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(PlanError, match="cooperative hosting mode"):
        PlanRequest("qwen3-0.6b", 2, 2, coop="sometimes").validate()


def test_the_validator_refuses_bad_teams() -> None:
    model = load_model("qwen3-0.6b", 2)
    schedule = compile_schedule(make_plan(model, PlanRequest("qwen3-0.6b", 2, 2, coop="force")))
    group = next(g for g in schedule.tp.ranks[0].groups if g.teams)
    team = group.teams[0]
    for bad, message in (([0, 0], "distinct"), ([1], "distinct"), ([0, 1, 2], "distinct")):
        broken = schedule.model_copy(deep=True)
        target = next(g for g in broken.tp.ranks[0].groups if g.teams)
        object.__setattr__(target, "teams", [TeamEntry(param=team.param, hosts=bad, load=team.load)])
        with pytest.raises(ScheduleError, match=message):
            parse_schedule(dump_schedule(sealed(broken)))


def test_the_simulator_prices_teams_and_shortens_the_optimizer_stage_of_qwen3_32b() -> None:
    from canzona.planner.predict.hardware import BUILTIN
    from canzona.planner.predict.simulate import simulate
    from canzona.planner.predict.step import build_instance, default_time_model, team_seconds

    model = load_model("qwen3-32b", 8)
    off = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32, coop="off")))
    auto = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32)))
    h100 = BUILTIN["h100"]
    inst = build_instance(auto, h100, default_time_model(auto, h100))
    fc1 = inst.matrices["decoder.layers.0.mlp.linear_fc1.weight"]
    # A member of a team of 8 does 1/8 of the long-side work plus the replicated r^3 and the all-reduces.
    assert fc1.seconds / 8 < team_seconds(inst, fc1, 8) < fc1.seconds / 2
    before, after = simulate(off, h100).get("canzona"), simulate(auto, h100).get("canzona")
    assert after.optimizer_stage < 0.7 * before.optimizer_stage


def test_reshard_report_splits_a_teams_state_over_its_members() -> None:
    from canzona.schedules.reshard import matrix_hosts, reshard_report

    model = load_model("qwen3-32b", 8)
    teamed = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32)))
    plain = compile_schedule(make_plan(model, PlanRequest("qwen3-32b", 8, 32, coop="off")))
    hosts = matrix_hosts(teamed)
    team = next(t for g in teamed.tp.ranks[0].groups for t in g.teams)
    assert hosts[team.param] == tuple(team.hosts) and len(hosts[team.param]) == 2
    same = reshard_report(teamed, teamed)
    assert same.compatible and sum(same.moved_in) == 0
    # The team writes what one host would (its slices add up), and reads it back as it wrote it.
    assert sum(same.writes) == sum(reshard_report(plain, plain).writes)
    assert sum(same.loads) == sum(reshard_report(plain, plain).loads)
    moved = reshard_report(teamed, plain)
    assert moved.compatible and sum(moved.moved_in) > 0 and sum(moved.writes) == sum(same.writes)
