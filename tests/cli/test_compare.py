"""`canzona diff`, `check` and `table`: verdicts, exit codes, stale detection, --fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from canzona.cli.compare import TABLE_BEGIN, TABLE_END
from canzona.cli.main import main
from canzona.schedules.format import SCHEMA_VERSION, dump_schedule, read_schedule, sealed, write_schedule

from cli_run import run


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("plans")
    paths = {}
    for key, extra in {
        "a1": [],
        "a0": ["--alpha", "0"],
        "tp1": ["--tp", "1"],
        "other": ["--model", "qwen3-0.6b"],
    }.items():
        model = [] if "--model" in extra else ["--model", "qwen3-8b"]
        # registration order: there α trades padding for balance (free order balances at α 0 too)
        args = [
            "plan",
            *model,
            "--tp",
            "2",
            "--dp",
            "4",
            "--order",
            "registration",
            *extra,
            "-o",
            str(folder / f"{key}.yaml"),
        ]
        assert main(args) == 0
        paths[key] = folder / f"{key}.yaml"
    return paths


def test_diff_equal_is_exit_0_all_same(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["diff", str(plans["a1"]), str(plans["a1"]), "--json"], capsys)
    assert code == 0 and err == ""
    assert {row["verdict"] for row in json.loads(out)} == {"same"}


def test_diff_regression_names_each_failing_metric(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["diff", str(plans["a1"]), str(plans["a0"])], capsys)
    assert code == 1
    assert "dp imbalance" in err and "dp gap" in err and "REGRESSION" in out
    assert all(line.startswith("canzona: regression: ") for line in err.splitlines())
    # Within generous thresholds the same change passes.
    code, _, err = run(
        [
            "diff",
            str(plans["a1"]),
            str(plans["a0"]),
            "--max-imbalance-increase",
            "0.1",
            "--max-gap-increase",
            "0.1",
            "--max-memory-increase",
            "0.5",
        ],
        capsys,
    )
    assert code == 0 and err == ""


def test_diff_improvement_is_exit_0(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["diff", str(plans["a0"]), str(plans["a1"]), "--json"], capsys)
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0
    assert rows["dp imbalance"]["verdict"] == "better" and rows["dp imbalance"]["delta"] < 0


def test_diff_and_show_report_the_device_gap(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["diff", str(plans["a0"]), str(plans["a1"]), "--json"], capsys)
    rows = {row["name"]: row for row in json.loads(out)}
    new = read_schedule(plans["a1"]).metrics.tp
    assert code == 0 and rows["device gap"]["new"] == pytest.approx(new.device_gap)
    code, out, _ = run(["show", str(plans["a1"])], capsys)
    assert code == 0 and "above the device lower bound" in out
    # A file written before the device bound was recorded: the row has no old value.
    old = read_schedule(plans["a1"])
    stripped = old.model_copy(
        update={
            "metrics": old.metrics.model_copy(
                update={"tp": old.metrics.tp.model_copy(update={"device_lower_bound": None, "device_gap": None})}
            )
        }
    )
    write_schedule(sealed(stripped), tmp_path / "old.yaml")
    code, out, _ = run(["diff", str(tmp_path / "old.yaml"), str(plans["a1"]), "--json"], capsys)
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and rows["device gap"]["old"] is None
    code, out, _ = run(["show", str(tmp_path / "old.yaml")], capsys)
    assert code == 0 and "device lower bound" not in out


def test_diff_different_layouts_of_one_model_and_same_model_flag(
    plans: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(
        [
            "diff",
            str(plans["a1"]),
            str(plans["tp1"]),
            "--same-model",
            "--max-imbalance-increase",
            "9",
            "--max-gap-increase",
            "9",
            "--max-memory-increase",
            "9",
        ],
        capsys,
    )
    assert code == 0  # one model at two TP sizes (their fingerprints differ: padded vocab)
    code, _, err = run(["diff", str(plans["a1"]), str(plans["other"]), "--same-model"], capsys)
    assert code == 2 and err.startswith("canzona: error: different models: qwen3-8b")


@pytest.mark.parametrize("problem", ["missing", "garbage", "version", "negative", "nan", "inf", "-inf"])
def test_diff_bad_input_is_exit_2(
    problem: str, plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    args = ["diff", str(plans["a1"]), str(bad)]
    if problem == "garbage":
        bad.write_text("{{{")
    elif problem == "version":
        bad.write_text(plans["a1"].read_text().replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 99", 1))
    elif problem == "negative":
        args = ["diff", str(plans["a1"]), str(plans["a1"]), "--max-gap-increase", "-1"]
    elif problem in ("nan", "inf", "-inf"):  # regression: nan passed a 0.35 -> 4.41 GiB increase
        args = ["diff", str(plans["a1"]), str(plans["a0"]), "--max-memory-increase", problem]
    code, out, err = run(args, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("canzona: error: ")
    if problem == "version":
        assert "schema_version 99" in err


def test_check_fresh_stale_tampered_and_fix(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    library = tmp_path / "lib" / "qwen3-8b"
    library.mkdir(parents=True)
    fresh, stale = library / "fresh.yaml", library / "stale.yaml"
    shutil.copy(plans["a1"], fresh)
    # Stale: the file claims α = 1 in its request but holds the α = 0 plan.
    schedule = read_schedule(plans["a0"])
    write_schedule(sealed(schedule.model_copy(update={"request": read_schedule(plans["a1"]).request})), stale)
    code, out, err = run(["check", str(tmp_path / "lib")], capsys)
    assert code == 1
    assert f"fresh  {fresh}" in out and f"STALE  {stale}: different assignment" in out
    assert "1 stale file" in err
    code, out, _ = run(["check", str(tmp_path / "lib"), "--fix"], capsys)
    assert code == 0 and f"fixed  {stale}" in out
    assert dump_schedule(read_schedule(stale)) == dump_schedule(read_schedule(fresh))
    assert run(["check", str(tmp_path / "lib")], capsys)[0] == 0


def test_check_flags_tampered_files_and_fixes_them_from_their_request(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tampered = tmp_path / "t.yaml"
    tampered.write_text(plans["a1"].read_text().replace('"shape": [4096, 12288]', '"shape": [4096, 12289]', 1))
    code, out, err = run(["check", str(tampered)], capsys)  # refused before anything is regenerated
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"canzona: error: {tampered}: invalid (fingerprint") and "check --fix" in err
    assert run(["check", str(tampered), "--fix"], capsys)[0] == 0
    assert tampered.read_bytes() == plans["a1"].read_bytes()


def test_check_unreadable_or_missing_files_are_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "g.yaml"
    garbage.write_text("request: [1, 2]\n")
    code, _, err = run(["check", str(garbage)], capsys)
    assert code == 2 and err.count("\n") == 1 and "invalid (" in err
    code, _, err = run(["check", str(garbage), "--fix"], capsys)
    assert code == 2 and err.count("\n") == 1 and "cannot read its request" in err
    code, _, err = run(["check", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such schedule" in err


def test_check_stale_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.yaml"
    model.write_text(
        "name: m\nparams:\n- {name: w1, shape: [64, 64], tp_dim: 0}\n- {name: w2, shape: [64, 128], tp_dim: 1}\n"
    )
    target = tmp_path / "s.yaml"
    assert main(["plan", "--model", str(model), "--dp", "2", "-o", str(target)]) == 0
    capsys.readouterr()
    assert run(["check", str(target)], capsys)[0] == 0
    model.write_text(model.read_text().replace("[64, 128]", "[64, 256]"))
    code, out, _ = run(["check", str(target)], capsys)
    assert code == 1 and "stale fingerprint" in out


def test_table_and_library_readme(plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    library = tmp_path / "lib"
    (library / "qwen3-8b").mkdir(parents=True)
    shutil.copy(plans["a1"], library / "qwen3-8b" / "muon-tp2-dp4.yaml")
    (library / "profiles").mkdir()
    (library / "profiles" / "cpu.yaml").write_text("not: a schedule\n")  # skipped
    readme = library / "README.md"
    readme.write_text(f"# lib\n\n{TABLE_BEGIN}\n{TABLE_END}\n")
    code, out, _ = run(["table", str(library)], capsys)
    assert code == 0 and "| `qwen3-8b/muon-tp2-dp4` | qwen3-8b | tp2 dp4 | muon |" in out
    assert run(["check", str(library)], capsys)[0] == 1  # README table out of date
    assert run(["table", str(library), "--update"], capsys)[0] == 0
    assert out in readme.read_text()
    assert run(["check", str(library)], capsys)[0] == 0


def test_library_is_fresh_and_shipped() -> None:
    """The checked-in library loads by name from the installed package."""
    from importlib.resources import files

    root = Path(str(files("canzona.schedules")))
    assert (root / "qwen3-32b" / "muon-tp8-dp32.yaml").is_file()
    schedule = read_schedule(root / "qwen3-32b" / "muon-tp8-dp32.yaml")
    assert (schedule.request.tp, schedule.request.dp) == (8, 32)


def test_diff_shows_predicted_step_when_both_files_have_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for alpha in ("auto", "1"):
        path = tmp_path / f"{alpha}.yaml"
        device = ["--device", "h100"] if alpha == "auto" else []
        assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4", "--alpha", alpha, *device, "-o", str(path)]) == 0
        paths.append(path)
    capsys.readouterr()
    code, out, _ = run(["diff", str(paths[0]), str(paths[0]), "--json"], capsys)
    rows = {row["name"]: row for row in json.loads(out)}
    chosen = read_schedule(paths[0])
    expected = next(t.predicted_step_s for t in chosen.metrics.alpha_search if t.alpha == chosen.request.alpha)
    assert code == 0 and rows["predicted step s"]["old"] == expected
    code, out, _ = run(
        [
            "diff",
            str(paths[0]),
            str(paths[1]),
            "--json",
            "--max-imbalance-increase",
            "1",
            "--max-gap-increase",
            "1",
            "--max-memory-increase",
            "1",
        ],
        capsys,
    )
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and rows["predicted step s"]["verdict"] == "missing"  # regression: never "better"
    assert rows["predicted step s"]["new"] is None and rows["predicted step s"]["delta"] is None
    code, out, _ = run(
        [
            "diff",
            str(paths[1]),
            str(paths[0]),
            "--max-imbalance-increase",
            "1",
            "--max-gap-increase",
            "1",
            "--max-memory-increase",
            "1",
        ],
        capsys,
    )
    assert code == 0 and any(
        line.split()[-1] == "missing" and line.startswith("predicted step s") for line in out.splitlines()
    )


def test_diff_refuses_a_non_finite_metric(
    plans: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from canzona.cli import compare

    broken = compare.Metric("dp imbalance", lambda s: float("nan"), True, "imbalance", False)
    monkeypatch.setattr(compare, "METRICS", (broken,))
    code, out, err = run(["diff", str(plans["a1"]), str(plans["a1"])], capsys)
    assert code == 2 and out == "" and err == "canzona: error: dp imbalance is nan, not a finite number\n"


def test_check_regenerates_an_older_schema_version(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old.yaml"
    lines = [line for line in plans["a1"].read_text().splitlines() if not line.startswith("digest: ")]
    old.write_text("\n".join(lines).replace(f"schema_version: {SCHEMA_VERSION}", "schema_version: 1", 1) + "\n")
    code, out, err = run(["check", str(old)], capsys)
    assert code == 2 and out == "" and "schema_version 1 is from an older canzona" in err
    assert run(["check", str(old), "--fix"], capsys)[0] == 0
    assert old.read_bytes() == plans["a1"].read_bytes()


def test_check_compares_bytes_and_names_the_kind_of_difference(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reformatted = tmp_path / "comment.yaml"
    reformatted.write_text(plans["a1"].read_text().replace("}\n", "}  # note\n", 1))
    assert read_schedule(reformatted) == read_schedule(plans["a1"])  # same content
    code, out, _ = run(["check", str(reformatted)], capsys)
    assert code == 1 and f"STALE  {reformatted}: formatting" in out
    versioned = tmp_path / "version.yaml"
    schedule = read_schedule(plans["a1"])
    request = schedule.request.model_copy(update={"canzona_version": "0.0.1"})
    write_schedule(sealed(schedule.model_copy(update={"request": request})), versioned)
    code, out, _ = run(["check", str(versioned)], capsys)
    assert code == 1 and "written by canzona 0.0.1" in out
    for path in (reformatted, versioned):
        assert run(["check", str(path), "--fix"], capsys)[0] == 0
        assert path.read_bytes() == plans["a1"].read_bytes()


def test_diff_across_models_says_so_first(plans: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["diff", str(plans["a1"]), str(plans["other"]), "--json"], capsys)
    lines = err.splitlines()
    assert lines[0] == (
        "canzona: note: the schedules are for different models (OLD qwen3-8b, NEW qwen3-0.6b): every "
        "figure compares two models, not two plans of one model (--same-model refuses such a pair)"
    )
    assert all(line.startswith("canzona: regression: ") for line in lines[1:])
    assert code == (1 if lines[1:] else 0) and {row["name"] for row in json.loads(out)} >= {"dp imbalance"}
    code, _, err = run(
        [
            "diff",
            str(plans["a1"]),
            str(plans["tp1"]),
            "--max-imbalance-increase",
            "9",
            "--max-gap-increase",
            "9",
            "--max-memory-increase",
            "9",
        ],
        capsys,
    )
    assert code == 0 and err == ""  # one model at two layouts: nothing to say
