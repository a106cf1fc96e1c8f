"""`plan --bucket-size auto`: the bucket size whose plan the simulator predicts fastest over a
whole training iteration.

Small buckets start reducing early in backward (more of the reduction hides behind it) but pay
more collective latency (every bucket pays its collective's α: n − 1 ring steps, or a rooted
reduce and broadcast per non-empty slice);
large buckets pay less latency but reduce later, and a single bucket hides nothing. Every
candidate is planned, compiled and simulated on the given hardware and training setup. The
choice:

1. only sizes that keep at least two buckets in the matrix buffer, so backward overlap exists
   (every size, if none does: the model is small);
2. among those, the smallest predicted iteration; exact ties go to the smaller size (less
   overlap lost if backward runs faster than modelled, smaller per-bucket scratch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import Plan, PlanRequest, SearchTrial, TrainingSetup, make_plan
from canzona.planner.predict.auto_alpha import trial
from canzona.planner.predict.hardware import Hardware
from canzona.planner.spec import ModelSpec, PlanError

ONE_BUCKET = 1 << 40  # larger than any buffer: one bucket per buffer
DEFAULT_BUCKET_SIZES = (10_000_000, 20_000_000, 40_000_000, 100_000_000, 200_000_000, 400_000_000, ONE_BUCKET)
TIE_TOLERANCE = 1e-9  # relative: predicted iterations this close count as equal


def size_label(size: int) -> str:
    """A bucket size as people write it (40M, or 'one bucket')."""
    if size >= ONE_BUCKET:
        return "one bucket"
    return f"{size / 1e6:g}M" if size % 1_000_000 == 0 else str(size)


def pick(trials: Sequence[SearchTrial]) -> tuple[SearchTrial, str]:
    """The winning trial by the module's rule, and the reason, in one line."""
    overlapping = [t for t in trials if t.num_buckets >= 2]
    pool = overlapping or list(trials)
    fastest = min(t.iteration_s for t in pool)
    chosen = min((t for t in pool if t.iteration_s <= fastest * (1 + TIE_TOLERANCE)), key=lambda t: t.value)
    scope = ("sizes that keep >= 2 matrix buckets to overlap with backward" if overlapping
             else "every size (none keeps 2 matrix buckets)")
    return chosen, (f"{size_label(int(chosen.value))} ({chosen.num_buckets} matrix buckets): the fastest predicted "
                    f"iteration, {chosen.iteration_s * 1e3:.3f} ms, among {scope}")


def choose_bucket_size(
    model: ModelSpec,
    request: PlanRequest,
    hardware: Hardware,
    time_model: CostModel | None = None,
    training: TrainingSetup = TrainingSetup(),
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
        trials.append(trial(make_plan(model, replace(request, bucket_size=size)), size, hardware, time_model, training))
        if progress:
            progress(f"bucket size {size_label(size)}")
    chosen, reason = pick(trials)
    # Planning is deterministic: plan the winner again rather than hold every candidate's plan.
    return make_plan(model, replace(request, bucket_size=int(chosen.value))), trials, reason
