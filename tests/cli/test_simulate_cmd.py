"""`canzona simulate` end to end: the step and iteration report by default, JSON, options, and
one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from canzona.cli.main import main
from canzona.schedules.limits import BUCKET_COLLECTIVES

from cli_run import run

LIBRARY_32B = "schedules/qwen3-32b/muon-tp8-dp32.yaml"
SMALL = "schedules/qwen3-8b/muon-tp2-dp4.yaml"


def test_default_report_has_step_and_iteration(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["simulate", LIBRARY_32B], capsys)
    assert code == 0, err
    assert "as the schedule records them" in out and "training: global batch 256 x 4096 tokens, 8 micro-batches" in out
    assert "canzona's DP collectives per bucket:" in out and "overlap, the same for every strategy" in out
    assert "optimizer step (nothing overlapped):" in out and "training iteration" in out
    for word in ("canzona", "tp-sc", "dp-sc", "zero1-gather", "start-owner", "layer-wise", "ddp-adamw", "fwd+bwd s"):
        assert word in out
    code, out, _ = run(["simulate", LIBRARY_32B, "--step-only"], capsys)
    assert code == 0 and "training iteration" not in out and "training:" not in out


def test_json_with_training_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate",
        LIBRARY_32B,
        "--json",
        "--global-batch",
        "512",
        "--seq-len",
        "2048",
        "--micro-batches",
        "4",
        "--overlap-param-gather",
        "--train-tflops",
        "300",
    ]
    code, out, err = run(args, capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["dp_collectives"] == "schedule"
    assert {row["collective"] for row in data["buckets"]} <= set(BUCKET_COLLECTIVES) and data["buckets"]
    assert data["training"] == {"global_batch": 512, "seq_len": 2048, "micro_batches": 4, "train_flops": 300e12}
    iterations = {it["name"]: it for it in data["iterations"]}
    assert iterations["canzona"]["ratio"] == 1.0 and iterations["canzona"]["overlap_param"] is True
    # Every strategy with per-bucket parameter gathers overlaps them alike; DP-SC gathers nothing.
    assert all(iterations[name]["overlap_param"] for name in ("tp-sc", "zero1-gather", "start-owner", "layer-wise"))
    assert iterations["dp-sc"]["overlap_param"] is False
    assert [s["name"] for s in data["strategies"]] == [it["name"] for it in data["iterations"]]
    assert "phases" not in data["strategies"][0]
    for it in data["iterations"]:
        parts = it["forward_backward"] + it["exposed_reduce"] + it["optimizer"] + it["exposed_gather"]
        assert it["iteration"] == pytest.approx(parts)


def test_dp_collectives_all_to_all_is_the_slow_option(capsys: pytest.CaptureFixture[str]) -> None:
    steps = {}
    for choice in ("rooted", "all_to_all"):
        code, out, _ = run(["simulate", LIBRARY_32B, "--json", "--step-only", "--dp-collectives", choice], capsys)
        assert code == 0
        steps[choice] = json.loads(out)["strategies"][0]["step"]
    assert steps["rooted"] < 1.0 < 10.0 < steps["all_to_all"]  # the 0.56 s against 13.3 s


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--global-batch", "6"], "does not split into dp 4"),
        (["--micro-batches", "0"], "micro-batches must be >= 1"),
        (["--seq-len", "0"], "must be >= 1"),
        (["--train-tflops", "0"], "--train-tflops must be a finite number > 0"),
        (["--routed-fraction", "0.5"], "--routed-fraction has no effect here: qwen3-8b has no MoE experts"),
    ],
)
def test_bad_training_options_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["simulate", SMALL, *args], capsys)
    assert code == 2 and out == ""
    assert err.startswith("canzona: error: ") and message in err and err.count("\n") == 1


def test_calibrate_training_throughput_feeds_the_iteration(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from canzona.planner.partition.profile_cost import read_profile
    from canzona.planner.predict.hardware import profile_device

    profile_path = tmp_path / "cpu.yaml"
    args = [
        "calibrate",
        "--model",
        "examples/tiny_qwen3.yaml",
        "--optimizer",
        "muon",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--train-tokens",
        "64",
        "-o",
        str(profile_path),
    ]
    assert main(args) == 0, capsys.readouterr().err
    training = read_profile(profile_path).training
    # One matmul per 2-D weight of the example: 2 layers x 4 matrices, embedding and output layer.
    assert training is not None and training.tokens == 64 and training.shapes == 10 and training.flops_per_second > 0
    device = profile_device(profile_path)
    assert device.hardware.training_flops() == training.flops_per_second
    assert "training forward/backward timed on 64 tokens" in device.hardware.source
    schedule = tmp_path / "tiny.yaml"
    plan = [
        "plan",
        "--model",
        "examples/tiny_qwen3.yaml",
        "--tp",
        "2",
        "--dp",
        "2",
        "--bucket-size",
        "20000",
        "--group-mb",
        "0.03",
        "-o",
        str(schedule),
    ]
    assert main(plan) == 0
    capsys.readouterr()
    code, out, err = run(
        [
            "simulate",
            str(schedule),
            "--device",
            f"profile:{profile_path}",
            "--json",
            "--global-batch",
            "8",
            "--seq-len",
            "32",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    # 4 ranks share the host; without a contention fit the profile assumes 4x slower.
    assert data["training"]["train_flops"] == pytest.approx(training.flops_per_second / 4)
    assert data["iterations"][0]["forward_backward"] > 0
    assert main(["calibrate", "--train-tokens", "-1", "-o", str(tmp_path / "x.yaml")]) == 2


@pytest.mark.parametrize("command", [["simulate", SMALL, "--device"], ["plan", "--model", "qwen3-8b", "--cost"]])
def test_a_schedule_given_as_a_profile_is_named_as_one(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*command, f"profile:{SMALL}"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == (
        f"canzona: error: {SMALL}: this is a schedule, not a profile; give a file written by "
        "`canzona calibrate -o FILE`\n"
    )


def test_a_file_that_is_no_profile_says_what_a_profile_has(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "other.yaml").write_text("a: 1\n")
    (tmp_path / "future.yaml").write_text("format: canzona-profile/9\n")
    code, _, err = run(["simulate", SMALL, "--device", f"profile:{tmp_path / 'other.yaml'}"], capsys)
    assert (
        code == 2 and "not a profile written by `canzona calibrate` (it has no `format: canzona-profile/1` line)" in err
    )
    code, _, err = run(["simulate", SMALL, "--device", f"profile:{tmp_path / 'future.yaml'}"], capsys)
    assert (
        code == 2
        and "profile format 'canzona-profile/9' is not supported (this canzona reads 'canzona-profile/1')" in err
    )
