"""The one objective a plan is chosen by: canzona's predicted optimizer step.

The partition and TP stages each balance a number of their own (the DP max load, the busiest
device, a bucket's collective), but the step is what a user waits for: the DP collectives, the
critical device's compute and the exposed TP collectives together. `Objective` is that step as
the simulator predicts it (`canzona_time`, with the runtime's default overlap) on the request's
device (`--alpha auto`'s or `--bucket-size auto`'s, else the H100 reference the planner prices
collectives on); ties, within a relative 1e-9, go to the smaller DP max, then to fewer bytes
sent by all devices.

`best_plan` makes a request's plan the best of every candidate on that objective:

- the searched plan at the request's α (`make_plan`);
- the plan chosen the same way at the next smaller α of the ladder (0, 0.25, 0.5, 0.75): valid
  at any larger α (its slices are within the tighter caps), so the plan at α is never worse on
  the objective than at any smaller ladder α, by construction;
- the plans whose owners follow a baseline's rule (`make_baseline_plan`: start-owner,
  zero1-gather's slicing with whole-matrix owners, layer-wise), each first tried at the
  smallest α whose caps allow it, and finished as any plan (with canzona's collectives,
  including `reslice`, which moves what start-owner moves).

The winner's `method` says where it came from when it is not the search at the request's α.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.baselines import OWNER_RULES
from canzona.planner.partition.dp import ALPHA_LADDER
from canzona.planner.plan import Plan, PlanRequest, make_baseline_plan, make_plan
from canzona.planner.predict.hardware import Device, resolve_device, shared_host
from canzona.planner.predict.step import build_instance, canzona_time
from canzona.planner.spec import ModelSpec
from canzona.schedules.limits import AS_SCHEDULED

REFERENCE_DEVICE = "h100"  # the network `choose_collective` prices buckets on
TIE = 1e-9  # relative: predicted seconds this close are a tie


@dataclass(frozen=True)
class Objective:
    """A plan's score: predicted step seconds, then its DP max load, then the bytes every
    device sends per step (the schedule's device figures)."""

    step_s: float
    dp_max: float
    bytes_sent: int

    def better_than(self, other: Objective) -> bool:
        """Whether this score wins over `other`: a shorter step, or on a tie (`TIE`) a smaller
        DP max, or on a tie of both fewer bytes."""
        for mine, theirs in ((self.step_s, other.step_s), (self.dp_max, other.dp_max)):
            if mine < theirs * (1 - TIE):
                return True
            if mine > theirs * (1 + TIE):
                return False
        return self.bytes_sent < other.bytes_sent


def search_device(name: str, num_devices: int) -> Device:
    """The device a plan of `num_devices` (tp x dp) is scored on; a CPU profile is shared by
    all of them."""
    device = resolve_device(name)
    if device.profile is not None and device.profile.device == "cpu":
        device = shared_host(device, num_devices)  # ranks share this machine's cores
    return device


def objective_device(request: PlanRequest) -> Device:
    """The device the request's plans are scored on: the one its searches simulate on, else
    the reference."""
    return search_device(request.alpha_device or request.bucket_device or REFERENCE_DEVICE, request.tp * request.dp)


def score(plan: Plan, device: Device) -> Objective:
    """The plan's `Objective` on `device` (compiled and simulated: canzona's step only)."""
    schedule = compile_schedule(plan)
    time_model = device.time_model(plan.request.optimizer)
    instance = build_instance(schedule, device.hardware, time_model, False, None, AS_SCHEDULED, True, False)
    step = canzona_time(instance, schedule).step
    return Objective(step, max(plan.loads), sum(d.bytes_sent for d in schedule.metrics.device))


@dataclass(frozen=True)
class Scored:
    """A candidate plan, its score, and where it came from (empty: the search at its α)."""

    plan: Plan
    objective: Objective
    origin: str = ""


def best_plan(model: ModelSpec, request: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
    """The request's plan: the best on the `Objective` of the searched plan, the best plan at
    the next smaller ladder α, and the baseline-owner plans (see the module docstring).
    `progress` hears of each α finished."""
    device = objective_device(request)
    ladder = [alpha for alpha in ALPHA_LADDER if alpha < request.alpha] + [request.alpha]
    tried_rules: set[str] = set()
    best: Scored | None = None
    for alpha in ladder:
        at = replace(request, alpha=alpha)
        searched = make_plan(model, at)
        candidates = [Scored(searched, score(searched, device))]
        if best is not None:
            candidates.append(replace(best, origin=best.origin or f"alpha {best.plan.request.alpha:g} plan"))
        for rule in OWNER_RULES:
            if rule in tried_rules:
                continue
            ruled = make_baseline_plan(model, at, rule)
            if ruled is not None:
                tried_rules.add(rule)
                candidates.append(Scored(ruled, score(ruled, device), f"{rule} owners"))
        best = candidates[0]
        for candidate in candidates[1:]:
            if candidate.objective.better_than(best.objective):
                best = candidate
        if progress:
            progress(f"alpha {alpha:g}")
    assert best is not None
    return _as_requested(best, request)


def _as_requested(best: Scored, request: PlanRequest) -> Plan:
    """The winning plan under the user's request, its method saying where it came from."""
    plan = replace(best.plan, request=request)
    if not best.origin or best.origin.endswith("owners"):
        return plan  # the search's own method, or the owner rule's (already in it)
    method = f"{plan.dense.method} ({best.origin} predicted no slower)"
    return replace(plan, dense=replace(plan.dense, method=method))
