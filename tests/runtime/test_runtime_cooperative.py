"""Cooperative hosting (schedule teams, Muon): each team member gets its slice of the gathered
matrix, runs its part of Newton-Schulz with the r x r Gram all-reduced over the team, and
scatters its part of the result. Every rank's parameters equal the single-process reference
(rtol 1e-5) after several steps: TP 2 x DP 2 and TP 4, matrices whose long side is the TP dim,
is not, or is replicated, fused fc1 (row blocks), fp32 and bf16, teams of different members,
a training recipe on the meta default device, DTensor parameters and expert parallelism.
Checkpoints move between teamed and plain schedules; a member failing inside Newton-Schulz
fails the step on every rank with nothing applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rt_harness import DATA, labelled, make_schedule, reload_and_step, run_ranks
from rt_oracle import compare, reference_run, train_worker

STEPS = 5
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}
MODEL = DATA / "tiny_moe.json"  # at TP 2: routers (replicated), experts (TP dim = short side), fc1 row blocks
MODEL_TP4 = DATA / "tiny_qwen3_tp4.json"  # dense, TP 4


def _teamed(tp: int, dp: int, **options: Any) -> Any:
    schedule = make_schedule(MODEL if tp == 2 else MODEL_TP4, tp, dp, coop="force", **options)
    teams = [team for rank in schedule.tp.ranks for group in rank.groups for team in group.teams]
    assert teams and all(team.hosts == list(range(tp)) for team in teams)
    entries = {e.name: e for e in schedule.params}
    kinds = {
        (entries[t.param].tp_dim, 0 if entries[t.param].shape[0] > entries[t.param].shape[1] else 1) for t in teams
    }
    assert len(kinds) >= (4 if tp == 2 else 2), f"want several geometries (tp dim, long dim), got {kinds}"
    return schedule


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("tp", "dp"), [(2, 2), (4, 1)])
def test_teams_match_the_reference(tp: int, dp: int) -> None:
    schedule = _teamed(tp, dp)
    results = run_ranks(train_worker, tp * dp, [schedule], STEPS, "canzona", HP)
    compare(schedule, [rank[0] for rank in results], reference_run(schedule, STEPS, HP))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_teams_with_bf16_parameters_round_like_the_reference() -> None:
    schedule = _teamed(2, 2, dtype="bf16")
    results = run_ranks(train_worker, 4, [schedule], STEPS, "canzona", HP)
    compare(schedule, [rank[0] for rank in results], reference_run(schedule, STEPS, HP), rtol=None, atol=None)


CHECKPOINT_CASES = [
    ("dcp", "into-teams", "fp32"),
    ("memory", "out-of-teams", "fp32"),
    ("dcp", "out-of-teams", "bf16"),
    ("memory", "into-teams", "bf16"),
]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("via", "move", "dtype"), CHECKPOINT_CASES)
def test_team_state_moves_through_checkpoints(via: str, move: str, dtype: str, tmp_path: Path) -> None:
    """A team member saves its slices of momentum (and of the fp32 main copy) as chunks of the
    canonical logical tensors: training continues exactly under a schedule without teams (TP 1
    x DP 4), and a state saved without teams loads into a team's slices."""
    from test_checkpoint_reshard import HP as CHECKPOINT_HP
    from test_checkpoint_reshard import MODEL as V300
    from test_checkpoint_reshard import K, M, _reshard_worker, _rows, to_gathered
    from test_checkpoint_reshard import reference_run as canonical_reference

    from rt_oracle import ordered, shard

    teamed = make_schedule(V300, 2, 2, alpha=1.0, bucket_size=3000, group_bytes=6144, dtype=dtype, coop="force")
    assert teamed.metrics.tp.cooperative > 0
    plain = make_schedule(V300, 1, 4, alpha=0.0, dtype=dtype)
    first, second = (plain, teamed) if move == "into-teams" else (teamed, plain)
    folder = str(tmp_path / "checkpoint") if via == "dcp" else None
    results = run_ranks(
        _reshard_worker,
        4,
        first,
        second,
        folder,
        {**CHECKPOINT_HP, "dp_collectives": "all_to_all"},
        ("canzona", "canzona"),
    )
    dp_per_step = [first.request.dp] * K + [second.request.dp] * M
    reference = canonical_reference(make_schedule(V300, 1, 1, dtype=dtype), dp_per_step, CHECKPOINT_HP)
    tp = second.request.tp
    rtol, atol = (1e-5, 1e-6) if dtype == "fp32" else (2**-7, 0.0)
    for rank, shards in enumerate(results):
        for entry in ordered(second):
            expected = shard(to_gathered(entry, _rows(reference[entry.name], entry.shape[0]), tp), entry, rank % tp, tp)
            torch.testing.assert_close(
                shards[entry.name],
                expected.to(shards[entry.name].dtype),
                rtol=rtol,
                atol=atol,
                msg=labelled(f"rank {rank} {entry.name}"),
            )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_teams_under_a_training_recipe_on_the_meta_default_device() -> None:
    """Groups, clipping, a frozen matrix and gradient gaps (a replicated matrix and one with a
    single rank's gradient among them), every step under a meta default device: a tensor the
    team code made without naming its device would fail."""
    from test_runtime_training import FROZEN, _check, decay_groups, gradient_gaps
    from test_runtime_training import HP as RECIPE_HP

    from rt_oracle import Scenario, scenario_worker

    scenario = Scenario(
        _teamed(2, 2),
        steps=4,
        hp=RECIPE_HP,
        groups=decay_groups,
        max_norm=5.0,
        frozen=FROZEN,
        has_grad=gradient_gaps,
        meta=True,
    )
    (result,) = zip(*run_ranks(scenario_worker, 4, [scenario], timeout=150))
    _check("tp2xdp2", "teams", scenario, list(result))


def _mixed_teams(tp: int = 4) -> Any:
    """A TP 4 schedule whose teams have different members ((0, 1), (0, 2), (1, 3), (2, 3) and all
    four): a rank belongs to several teams, its neighbours to others (the team process groups
    must still line up)."""
    import dataclasses

    from canzona.planner.compile import compile_schedule
    from canzona.planner.partition.cooperative import team_cost
    from canzona.planner.partition.tp import MicroGroup, Team
    from canzona.planner.plan import PlanRequest, make_plan, team_shapes
    from canzona.planner.sources.load import load_model

    spec = load_model(str(MODEL_TP4), tp)
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype="fp32") for p in spec.params))
    request = PlanRequest(model=str(MODEL_TP4), tp=tp, dp=1, bucket_size=4000, group_bytes=4096, coop="force")
    plan = make_plan(spec, dataclasses.replace(request, coop="off"))
    shapes, sets, turn = team_shapes(spec, request), [(0, 1), (0, 2), (1, 3), (2, 3), (0, 1, 2, 3)], 0
    ranks = []
    for rank_tasks, rank_groups in zip(plan.tasks, plan.chosen_groups):
        groups = []
        for group in rank_groups:
            teams: list[Team | None] = []
            for index, host in zip(group.tasks, group.hosts):
                shape = shapes.get(rank_tasks[index].name)
                fits = [s for s in sets if host in s and shape is not None and shape.splits(len(s), tp)]
                team = fits[turn % len(fits)] if fits else None
                turn += 1
                teams.append(None if team is None else Team(team, team_cost(shape, len(team), 5, tp)))
            groups.append(MicroGroup(group.tasks, group.hosts, tuple(teams)))
        ranks.append(tuple(groups))
    plan = dataclasses.replace(plan, request=request, groups={**plan.groups, request.tp_mode: tuple(ranks)})
    return compile_schedule(plan)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_teams_of_different_members_match_the_reference() -> None:
    schedule = _mixed_teams()
    members = {tuple(t.hosts) for r in schedule.tp.ranks for g in r.groups for t in g.teams}
    assert {(0, 1), (0, 2), (1, 3), (2, 3)} <= members, members
    results = run_ranks(train_worker, 4, [schedule], STEPS, "canzona", HP)
    compare(schedule, [rank[0] for rank in results], reference_run(schedule, STEPS, HP))


def _failing_member_worker(rank: int, world: int, schedule: Any) -> dict[str, Any]:
    from test_runtime_faults import _failing_step, _grads, _setup, _train

    import canzona.runtime.rules.cooperative as cooperative

    optimizer, params = _setup(schedule, rank)
    _train(optimizer, params, range(2))
    _grads(optimizer, params, 2)
    state, values = optimizer.state_dict(), [p.detach().clone() for _, p in params]
    original = cooperative._all_reduce
    calls = [0]

    def flaky(*args: Any) -> None:  # a member fails between two of its team's all-reduces
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected failure inside Newton-Schulz")
        original(*args)

    if rank == 1:
        cooperative._all_reduce = flaky
    out: dict[str, Any] = {"failed": _failing_step(optimizer, params, 2)}
    cooperative._all_reduce = original
    out["params"] = reload_and_step(optimizer, state, params, values)  # the step changed state: load a checkpoint
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_member_failing_inside_newton_schulz_fails_the_step_everywhere() -> None:
    schedule = _teamed(2, 2)
    results = run_ranks(_failing_member_worker, 4, schedule, timeout=100.0)
    messages = {result["failed"][0] for result in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "rank 1: updating " in message and "injected failure inside Newton-Schulz" in message, message
    assert "failed while updating" in message
    compare(schedule, [result["params"] for result in results], reference_run(schedule, 3, {}))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_teams_with_dtensor_parameters(tmp_path: Path) -> None:
    """The DTensor toy (TP 2 over a device mesh, sequence-parallel norms, expert slices) with
    every eligible matrix teamed equals the reference, each step on the meta default device."""
    from test_runtime_dtensor import HP as TOY_HP
    from test_runtime_dtensor import SHAPES, full_grad, toy_rank
    from test_runtime_dtensor import STEPS as TOY_STEPS
    from test_runtime_models import plan

    from canzona.runtime.tools.reference import ReferenceOptimizer

    import models

    schedule = plan(tmp_path, "toy", 2, 1, "--sequence-parallel", "--coop", "force")
    assert schedule.metrics.tp.cooperative > 0
    results = run_ranks(toy_rank, 2, schedule, "canzona", timeout=120)
    torch.manual_seed(0)
    reference_model = models.make_toy()
    reference = ReferenceOptimizer(reference_model.named_parameters(), schedule, **TOY_HP)
    for step in range(TOY_STEPS):
        reference.step(grads={name: full_grad(name, step) for name in SHAPES})
    for rank, result in enumerate(results):
        for name, value in reference_model.named_parameters():
            torch.testing.assert_close(
                result["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=labelled(f"rank {rank} {name}")
            )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_teams_under_expert_parallelism() -> None:
    """TP 2 x DP 2 with EP 2: each EP rank's experts (and the dense matrices) teamed over TP."""
    from test_runtime_experts import HP as EP_HP
    from test_runtime_experts import ep_schedule

    schedule = ep_schedule(2, 2, 2, coop="force")
    teamed = {t.param for r in schedule.tp.ranks for g in r.groups for t in g.teams}
    entries = {e.name: e for e in schedule.params}
    assert any(entries[name].ep_rank is not None for name in teamed) and any(
        entries[name].ep_rank is None for name in teamed
    )
    (results,) = zip(*run_ranks(train_worker, 4, [schedule], STEPS, "canzona", EP_HP))
    compare(schedule, list(results), reference_run(schedule, STEPS, EP_HP))
