"""Where `canzona plan` writes (issue 25, defects 1 and 2): default names that spell out every
option that changes the plan, the library inside a canzona checkout and `./<model>-<name>.yaml`
elsewhere, and no plan replaced by another without `--force`."""

from __future__ import annotations

import os
import shutil
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from canzona.cli.plan_output import default_output, file_part, in_checkout, plan_stem
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.request import PlanRequest, TrainingSetup
from canzona.planner.spec import ModelOptions
from canzona.schedules.format import read_request, read_schedule, schedule_text
from canzona.schedules.library import library_names, library_root

from cli_run import make_checkout, refused, run

BASE = PlanRequest("qwen3-8b", 2, 4)
OPTIMIZER = {
    "name": {"name": "shampoo"},
    "ns_steps": {"ns_steps": 3},
    "block_size": {"name": "shampoo", "block_size": 512},
    "precondition_frequency": {"name": "soap", "precondition_frequency": 5},
    "max_precond_dim": {"name": "soap", "max_precond_dim": 4096},
    "ns_coefficients": {"ns_coefficients": "quintic"},
    "ns_method": {"ns_method": "gram"},
    "gram_restart": {"ns_method": "gram", "gram_restart": 3},
    "ns_dtype": {"ns_dtype": "fp32"},
}
OPTIONS = {
    "split_qkv": {"split_qkv": "head"},
    "split_fc1": {"split_fc1": True},
    "router_optimizer": {"router_optimizer": "adamw"},
    "names": {"names": "torchtitan"},
    "sequence_parallel": {"sequence_parallel": True},
    "dtype": {"dtype": "fp32"},
}
TRAINING = {"global_batch": {"global_batch": 512}, "seq_len": {"seq_len": 1024}, "micro_batches": {"micro_batches": 4}}
SEARCHED = {"alpha_device": "h100"}
TOP: dict[str, list[dict[str, Any]]] = {
    "cost": [{"cost": "numel"}, {"cost": "profile:dir/gpu.yaml"}],
    "alpha": [{"alpha": 0.5}, {"alpha": 0.123456789}],
    "bucket_size": [{"bucket_size": 1000}],
    "tp_mode": [{"tp_mode": "heap"}, {"tp_mode": "fixed"}],
    "group_bytes": [{"group_bytes": 64 << 20}, {"group_bytes": 1000}],
    "ep": [{"ep": 2}],
    "solver": [{"solver": "ilp"}],
    "time_limit": [{"solver": "ilp", "time_limit": 2.5}],
    "seed": [{"solver": "ilp", "seed": 3}],
    "alpha_device": [SEARCHED, {"alpha_device": "a100"}],
    "bucket_device": [{"bucket_device": "h100"}, {"bucket_device": "profile:gpu.yaml"}],
    "sharding": [{"sharding": "fsdp"}],
    "dp_replicate": [{"sharding": "fsdp", "dp_replicate": 2}],
    "coop": [{"coop": "off"}, {"coop": "force"}],
    "tp_update": [{"tp_update": "hosted"}, {"tp_update": "replicated"}],
    "order": [{"order": "registration"}],
}


def variations() -> dict[str, PlanRequest]:
    """One request per option that changes the plan, each away from its default."""
    found = {
        f"{key} {index}": replace(BASE, **change)
        for key, changes in TOP.items()
        for index, change in enumerate(changes)
    }
    found.update(
        {f"optimizer.{key}": replace(BASE, optimizer=OptimizerConfig(**change)) for key, change in OPTIMIZER.items()}
    )
    found.update({f"options.{key}": replace(BASE, options=ModelOptions(**change)) for key, change in OPTIONS.items()})
    found.update(
        {
            f"training.{key}": replace(BASE, training=TrainingSetup(**change), **SEARCHED)
            for key, change in TRAINING.items()
        }
    )
    return found


def test_every_option_that_changes_the_plan_has_its_own_default_name() -> None:
    covered = {f.name for f in fields(PlanRequest)} - {"model", "tp", "dp", "optimizer", "options", "training"}
    assert covered == set(TOP), "a new PlanRequest field needs a part in the default file name (plan_output.py)"
    assert set(OPTIMIZER) == {f.name for f in fields(OptimizerConfig)}
    assert set(OPTIONS) == {f.name for f in fields(ModelOptions)}
    assert set(TRAINING) == {f.name for f in fields(TrainingSetup)}
    stems = {key: plan_stem(request, "megatron") for key, request in variations().items()}
    assert plan_stem(BASE, "megatron") == "muon-tp2-dp4" and "muon-tp2-dp4" not in stems.values()
    assert len(set(stems.values())) == len(stems), stems
    assert all(file_part(stem) == stem for stem in stems.values())
    assert stems["options.names"] == "muon-tp2-dp4-torchtitan" and stems["cost 1"] == "muon-tp2-dp4-profile-gpu"


def test_default_names_of_the_library_are_unchanged() -> None:
    for name in library_names():
        recorded = read_request(schedule_text(library_root() / f"{name}.yaml"))
        path = default_output(recorded.model.name, PlanRequest.from_request(recorded), "megatron", checkout=True)
        assert path == Path("schedules") / f"{name}.yaml"


def test_names_are_spelled_only_when_they_are_not_the_sources_own() -> None:
    hf = replace(BASE, options=ModelOptions(names="hf"))
    assert plan_stem(hf, "hf") == "muon-tp2-dp4" and plan_stem(hf, "megatron") == "muon-tp2-dp4-hf"
    assert default_output("../odd name", BASE, "megatron", checkout=False) == Path("_odd_name-muon-tp2-dp4.yaml")


def test_a_checkout_is_a_canzona_pyproject_next_to_a_schedules_folder(tmp_path: Path) -> None:
    assert not in_checkout(tmp_path)
    (tmp_path / "schedules").mkdir()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert not in_checkout(tmp_path)
    make_checkout(tmp_path)
    assert in_checkout(tmp_path)
    assert in_checkout(library_root().parent)  # this repository (tests run from a checkout)


def test_another_plan_goes_to_its_own_file_not_over_the_librarys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    library = make_checkout(tmp_path) / "qwen3-8b"
    library.mkdir()
    shipped = library / "muon-tp2-dp4.yaml"
    shutil.copy(library_root() / "qwen3-8b" / "muon-tp2-dp4.yaml", shipped)
    before = shipped.read_bytes()
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["plan", "--model", "qwen3-8b", "--names", "torchtitan", "--tp", "2", "--dp", "4"], capsys)
    assert code == 0, err
    assert out.startswith("wrote schedules/qwen3-8b/muon-tp2-dp4-torchtitan.yaml\n") and shipped.read_bytes() == before
    assert read_schedule(library / "muon-tp2-dp4-torchtitan.yaml").request.names == "torchtitan"
    assert run(["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4"], capsys)[0] == 0  # the same plan: kept
    assert shipped.read_bytes() == before and sorted(os.listdir(library)) == [
        "muon-tp2-dp4-torchtitan.yaml",
        "muon-tp2-dp4.yaml",
    ]


def test_a_file_holding_another_plan_is_replaced_only_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "s.yaml"
    plan = ["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(target)]
    assert run(plan, capsys)[0] == 0
    before, stat = target.read_bytes(), target.stat()
    err = refused(
        [*plan, "--names", "hf"], capsys, "refusing to replace", "names megatron there, hf now", "-o FILE", "--force"
    )
    assert str(target) in err and target.read_bytes() == before and os.listdir(tmp_path) == ["s.yaml"]
    assert run(plan, capsys)[0] == 0  # the same request: the same bytes, not even rewritten
    assert (target.stat().st_ino, target.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert run([*plan, "--names", "hf", "--force"], capsys)[0] == 0
    assert read_schedule(target).request.names == "hf"


def test_a_file_that_is_no_schedule_is_replaced_only_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "notes.yaml"
    target.write_text("my notes\n")
    refused(["plan", "--model", "qwen3-0.6b", "-o", str(target)], capsys, "is not a schedule", "-o FILE", "--force")
    assert target.read_text() == "my notes\n" and os.listdir(tmp_path) == ["notes.yaml"]


def test_outside_a_checkout_the_file_lands_here_under_a_name_show_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(["plan", "--model", "qwen3-0.6b", "--dp", "2"], capsys)
    written = out.splitlines()[0].removeprefix("wrote ")
    assert code == 0 and written == "qwen3-0.6b-muon-tp1-dp2.yaml" and os.listdir(tmp_path) == [written]
    code, out, _ = run(["show", written], capsys)
    assert code == 0 and "qwen3-0.6b" in out


def test_planning_again_into_the_same_bytes_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan` says "wrote" only when it wrote: the same plan again leaves the file untouched."""
    target = tmp_path / "p.yaml"
    args = ["plan", "--model", "qwen3-0.6b", "--dp", "2", "-o", str(target)]
    code, out, _ = run(args, capsys)
    assert code == 0 and out.startswith(f"wrote {target}\n")
    os.utime(target, ns=(0, 0))  # a mark a rewrite would clear
    code, out, _ = run(args, capsys)
    assert code == 0 and out.startswith(f"unchanged {target} ") and target.stat().st_mtime_ns == 0
    code, out, _ = run([*args, "--json"], capsys)
    assert code == 0 and '"written": false' in out
