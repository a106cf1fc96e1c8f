"""Issue 14's bad inputs, command by command: limits checked before any work, and every command
that reads a schedule refuses a bad one with one line and exit 2 (never a traceback)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.schedules.format import Schedule, dump_schedule, read_schedule, sealed
from canzona.schedules.library import library_root

from cli_run import PLANNING, refused, run

SIMULATING = ("canzona.cli.simulate_cmd:load_schedule",)  # reading the schedule: the command's work

LIBRARY = library_root() / "qwen3-8b" / "muon-tp2-dp4.yaml"


PLAN = ["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4"]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--group-mb", "nan"], ["--group-mb must be a finite number"]),
        (["--group-mb", "inf"], ["--group-mb must be a finite number"]),
        (["--group-mb", "-1"], ["--group-mb must be > 0"]),
        (["--dp", "2147483648"], ["dp 2147483648", "maximum of 8192 DP ranks"]),
        (["--dp", "100000000"], ["maximum of 8192 DP ranks"]),
        (["--tp", "1000000"], ["maximum of 256 TP ranks"]),
        (["--dp", "8192", "--tp", "32"], ["262144 devices", "maximum of 131072"]),
        (["--ep", "4096"], ["maximum of 1024 EP ranks"]),
        (["--ep", "3"], ["ep 3 does not divide dp 4"]),
        (["--solver", "ilp", "--time-limit", "nan"], ["time limit must be a finite number"]),
        (["--solver", "ilp", "--time-limit", "inf"], ["time limit must be a finite number"]),
        (["--solver", "ilp", "--time-limit", "301"], ["time limit must be <= 300"]),
        (["--solver", "ilp", "--seed", "-1"], ["seed must be >= 0"]),
        (["--solver", "ilp", "--seed", str(1 << 31)], ["31-bit"]),
        (["--solver", "ilp", "--order", "free"], ["--order free does not combine with --solver ilp"]),
        (["--alpha", "nan"], ["alpha must be in [0, 1]"]),
        (["--ns-steps", "0"], ["ns_steps must be >= 1"]),
        (["--optimizer", "soap", "--precondition-frequency", "0"], ["precondition_frequency must be >= 1"]),
        (["--bucket-size", "0"], ["bucket size must be >= 1"]),
        (["--dp", "1" * 5000], []),
    ],
)
def test_plan_limits_before_work(extra: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    refused([*PLAN, *extra, "-o", "never-written.yaml"], capsys, *needles, before=PLANNING)
    assert not Path("never-written.yaml").exists()


def test_model_sizes_fail_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = [{"name": f"w{i}", "shape": [8, 8], "tp_dim": 0} for i in range(100_000)]
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"name": "big", "params": entries}))
    refused(["plan", "--model", str(big), "-o", str(tmp_path / "o.yaml")], capsys, "100000 parameters", "65536")
    config = json.loads((Path(__file__).resolve().parents[1] / "runtime" / "data" / "tiny_moe.json").read_text())
    for layers in (10**7, 20_000):
        path = tmp_path / f"l{layers}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**config, "num_hidden_layers": layers, "mlp_only_layers": []}))
        refused(
            ["plan", "--model", str(path), "-o", str(tmp_path / "o.yaml")],
            capsys,
            "maximum of 65536",
            before=PLANNING[1:],
        )
    digits = tmp_path / "digits.json"
    digits.write_text('{"name": "d", "params": [{"name": "w", "shape": [' + "1" * 5000 + ', 8], "tp_dim": 0}]}')
    refused(["plan", "--model", str(digits), "-o", str(tmp_path / "o.yaml")], capsys, "4300 digits")


def test_table_needs_a_folder_and_update_needs_its_readme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(["table", str(LIBRARY)], capsys, "is a file")
    (tmp_path / "lib").mkdir()
    refused(["table", str(tmp_path / "lib"), "--update"], capsys, "README.md", "does not exist")


def test_show_refuses_special_files(capsys: pytest.CaptureFixture[str]) -> None:
    if Path("/dev/zero").exists():
        refused(["show", "/dev/zero"], capsys, "not a regular file")


def test_simulate_refuses_non_finite_network_figures(capsys: pytest.CaptureFixture[str]) -> None:
    for option in (["--latency-us", "nan"], ["--intra-gbps", "inf"], ["--inter-gbps", "nan"]):
        refused(["simulate", str(LIBRARY), *option], capsys, "finite", before=SIMULATING)


@pytest.mark.parametrize(
    "option, needle",
    [
        (["--routed-fraction", "2"], "routed fraction must be in (0, 1]"),
        (["--routed-fraction", "nan"], "routed fraction must be in (0, 1]"),
        (["--global-batch", "0"], "global batch and sequence length must be >= 1"),
        (["--seq-len", "0"], "global batch and sequence length must be >= 1"),
        (["--micro-batches", "0"], "micro-batches must be >= 1"),
        (["--dp-collectives", "magic"], "--dp-collectives must be one of"),
    ],
)
def test_simulate_checks_every_option_before_reading_the_schedule(
    option: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(["simulate", str(LIBRARY), *option], capsys, needle, before=SIMULATING)


@cache
def library() -> Schedule:
    return read_schedule(LIBRARY)


def write_edited(path: Path, edit: Any) -> Path:
    data = library().model_dump(mode="json")
    edit(data)
    path.write_text(dump_schedule(sealed(Schedule.model_validate(data))))
    return path


def alias_bomb(path: Path) -> Path:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, 9)]
    path.write_text("\n".join(lines) + "\n")
    return path


def owner_99(data: dict[str, Any]) -> None:  # issue 17, item 4
    next(p for p in data["params"] if p["optimizer"] == "matrix")["owner"] = 99


def huge_tp(data: dict[str, Any]) -> None:
    data["request"]["tp"] = 1_000_000


def unknown_optimizer(data: dict[str, Any]) -> None:
    next(p for p in data["params"] if p["optimizer"] == "matrix")["optimizer"] = "AdamW"


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: write_edited(p, owner_99), "owner 99 is not a DP rank"),
        (lambda p: write_edited(p, huge_tp), "maximum of 256 TP ranks"),
        (lambda p: write_edited(p, unknown_optimizer), "unknown optimizer 'AdamW'"),
        (alias_bomb, "aliases"),
        (lambda p: (p.write_text(LIBRARY.read_text().replace('"owner": 0', '"owner": 1', 1)), p)[1], "digest"),
    ],
    ids=["owner-99", "tp-1000000", "optimizer-AdamW", "alias-bomb", "hand-edit"],
)
@pytest.mark.parametrize(
    "command",
    [
        ["show"],
        ["show", "--rank", "3"],
        ["simulate"],
        ["render", "-o", "{tmp}/x.png"],
        ["diff", str(LIBRARY)],
        ["reshard-check", str(LIBRARY)],
        ["table"],
    ],
    ids=["show", "show-rank", "simulate", "render", "diff", "reshard-check", "table"],
)
def test_every_command_refuses_a_bad_schedule(
    make: Any, needle: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lib").mkdir()
    bad = make(tmp_path / "lib" / "bad.yaml")
    name, *options = [part.replace("{tmp}", str(tmp_path)) for part in command]
    if name in ("diff", "reshard-check"):  # OLD NEW: the bad file is the new one
        args = [name, *options, str(bad)]
    else:
        args = [name, str(bad.parent if name == "table" else bad), *options]
    refused(args, capsys, needle)


def test_check_flags_the_bad_schedule_and_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_edited(tmp_path / "bad.yaml", owner_99)
    code, out, err = run(["check", str(bad)], capsys)
    assert code == 2 and out == "" and "owner 99 is not a DP rank" in err
    assert run(["check", str(bad), "--fix"], capsys)[0] == 0
    assert bad.read_bytes() == LIBRARY.read_bytes()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--optimizer", "adam"], ["--optimizer 'adam' is not one of muon, shampoo, soap"]),
        (["--dtype=fp64"], ["--dtype 'fp64' is not one of bf16, fp16, fp32"]),
        (["--tp", "two"], ["--tp 'two' is not a whole number"]),
        (["--ns-steps", "1.5"], ["--ns-steps '1.5' is not a whole number"]),
    ],
)
def test_bad_option_values_are_named_in_canzonas_words(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The option, the value given and what it must be, whatever click or typer say about it."""
    err = refused([*PLAN, *args, "-o", "never-written.yaml"], capsys, *needles, before=PLANNING)
    assert "Value error" not in err and "Input should" not in err, err


def test_a_file_that_is_not_a_schedule_is_called_that(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    refused(["show", str(empty)], capsys, "not a canzona schedule")
