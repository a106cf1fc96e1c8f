"""Kernel calibration (`canzona calibrate`): rows in the profile format, fits, the command."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from canzona.runtime.tools.calibrate import (
    Settings,
    adamw_row,
    calibrate,
    fit_alpha_beta,
    fit_collectives,
    matrix_row,
    median_seconds,
)

CPU = __import__("torch").device("cpu")


def test_median_seconds_calls_warmup_plus_repeats() -> None:
    calls = []
    seconds = median_seconds(lambda: calls.append(1), CPU, warmup=2, repeats=3)
    assert len(calls) == 5 and seconds >= 0


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_matrix_rows(optimizer: str) -> None:
    row = matrix_row(optimizer, 16, 8, Settings(block_size=8, precondition_frequency=4), CPU, warmup=1, repeats=2)
    assert (row["optimizer"], row["rows"], row["cols"], row["repeats"]) == (optimizer, 16, 8, 2)
    assert row["seconds"] > 0
    if optimizer != "muon":
        # Amortised over the refresh period: between the plain step and the refreshing one.
        low, high = sorted((row["step_seconds"], row["refresh_seconds"]))
        assert low <= row["seconds"] <= high or row["seconds"] == pytest.approx(row["step_seconds"])


def test_adamw_row() -> None:
    row = adamw_row(1000, CPU, warmup=1, repeats=2)
    assert (row["optimizer"], row["rows"], row["cols"]) == ("adamw", 1000, 1) and row["seconds"] > 0


def test_calibrate_returns_a_valid_profile() -> None:
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.partition.profile_cost import Profile, ProfileCost

    data = calibrate(
        [(8, 16), (16, 16), (8, 16)],
        Settings(),
        "cpu",
        repeats=1,
        warmup=0,
        optimizers={"muon": [(8, 16), (16, 16)], "soap": [(8, 8)]},
        adamw_sizes=(100,),
        threads=1,
    )
    profile = Profile.model_validate(data)
    assert [(r.optimizer, r.rows, r.cols) for r in profile.rows] == [
        ("muon", 8, 16),
        ("muon", 16, 16),
        ("soap", 8, 8),
        ("adamw", 100, 1),
    ]
    assert profile.threads == 1 and profile.comm is None
    assert ProfileCost(profile, OptimizerConfig()).matrix_cost(16, 8) == profile.rows[0].seconds


def test_muon_is_timed_by_each_method_a_shape_runs_and_a_gram_plan_is_priced_by_its_rows() -> None:
    """8 x 32 runs Gram (four times as long as wide): timed both ways; 16 x 16 falls back: timed
    once. A gram configuration costs the gram row's seconds, a standard one the standard row's;
    a profile without gram rows prices gram by the standard rows scaled by the two FLOP counts."""
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.partition.profile_cost import Profile, ProfileCost, dump_profile, parse_profile
    from canzona.schedules.costs import muon_flops

    data = calibrate(
        [], Settings(), "cpu", repeats=1, warmup=0, optimizers={"muon": [(8, 32), (16, 16)]}, adamw_sizes=(100,)
    )
    profile = Profile.model_validate(data)
    assert [(r.method, r.rows, r.cols) for r in profile.rows if r.optimizer == "muon"] == [
        ("standard", 8, 32),
        ("gram", 8, 32),
        ("standard", 16, 16),
    ]
    assert parse_profile(dump_profile(profile)) == profile and '"method": "standard"' not in dump_profile(profile)
    standard, gram = OptimizerConfig(), OptimizerConfig(ns_method="gram")
    assert ProfileCost(profile, standard).matrix_cost(32, 8) == profile.rows[0].seconds
    assert ProfileCost(profile, gram).matrix_cost(32, 8) == profile.rows[1].seconds
    assert ProfileCost(profile, gram).matrix_cost(16, 16) == profile.rows[2].seconds  # falls back: the same kernel
    without = profile.model_copy(update={"rows": [r for r in profile.rows if r.method == "standard"]})
    scaled = ProfileCost(without, gram).matrix_cost(32, 8)
    expected = profile.rows[0].seconds * muon_flops(8, 32, 5, "gram", 2) / muon_flops(8, 32, 5)
    assert scaled == pytest.approx(expected, rel=1e-12)


def test_calibrate_rejects_unknown_optimizers_and_missing_gpus() -> None:
    with pytest.raises(ValueError, match="unknown matrix optimizer"):
        calibrate([(4, 4)], optimizers=["lion"], repeats=1, warmup=0, adamw_sizes=(10,))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            calibrate([(4, 4)], device="cuda", repeats=1, warmup=0)


def test_alpha_beta_fit_by_hand() -> None:
    # 2 ranks: 1 ms for ~nothing; 1 MB and 2 MB take 2 ms and 3 ms → 1 GB/s, α 1 ms.
    fit = fit_alpha_beta([4.0, 1e6, 2e6], [1e-3, 2e-3, 3e-3], 2)
    assert fit["latency"] == pytest.approx(1e-3) and fit["bandwidth"] == pytest.approx(1e9)
    two_point = fit_alpha_beta([4.0, 1e6], [1e-3, 2e-3], 2)
    assert two_point["bandwidth"] == pytest.approx(1e6 / 1e-3)


@pytest.mark.slow
def test_gloo_fit_on_two_processes() -> None:
    fit = fit_collectives(2, sizes=(64, 1 << 14, 1 << 16), repeats=2)
    assert fit["ranks"] == 2 and fit["latency"] > 0 and fit["bandwidth"] > 0


def test_calibrate_command_writes_a_profile(tmp_path) -> None:
    from canzona.cli.calibrate_cmd import calibrate as calibrate_command
    from canzona.planner.partition.profile_cost import read_profile

    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- [8, 16]\n- {rows: 16, cols: 16, optimizers: [muon]}\n")
    out = tmp_path / "profile.yaml"
    app = typer.Typer()
    app.command()(calibrate_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(
        app,
        [
            "calibrate",
            "--shapes",
            str(shapes),
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--optimizer",
            "muon",
            "--optimizer",
            "shampoo",
            "--threads",
            "1",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    profile = read_profile(out)
    assert [(r.optimizer, r.rows, r.cols) for r in profile.rows if r.optimizer != "adamw"] == [
        ("muon", 8, 16),
        ("muon", 16, 16),
        ("shampoo", 8, 16),
    ]


def test_calibrate_command_bad_input(tmp_path) -> None:
    from canzona.cli.calibrate_cmd import calibrate as calibrate_command
    from canzona.cli.calibrate_cmd import grid_shapes, model_shapes, read_shapes
    from canzona.planner.spec import PlanError

    bad = tmp_path / "bad.yaml"
    bad.write_text("- [8]\n")
    with pytest.raises(PlanError, match="two positive integers"):
        read_shapes(bad)
    bad.write_text("- {rows: 8, cols: 8, optimizers: [lion]}\n")
    with pytest.raises(PlanError, match="optimizers must be"):
        read_shapes(bad)
    with pytest.raises(PlanError, match="not both"):
        calibrate_command(tmp_path / "o.yaml", model="qwen3-0.6b", shapes=bad)
    with pytest.raises(PlanError, match="unknown optimizer"):
        calibrate_command(tmp_path / "o.yaml", optimizer=["lion"])
    assert (128, 512) in grid_shapes(512) and (128, 1024) not in grid_shapes(1024)
    assert (1024, 1024) in model_shapes("qwen3-0.6b")
