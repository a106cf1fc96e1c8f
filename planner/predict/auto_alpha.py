"""`plan --alpha auto`: the α whose plan the simulator predicts to step fastest.

At α = 1 compute is balanced, but a bucket's uneven reduce-scatter can land on one rank; at
α = 0 slices are as equal as parameter boundaries allow, but compute is not balanced. Which
wins depends on the model, the layout and the network, so every candidate is planned,
compiled and simulated (canzona's predicted step time on the given hardware), and the fastest
kept; ties go to the larger α (better compute balance at equal predicted time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import Plan, PlanRequest, make_plan
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.simulate import simulate
from canzona.planner.spec import ModelSpec, PlanError

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
TIE_TOLERANCE = 1e-9  # relative: predicted times this close count as equal


def choose_alpha(
    model: ModelSpec,
    request: PlanRequest,
    hardware: Hardware,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    time_model: CostModel | None = None,
    fused: bool = False,
    rooted: bool = True,
) -> tuple[Plan, list[tuple[float, float]]]:
    """Plan `model` at every α in `alphas` (the rest of `request` unchanged), simulate each
    schedule on `hardware` (`time_model`, `fused`, `rooted`: as `simulate` takes them), and
    return the plan with the smallest predicted canzona step time and every (α, predicted
    seconds) tried, in the order given."""
    candidates = sorted(set(float(a) for a in alphas))
    if not candidates:
        raise PlanError("alpha auto needs at least one candidate alpha")
    for alpha in candidates:
        if not 0.0 <= alpha <= 1.0:
            raise PlanError(f"alpha must be in [0, 1], got {alpha}")
    best: tuple[float, float, Plan] | None = None
    tried: dict[float, float] = {}
    for alpha in candidates:
        plan = make_plan(model, replace(request, alpha=alpha))
        seconds = simulate(compile_schedule(plan), hardware, time_model, fused=fused, rooted=rooted).get("canzona").step
        tried[alpha] = seconds
        if best is None or seconds <= best[0] * (1 + TIE_TOLERANCE):
            best = (min(seconds, best[0]) if best else seconds, alpha, plan)
    assert best is not None
    order = list(dict.fromkeys(float(a) for a in alphas))
    return best[2], [(alpha, tried[alpha]) for alpha in order]


def alpha_table(tried: Sequence[tuple[float, float]], chosen: float) -> str:
    """One line per α tried: predicted step time, the chosen one marked."""
    return "\n".join(
        f"  alpha {alpha:<5g} predicted step {seconds * 1e3:10.3f} ms" + ("  <- chosen" if alpha == chosen else "")
        for alpha, seconds in tried
    )


def plan_for_request(model: ModelSpec, request: PlanRequest) -> tuple[Plan, list[tuple[float, float]] | None]:
    """The plan a request asks for: its fixed α, or (with `alpha_device`) the α the simulator
    predicts fastest on that device; then also every (α, predicted seconds) tried."""
    if request.alpha_device is None:
        return make_plan(model, request), None
    from canzona.planner.predict.hardware import resolve_device, shared_host

    device = resolve_device(request.alpha_device)
    if device.profile is not None and device.profile.device == "cpu":
        device = shared_host(device, request.tp * request.dp)  # ranks share this machine's cores
    return choose_alpha(model, request, device.hardware, time_model=device.time_model(request.optimizer))
