"""One objective, the predicted step: the plan at a larger α of the ladder is never worse on it
(nor, on a tie, on the DP max), the baselines a schedule can express are candidates, the floors
that skip a candidate never exceed its simulated step, and the headline's lower bound holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.baselines import OWNER_RULES
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_baseline_plan, make_plan
from canzona.planner.predict.headline import step_headline
from canzona.planner.predict.objective import (
    TIE,
    Objective,
    best_plan,
    comm_floor,
    local_floor,
    objective_device,
    score,
)
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model
from canzona.schedules.format import parse_schedule, read_schedule
from canzona.schedules.library import resolve_schedule
from canzona.schedules.writing import dump_schedule

LADDER = (0.0, 0.25, 0.5, 0.75, 1.0)
# Layouts where the stages disagreed before (the examples), and small ones of each kind.
LAYOUTS = [
    ("qwen3-0.6b", 8, 64, 1, "muon"),
    ("qwen3-0.6b", 8, 64, 1, "shampoo"),
    ("qwen3-0.6b", 4, 64, 1, "muon"),
    ("qwen3-1.7b", 2, 12, 1, "soap"),
    ("mixtral-8x7b", 2, 8, 4, "muon"),
]


def _request(name: str, tp: int, dp: int, ep: int, optimizer: str, alpha: float = 1.0) -> PlanRequest:
    return PlanRequest(name, tp, dp, ep=ep, alpha=alpha, optimizer=OptimizerConfig(optimizer))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(map(str, layout)))
def test_a_larger_alpha_is_never_worse_on_the_objective(layout: tuple[str, int, int, int, str]) -> None:
    name, tp, dp, ep, optimizer = layout
    model = load_model(name, tp)
    scores: list[Objective] = []
    for alpha in LADDER:
        request = _request(name, tp, dp, ep, optimizer, alpha)
        scores.append(score(best_plan(model, request), objective_device(request)))
    for smaller in range(len(LADDER)):
        for larger in range(smaller + 1, len(LADDER)):
            assert not scores[smaller].better_than(scores[larger]), (LADDER[smaller], LADDER[larger])
            assert scores[larger].step_s <= scores[smaller].step_s * (1 + TIE)


@pytest.mark.slow
def test_no_baseline_is_predicted_faster_without_tp() -> None:
    """At TP 1 every matrix baseline but DP-SC is a candidate with canzona's collectives, which
    include what each baseline moves: canzona's step is never longer."""
    for name, dp, optimizer in (("qwen3-0.6b", 48, "muon"), ("qwen3-1.7b", 16, "soap"), ("llama3.1-8b", 24, "shampoo")):
        request = _request(name, 1, dp, 1, optimizer)
        device = objective_device(request)
        schedule = compile_schedule(best_plan(load_model(name, 1), request))
        sim = simulate(schedule, device.hardware, device.time_model(request.optimizer))
        canzona = sim.get("canzona").step
        for baseline in ("zero1-gather", "start-owner", "layer-wise", "tp-sc"):
            assert canzona <= sim.get(baseline).step * (1 + TIE), (name, baseline)


def test_a_baseline_that_wins_is_emitted_and_says_so() -> None:
    """qwen3-0.6b at tp 8 dp 128: 112 matrices over 128 DP ranks, so every search leaves a rank
    a whole matrix; the equal-slice owners with `reslice` move the fewest bytes."""
    request = _request("qwen3-0.6b", 8, 128, 1, "muon")
    plan = best_plan(load_model("qwen3-0.6b", 8), request)
    assert plan.dense.method.split(" owners")[0] in OWNER_RULES
    assert plan.request == request
    schedule = compile_schedule(plan)
    assert parse_schedule(dump_schedule(schedule), "emitted.yaml").metrics.dp.method == plan.dense.method
    assert "reslice" in {bucket.collective for bucket in schedule.dp.buckets}


@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=lambda layout: "-".join(map(str, layout)))
def test_the_floors_that_skip_a_candidate_never_exceed_its_step(layout: tuple[str, int, int, int, str]) -> None:
    name, tp, dp, ep, optimizer = layout
    model, request = load_model(name, tp), _request(name, tp, dp, ep, optimizer)
    device = objective_device(request)
    plans = [make_plan(model, request)] + [make_baseline_plan(model, request, rule) for rule in OWNER_RULES]
    for plan in plans:
        if plan is None:
            continue
        sim = simulate(compile_schedule(plan), device.hardware, device.time_model(request.optimizer))
        step = sim.get("canzona")
        assert comm_floor(plan, device) == pytest.approx(step.dp_comm, rel=1e-12)
        assert comm_floor(plan, device) + local_floor(plan, device) <= step.step * (1 + 1e-12)
        found = score(plan, device)  # the faster TP update: the hosted step, or TP-SC's (its replicated update)
        steps = {"hosted": step.step, "replicated": sim.get("tp-sc").step}
        assert found.step_s == pytest.approx(steps[found.tp_update], rel=1e-12)
        assert found.step_s <= min(steps.values()) * (1 + 1e-12)


def test_a_replicated_tp_update_is_chosen_where_faster_and_can_be_refused() -> None:
    """qwen3-1.7b tp 4 dp 64 with Shampoo: a DP rank owns about one matrix, whose host would
    scatter its update back, which a replicated update never does, so auto picks it and says
    so; hosted and replicated, asked for, are what the file holds."""
    model, request = load_model("qwen3-1.7b", 4), _request("qwen3-1.7b", 4, 64, 1, "shampoo")
    device = objective_device(request)
    plan = best_plan(model, request)
    assert plan.tp_update == "replicated" and "replicated tp update predicted faster" in plan.dense.method
    schedule = parse_schedule(dump_schedule(compile_schedule(plan)), "replicated.yaml")
    assert schedule.tp.update == "replicated" and schedule.request.tp_update == "auto"
    sim = simulate(schedule, device.hardware, device.time_model(request.optimizer))
    assert sim.get("canzona").step == pytest.approx(sim.get("tp-sc").step, rel=1e-12)
    hosted = best_plan(model, replace(request, tp_update="hosted"))
    assert hosted.tp_update == "hosted" and "replicated" not in hosted.dense.method
    hosted_sim = simulate(compile_schedule(hosted), device.hardware, device.time_model(request.optimizer))
    assert hosted_sim.get("canzona").step > sim.get("canzona").step
    forced = best_plan(model, replace(request, alpha=0.0, tp_update="replicated"))
    assert forced.tp_update == "replicated" and "predicted faster" not in forced.dense.method
    assert compile_schedule(forced).tp.update == "replicated"


def test_an_owner_rule_the_request_cannot_express_is_no_candidate() -> None:
    model = load_model("qwen3-0.6b", 2)
    registration = replace(_request("qwen3-0.6b", 2, 8, 1, "muon"), order="registration")
    # Layer-wise owners ignore the buffer order: registration order cannot hold them.
    assert make_baseline_plan(model, registration, "layer-wise") is None
    assert make_baseline_plan(model, registration, "start-owner") is not None
    # At α 0 every bucket's largest slice is the least parameter boundaries allow.
    tight = _request("qwen3-0.6b", 2, 8, 1, "muon", alpha=0.0)
    assert any(make_baseline_plan(model, tight, rule) is None for rule in OWNER_RULES)


@pytest.mark.parametrize(
    "name", ["qwen3-8b/muon-tp8-dp32", "qwen3-30b-a3b/muon-tp2-dp16-ep8", "qwen3-0.6b/muon-tp1-dp8"]
)
def test_the_headline_step_is_the_simulated_one_above_its_lower_bound(name: str) -> None:
    schedule = read_schedule(resolve_schedule(name))
    headline = step_headline(schedule)
    request = schedule.request
    device = objective_device(PlanRequest(request.model.name, request.tp, request.dp))
    config = OptimizerConfig(**request.optimizer.model_dump())
    sim = simulate(schedule, device.hardware, device.time_model(config))
    assert headline.step_s == pytest.approx(sim.get("canzona").step, rel=1e-12)
    assert 0 < headline.lower_bound_s <= headline.step_s
    assert headline.bound in ("compute", "communication") and headline.top_s <= headline.step_s
