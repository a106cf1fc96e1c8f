"""`canzona plan --tp-update`: auto writes the replicated update where it is predicted faster and
says so; hosted and replicated are what the file holds; the option is refused where it would
change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from canzona.schedules.format import read_schedule

from cli_run import refused, run

LAYOUT = ["--model", "qwen3-1.7b", "--tp", "4", "--dp", "64", "--optimizer", "shampoo"]


def test_auto_picks_the_faster_update_and_the_others_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    auto, hosted = tmp_path / "auto.yaml", tmp_path / "hosted.yaml"
    code, out, _ = run(["plan", *LAYOUT, "-o", str(auto)], capsys)
    assert code == 0 and "replicated tp update predicted faster" in out and "TP update replicated" in out
    assert read_schedule(auto).tp.update == "replicated" and "tp_update:" not in auto.read_text()
    code, out, _ = run(["plan", *LAYOUT, "--tp-update", "hosted", "-o", str(hosted)], capsys)
    assert code == 0 and "replicated" not in out
    assert read_schedule(hosted).tp.update == "hosted" and "tp_update: hosted" in hosted.read_text()
    code, out, _ = run(["show", str(auto)], capsys)
    assert code == 0 and "TP update replicated" in out
    steps = {}
    for path in (auto, hosted):
        code, out, _ = run(["simulate", str(path), "--json"], capsys)
        assert code == 0, out
        steps[path.stem] = out
    assert steps["auto"] != steps["hosted"]


@pytest.mark.parametrize("extra", [["--tp", "1"], ["--tp", "2", "--fsdp"]])
def test_tp_update_is_refused_where_it_changes_nothing(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(
        ["plan", "--model", "qwen3-0.6b", "--dp", "2", *extra, "--tp-update", "replicated", "-o", str(tmp_path / "x")],
        capsys,
        "--tp-update has no effect here",
        "tp > 1",
    )


def test_an_unknown_tp_update_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        ["plan", "--model", "qwen3-0.6b", "--tp", "2", "--dp", "2", "--tp-update", "sometimes", "-o", str(tmp_path)],
        capsys,
    )
    assert code == 2 and out == "" and "sometimes" in err and "\n" not in err.strip()
