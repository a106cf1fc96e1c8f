"""Schedules as untrusted input (issue 27), the validator's classes: a file whose request was
changed and re-sealed (fingerprint and digest recomputed, as anyone can) is refused unless every
cost, row block and figure was recomputed to match. Each test edits one thing of a planned file."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, TrainingSetup
from canzona.planner.predict.auto_alpha import plan_for_request
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ModelOptions
from canzona.schedules.format import (
    Schedule,
    ScheduleError,
    dump_schedule,
    parse_schedule,
    schedule_fingerprint,
    sealed,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_qwen3.yaml")
TINY_MOE = str(ROOT / "tests" / "runtime" / "data" / "tiny_moe.json")


def planned(model: str, tp: int, dp: int, **fields: Any) -> Schedule:
    options = fields.pop("options", ModelOptions())
    request = PlanRequest(model, tp, dp, options=options, **fields)
    return compile_schedule(*plan_for_request(load_model(model, tp, options), request))


@cache
def schedules() -> dict[str, Schedule]:
    """One small file per kind: a preset (QKV and fc1 row blocks), Shampoo, SOAP, a parameter
    list, MoE with EP, FSDP, CP-SAT, and the automatic searches."""
    return {
        "preset": planned("qwen3-0.6b", 2, 2),
        "shampoo": planned("qwen3-0.6b", 2, 2, optimizer=OptimizerConfig("shampoo", block_size=256)),
        "soap": planned("qwen3-0.6b", 2, 2, optimizer=OptimizerConfig("soap", max_precond_dim=2048)),
        "numel": planned("qwen3-0.6b", 2, 2, cost="numel"),
        "list": planned(TINY, 2, 2),
        "moe": planned(TINY_MOE, 2, 4, ep=2, bucket_size=2000, group_bytes=4096),
        "fsdp": planned("qwen3-0.6b", 2, 4, sharding="fsdp", dp_replicate=2),
        "ilp": planned(TINY, 2, 2, solver="ilp", time_limit=0.2, order="registration", alpha=0.5),
        "search": planned(TINY, 2, 2, alpha_device="h100", bucket_device="h100", training=TrainingSetup()),
    }


def edited(kind: str, edit: Callable[[dict[str, Any]], Any]) -> str:
    """The file of `kind` after `edit`, re-sealed (fingerprint and digest recomputed)."""
    data = schedules()[kind].model_dump(mode="json")
    edit(data)
    schedule = Schedule.model_validate(data)
    return dump_schedule(sealed(schedule.model_copy(update={"fingerprint": schedule_fingerprint(schedule)})))


def rejected(kind: str, edit: Callable[[dict[str, Any]], Any], *needles: str) -> str:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(kind, edit), "plan.yaml")
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("plan.yaml: "), message
    for needle in needles:
        assert needle in message, message
    return message


def param(data: dict[str, Any], fragment: str) -> dict[str, Any]:
    return next(p for p in data["params"] if fragment in p["name"])


def settings(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["request"]["optimizer"].update(values)


def test_every_kind_is_accepted_as_planned() -> None:
    for kind, schedule in schedules().items():
        assert parse_schedule(dump_schedule(schedule), kind) == schedule, kind


# ---------------------------------------------------------------------------------------------
# Optimizer settings that drift from the costs and figures computed for them


@pytest.mark.parametrize(
    "kind, change",
    [
        ("preset", {"ns_steps": 1}),
        ("preset", {"name": "soap"}),
        ("preset", {"name": "shampoo"}),
        ("shampoo", {"block_size": 512}),
        ("shampoo", {"precondition_frequency": 3}),
        ("shampoo", {"name": "muon"}),
        ("soap", {"max_precond_dim": 512}),
        ("soap", {"precondition_frequency": 100}),
        ("list", {"ns_steps": 7}),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value,
)
def test_a_resealed_settings_change_is_refused(kind: str, change: dict[str, Any]) -> None:
    """By the costs recomputed under the new settings, or (a setting the new optimizer does not
    use) by the rule that such settings stay at their defaults."""
    message = rejected(kind, settings(**change), "request")
    assert "cost model gives" in message or "has no effect on" in message, message


@pytest.mark.parametrize("change", [{"block_size": 7}, {"precondition_frequency": 3}, {"max_precond_dim": 5}])
def test_a_setting_the_optimizer_does_not_use_stays_at_its_default(change: dict[str, Any]) -> None:
    (key,) = change
    rejected("preset", settings(**change), f"{key} ", "no effect on muon")
    rejected("soap", settings(ns_steps=3), "ns_steps 3 has no effect on soap")


def test_a_settings_change_with_every_figure_recomputed_is_a_different_plan() -> None:
    """Re-planned for the new settings, the file is consistent: the runtime then executes what
    its costs were computed for (`canzona check` still tells it from its request)."""
    shampoo = planned("qwen3-0.6b", 2, 2, optimizer=OptimizerConfig("shampoo", block_size=512))
    assert parse_schedule(dump_schedule(shampoo)).request.optimizer.block_size == 512


def test_numel_costs_are_recomputed_too() -> None:
    rejected(
        "numel", lambda d: param(d, "linear_proj").update(cost=param(d, "linear_proj")["cost"] * 2), "numel cost model"
    )


# ---------------------------------------------------------------------------------------------
# Row blocks: what the request's split options give


def test_row_blocks_follow_split_fc1() -> None:
    rejected(
        "preset", lambda d: d["request"].update(split_fc1=True), "linear_fc1", "split_fc1 true gives it 2 row blocks"
    )

    rejected(
        "preset",
        lambda d: param(d, "linear_fc1.weight").update(row_blocks=None),
        "linear_fc1",
        "split_fc1 false gives it 1 row block",
    )


def test_row_blocks_follow_split_qkv() -> None:
    rejected("preset", lambda d: d["request"].update(split_qkv="none"), "linear_qkv", "split_qkv none")
    rejected("preset", lambda d: d["request"].update(split_qkv="head"), "linear_qkv", "split_qkv head")

    def shifted(data: dict[str, Any]) -> None:  # Q, K, V boundaries moved by one head
        qkv = param(data, "linear_qkv.weight")
        (q, k, v) = qkv["row_blocks"]
        qkv["row_blocks"] = [[[q[0][0], q[0][1] - 128]] + q[1:], [[q[0][1] - 128, q[0][1]]] + k, v]

    rejected("preset", shifted, "linear_qkv")


def test_row_blocks_of_a_parameter_list_have_a_form_canzona_writes() -> None:
    def permuted(data: dict[str, Any]) -> None:
        fc1 = param(data, "linear_fc1.weight")
        rows = fc1["shape"][0]
        fc1["row_blocks"] = [[[rows // 2, rows], [0, rows // 2]]]

    rejected("list", permuted, "not a form canzona writes")


def test_a_live_models_fused_blocks_follow_split_fc1() -> None:
    def live(data: dict[str, Any]) -> None:
        data["request"]["model"]["source"] = "py:model.py:make"

    assert parse_schedule(edited("list", live)).request.model.source.startswith("py:")
    rejected("list", lambda d: (live(d), d["request"].update(split_fc1=True)), "split_fc1 true splits into its parts")


# ---------------------------------------------------------------------------------------------
# Recorded figures: re-checked, every one


@pytest.mark.parametrize(
    "kind, edit, needle",
    [
        (
            "preset",
            lambda d: d["metrics"]["dp"]["state_bytes"].__setitem__(0, 10 * d["metrics"]["dp"]["state_bytes"][0]),
            "metrics.dp.state_bytes[0]",
        ),
        (
            "preset",
            lambda d: d["metrics"]["device"][1].update(state_bytes=10 * d["metrics"]["device"][1]["state_bytes"]),
            "metrics.device[1].state_bytes",
        ),
        (
            "preset",
            lambda d: d["metrics"]["device"][2].update(bytes_sent=d["metrics"]["device"][2]["bytes_sent"] + 1),
            "metrics.device[2]: bytes sent",
        ),
        ("moe", lambda d: d["metrics"]["device"][5].update(bytes_received=0), "metrics.device[5]: bytes sent"),
        ("preset", lambda d: d["metrics"]["dp"]["adamw_load"].__setitem__(1, 1.0), "metrics.dp.adamw_load[1]"),
        (
            "preset",
            lambda d: d["metrics"]["dp"]["baselines"]["zero1-gather"].update(padding_overhead=2.0),
            "zero1-gather.padding_overhead",
        ),
        (
            "preset",
            lambda d: d["metrics"]["dp"]["baselines"]["layer-wise"]["load"].__setitem__(0, 1.0),
            "layer-wise.load",
        ),
        ("moe", lambda d: d["metrics"]["dp"]["baselines"]["start-owner"]["load"].reverse(), "start-owner.load"),
        ("preset", lambda d: d["metrics"]["dp"]["baselines"].pop("dp-sc"), "metrics.dp.baselines must be"),
        (
            "preset",
            lambda d: d["metrics"]["tp"]["modes"].update(
                heap=dict(d["metrics"]["tp"]["modes"]["rollback"], critical_time=-1.0)
            ),
            "metrics.tp.modes.heap",
        ),
        (
            "preset",
            lambda d: d["metrics"]["tp"]["modes"].update(slowest=d["metrics"]["tp"]["modes"]["rollback"]),
            "TP modes only",
        ),
        ("preset", lambda d: d["metrics"]["dp"].update(method="\x1b[2J"), "metrics.dp.method"),
        ("ilp", lambda d: d["metrics"]["solver"].update(dp_objective=1.0), "metrics.solver.dp_objective"),
        ("ilp", lambda d: d["metrics"]["solver"].update(dp_bound=-1.0), "dp_bound must lie between"),
        ("ilp", lambda d: d["metrics"]["solver"].update(dp_status="\x1b[31mOPTIMAL"), "not a CP-SAT status"),
        ("ilp", lambda d: d["metrics"]["solver"].update(tp_groups_refined=10**6), "tp_groups_refined"),
        ("ilp", lambda d: d["metrics"]["solver"].update(dp_accepted=True), "dp_accepted"),
        ("ilp", lambda d: d["metrics"].update(solver=None), "present exactly when request.solver is ilp"),
        ("search", lambda d: d["metrics"]["alpha_search"][0].update(predicted_iteration_s=1e-12), "request.alpha"),
        ("search", lambda d: d["metrics"]["alpha_search"].pop(), "metrics.alpha_search must hold"),
        ("search", lambda d: d["metrics"]["bucket_search"]["trials"][2].update(num_buckets=3), "bucket counts"),
        ("search", lambda d: d["metrics"]["bucket_search"].update(reason="\x1b]0;pwned\x07"), "bucket_search.reason"),
        (
            "search",
            lambda d: d["metrics"]["bucket_search"]["trials"][3].update(predicted_iteration_s=1e-12),
            "request.bucket_size",
        ),
    ],
)
def test_a_forged_figure_is_refused(kind: str, edit: Callable[[dict[str, Any]], Any], needle: str) -> None:
    rejected(kind, edit, needle)


def test_time_limits_and_solver_budgets_are_capped() -> None:
    rejected("ilp", lambda d: d["request"].update(time_limit=1e6), "time limit must be <= 300")


# ---------------------------------------------------------------------------------------------
# FSDP files


def test_fsdp_files_refuse_grad_reduce() -> None:
    def partial(data: dict[str, Any]) -> None:
        param(data, "final_layernorm")["grad_reduce"] = "tp"

    rejected("fsdp", partial, "FSDP schedules have no grad_reduce")


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d["metrics"]["device"][3].update(state_bytes=1.0), "metrics.device[3].state_bytes"),
        (lambda d: d["metrics"]["dp"]["state_bytes"].__setitem__(0, 1.0), "metrics.dp.state_bytes[0]"),
        (lambda d: d["metrics"]["device"][0].update(bytes_sent=1), "gather and scatter"),
        (lambda d: d["metrics"]["dp"]["baselines"]["round_robin"]["load"].reverse(), "round_robin.load"),
        (lambda d: d["metrics"]["dp"]["adamw_load"].__setitem__(2, 0.0), "metrics.dp.adamw_load[2]"),
    ],
)
def test_fsdp_figures_are_recomputed(edit: Callable[[dict[str, Any]], Any], needle: str) -> None:
    rejected("fsdp", edit, needle)
