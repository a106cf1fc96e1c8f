"""One candidate of an automatic search (`--alpha auto`, `--bucket-size auto`): a plan compiled
and simulated, canzona's predicted step and iteration."""

from __future__ import annotations

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import Plan, SearchTrial, TrainingSetup
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.simulate import simulate


def trial(
    plan: Plan, value: float, hardware: Hardware, time_model: CostModel | None, training: TrainingSetup | None
) -> SearchTrial:
    """Compile and simulate one candidate plan: canzona's predicted step and iteration (the
    step again when there is no training setup)."""
    sim = simulate(compile_schedule(plan), hardware, time_model, training=training)
    step = sim.get("canzona").step
    iteration = sim.iteration("canzona").iteration if training is not None else step
    return SearchTrial(value, len(plan.dense.layout.buckets), step, iteration)
