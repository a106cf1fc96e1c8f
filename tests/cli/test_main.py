"""The `canzona` command end to end: outputs, exit codes, one-line errors, files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from canzona.cli.main import main
from canzona.schedules.format import read_schedule

from cli_run import run


def test_models_lists_every_preset_with_counts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["models", "--json"], capsys)
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["qwen3-32b"]["params_b"] == pytest.approx(32.762, abs=1e-3)
    assert rows["deepseek-v3"]["experts"] == 256
    code, out, _ = run(["models"], capsys)
    assert code == 0 and "qwen3-235b-a22b" in out and "235.094B" in out


def test_plan_writes_a_valid_schedule_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.yaml"
    code, out, err = run(
        ["plan", "--model", "qwen3-0.6b", "--tp", "2", "--dp", "4", "-o", str(target), "--json"], capsys
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["output"] == str(target) and summary["tp"] == 2 and summary["dp"] == 4
    schedule = read_schedule(target)
    assert schedule.request.model.name == "qwen3-0.6b"
    assert summary["imbalance"] == schedule.metrics.dp.imbalance
    assert set(summary["baselines"]) == {"dp-sc", "zero1-gather", "start-owner", "layer-wise"}


def test_plan_default_output_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["plan", "--model", "qwen3-0.6b", "--dp", "2", "--alpha", "0.5"], capsys)
    assert code == 0
    expected = Path("qwen3-0.6b-muon-tp1-dp2-alpha0.5.yaml")  # outside a canzona checkout: next to the user
    assert (tmp_path / expected).is_file() and str(expected) in out


def test_plan_is_byte_identical_when_repeated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for target in (first, second):
        assert run(["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4", "-o", str(target)], capsys)[0] == 0
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "qwen3-3b", "--dp", "2"], "did you mean: qwen3-32b"),
        (["plan", "--model", "qwen3-32b", "--tp", "3"], "tp 3 does not divide"),
        (["plan", "--model", "qwen3-235b-a22b", "--tp", "8"], "num_kv_groups 4"),
        (["plan", "--model", "qwen3-8b", "--dp", "0"], "dp must be >= 1"),
        (["plan", "--model", "qwen3-8b", "--tp", "0"], "tp must be >= 1"),
        (["plan", "--model", "qwen3-8b", "--alpha", "1.5"], "alpha must be in [0, 1]"),
        (["plan", "--model", "qwen3-8b", "--alpha", "-0.1"], "alpha must be in [0, 1]"),
        (["plan", "--model", "qwen3-8b", "--bucket-size", "0"], "bucket size must be >= 1"),
        (["plan", "--model", "qwen3-8b", "--group-mb", "0"], "--group-mb must be > 0"),
        (["plan", "--model", "/nonexistent/config.json"], "cannot read"),
        (["plan", "--model", "qwen3-8b", "--optimizer", "adam"], "--optimizer"),
        (["plan", "--dp", "2"], "--model"),
        (["show", "/nonexistent.yaml"], "cannot read schedule"),
        (["plan", "--model", "qwen3-8b", "--cost", "flopz"], "unknown cost model 'flopz'"),
        (["plan", "--model", "qwen3-8b", "--cost", "profile:/nonexistent.yaml"], "cannot read profile"),
        (["plan", "--model", "qwen3-8b", "--alpha", "half"], "alpha must be a number in [0, 1] or auto"),
        (["plan", "--model", "qwen3-8b", "--alpha", "auto", "--device", "tpu9"], "unknown device 'tpu9'"),
        (["simulate", "schedules/qwen3-8b/muon-tp2-dp4.yaml", "--dp-collectives", "tree"], "--dp-collectives must be"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(args, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("canzona: error: ")
    assert message in err
    assert not (tmp_path / "schedules").exists()


def test_malformed_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("params: [\n")
    for args in (["show", str(broken)], ["plan", "--model", str(broken)]):
        code, _, err = run(args, capsys)
        assert code == 2 and err.count("\n") == 1 and "broken.yaml" in err
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, _, err = run(["plan", "--model", str(unknown)], capsys)
    assert code == 2 and "GPT2LMHeadModel" in err


def test_failed_plan_never_overwrites_a_good_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "good.yaml"
    assert run(["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(target)], capsys)[0] == 0
    before = target.read_bytes()
    code, _, _ = run(["plan", "--model", "qwen3-0.6b", "--tp", "3", "-o", str(target)], capsys)
    assert code == 2
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.yaml"]


def test_show_text_json_and_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "s.yaml"
    assert run(["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4", "-o", str(target)], capsys)[0] == 0
    code, out, _ = run(["show", str(target)], capsys)
    assert code == 0
    for needle in (
        "imbalance",
        "start-owner",
        "layer-wise",
        "rollback",
        "compute load per device",
        "predicted peak memory max",
    ):
        assert needle in out
    assert "sorted" not in out and "heap" not in out  # only the chosen mode is recorded
    code, out, _ = run(["show", str(target), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["request"]["dp"] == 4 and len(data["metrics"]["device"]) == 8
    code, out, _ = run(["show", str(target), "--rank", "3"], capsys)
    assert code == 0 and out.startswith("device 3 = dp rank 1, tp rank 1") and "peak memory" in out
    code, _, err = run(["show", str(target), "--rank", "8"], capsys)
    assert code == 2 and "outside the world of 8 devices" in err


def test_internal_errors_are_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("canzona.planner.sources.load.load_model", explode)
    code, _, err = run(["plan", "--model", "qwen3-8b"], capsys)
    assert code == 1 and err.count("\n") == 1 and "internal error" in err and "boom" in err
    monkeypatch.setenv("CANZONA_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["plan", "--model", "qwen3-8b"])


def test_console_script_and_no_torch_import(tmp_path: Path) -> None:
    """The installed command works, and planning never imports torch (it costs seconds)."""
    probe = (
        "import sys; from canzona.cli.main import main; "
        f"code = main(['plan', '--model', 'qwen3-0.6b', '--dp', '2', '-o', {str(tmp_path / 'x.yaml')!r}]); "
        "assert code == 0; assert 'torch' not in sys.modules and 'ortools' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "canzona"), "plan", "--model", "nope"],
        capture_output=True,
        text=True,
        env={**os.environ, "CANZONA_DEBUG": ""},
    )
    assert result.returncode == 2 and result.stderr.startswith("canzona: error: unknown model")
