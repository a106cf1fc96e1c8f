"""The FSDP mode on the command line: `plan --fsdp` / `--dp-replicate`, and what `show`, `check`,
`diff`, `simulate` and `reshard-check` make of FSDP schedules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import make_checkout, refused, run


@pytest.fixture()
def planned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Path:
    """qwen3-8b planned four ways in tmp_path, a checkout's root: replicated, FSDP, FSDP with
    smaller groups, HSDP."""
    make_checkout(tmp_path)
    monkeypatch.chdir(tmp_path)
    for args in (
        ["--dp", "4"],
        ["--dp", "4", "--fsdp"],
        ["--dp", "4", "--fsdp", "--group-mb", "512", "-o", "small.yaml"],
        ["--tp", "2", "--dp", "8", "--fsdp", "--dp-replicate", "2"],
    ):
        code, _, err = run(["plan", "--model", "qwen3-8b", *args], capsys)
        assert code == 0, err
    return tmp_path / "schedules" / "qwen3-8b"


def test_plan_names_the_mode_and_reports_the_hosts(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in planned.iterdir()) == [
        "muon-tp1-dp4-fsdp.yaml",
        "muon-tp1-dp4.yaml",
        "muon-tp2-dp8-hsdp2.yaml",
    ]
    code, out, _ = run(["show", str(planned / "muon-tp2-dp8-hsdp2.yaml")], capsys)
    assert code == 0 and "HSDP 2 replicas x 4 shards: hosts over DP shard x TP = 8 devices" in out.splitlines()[0]
    code, out, _ = run(["show", str(planned / "muon-tp2-dp8-hsdp2.yaml"), "--rank", "9"], capsys)
    assert code == 0 and "hosts " in out and "(FSDP: no buffer slices)" in out  # replica 1's devices host too
    refused(["render", str(planned / "muon-tp1-dp4-fsdp.yaml"), "-o", "plan.png"], capsys, "for an FSDP schedule see")
    code, out, _ = run(["plan", "--model", "qwen3-8b", "--dp", "2", "--fsdp", "--json", "-o", "x.yaml"], capsys)
    summary = json.loads(out)
    assert (summary["sharding"], summary["dp_replicate"], summary["num_buckets"]) == ("fsdp", 1, 0)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--dp", "4", "--dp-replicate", "2"], "--dp-replicate has no effect here"),
        (["--dp", "4", "--fsdp", "--alpha", "0.5"], "which FSDP plans do not have"),
        (["--dp", "4", "--fsdp", "--bucket-size", "auto"], "--bucket-size auto search"),
        (["--dp", "4", "--fsdp", "--solver", "ilp"], "--solver ilp is not supported with --fsdp"),
        (["--dp", "4", "--fsdp", "--dp-replicate", "3"], "dp replicate 3 does not divide dp 4"),
        (["--dp", "4", "--fsdp", "--order", "free"], "FSDP plans have no buckets to order"),
        (["--tp", "2", "--dp", "4", "--fsdp", "--coop", "force"], "without --fsdp"),
    ],
)
def test_plan_refusals(
    args: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    refused(["plan", "--model", "qwen3-8b", *args], capsys, needle)


def test_check_regenerates_fsdp_files(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = planned / "muon-tp2-dp8-hsdp2.yaml"
    code, out, _ = run(["check", str(path)], capsys)
    assert code == 0 and out.startswith("fresh")
    text = path.read_text()
    path.write_text(text.replace('"owner": 0', '"owner": 1', 1))
    code, out, err = run(["check", str(path)], capsys)  # a hand edit: the digest no longer matches
    assert code == 2 and out == "" and "invalid (digest" in err
    code, _, _ = run(["check", "--fix", str(path)], capsys)
    assert code == 0 and path.read_text() == text


def test_diff_says_when_the_modes_differ(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["diff", str(planned / "muon-tp1-dp4.yaml"), str(planned / "muon-tp1-dp4-fsdp.yaml")], capsys)
    assert code == 0 and "the sharding modes differ (OLD replicated, NEW fsdp)" in err and "tp groups" in out
    code, out, err = run(
        ["diff", str(planned / "muon-tp1-dp4-fsdp.yaml"), str(planned.parents[1] / "small.yaml")], capsys
    )
    assert code == 0 and err == "" and "tp groups" in out


def test_table_names_the_mode(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["table", str(planned)], capsys)
    assert code == 0 and "| tp1 dp4 fsdp |" in out and "| tp2 dp8 hsdp2 |" in out and "| tp1 dp4 |" in out


def test_simulate_prices_the_fsdp_step(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("muon-tp1-dp4-fsdp.yaml", "muon-tp2-dp8-hsdp2.yaml"):
        code, out, _ = run(["simulate", str(planned / name), "--json"], capsys)
        data = json.loads(out)
        steps = {s["name"]: s["step"] for s in data["strategies"]}
        assert code == 0 and data["num_groups"] >= 2
        assert steps["adamw"] < steps["canzona"] <= steps["canzona (no overlap)"] < steps["redundant"]
    code, out, _ = run(["simulate", str(planned / "muon-tp1-dp4-fsdp.yaml")], capsys)
    assert code == 0 and "FSDP tp 1 x dp 4" in out and "redundant" in out
    refused(
        ["simulate", str(planned / "muon-tp1-dp4-fsdp.yaml"), "--global-batch", "64"],
        capsys,
        "--global-batch has no effect here: FSDP schedules are simulated for the optimizer step only",
    )


def test_reshard_check_reports_the_modes(planned: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fsdp = str(planned / "muon-tp1-dp4-fsdp.yaml")
    code, out, err = run(["reshard-check", str(planned / "muon-tp1-dp4.yaml"), fsdp], capsys)
    assert code == 1 and "sharding differs: OLD replicated, NEW fsdp" in err and "FSDP DP 4 x TP 1" in out
    code, _, err = run(["reshard-check", fsdp, str(planned.parents[1] / "small.yaml")], capsys)
    assert code == 1 and "both schedules are FSDP but differ" in err
    code, out, _ = run(["reshard-check", fsdp, fsdp, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["compatible"] and data["moved_bytes"] == 0
    assert sum(row["loads"] for row in data["new_ranks"]) == data["state_bytes"] > 0
