"""FSDP2 / HSDP plans: micro-groups over the fragmentation group (DP shard x TP), the schedule
fields that record the mode, the validator's FSDP rules and the refusals."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.fsdp import make_fsdp_plan
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.predict.auto_alpha import plan_for_request
from canzona.planner.sources.load import load_model
from canzona.planner.spec import PlanError
from canzona.schedules.format import Schedule, ScheduleError, dump_schedule, parse_schedule, sealed
from canzona.schedules.fsdp import FsdpLayout, fragment_traffic, shard_shape
from canzona.schedules.geometry import fsdp_rows


@cache
def fsdp(tp: int = 2, dp: int = 4, replicate: int = 1, group_bytes: int = 2048 << 20) -> Schedule:
    request = PlanRequest("qwen3-8b", tp, dp, sharding="fsdp", dp_replicate=replicate, group_bytes=group_bytes)
    plan, _ = plan_for_request(load_model("qwen3-8b", tp), request)
    return compile_schedule(plan)


def edited(schedule: Schedule, edit: Callable[[dict[str, Any]], Any]) -> str:
    data = schedule.model_dump(mode="json")
    edit(data)
    return dump_schedule(sealed(Schedule.model_validate(data)))


def rejected(schedule: Schedule, edit: Callable[[dict[str, Any]], Any], needle: str) -> None:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(schedule, edit), "plan.yaml")
    assert needle in str(excinfo.value) and "\n" not in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize("tp,dp,replicate", [(1, 4, 1), (2, 4, 1), (2, 8, 2), (1, 2, 1)])
def test_every_matrix_is_hosted_once_in_the_fragmentation_group(tp: int, dp: int, replicate: int) -> None:
    schedule = fsdp(tp, dp, replicate)
    hosts = tp * dp // replicate
    groups = schedule.tp.ranks[0].groups
    assert [r.dp_rank for r in schedule.tp.ranks] == [0]
    names = [n for g in groups for n in g.params]
    matrices = [e.name for e in schedule.params if e.optimizer == "matrix"]
    assert sorted(names) == sorted(matrices)
    assert {h for g in groups for h in g.hosts} == set(range(hosts))  # 144 matrices: every device hosts
    assert schedule.dp.buckets == [] and schedule.dp.adamw_buckets == []
    assert (schedule.request.sharding, schedule.request.dp_replicate) == ("fsdp", replicate)
    text = dump_schedule(schedule)
    assert parse_schedule(text) == schedule and dump_schedule(parse_schedule(text)) == text
    # replicas repeat the shard ranks' loads
    loads = schedule.metrics.dp.load
    assert loads == loads[: dp // replicate] * replicate


def test_deterministic_and_regenerated_from_its_request() -> None:
    schedule = fsdp()
    request = PlanRequest.from_request(schedule.request)
    assert request.sharding == "fsdp"
    again, _ = plan_for_request(load_model("qwen3-8b", 2), request)
    assert dump_schedule(compile_schedule(again)) == dump_schedule(schedule)


def test_replicated_files_do_not_mention_the_mode() -> None:
    text = dump_schedule(compile_schedule(make_plan(load_model("qwen3-8b", 1), PlanRequest("qwen3-8b", 1, 2))))
    assert "sharding" not in text and "dp_replicate" not in text


def test_capacity_bounds_the_groups() -> None:
    small = fsdp(group_bytes=256 << 20)
    assert len(small.tp.ranks[0].groups) > len(fsdp().tp.ranks[0].groups)
    for group in small.tp.ranks[0].groups:  # a host over capacity holds one matrix too large for any group
        assert all(size <= 256 << 20 or group.hosts.count(h) == 1 for h, size in enumerate(group.host_bytes))


def test_balance_beats_the_baselines() -> None:
    metrics = fsdp().metrics.dp
    assert metrics.imbalance < 1.01
    assert metrics.max < metrics.baselines["round_robin"].max < metrics.baselines["redundant"].max


def test_fsdp_rows_follow_torch_chunk() -> None:
    torch = pytest.importorskip("torch")
    for rows in (1, 3, 7, 8, 9, 16, 17):
        for shards in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(shards)
            sizes = [len(c) for c in chunks] + [0] * (shards - len(chunks))
            assert [stop - start for start, stop in fsdp_rows(rows, shards)] == sizes


def test_shard_shape_and_traffic() -> None:
    layout = FsdpLayout(tp=2, shards=2)
    assert shard_shape((8, 6), 0, layout, 3) == (2, 6)  # TP shard [4, 6], shard 1 of dim 0
    assert shard_shape((5, 6), 1, layout, 2) == (2, 3)  # TP shard [5, 3], chunks 3 + 2
    assert shard_shape((3, 4), None, FsdpLayout(tp=1, shards=4), 3) == (0, 4)
    traffic = fragment_traffic([((8, 6), None, 0)], layout)
    # replicated over TP: only TP rank 0's column sends to host 0; everyone gets the update
    assert traffic[1] == (0, 4 * 24) and traffic[2] == (4 * 24, 4 * 24) and traffic[0] == (3 * 4 * 24, 4 * 24)


@pytest.mark.parametrize(
    "request_args,needle",
    [
        ({"alpha": 0.5}, "alpha and the bucket size"),
        ({"bucket_size": 1000}, "alpha and the bucket size"),
        ({"solver": "ilp"}, "--solver ilp is not supported"),
        ({"dp_replicate": 3}, "does not divide dp 4"),
        ({"sharding": "zero3"}, "sharding"),
        ({"alpha_device": "h100"}, "--alpha auto"),
        ({"tp_update": "replicated"}, "--tp-update replicated is not supported"),
    ],
)
def test_refusals(request_args: dict[str, Any], needle: str) -> None:
    args = {"sharding": "fsdp", **request_args}
    with pytest.raises(PlanError, match=needle):
        make_fsdp_plan(load_model("qwen3-8b", 1), PlanRequest("qwen3-8b", 1, 4, **args))


def test_hsdp_needs_fsdp_and_no_ep() -> None:
    with pytest.raises(PlanError, match="needs FSDP"):
        PlanRequest("qwen3-8b", 1, 4, dp_replicate=2).validate()
    with pytest.raises(PlanError, match="ep 2 with FSDP"):
        PlanRequest("qwen3-8b", 1, 4, ep=2, sharding="fsdp").validate()


def _first_group(data: dict[str, Any]) -> dict[str, Any]:
    return data["tp"]["ranks"][0]["groups"][0]


def test_validator_fsdp_rules() -> None:
    schedule = fsdp()
    rejected(schedule, lambda d: _first_group(d)["hosts"].__setitem__(0, 8), "hosts must be fragment ranks")
    rejected(schedule, lambda d: d["params"][0].__setitem__("owner", 1), "owner is 0")
    rejected(schedule, lambda d: d["params"][0].__setitem__("offset", 64), "bucket and offset are 0")
    rejected(schedule, lambda d: d["tp"]["ranks"].append({"dp_rank": 1, "groups": []}), "holds one plan")
    rejected(schedule, lambda d: d["metrics"]["dp"]["load"].__setitem__(0, 1.0), "metrics.dp.load[0]")
    rejected(schedule, lambda d: d["metrics"]["dp"]["slice_bytes"].__setitem__(0, 4), "slice_bytes")
    rejected(schedule, lambda d: d["request"].__setitem__("dp_replicate", 3), "does not divide dp 4")
    rejected(schedule, lambda d: d["request"].__setitem__("sharding", "replicated"), "bucket 0 does not exist")
    rejected(schedule, lambda d: d["tp"].__setitem__("update", "replicated"), "the tp update must be hosted")

    def drop(d: dict[str, Any]) -> None:
        group = _first_group(d)
        group["params"].pop()
        group["hosts"].pop()

    rejected(schedule, drop, "host_loads disagree")
