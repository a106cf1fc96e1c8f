"""`canzona render`: writes a real image; clear errors without matplotlib or a writable path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from canzona.cli.main import main

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def schedule(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("render") / "s.yaml"
    assert main(["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4", "-o", str(path)]) == 0
    return path


def test_render_writes_a_png(schedule: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.png"
    assert main(["render", str(schedule), "-o", str(target)]) == 0
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert f"wrote {target}" in capsys.readouterr().out


def test_render_svg_mentions_every_strategy(schedule: Path, tmp_path: Path) -> None:
    target = tmp_path / "plan.svg"
    assert main(["render", str(schedule), "-o", str(target)]) == 0
    text = target.read_text()
    for name in ("canzona", "dp-sc", "zero1-gather", "start-owner", "layer-wise", "timeline"):
        assert name in text


def test_render_errors(
    schedule: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["render", str(schedule), "-o", str(tmp_path / "new" / "dir" / "x.png")]) == 0  # folders made, as plan
    assert (tmp_path / "new" / "dir" / "x.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    (tmp_path / "folder.png").mkdir()
    for bad, needle in (
        (tmp_path / "x.unknown", "cannot write"),
        (schedule, "also an input"),
        (tmp_path / "folder.png", "folder"),
    ):
        assert main(["render", str(schedule), "-o", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("canzona: error: ") and needle in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png", "new"]  # nothing half-written
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["render", str(schedule), "-o", str(tmp_path / "x.png")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "canzona: error: canzona render needs matplotlib: pip install 'canzona[render]'"
    )
