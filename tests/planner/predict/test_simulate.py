"""The step-time simulator: the micro-group pipeline,
hand-computed tiny schedules, invariants on real plans, hardware models, the CLI command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from canzona.cli.simulate_cmd import simulate as simulate_command
from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig, muon_flops
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.predict.hardware import BUILTIN, Hardware, override_network, resolve_device
from canzona.planner.predict.simulate import predicted_ratios, simulate
from canzona.planner.predict.step import GroupTimes, pipeline_events, pipeline_seconds
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ADAMW, MATRIX, ModelSpec, ParamSpec, PlanError
from canzona.schedules.format import write_schedule
from canzona.schedules.limits import BUCKET_COLLECTIVES

# ---------------------------------------------------------------------------------------------
# The micro-group pipeline


def test_one_group_is_compute_plus_comm() -> None:
    group = GroupTimes(gather=1.5, compute=2.25, scatter=0.75)
    assert pipeline_seconds([group]) == pytest.approx(4.5)
    assert pipeline_seconds([group], overlap=False) == pytest.approx(4.5)


def test_two_groups_timeline_by_hand() -> None:
    # gather 0 [0,1]; gather 1 [1,2] while compute 0 [1,3]; scatter 0 [3,4] while compute 1 [3,5];
    # scatter 1 [5,6]. Sequential would be 8.
    groups = [GroupTimes(1, 2, 1), GroupTimes(1, 2, 1)]
    events = {(e.kind, e.group): (e.start, e.end) for e in pipeline_events(groups)}
    assert events == {
        ("gather", 0): (0, 1),
        ("gather", 1): (1, 2),
        ("compute", 0): (1, 3),
        ("scatter", 0): (3, 4),
        ("compute", 1): (3, 5),
        ("scatter", 1): (5, 6),
    }
    assert pipeline_seconds(groups) == 6
    assert pipeline_seconds(groups, overlap=False) == 8


def test_network_queue_is_fifo() -> None:
    # A long gather of group 1 (issued before compute 0) delays scatter 0 on the same queue:
    # gather 0 [0,1]; gather 1 [1,6]; compute 0 [1,2]; scatter 0 waits → [6,7]; compute 1
    # [6,7]; scatter 1 [7,8]. Sequential: 3 + 7 = 10.
    groups = [GroupTimes(1, 1, 1), GroupTimes(5, 1, 1)]
    events = {(e.kind, e.group): (e.start, e.end) for e in pipeline_events(groups)}
    assert events[("gather", 1)] == (1, 6)
    assert events[("scatter", 0)] == (6, 7)
    assert events[("compute", 1)] == (6, 7)
    assert events[("scatter", 1)] == (7, 8)
    assert pipeline_seconds(groups) == 8
    assert pipeline_seconds(groups, overlap=False) == 10


group_times = st.builds(
    GroupTimes,
    st.floats(0, 10, allow_nan=False),
    st.floats(0, 10, allow_nan=False),
    st.floats(0, 10, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(group_times, min_size=1, max_size=12))
def test_overlap_never_slower_and_never_beats_the_bounds(groups: list[GroupTimes]) -> None:
    overlapped = pipeline_seconds(groups)
    sequential = pipeline_seconds(groups, overlap=False)
    assert overlapped <= sequential * (1 + 1e-12) + 1e-12
    compute = sum(g.compute for g in groups)
    comm = sum(g.gather + g.scatter for g in groups)
    assert overlapped >= max(compute, comm) * (1 - 1e-12) - 1e-12
    assert overlapped >= max(g.gather + g.compute + g.scatter for g in groups) * (1 - 1e-12) - 1e-12


# ---------------------------------------------------------------------------------------------
# Tiny schedules, every second computed by hand
#
# Hardware: a 4x4 Muon update (5 steps) is muon_flops(4, 4, 5) = 2080 FLOPs → 1 s; AdamW moves
# 28 B per element at 28·64 B/s → 64 elements per second; α = 0.5 s; 32 B/s inside a node.

TOY = Hardware(
    "toy",
    matrix_flops=2080.0,
    memory_bandwidth=28 * 64.0,
    latency=0.5,
    intra_bandwidth=32.0,
    inter_bandwidth=16.0,
    gpus_per_node=8,
    source="hand-made",
)


def _toy_model(num_matrices: int) -> ModelSpec:
    matrices = tuple(ParamSpec(f"m{i}", (4, 4), i % 2, MATRIX, ((4, 4),), "fp32") for i in range(num_matrices))
    return ModelSpec("toy", (*matrices, ParamSpec("norm", (8,), None, ADAMW, (), "fp32")), "toy")


def test_toy_costs_are_what_the_comments_say() -> None:
    assert muon_flops(4, 4, 5) == 2080


def test_tiny_schedule_tp2_dp2_by_hand() -> None:
    schedule = compile_schedule(make_plan(_toy_model(2), PlanRequest("toy", 2, 2)))
    # Geometry: m1 at 0 and m0 at 64 of one 128-element bucket, cut between them; AdamW equal.
    assert [b.cuts for b in schedule.dp.buckets] == [[0, 64, 128]]
    assert [b.cuts for b in schedule.dp.adamw_buckets] == [[0, 64, 128]]
    assert [[(g.params, g.hosts) for g in r.groups] for r in schedule.tp.ranks] == [[(["m1"], [0])], [(["m0"], [0])]]
    sim = simulate(schedule, TOY)
    # DP: every collective moves a 64-element fp32 slice (256 B) each way on 2 ranks: 0.5 + 8 s.
    # Reduce-scatter of the matrix and AdamW buckets, all-gather of both: 4 · 8.5 = 34 s.
    # TP group: gather 0.5 + 32/32 = 1.5 s, update 1 s, scatter 1.5 s; then AdamW of 64
    # elements 1 s → 5 s. Step 39 s; the host computes 2 s.
    canzona = sim.get("canzona")
    assert (canzona.step, canzona.compute, canzona.dp_comm, canzona.tp_comm) == pytest.approx((39.0, 2.0, 34.0, 3.0))
    assert canzona.exposed_comm == pytest.approx(37.0)
    assert canzona.optimizer_stage == pytest.approx(5.0)
    assert canzona.critical_device == 0
    # TP-SC: one all-gather of the 32 B shard (1.5 s), update 1 s, AdamW 1 s → 34 + 3.5.
    assert sim.get("tp-sc").step == pytest.approx(37.5)
    # DP-SC: all-reduce of both 128-element buckets (2·0.5 + 512/32 = 17 s each); gather both
    # shards (0.5 + 64/32 = 2.5 s); both matrices 2 s; AdamW over 128 elements 2 s → 34 + 6.5.
    assert sim.get("dp-sc").step == pytest.approx(40.5)
    # Layer-wise: all-reduce 17 + AdamW reduce-scatter 8.5; 3.5 s local; two broadcasts of
    # 32 B (0.5 + 1 s each) + AdamW all-gather 8.5 → 25.5 + 3.5 + 11.5.
    assert sim.get("layer-wise").step == pytest.approx(40.5)
    assert sim.ratios()["dp-sc"] == pytest.approx(40.5 / 39.0)


def test_tiny_pipeline_dp1_tp2_by_hand() -> None:
    # Three 4x4 matrices on one DP rank; 64 B of capacity per host: group 0 holds two tasks
    # (one per host), group 1 one. DP collectives are free (one rank).
    request = PlanRequest("toy", 2, 1, group_bytes=64)
    schedule = compile_schedule(make_plan(_toy_model(3), request))
    assert [len(g.params) for g in schedule.tp.ranks[0].groups] == [2, 1]
    sim = simulate(schedule, TOY)
    # Each group: gather 1.5 s, update 1 s, scatter 1.5 s. Pipelined: gather 0 [0, 1.5],
    # gather 1 [1.5, 3], compute 0 [1.5, 2.5], scatter 0 [3, 4.5], compute 1 [3, 4], scatter 1
    # [4.5, 6] → 6 s; back to back 2 · 4 = 8 s. AdamW: 128 padded elements, 2 s.
    assert sim.get("canzona").step == pytest.approx(8.0)
    assert sim.get("canzona-no-overlap").step == pytest.approx(10.0)
    assert sim.get("canzona").dp_comm == 0.0


# ---------------------------------------------------------------------------------------------
# Real plans: invariants and baseline ordering


@pytest.fixture(scope="module")
def qwen8b():
    return compile_schedule(make_plan(load_model("qwen3-8b", 2), PlanRequest("qwen3-8b", 2, 4, group_bytes=256 << 20)))


def test_more_groups_never_slower_than_no_overlap(qwen8b) -> None:
    assert max(len(r.groups) for r in qwen8b.tp.ranks) > 1
    for name in BUILTIN:
        sim = simulate(qwen8b, BUILTIN[name])
        assert sim.get("canzona").step <= sim.get("canzona-no-overlap").step
    sim = simulate(qwen8b, BUILTIN["h100"])
    assert sim.get("canzona").step < sim.get("canzona-no-overlap").step


def test_baselines_order_sanely(qwen8b) -> None:
    sim = simulate(qwen8b, BUILTIN["h100"])
    compute = {s.name: s.compute for s in sim.strategies}
    # DP-SC updates everything on every device: the most compute of all.
    assert compute["dp-sc"] == max(compute.values())
    # A rank under zero1-gather updates a superset of what it updates under start-owner.
    assert compute["zero1-gather"] >= compute["start-owner"]
    # Duplicating over TP never computes less than hosting once.
    assert compute["tp-sc"] >= compute["canzona"]
    for strategy in sim.strategies:
        assert strategy.step == pytest.approx(strategy.compute + strategy.exposed_comm)
        assert strategy.comm >= strategy.dp_comm >= 0
        assert 0 <= strategy.critical_device < qwen8b.request.tp * qwen8b.request.dp


def test_options_change_only_what_they_should(qwen8b) -> None:
    plain = simulate(qwen8b, BUILTIN["h100"])
    fused = simulate(qwen8b, BUILTIN["h100"], fused=True)
    assert fused.get("canzona").dp_comm <= plain.get("canzona").dp_comm
    assert fused.get("canzona").optimizer_stage == pytest.approx(plain.get("canzona").optimizer_stage)
    for collective in BUCKET_COLLECTIVES:
        forced = simulate(qwen8b, BUILTIN["h100"], dp_collectives=collective)
        assert forced.get("dp-sc").step == pytest.approx(plain.get("dp-sc").step)
        assert forced.get("canzona").optimizer_stage == pytest.approx(plain.get("canzona").optimizer_stage)
    with pytest.raises(PlanError, match="unknown DP collectives"):
        simulate(qwen8b, BUILTIN["h100"], dp_collectives="tree")
    ratios = predicted_ratios(qwen8b, BUILTIN["h100"])
    assert set(ratios) == {"canzona", "dp-sc", "tp-sc"}


def test_slower_network_never_speeds_a_strategy_up(qwen8b) -> None:
    fast = simulate(qwen8b, BUILTIN["h100"])
    slow = simulate(qwen8b, override_network(BUILTIN["h100"], intra_gbps=10, inter_gbps=1, latency_us=50))
    for name in ("canzona", "dp-sc", "tp-sc", "layer-wise"):
        assert slow.get(name).step >= fast.get(name).step


def test_expert_parallel_schedule_simulates() -> None:
    model = load_model("qwen3-30b-a3b", 2)
    schedule = compile_schedule(make_plan(model, PlanRequest("qwen3-30b-a3b", 2, 8, ep=4)))
    sim = simulate(schedule, BUILTIN["h100"])
    assert sim.ep == 4
    assert all(s.step > 0 for s in sim.strategies)
    assert sim.get("dp-sc").compute > sim.get("canzona").compute


# ---------------------------------------------------------------------------------------------
# Hardware models


def test_builtin_devices_state_their_sources() -> None:
    for name in ("h100", "h200", "a100", "cpu"):
        hardware = resolve_device(name).hardware
        assert hardware.source and hardware.matrix_flops > 0
    assert resolve_device("H100").hardware.intra_bandwidth == 450e9
    assert resolve_device("h100").hardware.inter_bandwidth == 50e9
    assert resolve_device("a100").hardware.matrix_flops < resolve_device("h100").hardware.matrix_flops
    assert resolve_device("h200").hardware.memory_bandwidth > resolve_device("h100").hardware.memory_bandwidth
    cpu = resolve_device("cpu")
    assert cpu.profile is not None and "calibrate" in cpu.hardware.source


def test_network_overrides() -> None:
    device = resolve_device("h100", intra_gbps=100, inter_gbps=12.5, gpus_per_node=4, latency_us=2)
    hardware = device.hardware
    assert (hardware.intra_bandwidth, hardware.inter_bandwidth, hardware.gpus_per_node) == (100e9, 12.5e9, 4)
    assert hardware.latency == pytest.approx(2e-6)
    assert "overridden" in hardware.source


def test_bad_devices_and_hardware() -> None:
    with pytest.raises(PlanError, match="unknown device"):
        resolve_device("tpu-v9")
    with pytest.raises(PlanError, match="must be > 0"):
        replace(BUILTIN["h100"], matrix_flops=0)
    with pytest.raises(PlanError, match="gpus per node"):
        replace(BUILTIN["h100"], gpus_per_node=0)


def test_groups_spanning_nodes_use_the_inter_node_link(qwen8b) -> None:
    from canzona.planner.predict.step import build_instance, default_time_model

    hardware = BUILTIN["h100"]
    inst = build_instance(qwen8b, hardware, default_time_model(qwen8b, hardware))
    assert inst.tp_link.bandwidth == hardware.intra_bandwidth  # tp 2 inside a node of 8
    assert inst.dp_link.bandwidth == hardware.intra_bandwidth  # 8 devices: one node
    two_per_node = replace(hardware, gpus_per_node=2)
    inst = build_instance(qwen8b, two_per_node, default_time_model(qwen8b, two_per_node))
    assert inst.dp_link.bandwidth == hardware.inter_bandwidth
    assert inst.tp_link.bandwidth == hardware.intra_bandwidth


# ---------------------------------------------------------------------------------------------
# The command


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(simulate_command)
    app.command("noop")(lambda: None)  # keep `simulate` a named subcommand
    return app


def test_simulate_command_text_and_json(tmp_path, qwen8b) -> None:
    path = tmp_path / "s.yaml"
    write_schedule(qwen8b, path)
    runner = CliRunner()
    result = runner.invoke(_app(), ["simulate", str(path), "--device", "a100"])
    assert result.exit_code == 0, result.output
    for word in (
        "canzona",
        "dp-sc",
        "tp-sc",
        "zero1-gather",
        "start-owner",
        "layer-wise",
        "critical device",
        "source:",
    ):
        assert word in result.output
    result = runner.invoke(_app(), ["simulate", str(path), "--json", "--inter-gbps", "25", "--fused"])
    data = json.loads(result.output)
    assert data["hardware"]["inter_bandwidth"] == 25e9 and data["fused"] is True
    assert data["strategies"][0]["name"] == "canzona" and data["strategies"][0]["ratio"] == 1.0


def test_simulate_command_bad_input(tmp_path, qwen8b) -> None:
    from canzona.schedules.format import ScheduleError

    path = tmp_path / "s.yaml"
    write_schedule(qwen8b, path)
    with pytest.raises(PlanError, match="unknown device"):
        simulate_command(path, device="nope")
    with pytest.raises(PlanError, match="inter-gbps"):
        simulate_command(path, inter_gbps=0)
    with pytest.raises(ScheduleError):
        simulate_command(tmp_path / "missing.yaml")


def test_optimizer_config_round_trip(qwen8b) -> None:
    # The default time model prices the schedule's own optimizer settings.
    from canzona.planner.predict.step import default_time_model

    model = default_time_model(qwen8b, BUILTIN["h100"])
    assert model.optimizer == OptimizerConfig()
