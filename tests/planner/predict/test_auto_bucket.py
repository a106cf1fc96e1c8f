"""`--bucket-size auto`: the rule by hand and the search on a real model."""

from __future__ import annotations

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, SearchTrial, TrainingSetup
from canzona.planner.predict.auto_bucket import ONE_BUCKET, choose_bucket_size, pick, size_label
from canzona.planner.predict.hardware import BUILTIN
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model


def test_pick_by_hand() -> None:
    trials = [SearchTrial(10e6, 9, 1.0, 5.0), SearchTrial(40e6, 3, 1.0, 4.0), SearchTrial(ONE_BUCKET, 1, 0.5, 3.0)]
    # One bucket predicts fastest but hides nothing behind backward: excluded.
    chosen, reason = pick(trials)
    assert chosen.value == 40e6 and reason.startswith("40M (3 matrix buckets)")
    # Exact ties go to the smaller size.
    chosen, _ = pick([SearchTrial(40e6, 3, 1.0, 4.0), SearchTrial(20e6, 5, 1.0, 4.0)])
    assert chosen.value == 20e6
    # A model too small for two buckets at any size: every size competes.
    chosen, reason = pick([SearchTrial(10e6, 1, 1.0, 2.0), SearchTrial(ONE_BUCKET, 1, 1.0, 1.0)])
    assert chosen.value == ONE_BUCKET and "none keeps 2" in reason
    assert size_label(ONE_BUCKET) == "one bucket" and size_label(400_000_000) == "400M" and size_label(12345) == "12345"


def test_search_keeps_the_fastest_overlapping_size() -> None:
    model = load_model("qwen3-1.7b", 2)
    training = TrainingSetup(global_batch=64, seq_len=2048)
    plan, trials, reason = choose_bucket_size(
        model,
        PlanRequest("qwen3-1.7b", 2, 8),
        BUILTIN["h100"],
        training=training,
        sizes=(5_000_000, 40_000_000, ONE_BUCKET),
    )
    assert [t.value for t in trials] == [5_000_000, 40_000_000, ONE_BUCKET]
    assert [t.num_buckets for t in trials][-1] == 1 and trials[0].num_buckets > trials[1].num_buckets >= 2
    chosen = next(t for t in trials if t.value == plan.request.bucket_size)
    assert chosen.iteration_s == min(t.iteration_s for t in trials if t.num_buckets >= 2)
    assert str(chosen.num_buckets) in reason
    # The recorded figures are the simulator's for that plan.
    sim = simulate(compile_schedule(plan), BUILTIN["h100"], training=training)
    assert sim.iteration("canzona").iteration == pytest.approx(chosen.iteration_s)
    assert sim.get("canzona").step == pytest.approx(chosen.step_s)
