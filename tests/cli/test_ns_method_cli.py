"""`canzona plan --ns-method/--ns-dtype`: the plan says how its matrix updates run (how many run
Gram, which fall back) and predicts the step for that method and precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import refused, run

LAYOUT = ["--model", "qwen3-1.7b", "--tp", "1", "--dp", "8"]


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code, out, err = run(["plan", *LAYOUT, *extra, "--json", "-o", str(tmp_path / f"{len(extra)}.yaml")], capsys)
    assert code == 0, err
    return json.loads(out)


def test_the_plan_counts_the_gram_matrices_and_prices_method_and_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    standard = _plan(tmp_path, capsys)
    gram = _plan(tmp_path, capsys, "--ns-method", "gram")
    fp32 = _plan(tmp_path, capsys, "--ns-dtype", "fp32", "--ns-method", "standard")
    # qwen3-1.7b: per layer the gate/up fc1 (6x) and fc2 (3x) run Gram; Q, K, V, O fall back
    assert (standard["gram_matrices"], gram["gram_matrices"]) == (0, 56)
    assert "on 56 of 168 matrices" in gram["update"] and gram["update"].endswith("bf16")
    steps = {name: plan["predicted_step"]["step_s"] for name, plan in (("s", standard), ("g", gram), ("f", fp32))}
    assert steps["g"] < steps["s"] < steps["f"]
    assert fp32["predicted_step"]["compute_s"] > 10 * standard["predicted_step"]["compute_s"]
    code, out, _ = run(["show", str(tmp_path / "2.yaml")], capsys)
    assert code == 0 and "matrix updates: gram Newton-Schulz on 56 of 168 matrices" in out
    code, out, _ = run(["show", str(tmp_path / "0.yaml")], capsys)
    assert code == 0 and "matrix updates" not in out  # the default says nothing


def test_gram_settings_are_refused_where_they_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(["plan", *LAYOUT, "--gram-restart", "3", "-o", str(tmp_path / "x")], capsys, "--gram-restart", "gram")
    refused(
        ["plan", *LAYOUT, "--optimizer", "soap", "--ns-method", "gram", "-o", str(tmp_path / "x")],
        capsys,
        "--ns-method has no effect here",
    )


def test_the_search_lines_follow_the_headline_under_the_method_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["plan", *LAYOUT, "--ns-method", "gram", "--alpha", "auto", "-o", str(tmp_path / "a")], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[2].startswith("matrix updates: gram") and lines[3].startswith("predicted step")
    assert lines[4].startswith("alpha chosen by the simulator")
