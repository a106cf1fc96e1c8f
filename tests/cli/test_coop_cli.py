"""`canzona plan --coop`: the summary and `show` say how many matrices are hosted cooperatively;
the option is refused where it would change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import refused, run


def test_plan_and_show_count_the_teams(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    teamed, plain = tmp_path / "teamed.yaml", tmp_path / "plain.yaml"
    code, out, _ = run(["plan", "--model", "qwen3-32b", "--tp", "8", "--dp", "32", "-o", str(teamed)], capsys)
    assert code == 0 and "64 matrices hosted cooperatively" in out
    code, out, _ = run(
        ["plan", "--model", "qwen3-32b", "--tp", "8", "--dp", "32", "--coop", "off", "-o", str(plain)], capsys
    )
    assert code == 0 and "cooperatively" not in out and "device imbalance 2.070" in out
    code, out, _ = run(["show", str(teamed)], capsys)
    assert code == 0 and "64 matrices hosted cooperatively" in out
    assert "coop: auto" in teamed.read_text() and "coop:" not in plain.read_text()


@pytest.mark.parametrize("extra", [["--optimizer", "shampoo", "--tp", "2"], ["--tp", "1"]])
def test_coop_is_refused_where_it_changes_nothing(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(
        ["plan", "--model", "qwen3-0.6b", "--dp", "2", *extra, "--coop", "force", "-o", str(tmp_path / "x.yaml")],
        capsys,
        "--coop has no effect here",
        "Muon with tp > 1",
    )


def test_an_unknown_coop_mode_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        [
            "plan",
            "--model",
            "qwen3-0.6b",
            "--tp",
            "2",
            "--dp",
            "2",
            "--coop",
            "sometimes",
            "-o",
            str(tmp_path / "x.yaml"),
        ],
        capsys,
    )
    assert code == 2 and out == "" and "sometimes" in err
