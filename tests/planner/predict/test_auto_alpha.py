"""`--alpha auto` (choose_alpha) and the profile cost model (`--cost profile:FILE`)."""

from __future__ import annotations

import math

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import FlopsCost, OptimizerConfig, param_cost
from canzona.planner.partition.profile_cost import (
    Profile,
    ProfileCost,
    dump_profile,
    load_profile,
    parse_profile,
    profile_cost_model,
    read_profile,
)
from canzona.planner.plan import PlanRequest, TrainingSetup
from canzona.planner.predict.auto_alpha import alpha_table, choose_alpha
from canzona.planner.predict.hardware import BUILTIN, ThroughputCost, override_network, profile_device
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX, ModelSpec, ParamSpec, PlanError

# ---------------------------------------------------------------------------------------------
# choose_alpha


@pytest.fixture(scope="module")
def qwen8b():
    return load_model("qwen3-8b", 2)


def test_auto_alpha_returns_a_tried_alpha_with_minimal_predicted_time(qwen8b) -> None:
    request = PlanRequest("qwen3-8b", 2, 4)
    slow_network = override_network(BUILTIN["h100"], intra_gbps=5, inter_gbps=5)
    plan, tried = choose_alpha(qwen8b, request, slow_network, alphas=(0.0, 0.5, 1.0))
    assert [t.value for t in tried] == [0.0, 0.5, 1.0]
    best = min(t.step_s for t in tried)
    assert plan.request.alpha in {t.value for t in tried}
    assert {t.value: t.step_s for t in tried}[plan.request.alpha] == pytest.approx(best)
    # Without a training setup the objective is the step, recorded as both figures.
    assert all(t.iteration_s == t.step_s for t in tried)
    # The recorded time is the simulator's prediction for that plan.
    again = simulate(compile_schedule(plan), slow_network).get("canzona").step
    assert again == pytest.approx(best)
    assert "<- chosen" in alpha_table(tried, plan.request.alpha)


def test_auto_alpha_minimises_the_iteration_given_a_training_setup(qwen8b) -> None:
    request = PlanRequest("qwen3-8b", 2, 4)
    slow_network = override_network(BUILTIN["h100"], intra_gbps=5, inter_gbps=5)
    training = TrainingSetup(global_batch=8, seq_len=1024)
    plan, tried = choose_alpha(qwen8b, request, slow_network, alphas=(0.0, 0.5, 1.0), training=training)
    chosen = {t.value: t for t in tried}[plan.request.alpha]
    assert chosen.iteration_s == pytest.approx(min(t.iteration_s for t in tried))
    sim = simulate(compile_schedule(plan), slow_network, training=training)
    assert sim.iteration("canzona").iteration == pytest.approx(chosen.iteration_s)
    assert all(t.iteration_s > t.step_s for t in tried)  # forward and backward come on top


def test_auto_alpha_ties_go_to_the_larger_alpha() -> None:
    # One DP rank: every alpha gives the same plan and the same predicted time.
    model = ModelSpec("pair", (ParamSpec("w", (64, 32), 0, MATRIX, ((64, 32),), "fp32"),), "pair")
    plan, tried = choose_alpha(model, PlanRequest("pair", 2, 1), BUILTIN["h100"], alphas=(1.0, 0.0, 0.5))
    assert len({t.step_s for t in tried}) == 1
    assert plan.request.alpha == 1.0
    assert [t.value for t in tried] == [1.0, 0.0, 0.5]


def test_auto_alpha_rejects_bad_candidates(qwen8b) -> None:
    with pytest.raises(PlanError, match="alpha must be in"):
        choose_alpha(qwen8b, PlanRequest("qwen3-8b", 2, 4), BUILTIN["h100"], alphas=(0.5, 1.5))
    with pytest.raises(PlanError, match="at least one"):
        choose_alpha(qwen8b, PlanRequest("qwen3-8b", 2, 4), BUILTIN["h100"], alphas=())


# ---------------------------------------------------------------------------------------------
# Profiles

SETTINGS = "settings: {ns_steps: 5, block_size: 1024, precondition_frequency: 10, max_precond_dim: 10000}"


def _profile_text(rows: str, extra: str = "") -> str:
    return (
        "format: canzona-profile/1\ndevice: cpu\ndevice_name: test cpu\ntorch: 2.13.0\ndtype: fp32\nthreads: 1\n"
        f"{SETTINGS}\n{extra}rows:\n{rows}"
    )


ROWS = (
    '  - {"optimizer": "muon", "rows": 256, "cols": 1024, "seconds": 0.02, "repeats": 5}\n'
    '  - {"optimizer": "muon", "rows": 1024, "cols": 1024, "seconds": 0.5, "repeats": 5}\n'
    '  - {"optimizer": "adamw", "rows": 1000000, "cols": 1, "seconds": 0.004, "repeats": 5}\n'
)


def test_measured_shape_costs_its_measured_seconds() -> None:
    cost = ProfileCost(parse_profile(_profile_text(ROWS)), OptimizerConfig())
    assert cost.matrix_cost(256, 1024) == 0.02
    assert cost.matrix_cost(1024, 256) == 0.02  # Muon is symmetric: the transpose is the same work


def test_unmeasured_shape_scales_by_the_nearest_achieved_rate() -> None:
    cost = ProfileCost(parse_profile(_profile_text(ROWS)), OptimizerConfig())
    flops = FlopsCost(OptimizerConfig())
    # 2048x2048 is nearest (in log sides) to 1024x1024: same achieved FLOP/s.
    rate = flops.matrix_cost(1024, 1024) / 0.5
    assert cost.matrix_cost(2048, 2048) == pytest.approx(flops.matrix_cost(2048, 2048) / rate)
    # 128x512 is nearest to 256x1024.
    rate = flops.matrix_cost(256, 1024) / 0.02
    assert cost.matrix_cost(128, 512) == pytest.approx(flops.matrix_cost(128, 512) / rate)


def test_other_settings_scale_even_measured_shapes() -> None:
    # 10 Newton-Schulz steps instead of the 5 measured: same FLOP/s, about twice the work.
    cost = ProfileCost(parse_profile(_profile_text(ROWS)), OptimizerConfig(ns_steps=10))
    flops5, flops10 = FlopsCost(OptimizerConfig()), FlopsCost(OptimizerConfig(ns_steps=10))
    expected = 0.02 * flops10.matrix_cost(256, 1024) / flops5.matrix_cost(256, 1024)
    assert cost.matrix_cost(256, 1024) == pytest.approx(expected)


def test_adamw_scales_linearly_from_the_nearest_size() -> None:
    cost = ProfileCost(parse_profile(_profile_text(ROWS)), OptimizerConfig())
    assert cost.adamw_cost(500_000) == pytest.approx(0.002)
    assert cost.adamw_cost(0) == 0.0


def test_profile_cost_plans(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(_profile_text(ROWS))
    cost = profile_cost_model(f"profile:{path}", OptimizerConfig())
    param = ParamSpec("w", (1024, 1024), 0, MATRIX, ((1024, 1024),))
    assert param_cost(param, cost) == 0.5
    assert load_profile(path).optimizer.name == "muon"


def test_profile_round_trips_through_dump(tmp_path) -> None:
    profile = parse_profile(_profile_text(ROWS, "comm: {backend: gloo, ranks: 2, latency: 0.0001, bandwidth: 1.0e9}\n"))
    path = tmp_path / "p.yaml"
    path.write_text(dump_profile(profile))
    assert read_profile(path) == profile
    device = profile_device(path)
    assert device.hardware.latency == 0.0001 and device.hardware.intra_bandwidth == 1e9
    # Hardware summary: the achieved rates of the rows.
    flops = FlopsCost(OptimizerConfig())
    rates = sorted(flops.matrix_cost(r, c) / s for r, c, s in ((256, 1024, 0.02), (1024, 1024, 0.5)))
    assert device.hardware.matrix_flops == pytest.approx(sum(rates) / 2)
    assert isinstance(device.time_model(OptimizerConfig()), ProfileCost)
    assert isinstance(device.time_model(OptimizerConfig("soap")), ThroughputCost)  # no soap rows


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("format: other/1\n", "not supported"),
        ("- just a list\n", "expected a mapping"),
        ("format: canzona-profile/1\n: [\n", "not valid YAML"),
        (_profile_text('  - {"optimizer": "muon", "rows": 4, "cols": 4, "seconds": 1.0, "repeats": 1}\n'), "adamw row"),
        (
            _profile_text('  - {"optimizer": "adamw", "rows": 4, "cols": 1, "seconds": 0.0, "repeats": 1}\n'),
            "rows.0.seconds",
        ),
        (
            _profile_text('  - {"optimizer": "lion", "rows": 4, "cols": 1, "seconds": 1.0, "repeats": 1}\n'),
            "rows.0.optimizer",
        ),
        (_profile_text(ROWS, "colour: blue\n"), "colour"),
        (_profile_text(""), "rows"),
    ],
)
def test_invalid_profiles_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message) as error:
        parse_profile(text, "p.yaml")
    assert "\n" not in str(error.value)


def test_profile_errors(tmp_path) -> None:
    with pytest.raises(PlanError, match="cannot read profile"):
        read_profile(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="no soap rows"):
        ProfileCost(parse_profile(_profile_text(ROWS)), OptimizerConfig("soap"))
    with pytest.raises(PlanError, match="profile:PATH"):
        profile_cost_model("profile:", OptimizerConfig())


def test_checked_in_cpu_profile_is_valid() -> None:
    from canzona.planner.predict.hardware import CPU_PROFILE

    profile = read_profile(CPU_PROFILE)
    assert isinstance(profile, Profile) and profile.device == "cpu" and profile.comm is not None
    assert set(profile.optimizers()) == {"muon", "shampoo", "soap"}
    assert all(math.isfinite(row.seconds) for row in profile.rows)


def test_contention_interpolates_and_slows_a_shared_host(tmp_path) -> None:
    from canzona.planner.predict.hardware import shared_host

    extra = "contention: [{processes: 2, slowdown: 1.0}, {processes: 4, slowdown: 2.0}]\n"
    profile = parse_profile(_profile_text(ROWS, extra))
    assert [profile.slowdown(n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 4.0]
    path = tmp_path / "p.yaml"
    path.write_text(dump_profile(profile))
    device = profile_device(path)
    assert shared_host(device, 2) is device
    crowded = shared_host(device, 4)
    assert crowded.hardware.matrix_flops == pytest.approx(device.hardware.matrix_flops / 2)
    assert crowded.time_model(OptimizerConfig()).matrix_cost(256, 1024) == pytest.approx(0.04)
