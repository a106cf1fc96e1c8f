"""`PlanRequest`: one request type, built by keyword, that writes the schedule's `request` section
itself and is read back from it."""

from __future__ import annotations

import pytest

from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.request import PlanRequest, TrainingSetup
from canzona.planner.spec import ModelOptions, ModelSpec
from canzona.schedules.format import read_request, schedule_text
from canzona.schedules.library import library_names, library_root


def spec_of(request_model: object) -> ModelSpec:
    """A model as `to_request` sees it: its name, source and sha256 (no parameters needed)."""
    return ModelSpec(
        name=request_model.name,
        params=(),
        source=request_model.source,  # type: ignore[attr-defined]
        source_sha256=request_model.sha256,
    )  # type: ignore[attr-defined]


def test_only_the_model_and_layout_go_by_position() -> None:
    with pytest.raises(TypeError):
        PlanRequest("qwen3-8b", 2, 4, OptimizerConfig("soap"))  # type: ignore[misc]
    assert PlanRequest("qwen3-8b", 2, 4, optimizer=OptimizerConfig("soap")).optimizer.name == "soap"


def test_every_library_request_reads_back_and_writes_itself_unchanged() -> None:
    for name in library_names():
        recorded = read_request(schedule_text(library_root() / f"{name}.yaml"))
        again = PlanRequest.from_request(recorded).to_request(spec_of(recorded.model))
        assert again.model_copy(update={"canzona_version": recorded.canzona_version}) == recorded, name


def test_every_field_survives_the_file() -> None:
    request = PlanRequest(
        "tiny.yaml",
        2,
        8,
        optimizer=OptimizerConfig("muon", ns_steps=3, ns_coefficients="polar_express"),
        cost="numel",
        alpha=0.25,
        bucket_size=12345,
        options=ModelOptions(
            split_qkv="head", split_fc1=True, router_optimizer="adamw", names="hf", sequence_parallel=True, dtype="fp32"
        ),
        tp_mode="heap",
        group_bytes=3 << 20,
        ep=2,
        solver="ilp",
        time_limit=2.5,
        seed=7,
        alpha_device="a100",
        bucket_device="a100",
        training=TrainingSetup(global_batch=64, seq_len=512, micro_batches=2),
        coop="off",
        order="free",
    )
    recorded = request.to_request(ModelSpec(name="tiny", params=(), source="tiny.yaml", source_sha256="ab" * 32))
    assert PlanRequest.from_request(recorded) == request
    assert recorded.model.sha256 == "ab" * 32 and recorded.training is not None and recorded.training.micro_batches == 2
    assert PlanRequest.from_request(recorded, "elsewhere/tiny.yaml").model == "elsewhere/tiny.yaml"


def test_a_request_without_a_search_records_no_training() -> None:
    request = PlanRequest("qwen3-8b", 1, 2, training=TrainingSetup(global_batch=64))
    assert not request.searching
    assert request.to_request(ModelSpec(name="qwen3-8b", params=(), source="qwen3-8b")).training is None


def test_the_coefficient_schedule_is_recorded_only_away_from_its_default() -> None:
    from canzona.planner.spec import PlanError

    spec = ModelSpec(name="qwen3-8b", params=(), source="qwen3-8b")
    plain = PlanRequest("qwen3-8b", 2, 4).to_request(spec)
    quintic = PlanRequest("qwen3-8b", 2, 4, optimizer=OptimizerConfig(ns_coefficients="quintic")).to_request(spec)
    assert "ns_coefficients" not in plain.model_dump(exclude_defaults=True)["optimizer"]
    assert quintic.optimizer.ns_coefficients == "quintic"
    assert quintic.model_dump_json() != plain.model_dump_json()
    with pytest.raises(PlanError, match="unknown ns_coefficients 'cubic'"):
        OptimizerConfig(ns_coefficients="cubic")


def test_the_coefficient_schedule_changes_the_digest_and_nothing_else() -> None:
    """The coefficients cost the same flops: the plan is the same, the file's digest is not."""
    from canzona.planner.compile import compile_schedule
    from canzona.planner.plan import make_plan
    from canzona.planner.sources.load import load_model

    spec = load_model("qwen3-0.6b", 1)
    plain, quintic = (
        compile_schedule(
            make_plan(spec, PlanRequest("qwen3-0.6b", 1, 2, optimizer=OptimizerConfig(ns_coefficients=name)))
        )
        for name in ("simple", "quintic")
    )
    assert plain.digest != quintic.digest
    assert plain.params == quintic.params and plain.metrics == quintic.metrics
