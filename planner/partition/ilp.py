"""Optional CP-SAT refinement of the greedy DP partition and TP host assignment.

This is the only module that uses OR-Tools, and it imports it inside the functions that need
it: the rest of canzona works without it, and `--solver ilp` without it fails with
`SolverUnavailable`, a one-line `PlanError`.

Both refiners take the greedy answer as a full solution hint and as an upper bound on the
objective, run CP-SAT single-threaded with a seed and a *deterministic* time budget (so the
same inputs give the same answer, byte for byte), and keep the solver's answer only when it is
valid (re-checked here, in Python) and strictly better in the original float costs. Otherwise
the greedy answer comes back unchanged. The refined answer is therefore never worse than the
greedy one.

Costs are floats; the models use integers: every cost is scaled so the largest becomes
`SCALE` and rounded. Reported objectives are recomputed from the float costs; reported bounds
are converted back conservatively (each rounded cost may be off by half a unit).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from canzona.planner.partition.dp import DpInstance, lower_bound, rank_loads
from canzona.planner.spec import PlanError

SCALE = 1_000_000
"""The largest cost becomes this many integer units in a model."""

FULL_MODEL_PAIRS = 50_000
"""Up to this many (item, rank) pairs the DP model lets every item go to every rank."""

MAX_MODEL_PAIRS = 200_000
"""A model with more (item, rank) pairs than this is not built: the hint comes back, UNKNOWN."""

WALL_FACTOR, WALL_SLACK = 10.0, 5.0
"""Wall-clock safety net: WALL_FACTOR · time_limit + WALL_SLACK seconds."""

POLL_SECONDS = 0.05
"""How often the thread waiting for CP-SAT wakes to handle signals."""

UNAVAILABLE = "--solver ilp needs OR-Tools: pip install 'canzona[ilp]'"

Owners = tuple[tuple[int, ...], ...]


class SolverUnavailable(PlanError):
    """OR-Tools cannot be imported, so the ILP refinement cannot run."""

    def __init__(self, message: str = UNAVAILABLE) -> None:
        super().__init__(message)


@dataclass(frozen=True)
class SolverReport:
    """What one CP-SAT refinement did.

    `objective` is the returned answer's objective in the instance's float cost units (the
    max rank load, or one micro-group's makespan); `bound` is a lower bound on the optimum in
    the same units (>= 0). `seconds` is wall time, for information only: it differs between
    runs, so callers must keep it out of anything that has to be deterministic. `accepted` is
    True only when the solver's answer replaced the hint.
    """

    status: str
    objective: float
    bound: float
    seconds: float
    accepted: bool


def _cp_model() -> Any:
    """The `ortools.sat.python.cp_model` module, imported on first use."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise SolverUnavailable() from None
    return cp_model


def _check_limits(time_limit: float, seed: int) -> None:
    if not 0.0 < time_limit < float("inf"):
        raise PlanError(f"solver time limit must be a positive number of seconds, got {time_limit}")
    if not 0 <= seed < 2**31:
        raise PlanError(f"solver seed must be in [0, 2^31), got {seed}")


def _check_costs(costs: list[float] | tuple[float, ...]) -> None:
    if any(not 0.0 <= cost < float("inf") for cost in costs):
        raise PlanError("solver costs must be finite and non-negative")


def _scaled(costs: list[float]) -> tuple[list[int], float]:
    """Integer costs for a model, and the float value of one integer unit."""
    largest = max(costs, default=0.0)
    if largest == 0.0:
        return [0] * len(costs), 0.0
    return [round(cost * SCALE / largest) for cost in costs], largest / SCALE


def _solve(model: Any, time_limit: float, seed: int) -> tuple[Any, str, float]:
    """Run CP-SAT deterministically; the solver, its status name and the wall seconds."""
    cp_model = _cp_model()
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = time_limit
    # One complete search (for proofs of optimality) interleaved with CP-SAT's large
    # neighbourhood searches, all on one thread in a fixed order: deterministic. The default
    # single-worker search alone rarely improves a good hint on a large instance.
    solver.parameters.interleave_search = True
    solver.parameters.subsolvers.append("default_lp")
    # This presolve step costs more deterministic time than a short budget has on these
    # models (every load row overlaps its neighbours) and found nothing useful in trials.
    solver.parameters.find_big_linear_overlap = False
    # Only a safety net: hitting it makes the answer depend on machine speed.
    solver.parameters.max_time_in_seconds = WALL_FACTOR * time_limit + WALL_SLACK
    solver.parameters.log_search_progress = False
    start = time.perf_counter()
    status = _interruptible(solver, model)
    return solver, solver.StatusName(status), time.perf_counter() - start


def _interruptible(solver: Any, model: Any) -> int:
    """`solver.Solve(model)` on a worker thread while this thread waits in Python, so that a
    signal (SIGINT, SIGTERM, check's deadline) is handled at once: its exception stops the
    search (CP-SAT's StopSearch is thread-safe) and propagates once the solve has returned,
    within moments instead of after the budget. The search itself is unchanged (one worker,
    seeded). An Event, not Thread.join, is waited on: a join interrupted by an exception may
    return before its thread ends, and a process leaving CP-SAT running aborts at exit."""
    result: list[int] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def solve() -> None:
        try:
            result.append(solver.Solve(model))
        except BaseException as error:
            failure.append(error)
        finally:
            done.set()

    worker = threading.Thread(target=solve, name="canzona-cp-sat", daemon=True)
    worker.start()
    try:
        while not done.wait(POLL_SECONDS):
            pass
    except BaseException:
        solver.StopSearch()
        _wait_out(done)
        raise
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


def _wait_out(done: threading.Event) -> None:
    """Wait until the stopped solve has returned, whatever further signals arrive meanwhile
    (the first one's exception is already on its way)."""
    while True:
        try:
            if done.wait(POLL_SECONDS):
                return
        except BaseException:
            continue


def _solved(status: str) -> bool:
    return status in ("OPTIMAL", "FEASIBLE")


def _float_bound(solver: Any, status: str, unit: float, items: int) -> float:
    """CP-SAT's objective bound in float units, lowered by the worst rounding error."""
    if status not in ("OPTIMAL", "FEASIBLE", "UNKNOWN"):
        return 0.0
    return max(0.0, (solver.BestObjectiveBound() - 0.5 * items) * unit)


# --- DP: owners of every item, non-decreasing along each bucket -------------------------------


def _dp_problem(instance: DpInstance, caps: tuple[int, ...], owners: Owners) -> str | None:
    """Why `owners` is not a valid answer for `instance` under `caps`, or None if it is."""
    if len(caps) != len(instance.costs) or len(owners) != len(instance.costs):
        return f"expected {len(instance.costs)} buckets of caps and owners"
    for bucket, (spans, cap, row) in enumerate(zip(instance.spans, caps, owners)):
        if len(row) != len(spans):
            return f"bucket {bucket} has {len(spans)} items but {len(row)} owners"
        slices = [0] * instance.num_ranks
        previous = 0
        for owner, span in zip(row, spans):
            if not previous <= owner < instance.num_ranks:
                return f"bucket {bucket}: owners must be non-decreasing ranks in [0, {instance.num_ranks})"
            slices[owner] += span
            previous = owner
        if slices and max(slices) > cap:
            return f"bucket {bucket}: a slice of {max(slices)} elements exceeds the cap {cap}"
    return None


def _dp_windows(instance: DpInstance, owners: Owners) -> list[list[tuple[int, int]]] | None:
    """Per item, the ranks [low, high] the model may give it; None when the model is too big.

    Small instances get every rank. Larger ones get a window of the same half-width around
    each hint owner, as wide as FULL_MODEL_PAIRS allows (at least one rank either side): the
    solver then improves the hint locally. Windows of non-decreasing owners have
    non-decreasing ends, which the order encoding relies on.
    """
    ranks = instance.num_ranks
    items = sum(len(row) for row in owners)
    if items * ranks <= FULL_MODEL_PAIRS:
        return [[(0, ranks - 1)] * len(row) for row in owners]
    half = max(1, (FULL_MODEL_PAIRS // items - 1) // 2)
    windows = [[(max(0, o - half), min(ranks - 1, o + half)) for o in row] for row in owners]
    if sum(high - low + 1 for row in windows for low, high in row) > MAX_MODEL_PAIRS:
        return None
    return windows


class _OrderEncoding:
    """Owner of every item as `low + Σ_r at_least[r]`, with at_least[r] ⇔ owner ≥ r.

    `at_least(b, i, r)` is a Boolean variable inside the item's window and the constant 1
    below it, 0 above it. "Owner = r" is then at_least(r) − at_least(r + 1), and owners that
    never decrease along a bucket are the clauses at_least(i, r) ⇒ at_least(i + 1, r).
    """

    def __init__(self, model: Any, windows: list[list[tuple[int, int]]], owners: Owners) -> None:
        self.windows = windows
        self.vars: list[list[list[Any]]] = []
        for bucket, row in enumerate(windows):
            bucket_vars = []
            for index, (low, high) in enumerate(row):
                hint = owners[bucket][index]
                item_vars = [model.NewBoolVar(f"o{bucket}_{index}_{r}") for r in range(low + 1, high + 1)]
                for r, var in zip(range(low + 1, high + 1), item_vars):
                    model.AddHint(var, hint >= r)
                for higher, lower in zip(item_vars[1:], item_vars):
                    model.AddImplication(higher, lower)
                bucket_vars.append(item_vars)
            self.vars.append(bucket_vars)

    def at_least(self, bucket: int, index: int, rank: int) -> Any:
        low, high = self.windows[bucket][index]
        if rank <= low:
            return 1
        if rank > high:
            return 0
        return self.vars[bucket][index][rank - low - 1]

    def monotone(self, model: Any) -> None:
        """Owners never decrease along a bucket."""
        for bucket, row in enumerate(self.vars):
            for index in range(len(row) - 1):
                low, high = self.windows[bucket][index + 1]
                for rank in range(low + 1, high + 1):
                    here = self.at_least(bucket, index, rank)
                    if not isinstance(here, int):
                        model.AddImplication(here, self.vars[bucket][index + 1][rank - low - 1])

    def owner(self, solver: Any, bucket: int, index: int) -> int:
        low = self.windows[bucket][index][0]
        return low + sum(int(solver.BooleanValue(var)) for var in self.vars[bucket][index])


def _dp_scaled(instance: DpInstance) -> tuple[list[list[int]], list[int], float]:
    """Integer item costs per bucket, integer base loads per rank, and one unit's float value."""
    base = instance.initial_loads()
    flat, unit = _scaled([cost for row in instance.costs for cost in row] + base)
    costs, start = [], 0
    for row in instance.costs:
        costs.append(flat[start : start + len(row)])
        start += len(row)
    return costs, flat[start:], unit


def _dp_model(
    instance: DpInstance, caps: tuple[int, ...], owners: Owners, windows: list[list[tuple[int, int]]]
) -> tuple[Any, _OrderEncoding]:
    """The CP-SAT model: minimise the largest rank load, hint = `owners`, never above it."""
    model = _cp_model().CpModel()
    encoding = _OrderEncoding(model, windows, owners)
    encoding.monotone(model)
    costs, base, _ = _dp_scaled(instance)
    ranks = instance.num_ranks
    loads: list[list[tuple[Any, int]]] = [[] for _ in range(ranks)]
    for bucket, row in enumerate(windows):
        slices: list[list[tuple[Any, int]]] = [[] for _ in range(ranks)]
        for index, (low, high) in enumerate(row):
            for rank in range(low, high + 1):
                is_owner = encoding.at_least(bucket, index, rank) - encoding.at_least(bucket, index, rank + 1)
                loads[rank].append((is_owner, costs[bucket][index]))
                slices[rank].append((is_owner, instance.spans[bucket][index]))
        for rank_slice in slices:
            # Skipped when every item that could land on the rank fits anyway.
            if sum(span for _, span in rank_slice) > caps[bucket]:
                model.Add(sum(span * term for term, span in rank_slice) <= caps[bucket])
    hint_loads = list(base)
    for bucket, bucket_owners in enumerate(owners):
        for index, owner in enumerate(bucket_owners):
            hint_loads[owner] += costs[bucket][index]
    largest = max((cost for row in costs for cost in row), default=0)
    floor = max(max(base), largest + min(base), -(-(sum(map(sum, costs)) + sum(base)) // ranks))
    max_load = model.NewIntVar(min(floor, max(hint_loads)), max(hint_loads), "max_load")
    model.AddHint(max_load, max(hint_loads))
    for rank, terms in enumerate(loads):
        model.Add(base[rank] + sum(cost * term for term, cost in terms) <= max_load)
    model.Minimize(max_load)
    return model, encoding


def refine_dp(
    instance: DpInstance, caps: tuple[int, ...], owners: Owners, *, time_limit: float, seed: int
) -> tuple[Owners, SolverReport]:
    """Owners with a max rank load no worse than `owners` (the greedy answer), via CP-SAT.

    Constraints: every item has one owner in [0, D); owners never decrease along a bucket;
    every rank's slice of bucket b (sum of its items' spans) is at most caps[b]. `owners` must
    satisfy them (PlanError otherwise); it is the solver's full hint and upper bound.

    Model size: with at most FULL_MODEL_PAIRS (item, rank) pairs every item may go to every
    rank, OPTIMAL is a proof, and the bound is the larger of CP-SAT's and `lower_bound`.
    Above that each item is restricted to a window of ranks around its hint owner
    (FULL_MODEL_PAIRS in all, at least ±1 rank): the search is then local, so OPTIMAL is
    reported as FEASIBLE and the bound is `lower_bound(instance)`. A window model with more
    than MAX_MODEL_PAIRS pairs is not built: the hint comes back with status UNKNOWN. A hint
    already at `lower_bound` comes back as OPTIMAL without solving. Base loads count.

    Deterministic for fixed inputs (single worker, `seed`, deterministic time `time_limit`)
    unless the wall-clock safety net (10·time_limit + 5 s) is hit. Wall time is about 1.5-2×
    `time_limit` on models of a few thousand pairs; near MAX_MODEL_PAIRS, building the model
    and presolve steps CP-SAT does not count add several seconds.
    """
    _cp_model()  # fail early and alike on every instance when OR-Tools is missing
    _check_limits(time_limit, seed)
    _check_costs([cost for row in instance.costs for cost in row] + instance.initial_loads())
    problem = _dp_problem(instance, caps, owners)
    if problem is not None:
        raise PlanError(f"refine_dp: the greedy hint is invalid: {problem}")
    owners = tuple(tuple(row) for row in owners)
    hint_max = max(rank_loads(instance, owners))
    floor = lower_bound(instance)
    if hint_max <= floor:
        return owners, SolverReport("OPTIMAL", hint_max, hint_max, 0.0, False)
    windows = _dp_windows(instance, owners)
    if windows is None:
        return owners, SolverReport("UNKNOWN", hint_max, floor, 0.0, False)
    full = all(window == (0, instance.num_ranks - 1) for row in windows for window in row)
    model, encoding = _dp_model(instance, caps, owners, windows)
    solver, status, seconds = _solve(model, time_limit, seed)
    # A rank's load sums at most every item and its base load, each rounded.
    rounded = sum(len(row) for row in owners) + 1
    bound = max(floor, _float_bound(solver, status, _dp_scaled(instance)[2], rounded)) if full else floor
    if not full and status == "OPTIMAL":
        status = "FEASIBLE"
    bound = min(bound, hint_max)
    if _solved(status):
        found = tuple(tuple(encoding.owner(solver, b, i) for i in range(len(row))) for b, row in enumerate(owners))
        found_max = max(rank_loads(instance, found))
        if _dp_problem(instance, caps, found) is None and found_max < hint_max:
            return found, SolverReport(status, found_max, min(bound, found_max), seconds, True)
    return owners, SolverReport(status, hint_max, bound, seconds, False)


# --- TP: one micro-group's tasks on hosts ------------------------------------------------------


def _host_loads(values: tuple[float, ...] | tuple[int, ...], hosts: tuple[int, ...], num_hosts: int) -> list[Any]:
    loads: list[Any] = [0] * num_hosts
    for value, host in zip(values, hosts):
        loads[host] += value
    return loads


def _check_hosts(
    costs: tuple[float, ...], sizes: tuple[int, ...], hosts: tuple[int, ...], num_hosts: int, capacity: int
) -> None:
    if num_hosts < 1:
        raise PlanError(f"refine_hosts: need at least one host, got {num_hosts}")
    if not len(costs) == len(sizes) == len(hosts):
        raise PlanError("refine_hosts: costs, sizes and hosts must have one entry per task")
    _check_costs(costs)
    if any(not isinstance(size, int) or size < 0 for size in (*sizes, capacity)):
        raise PlanError("refine_hosts: task sizes and the capacity must be non-negative integers")
    if any(not 0 <= host < num_hosts for host in hosts):
        raise PlanError(f"refine_hosts: the greedy hint is invalid: hosts must be in [0, {num_hosts})")


def _hosts_model(
    costs: list[int], sizes: tuple[int, ...], hosts: tuple[int, ...], num_hosts: int, limit: int
) -> tuple[Any, list[list[Any]]]:
    """The CP-SAT model: minimise the makespan, hint = `hosts`, never above it."""
    cp_model = _cp_model()
    model = cp_model.CpModel()
    on = [[model.NewBoolVar(f"t{task}_h{host}") for host in range(num_hosts)] for task in range(len(costs))]
    for task, row in enumerate(on):
        model.AddExactlyOne(row)
        for host, var in enumerate(row):
            model.AddHint(var, hosts[task] == host)
    hint_loads = _host_loads(tuple(costs), hosts, num_hosts)
    floor = max(max(costs), -(-sum(costs) // num_hosts))
    makespan = model.NewIntVar(min(floor, max(hint_loads)), max(hint_loads), "makespan")
    model.AddHint(makespan, max(hint_loads))
    for host in range(num_hosts):
        column = [row[host] for row in on]
        model.Add(sum(cost * var for cost, var in zip(costs, column)) <= makespan)
        if sum(sizes) > limit:
            model.Add(sum(size * var for size, var in zip(sizes, column)) <= limit)
    model.Minimize(makespan)
    return model, on


def refine_hosts(
    costs: tuple[float, ...],
    sizes: tuple[int, ...],
    hosts: tuple[int, ...],
    num_hosts: int,
    capacity: int,
    *,
    time_limit: float,
    seed: int,
) -> tuple[tuple[int, ...], SolverReport]:
    """Hosts for one micro-group's tasks with a makespan no worse than `hosts` (the greedy one).

    Minimises the largest per-host summed cost subject to every host's summed bytes staying
    within `capacity`, or within the hint's largest host bytes when the hint already exceeds
    it (a single oversize task, say). Same hint, acceptance and determinism rules as
    `refine_dp`; a model with more than MAX_MODEL_PAIRS (task, host) pairs is not built and
    the hint comes back with status UNKNOWN.
    """
    _cp_model()
    _check_limits(time_limit, seed)
    _check_hosts(costs, sizes, hosts, num_hosts, capacity)
    hosts = tuple(hosts)
    hint_max = max(_host_loads(costs, hosts, num_hosts), default=0.0)
    floor = max(max(costs, default=0.0), sum(costs) / num_hosts)
    if hint_max <= floor:
        return hosts, SolverReport("OPTIMAL", hint_max, hint_max, 0.0, False)
    if len(costs) * num_hosts > MAX_MODEL_PAIRS:
        return hosts, SolverReport("UNKNOWN", hint_max, floor, 0.0, False)
    limit = max(capacity, max(_host_loads(sizes, hosts, num_hosts)))
    scaled, unit = _scaled(list(costs))
    model, on = _hosts_model(scaled, sizes, hosts, num_hosts, limit)
    solver, status, seconds = _solve(model, time_limit, seed)
    bound = min(max(floor, _float_bound(solver, status, unit, len(costs))), hint_max)
    if _solved(status):
        found = tuple(next(h for h, var in enumerate(row) if solver.BooleanValue(var)) for row in on)
        found_max = max(_host_loads(costs, found, num_hosts))
        valid = max(_host_loads(sizes, found, num_hosts)) <= limit
        if valid and found_max < hint_max:
            return found, SolverReport(status, found_max, min(bound, found_max), seconds, True)
    return hosts, SolverReport(status, hint_max, bound, seconds, False)
