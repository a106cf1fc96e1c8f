"""The schedule fields of issue 13's model sources, and how the validator checks them: grouped
expert slices (`param`, `slice`), partial gradients (`grad_reduce`), the naming convention
(`request.names`) and sequence parallelism (`request.sequence_parallel`). Each rule against a
file edited consistently (digest resealed), so only the validator stands between it and a run."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ModelOptions
from canzona.schedules.format import (
    Schedule,
    ScheduleError,
    compute_fingerprint,
    dump_schedule,
    parse_schedule,
    schedule_fingerprint,
    sealed,
)

TINY_MOE = str(Path(__file__).resolve().parents[1] / "runtime" / "data" / "tiny_moe.json")
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@cache
def planned(names: str = "hf", tp: int = 2, ep: int = 1, sequence_parallel: bool = False) -> Schedule:
    """The tiny Qwen3-MoE (2 experts of 16, hidden 32) under a naming convention, at TP x DP 4."""
    options = ModelOptions(names=names, sequence_parallel=sequence_parallel)
    request = PlanRequest(TINY_MOE, tp, 4, ep=ep, options=options, bucket_size=2000, group_bytes=4096)
    return compile_schedule(make_plan(load_model(TINY_MOE, tp, options), request))


def edited(schedule: Schedule, edit: Callable[[dict[str, Any]], Any]) -> str:
    """The file after `edit`, with fingerprint and digest recomputed (as a tool would)."""
    data = schedule.model_dump(mode="json")
    edit(data)
    data["fingerprint"] = schedule_fingerprint(Schedule.model_validate(data))
    return dump_schedule(sealed(Schedule.model_validate(data)))


def rejected(schedule: Schedule, edit: Callable[[dict[str, Any]], Any], *needles: str) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(schedule, edit), "plan.yaml")
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("plan.yaml: ")
    for needle in needles:
        assert needle in message, message


def entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in data["params"] if p["name"] == name)


@pytest.mark.parametrize(
    "names, ep, sp", [("hf", 1, False), ("hf", 2, True), ("torchtitan", 1, False), ("torchtitan", 2, False)]
)
def test_planned_files_pass_and_round_trip(names: str, ep: int, sp: bool) -> None:
    schedule = planned(names, 2, ep, sp)
    assert parse_schedule(dump_schedule(schedule)) == schedule
    slices = [e for e in schedule.params if e.param is not None]
    assert slices and all(e.name == f"{e.param}[{e.slice}]" for e in slices)
    assert (schedule.request.names, schedule.request.sequence_parallel) == (names, sp)
    if ep > 1:
        assert all(e.ep_rank == e.slice for e in slices)  # 2 experts over 2 EP ranks


def test_fingerprint_is_about_the_real_parameters() -> None:
    schedule = planned()
    model = load_model(TINY_MOE, 2, ModelOptions(names="hf"))
    assert model.params[18].name == f"{GATE_UP}[0]"
    real = [(p.name, p.shape, p.dtype, p.tp_dim) for p in model.params if p.parent is None]
    # The 3-D tensors in registration order among the others, with their own TP dims.
    layer1 = [r for r in real if r[0].startswith("model.layers.1.mlp")]
    assert layer1 == [("model.layers.1.mlp.gate.weight", (2, 32), "bf16", None)]
    expected = []
    for p in model.params:
        if p.parent is None:
            expected.append((p.name, p.shape, p.dtype, p.tp_dim))
        elif p.expert_index == 0:
            expected.append((p.parent, (p.num_experts, *p.shape), p.dtype, None if p.tp_dim is None else p.tp_dim + 1))
    assert (GATE_UP, (2, 32, 32), "bf16", 1) in expected
    assert schedule.fingerprint == compute_fingerprint(expected)


def test_files_without_the_new_fields_keep_their_bytes() -> None:
    """Fields at their default are left out: a Megatron-named plan writes none of them."""
    text = dump_schedule(planned("megatron"))
    for field in ('"param"', '"slice"', '"grad_reduce"', "names:", "sequence_parallel:"):
        assert field not in text


def test_slice_name_must_be_param_and_slice() -> None:
    rejected(planned(), lambda d: entry(d, f"{GATE_UP}[1]").update(name=f"{GATE_UP}[7]"), "named")


def test_slice_numbers_must_count_up() -> None:
    def swap(data: dict[str, Any]) -> None:
        first, second = entry(data, f"{GATE_UP}[0]"), entry(data, f"{GATE_UP}[1]")  # both, before renaming either
        first.update(slice=1, name=f"{GATE_UP}[1]")
        second.update(slice=0, name=f"{GATE_UP}[0]")

    rejected(planned(), swap, "slices must be 0..1 at consecutive indices")


def test_param_and_slice_go_together() -> None:
    rejected(planned(), lambda d: entry(d, f"{GATE_UP}[1]").update(slice=None), "param and slice")
    rejected(planned(), lambda d: entry(d, "model.norm.weight").update(slice=0), "param and slice")


def test_slices_are_alike_matrices() -> None:
    rejected(
        planned(),
        lambda d: entry(d, f"{GATE_UP}[1]").update(row_blocks=None),
        "slices differ in shape, dtype, tp_dim, row blocks or grad_reduce",
    )
    rejected(
        planned(),
        lambda d: entry(d, "model.norm.weight").update(param="model.norm", slice=0, name="model.norm[0]"),
        "an expert slice is a matrix",
    )


def test_grouped_tensor_name_is_nobody_elses() -> None:
    def clash(data: dict[str, Any]) -> None:
        for p in data["params"]:
            if p["param"] == GATE_UP:
                p["param"] = "model.norm.weight"
                p["name"] = f"model.norm.weight[{p['slice']}]"
        for group in (g for rank in data["tp"]["ranks"] for g in rank["groups"]):
            group["params"] = [n.replace(GATE_UP, "model.norm.weight") for n in group["params"]]

    with pytest.raises(ScheduleError, match="another parameter has its name"):
        parse_schedule(edited(planned(), clash))


def test_slices_sit_on_the_ep_rank_holding_their_expert() -> None:
    def move(data: dict[str, Any]) -> None:
        for name, rank in ((f"{GATE_UP}[0]", 1), (f"{GATE_UP}[1]", 0)):
            entry(data, name)["ep_rank"] = rank

    rejected(planned(ep=2), move, "sit on EP rank slice // (E / ep)")


def test_grad_reduce_only_on_replicated_parameters_at_tp_above_one() -> None:
    partial = planned(sequence_parallel=True)
    flagged = [e.name for e in partial.params if e.grad_reduce == "tp"]
    assert "model.norm.weight" in flagged and "model.layers.0.self_attn.q_norm.weight" in flagged
    rejected(partial, lambda d: entry(d, "model.norm.weight").update(grad_reduce="dp"), "grad_reduce 'dp'")
    rejected(planned(), lambda d: entry(d, "lm_head.weight").update(grad_reduce="tp"), "replicated over TP")
    rejected(planned(tp=1), lambda d: entry(d, "model.norm.weight").update(grad_reduce="tp"), "when tp > 1")
    assert all(e.grad_reduce is None for e in planned(tp=1, sequence_parallel=True).params)  # nothing to sum at TP 1


def test_request_names_is_a_known_convention() -> None:
    rejected(planned(), lambda d: d["request"].update(names="flax"), "unknown names 'flax'")


def test_reshard_check_moves_expert_slices_and_partial_gradient_parameters() -> None:
    """The runtime executes grouped experts (state per slice) and grad_reduce: their checkpoints
    move between layouts like any other parameter's."""
    from canzona.schedules.reshard import reshard_report

    for old, new in (
        (planned(), planned(ep=2)),
        (planned("megatron", sequence_parallel=True), planned("megatron", tp=1)),
    ):
        report = reshard_report(old, new)
        assert report.compatible and not report.problems, report.problems
    assert any("expert" in note for note in reshard_report(planned(), planned(ep=2)).notes)
