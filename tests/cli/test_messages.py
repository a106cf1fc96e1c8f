"""Messages, progress and the `show` report (issue 17, items 12-14): one plain line per error,
the right plurals and units, progress and warnings on stderr, bars that say what they show."""

from __future__ import annotations

import errno
import json
import re
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from canzona.cli import progress as progress_module
from canzona.cli.wording import duration, percent, plural, table_unit

from cli_run import refused, run

NAME = "qwen3-8b/muon-tp2-dp4"
BIG = "qwen3-8b/muon-tp8-dp32"  # 256 devices


# --------------------------------------------------------------------------------------------
# Wording


def test_plurals_percentages_and_units() -> None:
    assert plural(1, "micro-group") == "1 micro-group" and plural(2, "micro-group") == "2 micro-groups"
    assert plural(1, "matrix", "matrices") == "1 matrix" and plural(0, "matrix", "matrices") == "0 matrices"
    assert percent(-1e-12) == "0.00%" and percent(-0.004) == "-0.40%" and percent(0.0123) == "1.23%"
    assert [duration(s) for s in (0.000123, 0.557, 12.34, 725, 2 * 3600 + 14 * 60 + 5)] == [
        "0.123 ms",
        "557 ms",
        "12.3 s",
        "12 min 5 s",
        "2 h 14 min",
    ]
    assert [table_unit(s)[0] for s in (0.5, 13.0, 600.0, 5 * 3600.0)] == ["ms", "s", "min", "h"]


def test_one_matrix_plan_speaks_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "one.yaml"
    model.write_text("name: one\nparams:\n- {name: w, shape: [64, 64], tp_dim: 0}\n")
    code, out, err = run(["plan", "--model", str(model), "-o", str(tmp_path / "s.yaml")], capsys)
    assert code == 0, err
    assert "1 matrix parameter in 1 bucket," in out and "1 micro-group," in out and "-0.00%" not in out
    code, out, _ = run(["show", str(tmp_path / "s.yaml"), "--rank", "0"], capsys)
    assert "owns 1 matrix;" in out and "1 task," in out and "1 hosted here" in out


def test_simulated_hours_are_printed_in_hours(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["simulate", NAME, "--device", "cpu"], capsys)
    assert code == 0 and "step h" in out and "iteration h" in out and " ms " not in out
    step_rows = out.split("optimizer step (nothing overlapped):\n")[1].split("\n\n")[0].splitlines()[1:]
    assert all(float(row.split()[1]) < 1000 for row in step_rows)  # no column of millions of ms
    code, out, _ = run(["simulate", "qwen3-0.6b/muon-tp1-dp8"], capsys)
    assert "step ms" in out and "iteration s" in out  # each table in the unit its largest time reads best in


# --------------------------------------------------------------------------------------------
# One plain line per error


@pytest.mark.parametrize("text", ["{{{garbage", "a: [1, 2\n b: c\n", "\t- x\n", '"unterminated\n', "- 3\n", "{}\n"])
def test_calibrate_garbage_shapes_is_refused(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shapes = tmp_path / "garbage.json"
    shapes.write_text(text)
    refused(["calibrate", "--shapes", str(shapes), "-o", str(tmp_path / "p.yaml")], capsys, "garbage.json")


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("-1", "--group-mb must be > 0 MiB, got -1 MiB"),
        ("0", "> 0 MiB"),
        ("nan", "finite number of MiB"),
        ("1e-9", "at least one byte"),
        ("1e30", "MiB, got 1e+30 MiB"),
    ],
)
def test_group_mb_errors_speak_mib(value: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["plan", "--model", "qwen3-0.6b", "--group-mb", value], capsys, needle)
    assert "bytes" not in err and "capacity" not in err


def test_output_paths_get_plain_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    for command in (["plan", "--model", "qwen3-0.6b"], ["render", NAME], ["calibrate", "--quick"]):
        refused([*command, "-o", ""], capsys, "--output is empty")
        refused([*command, "-o", str(afile / "x.yaml")], capsys, f"{str(afile)!r} is not a folder")
    assert afile.read_text() == "x\n"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.ENOSPC, "no space left on the device"),
        (errno.ENOENT, "its folder does not accept new files"),
        (errno.EACCES, "permission denied"),
    ],
)
def test_failed_writes_name_the_path_once(
    code: int, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import canzona.cli.options as options

    def fail(path: object, data: object) -> bool:
        raise OSError(code, "raw errno text", str(tmp_path / ".p.png.123.abc.canzona-tmp"))

    monkeypatch.setattr(options, "write_atomic", fail)
    targets = [(["plan", "--model", "qwen3-0.6b"], tmp_path / "s.yaml")]
    if find_spec("matplotlib") is not None:
        targets.append((["render", NAME], tmp_path / "p.png"))
    for command, target in targets:
        err = refused([*command, "-o", str(target)], capsys, f"cannot write {str(target)!r}: {reason}")
        assert err.count(str(target)) == 1 and "raw errno text" not in err


def test_render_says_what_it_wrote_and_makes_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["render", NAME, "-o", "plan"], capsys)
    assert code == 0 and out == "wrote plan.png\n" and Path("plan.png").is_file() and not Path("plan").exists()
    code, out, _ = run(["render", NAME, "-o", "new/folder/p.svg"], capsys)
    assert code == 0 and out == "wrote new/folder/p.svg\n"
    refused(["render", NAME, "-o", "p.xyz"], capsys, "not an image format", ".png, .svg or .pdf")


# --------------------------------------------------------------------------------------------
# Progress and warnings


def test_plan_warns_when_most_ranks_have_nothing_to_update(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", "--model", "qwen3-0.6b", "--dp", "1024", "-o", str(tmp_path / "a.yaml")], capsys)
    assert code == 0 and out.startswith("wrote")
    assert err.startswith("canzona: warning: qwen3-0.6b has 112 matrices for 1024 DP ranks: at least 912 ranks")
    skew = tmp_path / "skew.yaml"  # enough matrices, but one dominates: known only after planning
    skew.write_text(
        "name: skew\nparams:\n- {name: big, shape: [8192, 8192], tp_dim: 0}\n"
        + "".join(f"- {{name: w{i}, shape: [64, 64], tp_dim: 0}}\n" for i in range(150))
    )
    code, _, err = run(["plan", "--model", str(skew), "--dp", "200", "-o", str(tmp_path / "b.yaml")], capsys)
    assert code == 0 and re.fullmatch(r"canzona: warning: \d+ of 200 DP ranks own no matrix to update .*\n", err)
    code, _, err = run(["plan", "--model", "qwen3-0.6b", "--dp", "8", "-o", str(tmp_path / "c.yaml")], capsys)
    assert code == 0 and err == ""


def test_huge_dp_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    refused(["plan", "--model", "qwen3-0.6b", "--dp", "100000"], capsys, "maximum of 8192 DP ranks")


def test_auto_search_summaries_show_why_the_winner_won(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every candidate of qwen3-8b's α search predicts 16.5 s to three digits: each other one is
    shown as its difference from the chosen one, to the microsecond."""
    code, out, _ = run(
        [
            "plan",
            "--model",
            "qwen3-8b",
            "--tp",
            "2",
            "--dp",
            "4",
            "--alpha",
            "auto",
            "--bucket-size",
            "auto",
            "-o",
            str(tmp_path / "s.yaml"),
        ],
        capsys,
    )
    assert code == 0
    difference = r"(\+\d+\.\d{3} ms|\+\d+ ns|same)"
    alpha = next(line for line in out.splitlines() if line.startswith("alpha chosen by the simulator on h100: "))
    assert re.search(
        rf"predicted iteration \S+ s at alpha (\S+); (\S+: {difference}, ){{3}}\S+: {difference} "
        r"\(equal times go to the larger alpha\)$",
        alpha,
    ), alpha
    bucket = next(line for line in out.splitlines() if line.startswith("bucket size chosen by the simulator"))
    assert re.search(
        rf"\(predicted iteration \S+ s at \S+; (\S+( bucket)?: {difference}, )+\S+( bucket)?: {difference}\)$", bucket
    ), bucket


def test_auto_searches_report_each_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int | None, list[str]]] = []

    class Recorder:
        def __init__(self, description: str, total: int | None = None, *, lines: bool = False) -> None:
            seen.append((description, total, []))

        def __enter__(self):  # type: ignore[no-untyped-def]
            return seen[-1][2].append

        def __exit__(self, *exc: object) -> None:
            return None

    import canzona.cli.plan_cmd as plan_cmd

    monkeypatch.setattr(plan_cmd, "progress", Recorder)
    args = [
        "plan",
        "--model",
        "qwen3-0.6b",
        "--dp",
        "2",
        "--alpha",
        "auto",
        "--bucket-size",
        "auto",
        "--global-batch",
        "8",
        "--seq-len",
        "64",
        "-o",
        str(tmp_path / "s.yaml"),
    ]
    assert run(args, capsys)[0] == 0
    description, total, labels = seen[0]
    assert description == "planning qwen3-0.6b tp 1 x dp 2" and total == 12 and len(labels) == 12
    assert labels[0] == "bucket size 10M" and labels[7:] == [
        "alpha 0",
        "alpha 0.25",
        "alpha 0.5",
        "alpha 0.75",
        "alpha 1",
    ]
    assert run(["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(tmp_path / "t.yaml")], capsys)[0] == 0
    assert seen[1][1] is None and seen[1][2] == []  # a single plan: a spinner with the elapsed time


def test_progress_off_a_terminal_is_silent_or_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_module, "interactive", lambda: False)
    with progress_module.progress("work", 2) as step:
        step("a")
        step("b")
    assert capsys.readouterr().err == ""
    with progress_module.progress("work", 2, lines=True) as step:
        step("a")
        step("b")
    assert capsys.readouterr().err == "[1/2] a\n[2/2] b\n"
    monkeypatch.setattr(progress_module, "interactive", lambda: True)  # a rich bar, gone when done
    with progress_module.progress("work", 2) as step:
        step("a")
    with progress_module.progress("spinner") as step:
        step("a")
    assert capsys.readouterr().out == ""


def test_slow_work_off_a_terminal_says_it_is_working(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a CI log a long plan prints a plain line every HEARTBEAT_S seconds (here made tiny),
    so it never looks like a hang; the lines stop with the work."""
    monkeypatch.setattr(progress_module, "interactive", lambda: False)
    monkeypatch.setattr(progress_module, "HEARTBEAT_S", 0.01)
    seen = ""
    with progress_module.progress("planning deepseek-v3 tp 8 x dp 1024") as step:
        while seen.count("\n") < 2:  # bounded by the suite's timeout, not asserted on the clock
            time.sleep(0.01)
            seen += capsys.readouterr().err
        step("done")
    lines = seen.splitlines()
    assert lines[0].startswith("canzona: planning deepseek-v3 tp 8 x dp 1024: working, ") and lines[0].endswith(" s")
    time.sleep(0.05)
    assert capsys.readouterr().err == ""  # stopped with the work


def test_calibrate_estimates_then_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from canzona.planner.partition.profile_cost import read_profile

    shapes = tmp_path / "s.yaml"
    shapes.write_text("- [16, 32]\n- [32, 32]\n")
    target = tmp_path / "p.yaml"
    code, out, err = run(
        [
            "calibrate",
            "--shapes",
            str(shapes),
            "--quick",
            "--optimizer",
            "muon",
            "--optimizer",
            "soap",
            "--threads",
            "1",
            "-o",
            str(target),
        ],
        capsys,
    )
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("canzona: timing 4 matrix kernels (muon 2, soap 2), 4 AdamW sizes; about ")
    assert [line.split("]")[0] for line in lines[1:]] == [f"[{n}/8" for n in range(1, 9)]
    assert lines[1].startswith("[1/8] muon 16x32: ") and lines[-1].startswith("[8/8] adamw 10000000: ")
    assert out == f"wrote {target}: 8 rows on " + read_profile(target).device_name + "\n"
    assert {row.repeats for row in read_profile(target).rows} == {1}  # --quick: one timed call


def test_calibrate_quick_times_a_models_shapes_scaled_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--quick` on qwen3-0.6b once timed its full shapes (6144 x 1024 Shampoo and SOAP: minutes
    on 2 cores); now every shape is at most 512 on a side, the model's aspect ratios kept."""
    from canzona.cli.calibrate_cmd import QUICK, kernel_flops, kernel_plan, model_shapes

    plan = kernel_plan(["muon", "shampoo", "soap"], "qwen3-0.6b", None, QUICK["max_side"], quick=True)
    assert capsys.readouterr().err.startswith("canzona: --quick: shapes scaled down to at most 512 on a side")
    full = model_shapes("qwen3-0.6b")
    for shapes in plan.values():
        assert len(shapes) == len(full) and all(max(shape) <= 512 for shape in shapes)
        assert all(abs(r / c - fr / fc) < 0.02 * fr / fc for (r, c), (fr, fc) in zip(shapes, full))
    grid = kernel_plan(["muon", "shampoo", "soap"], None, None, QUICK["max_side"], quick=True)
    settings = (5, 1024, 10, 10000)
    work, full_work = (
        sum(kernel_flops(todo, settings, 2).values()) for todo in (plan, {"muon": full, "shampoo": full, "soap": full})
    )
    assert work <= 1.5 * sum(kernel_flops(grid, settings, 2).values()) and full_work > 20 * work  # the grid: seconds


def test_calibrate_quick_on_a_model_writes_a_profile_simulate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from canzona.planner.partition.profile_cost import read_profile

    target = tmp_path / "p.yaml"
    code, _, err = run(
        ["calibrate", "--model", "qwen3-0.6b", "--quick", "--optimizer", "muon", "-o", str(target)], capsys
    )
    assert code == 0, err
    assert all(max(row.rows, row.cols) <= 512 for row in read_profile(target).rows if row.optimizer == "muon")
    code, out, err = run(["simulate", "qwen3-0.6b/muon-tp1-dp8", "--device", f"profile:{target}"], capsys)
    assert code == 0 and "measured by `canzona calibrate`" in out, err


# --------------------------------------------------------------------------------------------
# show


def test_show_summarises_many_devices_and_says_bars_are_range_maxima(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", BIG], capsys)
    assert code == 0 and len(out.splitlines()) < 80
    section = out.split("compute load per device")[1]
    header, *rows = section.splitlines()
    assert "16 ranks a row, each row the maximum of its range" in header and "--rank R" in header
    bars = [row for row in rows if re.match(r"\s+\d+-\d+  ", row)]
    assert len(bars) == 16 and bars[0].split()[0] == "0-15" and bars[-1].split()[0] == "240-255"
    assert re.search(r"min \d\.\d{3}, median \d\.\d{3}, max \d\.\d{3}", section)
    dp_section = out.split("compute load per DP rank")[1].split("\n\n")[0]
    assert len(dp_section.splitlines()) == 33  # 32 DP ranks: one row each, no ranges
    code, small, _ = run(["show", NAME], capsys)
    assert "maximum of its range" not in small


def test_show_json_is_unchanged_by_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["show", BIG, "--json"], capsys)
    assert code == 0 and len(json.loads(out)["metrics"]["device"]) == 256


# --------------------------------------------------------------------------------------------
# The picture


def test_picture_keeps_every_strategy_visible_and_keys_outside(capsys: pytest.CaptureFixture[str]) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from canzona.cli.options import load_schedule
    from canzona.cli.render import draw

    figure, timeline = draw(plt, load_schedule("qwen3-32b/muon-tp8-dp32"), "h100")
    try:
        figure.canvas.draw()
        strategies, devices, pipeline = figure.axes[:3]
        lines = {line.get_label(): line for line in strategies.get_lines()}
        # layer-wise is as balanced as canzona here: it is drawn above canzona's band, not under it
        assert lines["layer-wise (max 1.00)"].get_zorder() > lines["canzona (max 1.000)"].get_zorder()
        for ax in (strategies, devices, pipeline):
            legend = ax.get_legend()
            assert legend is not None
            # the key sits right of the plotting area, so it covers no data
            assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
        assert [t.get_text() for t in devices.get_legend().get_texts()] == [f"TP rank {r}" for r in range(8)]
        assert pipeline.get_xlabel() == "time (ms)" and timeline["seconds"] > 0
        assert "simulated on h100" in pipeline.get_title()
    finally:
        plt.close(figure)
