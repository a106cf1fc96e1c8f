"""`plan --bucket-size auto`: the bucket size whose plan the simulator predicts fastest over a
whole training iteration.

Small buckets start reducing early in backward (more of the reduction hides behind it) but pay
more collective latency (every bucket pays its collective's α: n − 1 ring steps, or a rooted
reduce and broadcast per non-empty slice);
large buckets pay less latency but reduce later, and a single bucket hides nothing. Every
candidate is planned as `canzona plan` plans one size (`objective.best_plan`: the best
predicted step of the searches, smaller α and baseline owners, and TP updates, on the search's
device), compiled and simulated on the given hardware and training setup. The choice:

1. only sizes that keep at least two buckets in the matrix buffer, so backward overlap exists
   (every size, if none does: the model is small);
2. among those, the smallest predicted iteration; exact ties go to the smaller size (less
   overlap lost if backward runs faster than modelled, smaller per-bucket scratch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import Plan, PlanRequest, SearchTrial, TrainingSetup
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.objective import best_plan
from canzona.planner.predict.trial import trial
from canzona.planner.request import DEFAULT_TRAINING
from canzona.planner.spec import ModelSpec, PlanError
from canzona.schedules.searches import (  # noqa: F401 - the candidates and the rule, re-exported
    DEFAULT_BUCKET_SIZES,
    ONE_BUCKET,
    bucket_winner,
    size_label,
)


def pick(trials: Sequence[SearchTrial]) -> tuple[SearchTrial, str]:
    """The winning trial by the module's rule, and the reason, in one line."""
    chosen, reason = bucket_winner(
        [int(t.value) for t in trials], [t.num_buckets for t in trials], [t.iteration_s for t in trials]
    )
    return trials[chosen], reason


def choose_bucket_size(
    model: ModelSpec,
    request: PlanRequest,
    hardware: Hardware,
    time_model: CostModel | None = None,
    training: TrainingSetup = DEFAULT_TRAINING,
    sizes: Sequence[int] = DEFAULT_BUCKET_SIZES,
    progress: Callable[[str], None] | None = None,
) -> tuple[Plan, list[SearchTrial], str]:
    """Plan `model` at every bucket size in `sizes` (the rest of `request` unchanged), predict
    canzona's iteration on `hardware` with `training`, and return the chosen plan, every
    trial (in the order given) and why it won. `progress` hears of each finished trial."""
    candidates = list(dict.fromkeys(int(size) for size in sizes))
    if not candidates:
        raise PlanError("bucket size auto needs at least one candidate size")
    if min(candidates) < 1:
        raise PlanError(f"bucket size must be >= 1, got {min(candidates)}")
    trials = []
    for size in candidates:
        trials.append(trial(best_plan(model, replace(request, bucket_size=size)), size, hardware, time_model, training))
        if progress:
            progress(f"bucket size {size_label(size)}")
    chosen, reason = pick(trials)
    # Planning is deterministic: plan the winner again rather than hold every candidate's plan.
    return best_plan(model, replace(request, bucket_size=int(chosen.value))), trials, reason
