"""The semantic validator: each rule against a file edited consistently (digest resealed, as
a tool or a careful hand would), so only the validator stands between it and a run."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules.figures import micro_group_traffic
from canzona.schedules.format import Schedule, ScheduleError, dump_schedule, parse_schedule, sealed
from canzona.schedules.limits import BUCKET_COLLECTIVES, MAX_TP
from canzona.schedules.validate import schedule_problem
from canzona.schedules.validate_devices import device_traffic

TINY_MOE = Path(__file__).resolve().parents[1] / "runtime" / "data" / "tiny_moe.json"


@cache
def dense() -> Schedule:
    """qwen3-8b at TP 2 x DP 4: QKV and fc1 row blocks, several buckets."""
    return compile_schedule(make_plan(load_model("qwen3-8b", 2), PlanRequest("qwen3-8b", 2, 4)))


@cache
def moe() -> Schedule:
    """A tiny MoE at TP 2 x DP 4 with EP 2: expert buffers and EP ranks."""
    request = PlanRequest(str(TINY_MOE), 2, 4, ep=2, bucket_size=2000, group_bytes=4096)
    return compile_schedule(make_plan(load_model(str(TINY_MOE), 2), request))


def edited(schedule: Schedule, edit: Callable[[dict[str, Any]], Any]) -> str:
    """The file of `schedule` after `edit` on its data, with the digest resealed."""
    data = schedule.model_dump(mode="json")
    edit(data)
    return dump_schedule(sealed(Schedule.model_validate(data)))


def rejected(schedule: Schedule, edit: Callable[[dict[str, Any]], Any], *needles: str) -> str:
    with pytest.raises(ScheduleError) as excinfo:
        parse_schedule(edited(schedule, edit), "plan.yaml")
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith("plan.yaml: ")
    for needle in needles:
        assert needle in message, message
    return message


def param(data: dict[str, Any], fragment: str) -> dict[str, Any]:
    return next(p for p in data["params"] if fragment in p["name"])


def test_planner_files_pass() -> None:
    for schedule in (dense(), moe()):
        assert schedule_problem(schedule) is None
        assert parse_schedule(dump_schedule(schedule)) == schedule


def test_unedited_digest_catches_any_hand_edit() -> None:
    text = dump_schedule(dense()).replace('"owner": 0', '"owner": 1', 1)
    with pytest.raises(ScheduleError, match="digest does not match"):
        parse_schedule(text)


# Regressions from issue 14 ("silently wrong training").


def test_unknown_parameter_optimizer() -> None:
    rejected(dense(), lambda d: param(d, "linear_proj").update(optimizer="AdamW"), "unknown optimizer 'AdamW'")


def test_qkv_row_blocks_replaced_by_one_whole_block() -> None:
    def whole(d: dict[str, Any]) -> None:
        qkv = param(d, "linear_qkv.weight")
        qkv["row_blocks"] = [[[0, qkv["shape"][0]]]]

    rejected(dense(), whole, "single row block", "row_blocks null")


@pytest.mark.parametrize(
    "blocks, needle",
    [
        ([[]], "start < stop"),
        ([], "row_blocks is empty"),
        ([[[0, 6144]], [[0, 1]]], "exactly once"),
        ([[[0, 100]], [[100, 6143]]], "exactly once"),
        ([[[0, 100], [100, 6144]]], "adjacent ranges"),
        ([[[0, 100, 7]], [[100, 6144]]], "start < stop"),
    ],
)
def test_row_blocks_must_tile_the_rows(blocks: list, needle: str) -> None:
    rejected(dense(), lambda d: param(d, "linear_qkv.weight").update(row_blocks=blocks), needle)


@pytest.mark.parametrize("extra", [10**12, 5 * 10**8, 128])
def test_bucket_numel_enlarged_with_its_last_cut(extra: int) -> None:
    def enlarge(d: dict[str, Any]) -> None:
        bucket = d["dp"]["buckets"][0]
        bucket["numel"] += extra
        bucket["cuts"][-1] += extra

    rejected(dense(), enlarge, "matrix bucket 0: numel", "padded to a multiple")


def test_ep_fields_in_an_ep1_file() -> None:
    rejected(dense(), lambda d: param(d, "linear_proj").update(ep_rank=0), "ep_rank")
    rejected(dense(), lambda d: d["dp"].update(expert_buckets=d["dp"]["buckets"][:1]), "expert_buckets")


def test_owner_that_is_not_a_dp_rank() -> None:  # issue 17, item 4
    rejected(dense(), lambda d: param(d, "linear_proj").update(owner=99), "owner 99 is not a DP rank")


def test_request_values_beyond_the_planner_limits() -> None:
    rejected(dense(), lambda d: d["request"].update(tp=1_000_000), f"maximum of {MAX_TP} TP ranks")
    rejected(dense(), lambda d: d["request"]["optimizer"].update(ns_steps=0), "ns_steps must be >= 1")
    rejected(dense(), lambda d: d["request"].update(tp_mode="magic"), "unknown TP mode")
    rejected(dense(), lambda d: d["request"].update(cost="guess"), "unknown cost model")


# Buffers


def test_cut_off_a_parameter_boundary() -> None:
    def shift(d: dict[str, Any]) -> None:
        cuts = d["dp"]["buckets"][0]["cuts"]
        cuts[1] = cuts[1] + 64 if cuts[1] < cuts[-1] else cuts[1] - 64

    rejected(dense(), shift, "not a parameter boundary")


def test_owner_outside_its_slice() -> None:
    def flip(d: dict[str, Any]) -> None:
        entry = param(d, "layers.35.mlp.linear_fc2")
        entry["owner"] = (entry["owner"] + 1) % 4

    rejected(dense(), flip, "not inside its owner's slice")


def test_offsets_must_be_packed() -> None:
    def gap(d: dict[str, Any]) -> None:
        second = next(p for p in d["params"] if p["bucket"] == 0 and p["offset"] > 0 and p["optimizer"] == "matrix")
        second["offset"] += 64

    rejected(dense(), gap, "packing puts it at")


def test_bucket_membership_follows_reverse_registration_order() -> None:
    def swap(d: dict[str, Any]) -> None:
        first, later = param(d, "layers.35.mlp.linear_fc2"), param(d, "layers.0.mlp.linear_fc2")
        first["bucket"], later["bucket"] = later["bucket"], first["bucket"]

    rejected(dense(), swap, "reverse registration order")


def test_bucket_closes_at_bucket_size() -> None:
    rejected(
        dense(), lambda d: d["request"].update(bucket_size=10**9), "fewer than bucket_size", "another bucket follows"
    )
    rejected(dense(), lambda d: d["request"].update(bucket_size=100), "should have closed before")


def test_adamw_cuts_are_the_equal_split() -> None:
    def skew(d: dict[str, Any]) -> None:
        cuts = d["dp"]["adamw_buckets"][0]["cuts"]
        cuts[1] += 1

    rejected(dense(), skew, "AdamW bucket 0", "equal split")


def test_slice_bytes_and_padding_follow_the_cuts() -> None:
    rejected(dense(), lambda d: d["dp"]["buckets"][0]["slice_bytes"].__setitem__(0, 4), "slice_bytes disagree")
    rejected(dense(), lambda d: d["dp"]["buckets"][0].update(padding_overhead=1.5), "padding_overhead")


def test_expert_buffers() -> None:
    rejected(moe(), lambda d: next(p for p in d["params"] if p.get("ep_rank") == 1).update(ep_rank=5), "not an EP rank")
    rejected(
        moe(),
        lambda d: next(p for p in d["params"] if p.get("ep_rank") == 1).update(owner=2),
        "expert-DP rank (dp / ep = 2)",
    )
    rejected(moe(), lambda d: d["request"].update(ep=4), "is not an expert-DP rank (dp / ep = 1)")


# Micro-groups


def first_group(d: dict[str, Any]) -> dict[str, Any]:
    return d["tp"]["ranks"][0]["groups"][0]


def test_hosts_inside_the_tp_group() -> None:
    rejected(
        dense(), lambda d: first_group(d).update(hosts=[2] * len(first_group(d)["hosts"])), "hosts must be TP ranks"
    )


def test_micro_groups_cover_every_owned_matrix_once() -> None:
    def drop(d: dict[str, Any]) -> None:
        group = first_group(d)
        group["params"], group["hosts"] = group["params"][1:], group["hosts"][1:]

    def twice(d: dict[str, Any]) -> None:
        group = first_group(d)
        group["params"].append(group["params"][0])
        group["hosts"].append(group["hosts"][0])

    rejected(dense(), drop, "exactly the matrices it owns")
    rejected(dense(), twice, "exactly the matrices it owns")


def test_stale_host_loads_and_bytes() -> None:
    rejected(dense(), lambda d: first_group(d)["host_loads"].__setitem__(0, 1.0), "host_loads disagree")
    rejected(dense(), lambda d: first_group(d)["host_bytes"].__setitem__(0, 1), "host_bytes disagree")
    rejected(dense(), lambda d: first_group(d).update(makespan=1.0), "makespan")


def test_group_capacity_in_rollback_mode() -> None:
    def squeeze(d: dict[str, Any]) -> None:
        d["request"]["group_bytes"] = d["tp"]["group_bytes"] = 1 << 20
        for rank in d["tp"]["ranks"]:
            for group in rank["groups"]:
                group["saturation"] = max(group["host_bytes"]) / (1 << 20)

    rejected(dense(), squeeze, "over the group capacity")


# Metrics


def test_loads_must_equal_the_summed_costs() -> None:
    def stale(d: dict[str, Any]) -> None:
        d["metrics"]["dp"]["load"][1] *= 1.01

    rejected(dense(), stale, "metrics.dp.load[1]", "costs of the matrices DP rank 1 owns")


def test_imbalance_below_one_and_other_derived_figures() -> None:
    rejected(dense(), lambda d: d["metrics"]["dp"].update(imbalance=0.9), "metrics.dp.imbalance")
    rejected(dense(), lambda d: d["metrics"]["dp"].update(gap=-0.5), "metrics.dp.gap")
    rejected(dense(), lambda d: d["metrics"]["dp"]["slice_bytes"].__setitem__(0, 0), "metrics.dp.slice_bytes")
    rejected(dense(), lambda d: d["metrics"]["dp"].update(lower_bound=1.0), "lower_bound")
    rejected(dense(), lambda d: d["metrics"]["dp"]["baselines"]["dp-sc"].update(max=0.0), "baselines.dp-sc.max")
    rejected(dense(), lambda d: d["metrics"]["tp"].update(num_groups=999), "metrics.tp.num_groups")
    rejected(dense(), lambda d: d["metrics"]["tp"].update(critical_lower_bound=1.0), "critical_lower_bound")
    rejected(dense(), lambda d: d["metrics"]["device"][0].update(load=0.0), "metrics.device[0].load")
    rejected(dense(), lambda d: d["metrics"]["device"][1].update(tp_rank=0), "metrics.device must list")


def test_device_lower_bound_and_gap() -> None:
    tp, devices = dense().metrics.tp, [d.load for d in dense().metrics.device]
    work = sum(p.cost for p in dense().params if p.owner is not None)
    adamw = [dense().metrics.dp.adamw_load[d.dp_rank] / 2 for d in dense().metrics.device]
    # Plan-independent: at least the mean of the matrices' own work, at most the worst device.
    assert (work + sum(adamw)) / len(adamw) * (1 - 1e-12) <= tp.device_lower_bound <= max(devices)
    assert tp.device_gap == pytest.approx(max(devices) / tp.device_lower_bound - 1, rel=1e-12, abs=1e-15)
    rejected(dense(), lambda d: d["metrics"]["tp"].update(device_lower_bound=1.0), "metrics.tp.device_lower_bound")
    rejected(dense(), lambda d: d["metrics"]["tp"].update(device_lower_bound=max(devices) * 2), "worst device load")
    rejected(dense(), lambda d: d["metrics"]["tp"].update(device_gap=0.5), "metrics.tp.device_gap")
    rejected(dense(), lambda d: d["metrics"]["tp"].update(device_gap=None), "come together")
    # A file from before the bound was recorded (neither field) still reads.
    old = edited(dense(), lambda d: d["metrics"]["tp"].update(device_lower_bound=None, device_gap=None))
    assert parse_schedule(old, "old.yaml").metrics.tp.device_gap is None


def test_dp_lower_bound_is_the_plan_independent_one_or_the_former_one() -> None:
    from canzona.schedules.bounds import dp_lower_bound

    m = moe().metrics.dp
    assert m.lower_bound == pytest.approx(dp_lower_bound([p.cost for p in moe().params if p.owner is not None], 4))
    # A file written before (the dense partition's bound around the experts' loads) still reads.
    loads = [0.0] * 4
    for e in moe().params:
        if e.ep_rank is not None:
            loads[e.owner * 2 + e.ep_rank] += e.cost
    dense_costs = [e.cost for e in moe().params if e.owner is not None and e.ep_rank is None]
    former = max(sum(m.load) / 4, max(dense_costs) + min(loads), max(loads))

    def older(d: dict[str, Any]) -> None:
        d["metrics"]["dp"].update(lower_bound=former, gap=max(m.load) / former - 1)
        for score in d["metrics"]["dp"]["baselines"].values():
            score.update(gap=score["max"] / former - 1)

    assert parse_schedule(edited(moe(), older), "older.yaml").metrics.dp.lower_bound == pytest.approx(former)
    rejected(moe(), lambda d: d["metrics"]["dp"].update(lower_bound=m.lower_bound * 0.9), "metrics.dp.lower_bound")


def test_each_bucket_collective_is_known_and_defaults_to_rooted() -> None:
    def force(collective: str, recount: bool = True) -> Callable[[dict[str, Any]], None]:
        """Every matrix bucket in `collective`; `recount`: the devices' traffic counted anew."""

        def edit(data: dict[str, Any]) -> None:
            for bucket in data["dp"]["buckets"]:
                bucket.update(collective=collective)
            if recount:
                traffic = device_traffic(Schedule.model_validate(data))
                for device, (sent, received) in zip(data["metrics"]["device"], traffic):
                    device.update(bytes_sent=sent, bytes_received=received)

        return edit

    for collective in BUCKET_COLLECTIVES:
        schedule = parse_schedule(edited(dense(), force(collective)), "forced.yaml")
        assert {b.collective for b in schedule.dp.buckets} == {collective}
    rejected(dense(), force("tree", recount=False), "matrix bucket 0 collective", "'tree'")
    # a bucket's collective decides its traffic: another one without the devices' bytes is refused
    recorded = {b.collective for b in dense().dp.buckets}
    other = next(c for c in ("ring", "all_to_all") if {c} != recorded)
    rejected(dense(), force(other, recount=False), "bytes sent and received")

    # A file written before the field: every bucket reads as rooted, what the runtime did then.
    def strip(d: dict[str, Any]) -> None:
        for bucket in d["dp"]["buckets"]:
            bucket.pop("collective", None)

    old = parse_schedule(edited(dense(), strip), "old.yaml")
    assert {b.collective for b in old.dp.buckets} == {"rooted"} and '"collective"' not in edited(dense(), strip)


@cache
def free_order() -> Schedule:
    """qwen3-8b at TP 4 x DP 64 in free order: the planner reorders some buckets."""
    return compile_schedule(make_plan(load_model("qwen3-8b", 4), PlanRequest("qwen3-8b", 4, 64, order="free")))


def test_registration_order_is_checked_and_free_order_is_not() -> None:
    assert parse_schedule(dump_schedule(free_order()), "free.yaml").request.order == "free"
    rejected(free_order(), lambda d: d["request"].update(order="registration"), "not in reverse registration order")
    rejected(free_order(), lambda d: d["request"].update(order="shuffled"), "unknown order 'shuffled'")
    rejected(
        free_order(), lambda d: d["request"].update(solver="ilp"), "--order free does not combine with --solver ilp"
    )


def test_alpha_search_goes_with_alpha_device() -> None:
    rejected(dense(), lambda d: d["request"].update(alpha_device="h100"), "alpha_device")


def test_predicted_peak_memory_is_recomputed() -> None:
    """Each device's peak_bytes is its bucket buffer (fp32, every bucket), its state and a step's
    transients (a micro-group's capacity, one bucket over DP); a tampered figure is refused, an
    older file without it still reads."""
    schedule = dense()
    buckets = [*schedule.dp.buckets, *schedule.dp.expert_buckets, *schedule.dp.adamw_buckets]
    for device in schedule.metrics.device:
        expected = (
            4 * sum(b.numel for b in buckets)
            + device.state_bytes
            + schedule.request.group_bytes
            + 4 * max(b.numel for b in buckets)
        )
        assert device.peak_bytes == pytest.approx(expected)
    rejected(
        schedule, lambda d: d["metrics"]["device"][3].__setitem__("peak_bytes", 1.0), "metrics.device[3].peak_bytes"
    )

    def without_peaks(data: dict[str, Any]) -> None:
        for device in data["metrics"]["device"]:
            device.pop("peak_bytes")

    assert parse_schedule(edited(schedule, without_peaks), "plan.yaml").metrics.device[0].peak_bytes is None


@cache
def replicated() -> Schedule:
    """`dense()`'s plan with a replicated TP update: every TP rank updates every matrix its DP
    rank owns."""
    request = PlanRequest("qwen3-8b", 2, 4, tp_update="replicated")
    return compile_schedule(make_plan(load_model("qwen3-8b", 2), request))


def test_a_replicated_tp_update_counts_every_matrix_on_every_tp_rank() -> None:
    """A device's load and state are all of its DP rank's matrices, its traffic the all-gather
    of their shards (nothing scattered back), its peak three fp32 copies of them."""
    hosted, schedule = dense(), replicated()
    assert schedule.tp.update == "replicated" and schedule_problem(schedule) is None
    assert [b.cuts for b in schedule.dp.buckets] == [b.cuts for b in hosted.dp.buckets]
    entries = {e.name: e for e in schedule.params}
    owned: list[list[Any]] = [[] for _ in range(4)]
    for e in schedule.params:
        if e.optimizer == "matrix":
            owned[e.owner].append(e)
    for mine, theirs in zip(schedule.metrics.device, hosted.metrics.device):
        matrices = owned[mine.dp_rank]
        hosted_pair = hosted.metrics.device[mine.dp_rank * 2 + 1 - mine.tp_rank]
        assert mine.load == pytest.approx(
            theirs.load + hosted_pair.load - hosted.metrics.dp.adamw_load[mine.dp_rank] / 2
        )
        assert mine.load == pytest.approx(
            sum(e.cost for e in matrices) + schedule.metrics.dp.adamw_load[mine.dp_rank] / 2
        )
        # the all-gather: each sharded matrix's other half in, this half out; DP traffic as hosted
        sharded = sum(4 * e.shape[0] * e.shape[-1] // 2 for e in matrices if e.tp_dim is not None)
        micro_groups = micro_group_traffic(
            (
                (host, 4 * math.prod(entries[name].shape), 1, entries[name].tp_dim is None)
                for group in hosted.tp.ranks[mine.dp_rank].groups
                for name, host in zip(group.params, group.hosts)
            ),
            2,
        )[mine.tp_rank]
        assert mine.bytes_sent - sharded == theirs.bytes_sent - micro_groups[0]
        assert mine.bytes_received - sharded == theirs.bytes_received - micro_groups[1]
        assert mine.peak_bytes is not None and theirs.peak_bytes is not None
        full = 4 * sum(e.shape[0] * e.shape[-1] for e in matrices)
        assert mine.peak_bytes - mine.state_bytes == pytest.approx(
            theirs.peak_bytes - theirs.state_bytes - schedule.request.group_bytes + 3 * full
        )


def test_the_tp_update_is_known_and_is_the_one_asked_for() -> None:
    rejected(dense(), lambda d: d["tp"].update(update="synchronous"), "tp section update", "synchronous")
    rejected(dense(), lambda d: d["request"].update(tp_update="sometimes"), "tp_update", "sometimes")
    rejected(replicated(), lambda d: d["tp"].update(update="hosted"), "asked for replicated")
    # flipped with its figures left as they were: the device figures give it away
    rejected(dense(), lambda d: d["tp"].update(update="replicated"), "metrics.device[0]")
    assert parse_schedule(dump_schedule(dense())).request.tp_update == "auto"  # the default, not written


def test_the_newton_schulz_method_is_part_of_the_digest_and_of_every_cost() -> None:
    """A gram plan records its method; its digest differs from the standard plan's; a file
    whose method is edited (and resealed) is refused by its recomputed costs; an unknown method
    or precision is refused by name; a file written before the fields reads as standard."""
    model = load_model("qwen3-8b", 2)
    gram = compile_schedule(
        make_plan(model, PlanRequest("qwen3-8b", 2, 4, optimizer=OptimizerConfig(ns_method="gram")))
    )
    standard = dense()
    assert gram.request.optimizer.ns_method == "gram" and gram.digest != standard.digest
    assert "ns_method: gram" in dump_schedule(gram) and "ns_method" not in dump_schedule(standard)
    rejected(gram, lambda d: d["request"]["optimizer"].update(ns_method="standard"), "cost")
    rejected(standard, lambda d: d["request"]["optimizer"].update(ns_method="fast"), "ns_method", "fast")
    rejected(standard, lambda d: d["request"]["optimizer"].update(ns_dtype="fp8"), "ns_dtype", "fp8")
    rejected(standard, lambda d: d["request"]["optimizer"].update(gram_restart=1000), "gram_restart")
    shampoo = compile_schedule(make_plan(model, PlanRequest("qwen3-8b", 2, 4, optimizer=OptimizerConfig("shampoo"))))
    rejected(shampoo, lambda d: d["request"]["optimizer"].update(ns_method="gram"), "ns_method", "no effect")
    assert parse_schedule(dump_schedule(standard)).request.optimizer.ns_method == "standard"
