"""`canzona reshard-check OLD NEW`: exit 0 and per-rank bytes when a checkpoint can move,
exit 1 with the reasons when it cannot, bad input as ScheduleError (exit 2 through `main`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from canzona.cli import main as cli
from canzona.cli.reshard_cmd import human_bytes, reshard_check
from canzona.schedules.format import SCHEMA_VERSION, ScheduleError

OLD, NEW = "qwen3-8b/muon-tp2-dp4", "qwen3-8b/muon-tp8-dp32"
OTHER_MODEL = "qwen3-0.6b/muon-tp1-dp8"


def test_compatible_library_schedules_report_bytes_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    reshard_check(OLD, NEW, as_json=True)
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert out.err == "" and data["compatible"] is True and data["problems"] == []
    assert (data["old"]["dp"], data["old"]["tp"], data["new"]["dp"], data["new"]["tp"]) == (4, 2, 32, 8)
    assert len(data["new_ranks"]) == 256 and len(data["old_ranks"]) == 8
    assert sum(row["writes"] for row in data["old_ranks"]) == data["state_bytes"]
    moved = data["moved_bytes"]
    assert moved == sum(row["from_other_ranks"] for row in data["new_ranks"]) == sum(f["bytes"] for f in data["flows"])
    assert len(data["notes"]) == 2 and "vocab padding" in data["notes"][0]
    reshard_check(OLD, NEW)
    text = capsys.readouterr().out
    assert text.startswith("compatible: yes\n") and "note: embedding.word_embeddings.weight" in text
    assert "new rank" in text and "old rank" in text and "changes rank" in text


def test_incompatible_schedules_exit_1_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as caught:
        reshard_check(OLD, OTHER_MODEL, as_json=True)
    assert caught.value.exit_code == 1
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["compatible"] is False and data["problems"][0].startswith(
        "different models: qwen3-8b before, qwen3-0.6b now"
    )
    assert "new_ranks" not in data
    assert out.err.startswith("canzona: incompatible: different models")
    with pytest.raises(typer.Exit):
        reshard_check(OLD, OTHER_MODEL)
    assert "compatible: no" in capsys.readouterr().out


def test_bad_input_raises_schedule_error(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="missing.yaml"):
        reshard_check(str(tmp_path / "missing.yaml"), NEW)
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"schema_version: {SCHEMA_VERSION}\n")
    with pytest.raises(ScheduleError, match="invalid schedule"):
        reshard_check(OLD, str(broken))


def test_exit_codes_through_main(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    names = {command.name for command in cli.app.registered_commands}
    if "reshard-check" not in names:
        pytest.skip("reshard-check is not registered in canzona.cli.main yet")
    assert cli.main(["reshard-check", OLD, NEW]) == 0
    assert cli.main(["reshard-check", OLD, OTHER_MODEL]) == 1
    assert cli.main(["reshard-check", OLD, str(tmp_path / "missing.yaml")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("canzona: error: ") and "missing.yaml" in last


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 << 20, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.50 KiB",
        "3.00 MiB",
        "5.00 GiB",
    ]


def test_expert_parallel_layouts_say_which_experts_move(capsys: pytest.CaptureFixture[str]) -> None:
    """The library's Qwen3-30B-A3B schedules at EP 8 (TP 2 x DP 16 -> TP 4 x DP 32)."""
    old, new = "qwen3-30b-a3b/muon-tp2-dp16-ep8", "qwen3-30b-a3b/muon-tp4-dp32-ep8"
    reshard_check(old, new, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["compatible"] is True and (data["old"]["ep"], data["new"]["ep"]) == (8, 8)
    assert any(note.startswith("experts: EP 8 -> EP 8, 0 of ") for note in data["notes"]), data["notes"]
    reshard_check(old, new)
    text = capsys.readouterr().out
    assert "old: qwen3-30b-a3b, muon, DP 16 (EP 8) x TP 2" in text and "note: experts: EP 8 -> EP 8" in text
