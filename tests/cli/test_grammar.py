"""One CLI grammar (issue 17, items 9-11): help and version, library names wherever a schedule
is read, one `--device` vocabulary, options that would have no effect refused, `--json`
wherever CI or a script reads the output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from canzona.cli.main import app, main
from canzona.schedules.format import read_schedule, sealed, write_schedule
from canzona.schedules.library import library_root

from cli_run import refused, run

NAME = "qwen3-8b/muon-tp2-dp4"
OTHER = "qwen3-8b/muon-tp4-dp16"


def command_names() -> list[str]:
    return sorted(command.name or command.callback.__name__ for command in app.registered_commands)


# --------------------------------------------------------------------------------------------
# Help and version


def test_bare_canzona_prints_help_not_an_empty_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([], capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: canzona") and "plan" in out and "--version" in out


@pytest.mark.parametrize(
    "command",
    [
        [],
        *(
            [name]
            for name in (
                "models",
                "plan",
                "show",
                "diff",
                "check",
                "table",
                "render",
                "simulate",
                "calibrate",
                "reshard-check",
                "describe",
            )
        ),
    ],
)
def test_h_and_help_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, short, _ = run([*command, "-h"], capsys)
    assert code == 0 and short.startswith("Usage: canzona")
    code, long, _ = run([*command, "--help"], capsys)
    assert code == 0 and long == short


def test_every_command_is_covered_by_the_help_test() -> None:
    assert command_names() == sorted(
        [
            "models",
            "plan",
            "show",
            "diff",
            "check",
            "table",
            "render",
            "simulate",
            "calibrate",
            "reshard-check",
            "describe",
        ]
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out == f"canzona {version('canzona')}\n"


def test_help_text_keeps_brackets_and_shows_flags_as_flags(capsys: pytest.CaptureFixture[str]) -> None:
    _, calibrate, _ = run(["calibrate", "-h"], capsys)
    assert "[rows, cols]" in " ".join(calibrate.split())  # help is plain text, not rich markup
    _, plan, _ = run(["plan", "-h"], capsys)
    assert "--split-fc1 / --no-split-fc1" in plan
    for text in (plan, calibrate):
        assert "<bool>" not in text


def test_boolean_flags_take_the_spelling_the_help_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from canzona.schedules.format import read_schedule

    for flag, value in (("--split-fc1", True), ("--no-split-fc1", False)):
        target = tmp_path / f"{flag}.yaml"
        assert run(["plan", "--model", "qwen3-0.6b", "--dp", "2", flag, "-o", str(target)], capsys)[0] == 0
        assert read_schedule(target).request.split_fc1 is value
    refused(["plan", "--model", "qwen3-0.6b", "--split-fc1", "true"], capsys, "unexpected extra argument")


# --------------------------------------------------------------------------------------------
# A path or a library name, in every command that reads a schedule


@pytest.mark.parametrize(
    "args",
    [
        ["show", NAME],
        ["show", NAME, "--rank", "1"],
        ["simulate", NAME, "--step-only"],
        ["diff", NAME, OTHER, "--json"],
        ["check", NAME],
        ["reshard-check", NAME, OTHER],
    ],
)
def test_library_names_work_like_paths(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    by_name = run(args, capsys)
    path = [str(library_root() / f"{a}.yaml") if a in (NAME, OTHER) else a for a in args]
    by_path = run(path, capsys)
    assert by_name[0] in (0, 1) and by_name[0] == by_path[0], by_name
    assert by_name[1].replace(str(library_root()) + "/", "").replace(".yaml", "") == by_path[1].replace(
        str(library_root()) + "/", ""
    ).replace(".yaml", "")


def test_render_takes_a_library_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "p.png"
    assert run(["render", NAME, "-o", str(target)], capsys)[0] == 0
    assert target.read_bytes().startswith(b"\x89PNG")


def test_an_unknown_name_suggests_library_names(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["show"], ["simulate"], ["render"], ["diff", NAME], ["reshard-check", NAME]):
        refused(
            [*command, "qwen3-8b/muon-tp2-dp5"], capsys, "no library schedule", "did you mean: qwen3-8b/muon-tp2-dp4"
        )
    refused(["check", "qwen3-8b/muon-tp2-dp5"], capsys, "no such schedule", "did you mean")


def test_one_resolver() -> None:
    """Names resolve in one place: `canzona.cli.options.schedule_path` (over the library's
    `resolve_schedule`, which the runtime uses too); `check` adds folders on top of it."""
    root = Path(__file__).resolve().parents[2] / "cli"
    users = sorted(
        module.name for module in root.glob("*.py") if "resolve_schedule" in module.read_text(encoding="utf-8")
    )
    assert users == ["compare.py", "options.py"]


# --------------------------------------------------------------------------------------------
# --device: a hardware model everywhere; a profile is profile:FILE


def test_device_means_a_hardware_model_and_a_profile_is_spelled_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = library_root() / "profiles" / "cpu-dev.yaml"
    code, out, err = run(["simulate", NAME, "--device", f"profile:{profile}", "--step-only", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["hardware"]["name"] == "cpu-dev"
    refused(["simulate", NAME, "--device", str(profile)], capsys, "unknown device", f"profile:{profile}")
    target = tmp_path / "auto.yaml"
    code, _, err = run(
        [
            "plan",
            "--model",
            "qwen3-0.6b",
            "--dp",
            "2",
            "--alpha",
            "auto",
            "--device",
            f"profile:{profile}",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "-o",
            str(target),
        ],
        capsys,
    )
    assert code == 0, err
    from canzona.schedules.format import read_schedule

    assert read_schedule(target).request.alpha_device == f"profile:{profile}"
    code, out, _ = run(["check", str(target)], capsys)
    assert code == 0 and out.startswith("fresh")
    refused(["plan", "--model", "qwen3-0.6b", "--alpha", "auto", "--device", "profile:"], capsys, "needs a file")


def test_calibrate_names_its_torch_device_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    _, text, _ = run(["calibrate", "-h"], capsys)
    assert re.search(r"^\s+--torch-device <cpu\|cuda>", text, re.M) and not re.search(r"^\s+--device", text, re.M)
    refused(["calibrate", "--device", "cpu", "-o", "x.yaml"], capsys, "No such option: --device")


# --------------------------------------------------------------------------------------------
# Options that would have no effect are refused


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--model", "qwen3-0.6b", "--device", "h800"], "--device has no effect here"),
        (["plan", "--model", "qwen3-0.6b", "--device", "h100"], "--device has no effect here"),
        (["plan", "--model", "qwen3-0.6b", "--global-batch", "64"], "--global-batch has no effect here"),
        (["plan", "--model", "qwen3-0.6b", "--seq-len", "64"], "--seq-len has no effect here"),
        (["plan", "--model", "qwen3-0.6b", "--micro-batches", "2"], "--micro-batches has no effect here"),
        (
            ["plan", "--model", "qwen3-0.6b", "--time-limit", "5"],
            "--time-limit has no effect here: it applies to --solver ilp",
        ),
        (["plan", "--model", "qwen3-0.6b", "--seed", "3"], "--seed has no effect here"),
        (
            ["plan", "--model", "qwen3-0.6b", "--block-size", "512"],
            "--block-size has no effect here: it only changes shampoo",
        ),
        (["plan", "--model", "qwen3-0.6b", "--optimizer", "soap", "--ns-steps", "3"], "--ns-steps has no effect here"),
        (
            ["plan", "--model", "qwen3-0.6b", "--optimizer", "shampoo", "--ns-coefficients", "quintic"],
            "--ns-coefficients has no effect here: it only changes muon",
        ),
        (["plan", "--model", "qwen3-0.6b", "--max-precond-dim", "100"], "--max-precond-dim has no effect here"),
        (["plan", "--model", "qwen3-0.6b", "--precondition-frequency", "5"], "--precondition-frequency has no effect"),
        (["plan", "--model", "qwen3-0.6b", "--alpha", "auto", "--device", "h800"], "unknown device 'h800'"),
        (["simulate", NAME, "--step-only", "--global-batch", "64"], "--global-batch has no effect here: --step-only"),
        (["simulate", NAME, "--step-only", "--no-overlap-grad-reduce"], "--overlap-grad-reduce has no effect here"),
        (["simulate", NAME, "--step-only", "--train-tflops", "100"], "--train-tflops has no effect here"),
        (["simulate", NAME, "--routed-fraction", "0.5"], "--routed-fraction has no effect here: qwen3-8b has no MoE"),
        (
            ["simulate", "qwen3-30b-a3b/muon-tp2-dp16-ep8", "--routed-fraction", "2"],
            "routed fraction must be in (0, 1]",
        ),
        (["calibrate", "--quick", "--repeats", "3", "-o", "x.yaml"], "--repeats has no effect here: --quick sets it"),
        (["calibrate", "--model", "qwen3-0.6b", "--max-side", "256", "-o", "x.yaml"], "--max-side has no effect here"),
        (
            ["calibrate", "--optimizer", "muon", "--block-size", "256", "-o", "x.yaml"],
            "--block-size has no effect here",
        ),
        (["table", "schedules", "--update", "--json"], "give one"),
    ],
)
def test_options_without_effect_are_refused(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schedules").mkdir()
    refused(args, capsys, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["schedules"]  # nothing written


def test_options_with_effect_are_taken(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for index, extra in enumerate(
        (
            ["--optimizer", "shampoo", "--block-size", "512", "--precondition-frequency", "5"],
            ["--optimizer", "soap", "--max-precond-dim", "4096"],
            ["--ns-steps", "3"],
            ["--ns-coefficients", "quintic"],
        )
    ):
        assert (
            run(["plan", "--model", "qwen3-0.6b", "--dp", "2", *extra, "-o", str(tmp_path / f"{index}.yaml")], capsys)[
                0
            ]
            == 0
        )


# --------------------------------------------------------------------------------------------
# --json where scripts read the output


def test_check_json_reports_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = tmp_path / "fresh.yaml"
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(fresh)]) == 0
    stale = tmp_path / "stale.yaml"
    schedule = read_schedule(fresh)
    request = schedule.request.model_copy(update={"canzona_version": "0" + schedule.request.canzona_version})
    write_schedule(sealed(schedule.model_copy(update={"request": request})), stale)
    capsys.readouterr()
    code, out, err = run(["check", str(fresh), str(stale), "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and report["stale"] == 1 and report["fixed"] == 0 and "1 stale file;" in err
    assert [(f["path"], f["status"]) for f in report["files"]] == [(str(fresh), "fresh"), (str(stale), "stale")]
    assert report["files"][0]["reason"] is None and report["files"][1]["reason"]
    code, out, _ = run(["check", str(stale), "--fix", "--json"], capsys)
    assert code == 0 and json.loads(out)["files"][0]["status"] == "fixed"


def test_table_json_has_the_markdown_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["table", str(library_root()), "--json"], capsys)
    rows = json.loads(out)
    code_md, markdown, _ = run(["table", str(library_root())], capsys)
    assert code == code_md == 0 and len(rows) == markdown.count("\n") - 2
    row = next(r for r in rows if r["schedule"] == NAME)
    assert (row["tp"], row["dp"], row["optimizer"]) == (2, 4, "muon") and f"| `{NAME}` |" in markdown


def test_show_rank_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", NAME, "--rank", "3", "--json"], capsys)
    part = json.loads(out)
    assert code == 0 and (part["rank"], part["dp_rank"], part["tp_rank"]) == (3, 1, 1)
    hosted = [name for group in part["groups"] for name in group["hosted"]]
    assert hosted and set(hosted) <= set(part["owned"])
    assert all(s["stop"] - s["start"] == s["elements"] > 0 for s in part["slices"])
    code, text, _ = run(["show", NAME, "--rank", "3"], capsys)
    assert text.startswith("device 3 = dp rank 1, tp rank 1") and f"owns {len(part['owned'])} matrices" in text


def test_render_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, out, _ = run(["render", NAME, "-o", str(tmp_path / "p"), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["output"] == str(tmp_path / "p.png") and data["format"] == "png"
    assert data["bytes"] == (tmp_path / "p.png").stat().st_size and data["timeline"]["seconds"] > 0
