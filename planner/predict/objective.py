"""The one objective a plan is chosen by: canzona's predicted optimizer step.

The partition and TP stages each balance a number of their own (the DP max load, the busiest
device, a bucket's collective), but the step is what a user waits for: the DP collectives, the
critical device's compute and the exposed TP collectives together. `Objective` is that step as
the simulator predicts it (`canzona_time`, with the runtime's default overlap) on the request's
device (`--alpha auto`'s or `--bucket-size auto`'s, else the H100 reference the planner prices
collectives on); ties, within a relative 1e-9, go to the smaller DP max, then to fewer bytes
moved by the buckets' busiest ranks (`dp_bytes`).

`best_plan` makes a request's plan the best of every candidate on that objective:

- the searched plan at the request's α (`partition_plan`, then `finish_plan`);
- the plan chosen the same way at the next smaller α of the ladder (0, 0.25, 0.5, 0.75): valid
  at any larger α (its slices are within the tighter caps), so the plan at α is never worse on
  the objective than at any smaller ladder α, by construction;
- the plans whose owners follow a baseline's rule (`make_baseline_plan`: start-owner,
  zero1-gather's slicing with whole-matrix owners, layer-wise), each first tried at the
  smallest α whose caps allow it, and finished as any plan but for the device stage (with
  canzona's collectives, including `reslice`, which moves what start-owner moves).

Each candidate is scored under each TP update the request allows (`--tp-update`; auto: the
hosted micro-groups and the replicated update, TP-SC's, which moves no update back but
computes every matrix on every TP rank); it keeps the faster, on a tie the hosted one (1/P of
the state). The winner's `method` says where it came from when it is not the search at the
request's α, and when its update is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from canzona.planner.compile import simulation_schedule
from canzona.planner.partition.baselines import OWNER_RULES
from canzona.planner.partition.collectives import (
    GRAD_BYTES,
    all_gather,
    bucket_load,
    bucket_seconds,
    layout_links,
    reduce_scatter,
)
from canzona.planner.partition.costs import param_cost
from canzona.planner.partition.dp import ALPHA_LADDER
from canzona.planner.partition.layout import adamw_elements, equal_cuts, param_bytes, slice_sizes
from canzona.planner.plan import Partitions, Plan, PlanRequest, finish_plan, make_baseline_plan, partition_plan
from canzona.planner.predict.hardware import Device, resolve_device, shared_host
from canzona.planner.predict.step import (
    build_instance,
    canzona_parts,
    critical_local,
    replicated_locals,
)
from canzona.planner.spec import ModelSpec
from canzona.schedules.limits import AS_SCHEDULED, HOSTED, REPLICATED_UPDATE, TP_UPDATES

REFERENCE_DEVICE = "h100"  # the network `choose_collective` prices buckets on
TIE = 1e-9  # relative: predicted seconds this close are a tie


@dataclass(frozen=True)
class Objective:
    """A plan's score: predicted step seconds, then its DP max load, then the bytes its matrix
    buckets move (`dp_bytes`); `tp_update`, the TP update the step was predicted for."""

    step_s: float
    dp_max: float
    dp_bytes: int
    tp_update: str = HOSTED

    def better_than(self, other: Objective) -> bool:
        """Whether this score wins over `other`: a shorter step, or on a tie (`TIE`) a smaller
        DP max, or on a tie of both fewer bytes."""
        for mine, theirs in ((self.step_s, other.step_s), (self.dp_max, other.dp_max)):
            if mine < theirs * (1 - TIE):
                return True
            if mine > theirs * (1 + TIE):
                return False
        return self.dp_bytes < other.dp_bytes


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


def tp_updates(request: PlanRequest) -> tuple[str, ...]:
    """The TP updates a request's plans may run: the one it names, else both where TP > 1
    (at TP 1 they are the same update)."""
    if request.tp_update in TP_UPDATES:
        return (request.tp_update,)
    return (HOSTED, REPLICATED_UPDATE) if request.tp > 1 else (HOSTED,)


def score(plan: Plan, device: Device) -> Objective:
    """The plan's `Objective` on `device` (compiled and simulated: canzona's step only) under
    the faster of the TP updates its request allows (ties: hosted)."""
    schedule = simulation_schedule(replace(plan, tp_update=HOSTED))
    time_model = device.time_model(plan.request.optimizer)
    instance = build_instance(schedule, device.hardware, time_model, False, None, AS_SCHEDULED, True, False)
    parts, hosted = canzona_parts(instance, schedule)
    comm, tie_break = sum(parts.values()), (max(plan.loads), dp_bytes(plan))
    scores = []
    for update in tp_updates(plan.request):
        local = hosted if update == HOSTED else critical_local(replicated_locals(instance))
        scores.append(Objective(comm + max(local.seconds, 0.0), *tie_break, update))
    best = scores[0]
    for other in scores[1:]:
        if other.better_than(best):
            best = other
    return best


def dp_bytes(plan: Plan) -> int:
    """The bytes the busiest rank of every matrix bucket's group moves to reduce it (fp32) and
    gather it (its parameters' dtype) in its collective, summed over the buckets."""
    req = plan.request
    buffers = [(plan.dense, req.dp)] + ([(plan.expert, req.dp // req.ep)] if plan.expert else [])
    return sum(
        bucket_load(ranks, slice_sizes(cuts), collective)[1] * (GRAD_BYTES + param_bytes(plan.model, bucket))
        for buffer, ranks in buffers
        for bucket, cuts, collective in zip(buffer.layout.buckets, buffer.cuts, buffer.collectives)
    )


@dataclass(frozen=True)
class Scored:
    """A candidate plan, its score, and where it came from (empty: the search at its α)."""

    plan: Plan
    objective: Objective
    origin: str = ""


def comm_floor(plan: Plan, device: Device) -> float:
    """The seconds the plan's DP collectives take on `device` as the simulator prices them:
    every matrix bucket reduced and gathered in its collective, the AdamW buffer's equal
    reduce-scatter and all-gather. A part of its predicted step, so a floor under it."""
    req = plan.request
    dp_link, expert_link, _ = layout_links(device.hardware.network, req.tp, req.dp, req.ep)
    buffers = [(plan.dense, dp_link)] + ([(plan.expert, expert_link)] if plan.expert else [])
    seconds = sum(
        bucket_seconds(link, slice_sizes(cuts), GRAD_BYTES, param_bytes(plan.model, bucket), collective)
        for buffer, link in buffers
        for bucket, cuts, collective in zip(buffer.layout.buckets, buffer.cuts, buffer.collectives)
    )
    adamw = plan.adamw_layout.buckets
    gathered = param_bytes(plan.model, adamw[0]) if adamw else GRAD_BYTES  # the simulator's: the first one's
    for bucket in adamw:
        slices = slice_sizes(equal_cuts(bucket.numel, req.dp))
        seconds += (
            reduce_scatter(dp_link, slices, GRAD_BYTES).seconds() + all_gather(dp_link, slices, gathered).seconds()
        )
    return seconds


def local_floor(plan: Plan, device: Device) -> float:
    """The least the plan's local stage can take on `device`: on the DP rank where it is
    largest, the rank's matrix updates spread evenly over its TP devices (a team member does at
    least its share) plus each device's AdamW."""
    req = plan.request
    time_model = device.time_model(req.optimizer)
    index_of = {param.name: index for index, param in enumerate(plan.model.params)}
    elements = adamw_elements(plan.adamw_layout, req.dp)
    seconds_of: dict[str, float] = {}
    worst = 0.0
    for rank, tasks in enumerate(plan.tasks):
        updates = 0.0
        for task in tasks:
            if task.name not in seconds_of:
                seconds_of[task.name] = param_cost(plan.model.params[index_of[task.name]], time_model)
            updates += seconds_of[task.name]
        worst = max(worst, updates / req.tp + time_model.adamw_cost(elements[rank]))
    return worst


def same_plan(one: Plan, other: Plan) -> bool:
    """Whether two plans of a request (at any α) would compile to the same schedule but for
    the request: the same owners, buffers, cuts, collectives and micro-groups."""
    return (
        one.owners == other.owners
        and one.dense.layout == other.dense.layout
        and one.dense.cuts == other.dense.cuts
        and one.dense.collectives == other.dense.collectives
        and one.expert == other.expert
        and one.chosen_groups == other.chosen_groups
    )


def _contender(plan: Plan, best: Scored | None, device: Device, origin: str = "") -> Scored | None:
    """The plan scored, or None where it cannot beat `best`: the same plan, or a floor of its
    step (its DP collectives plus the least its local stage can take) above `best`'s step."""
    if best is not None:
        if same_plan(plan, best.plan):
            return None
        if comm_floor(plan, device) + local_floor(plan, device) > best.objective.step_s * (1 + TIE):
            return None
    return Scored(plan, score(plan, device), origin)


def best_plan(model: ModelSpec, request: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
    """The request's plan: the best on the `Objective` of the searched plan, the best plan at
    the next smaller ladder α, and the baseline-owner plans (see the module docstring); on a
    tie the search at the larger α. `progress` hears of each α finished."""
    return best_plans(model, request, (request.alpha,), progress)[0]


def best_plans(
    model: ModelSpec,
    request: PlanRequest,
    alphas: Sequence[float],
    progress: Callable[[str], None] | None = None,
) -> list[Plan]:
    """`best_plan` of the request at each of `alphas` (in that order), in one pass up the
    ladder: each plan is never worse on the objective than those at smaller α. `progress`
    hears of each α finished."""
    device = objective_device(request)
    wanted = set(alphas)
    ladder = sorted({alpha for alpha in ALPHA_LADDER if alpha < max(wanted)} | wanted)
    chosen: dict[float, Plan] = {}
    tried_rules: set[str] = set()
    best: Scored | None = None
    previous: Partitions | None = None
    for alpha in ladder:
        at = replace(request, alpha=alpha)
        partitions = partition_plan(model, at)
        if best is None or previous is None or not partitions.same_owners(previous):
            # Where the DP owners are those of the smaller α, the plan chosen there stands.
            best = _searched(finish_plan(model, partitions), best, device)
        previous = partitions
        for rule in OWNER_RULES:
            ruled = None if rule in tried_rules else make_baseline_plan(model, at, rule)
            if ruled is None:
                continue
            tried_rules.add(rule)
            found = _contender(ruled, best, device, f"{rule} owners")
            if found is not None and best is not None and found.objective.better_than(best.objective):
                best = found
        assert best is not None
        if alpha in wanted:
            chosen[alpha] = _as_requested(best, at)
        if progress:
            progress(f"alpha {alpha:g}")
    return [chosen[alpha] for alpha in alphas]


def _searched(searched: Plan, best: Scored | None, device: Device) -> Scored:
    """The better of the search at an α and `best`, the plan chosen at the smaller α (ties: the
    search)."""
    if best is not None and same_plan(searched, best.plan):
        return Scored(searched, best.objective)  # found again: no need to score it
    found = _contender(searched, best, device)
    if found is not None and (best is None or not best.objective.better_than(found.objective)):
        return found
    assert best is not None  # `_contender` scores every plan when there is nothing to beat
    return best if best.origin else replace(best, origin=f"alpha {best.plan.request.alpha:g} plan")


def _as_requested(best: Scored, request: PlanRequest) -> Plan:
    """The winning plan under the user's request and its TP update, its method saying where it
    came from (the search's own method, or the owner rule's, is already in it) and, when the
    objective chose it, that the update is replicated."""
    plan = replace(best.plan, request=request, tp_update=best.objective.tp_update)
    notes = [] if not best.origin or best.origin.endswith("owners") else [f"{best.origin} predicted no slower"]
    if plan.tp_update != HOSTED and request.tp_update not in TP_UPDATES:
        notes.append("replicated tp update predicted faster")
    if not notes:
        return plan
    method = f"{plan.dense.method} ({' and '.join(notes)})"
    return replace(plan, dense=replace(plan.dense, method=method))
