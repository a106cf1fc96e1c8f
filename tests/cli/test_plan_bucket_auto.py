"""`canzona plan --bucket-size auto`: the search recorded in the schedule, reproduced by `check`,
byte-identical when repeated, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from canzona.cli.main import main
from canzona.planner.predict.auto_bucket import ONE_BUCKET
from canzona.schedules.format import read_schedule


def test_plan_records_the_search_and_check_reproduces_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    for path in paths:
        args = [
            "plan",
            "--model",
            "qwen3-0.6b",
            "--dp",
            "4",
            "--bucket-size",
            "auto",
            "--global-batch",
            "32",
            "--seq-len",
            "1024",
            "-o",
            str(path),
        ]
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "bucket size chosen by the simulator on h100" in out and "one bucket:" in out
    assert paths[0].read_bytes() == paths[1].read_bytes()
    schedule = read_schedule(paths[0])
    search, request = schedule.metrics.bucket_search, schedule.request
    assert search is not None and request.bucket_device == "h100" and request.alpha_device is None
    assert request.training is not None and (request.training.global_batch, request.training.seq_len) == (32, 1024)
    sizes = [t.bucket_size for t in search.trials]
    assert request.bucket_size in sizes and ONE_BUCKET in sizes and 40_000_000 in sizes
    assert main(["check", str(paths[0])]) == 0
    # A fixed bucket size records no search and no training setup.
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4", "--force", "-o", str(paths[1])]) == 0
    fixed = read_schedule(paths[1])
    assert (
        fixed.metrics.bucket_search is None and fixed.request.training is None and fixed.request.bucket_device is None
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bucket-size", "big"], "bucket size must be a whole number of elements or auto"),
        (["--bucket-size", "auto", "--global-batch", "6"], "does not split into dp 4"),
        (["--bucket-size", "auto", "--device", "tpu9"], "unknown device 'tpu9'"),
    ],
)
def test_bad_bucket_options(args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "x.yaml"
    code = main(["plan", "--model", "qwen3-0.6b", "--dp", "4", *args, "-o", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("canzona: error: ") and message in err
    assert not target.exists()
