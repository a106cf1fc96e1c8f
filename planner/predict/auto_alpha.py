"""`plan --alpha auto`: the α whose plan the simulator predicts fastest.

At α = 1 compute is balanced, but a bucket's uneven slices can load one rank's link (each
bucket's collective, padded ring or rooted chains, moves about the largest slice n − 1 times or
the bucket less its smallest slice); at α = 0 slices are as equal as parameter boundaries
allow, but compute is not balanced. Which wins depends on the model, the layout and the network, so every candidate is
planned, compiled and simulated, and the fastest kept; ties go to the larger α (better compute
balance at equal predicted time).

The objective is canzona's predicted training iteration (given a training setup): reductions
hidden behind backward do not cost what they cost in the bare optimizer step, so the step
would over-weight them. Without a training setup it is the step.

`plan_for_request` runs the searches a request asks for: the bucket size first
(`canzona.planner.predict.auto_bucket`, at the request's α, or 1 when α is searched too), then α
at the chosen bucket size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from canzona.planner.fsdp import make_fsdp_plan
from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import AutoSearch, Plan, PlanRequest, SearchTrial, TrainingSetup
from canzona.planner.predict.auto_bucket import choose_bucket_size
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.objective import best_plan, best_plans, search_device
from canzona.planner.predict.trial import trial
from canzona.planner.spec import ModelSpec, PlanError
from canzona.schedules.limits import FSDP
from canzona.schedules.searches import DEFAULT_ALPHAS, DEFAULT_BUCKET_SIZES, alpha_winner


def choose_alpha(
    model: ModelSpec,
    request: PlanRequest,
    hardware: Hardware,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    time_model: CostModel | None = None,
    training: TrainingSetup | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Plan, list[SearchTrial]]:
    """Plan `model` at every α in `alphas` (the rest of `request` unchanged), simulate each
    schedule on `hardware` (`time_model`, `training`: as `simulate` takes them), and return the
    plan with the smallest predicted canzona iteration (step, without `training`) and every
    trial, in the order given. `progress` hears of each finished trial."""
    candidates = sorted(set(float(a) for a in alphas))
    if not candidates:
        raise PlanError("alpha auto needs at least one candidate alpha")
    for alpha in candidates:
        if not 0.0 <= alpha <= 1.0:
            raise PlanError(f"alpha must be in [0, 1], got {alpha}")
    tried: dict[float, SearchTrial] = {}
    # One pass up the ladder: each α's plan is the objective's best, never worse than a smaller α's.
    planned = best_plans(model, request, candidates)
    for alpha, plan in zip(candidates, planned):
        tried[alpha] = trial(plan, alpha, hardware, time_model, training)
        if progress:
            progress(f"alpha {alpha:g}")
    best = planned[alpha_winner([tried[alpha].iteration_s for alpha in candidates])]
    order = list(dict.fromkeys(float(a) for a in alphas))
    return best, [tried[alpha] for alpha in order]


def alpha_table(tried: Sequence[SearchTrial], chosen: float) -> str:
    """One line per α tried: predicted step and iteration, the chosen one marked."""
    return "\n".join(
        f"  alpha {t.value:<5g} predicted step {t.step_s * 1e3:10.3f} ms  iteration {t.iteration_s * 1e3:10.3f} ms"
        + ("  <- chosen" if t.value == chosen else "")
        for t in tried
    )


def search_steps(request: PlanRequest) -> int:
    """How many candidates `plan_for_request` plans and simulates for `request` (0: none)."""
    return (len(DEFAULT_BUCKET_SIZES) if request.bucket_device is not None else 0) + (
        len(DEFAULT_ALPHAS) if request.alpha_device is not None else 0
    )


def plan_for_request(
    model: ModelSpec, request: PlanRequest, progress: Callable[[str], None] | None = None
) -> tuple[Plan, AutoSearch | None]:
    """The plan a request asks for: its fixed α and bucket size, or those the simulator
    predicts fastest (`bucket_device`, `alpha_device`); then what the searches tried.
    `progress` hears of each candidate the searches finish (`search_steps` of them)."""
    if request.sharding == FSDP:
        return make_fsdp_plan(model, request), None  # type: ignore[return-value]
    if request.alpha_device is None and request.bucket_device is None:
        return best_plan(model, request, progress), None
    training = request.training or TrainingSetup()
    search = AutoSearch()
    plan: Plan | None = None
    if request.bucket_device is not None:
        device = search_device(request.bucket_device, request.tp * request.dp)
        start = replace(request, alpha=1.0) if request.alpha_device is not None else request
        plan, trials, reason = choose_bucket_size(
            model, start, device.hardware, device.time_model(request.optimizer), training, progress=progress
        )
        request = replace(request, bucket_size=plan.request.bucket_size)
        search = replace(search, bucket=tuple(trials), bucket_reason=reason)
    if request.alpha_device is not None:
        device = search_device(request.alpha_device, request.tp * request.dp)
        plan, alphas = choose_alpha(
            model,
            request,
            device.hardware,
            time_model=device.time_model(request.optimizer),
            training=training,
            progress=progress,
        )
        search = replace(search, alpha=tuple(alphas))
    assert plan is not None
    return plan, search
