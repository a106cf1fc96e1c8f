"""Optional CP-SAT refinement: exactness, never worse, determinism, no ortools."""

from __future__ import annotations

import builtins
import itertools
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("ortools")

from canzona.planner.partition import ilp
from canzona.planner.partition.dp import DpInstance, lower_bound, partition, rank_loads, slice_caps
from canzona.planner.partition.ilp import SolverReport, SolverUnavailable, refine_dp, refine_hosts
from canzona.planner.spec import PlanError

Owners = tuple[tuple[int, ...], ...]
ALPHAS = (0.0, 0.5, 1.0)
EXACT_LIMIT = 5.0  # deterministic seconds; the small models are solved to optimality long before


def make_instance(costs, spans, num_ranks: int, base_loads=()) -> DpInstance:
    costs = tuple(tuple(float(c) for c in bucket) for bucket in costs)
    spans = tuple(tuple(int(s) for s in bucket) for bucket in spans)
    names = tuple(tuple(f"b{b}.p{i}" for i in range(len(bucket))) for b, bucket in enumerate(costs))
    return DpInstance(costs, spans, names, num_ranks, tuple(float(b) for b in base_loads))


def random_instance(rng: random.Random, max_items: int = 7, min_ranks: int = 1, min_items: int = 1) -> DpInstance:
    """≤ 3 buckets, D ≤ 4, costs 1..20, spans 1..6; base loads three times in ten."""
    num_buckets, num_ranks = rng.randint(1, 3), rng.randint(min_ranks, 4)
    sizes = [1] * num_buckets
    for _ in range(rng.randint(max(num_buckets, min_items), max_items) - num_buckets):
        sizes[rng.randrange(num_buckets)] += 1
    costs = [[rng.randint(1, 20) for _ in range(size)] for size in sizes]
    spans = [[rng.randint(1, 6) for _ in range(size)] for size in sizes]
    base = [rng.randint(0, 15) for _ in range(num_ranks)] if rng.random() < 0.3 else []
    return make_instance(costs, spans, num_ranks, base)


def valid_owners(instance: DpInstance, caps: tuple[int, ...]) -> Iterator[Owners]:
    """Every assignment with non-decreasing owners and slices within the caps."""
    per_bucket = []
    for spans, cap in zip(instance.spans, caps):
        options = []
        for owners in itertools.combinations_with_replacement(range(instance.num_ranks), len(spans)):
            slices = [0] * instance.num_ranks
            for owner, span in zip(owners, spans):
                slices[owner] += span
            if max(slices) <= cap:
                options.append(owners)
        per_bucket.append(options)
    return itertools.product(*per_bucket)


def max_load(instance: DpInstance, owners: Owners) -> float:
    return max(rank_loads(instance, owners))


def assert_valid(instance: DpInstance, caps: tuple[int, ...], owners: Owners) -> None:
    for spans, cap, row in zip(instance.spans, caps, owners):
        assert list(row) == sorted(row) and all(0 <= o < instance.num_ranks for o in row)
        slices = [0] * instance.num_ranks
        for owner, span in zip(row, spans):
            slices[owner] += span
        assert max(slices, default=0) <= cap


def assert_report(report: SolverReport, objective: float) -> None:
    assert report.objective == objective
    assert 0.0 <= report.bound <= report.objective
    assert report.status in ("OPTIMAL", "FEASIBLE", "UNKNOWN")


def dp_cases() -> Iterator[tuple[DpInstance, float]]:
    rng = random.Random(31)
    for _ in range(14):
        yield random_instance(rng, min_ranks=2, min_items=5), rng.choice(ALPHAS)


# ---------------------------------------------------------------------------------------------
# DP: exact on small instances


@pytest.mark.parametrize(("instance", "alpha"), list(dp_cases()))
def test_dp_reaches_the_brute_force_optimum(instance: DpInstance, alpha: float) -> None:
    caps = slice_caps(instance, alpha)
    assignments = list(valid_owners(instance, caps))
    optimum = min(max_load(instance, owners) for owners in assignments)
    worst = max(assignments, key=lambda owners: (max_load(instance, owners), owners))
    owners, report = refine_dp(instance, caps, worst, time_limit=EXACT_LIMIT, seed=0)
    assert_valid(instance, caps, owners)
    assert report.status == "OPTIMAL"
    assert max_load(instance, owners) == pytest.approx(optimum, rel=1e-12)
    assert report.bound == pytest.approx(optimum, rel=1e-5)
    assert report.accepted == (max_load(instance, worst) > optimum)
    assert_report(report, max_load(instance, owners))


def test_dp_fixes_the_known_local_search_stall() -> None:
    # From test_dp.py: the greedy's local search stops at 17; the optimum is the lower bound 11.
    instance = make_instance([[7, 11], [1, 9, 2]], [[1, 2], [1, 1, 3]], 3)
    caps = slice_caps(instance, 0.0)
    owners, report = refine_dp(instance, caps, ((0, 1), (0, 0, 1)), time_limit=EXACT_LIMIT, seed=0)
    assert max_load(instance, owners) == 11.0 == lower_bound(instance)
    assert report.accepted and report.status == "OPTIMAL"
    assert_valid(instance, caps, owners)


def test_dp_bad_hint_is_improved_and_accepted() -> None:
    rng = random.Random(5)
    costs = [[rng.randint(1, 50) for _ in range(10)] for _ in range(4)]
    instance = make_instance(costs, [[rng.randint(1, 9) for _ in range(10)] for _ in range(4)], 4)
    caps = slice_caps(instance, 1.0)  # α = 1: a rank may take a whole bucket
    hint = tuple((0,) * 10 for _ in range(4))
    owners, report = refine_dp(instance, caps, hint, time_limit=2.0, seed=0)
    assert report.accepted and owners != hint
    assert max_load(instance, owners) < max_load(instance, hint)
    assert_valid(instance, caps, owners)
    assert_report(report, max_load(instance, owners))


def test_dp_hint_at_the_lower_bound_is_returned_without_solving() -> None:
    instance = make_instance([[3, 3], [3, 3]], [[1, 1], [1, 1]], 2)
    hint = ((0, 1), (0, 1))
    owners, report = refine_dp(instance, slice_caps(instance, 1.0), hint, time_limit=1.0, seed=0)
    assert owners == hint and report == SolverReport("OPTIMAL", 6.0, 6.0, 0.0, False)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(0, 10**6), st.sampled_from(ALPHAS))
def test_dp_never_worse_than_the_greedy_hint(instance_seed: int, alpha: float) -> None:
    instance = random_instance(random.Random(instance_seed), max_items=12)
    caps = slice_caps(instance, alpha)
    hint = partition(instance, alpha).owners
    owners, report = refine_dp(instance, caps, hint, time_limit=0.2, seed=1)
    assert_valid(instance, caps, owners)
    assert max_load(instance, owners) <= max_load(instance, hint)
    assert report.accepted == (owners != hint)
    if report.accepted:
        assert max_load(instance, owners) < max_load(instance, hint)
    assert_report(report, max_load(instance, owners))


def layered_instance(num_items: int, num_ranks: int, num_buckets: int, seed: int) -> DpInstance:
    rng = random.Random(seed)
    sizes = [num_items // num_buckets + (b < num_items % num_buckets) for b in range(num_buckets)]
    costs = [[rng.choice((1, 4, 9, 16, 33, 50)) * rng.uniform(0.9, 1.1) for _ in range(k)] for k in sizes]
    spans = [[rng.randint(1, 100) for _ in range(k)] for k in sizes]
    return make_instance(costs, spans, num_ranks)


def test_dp_same_seed_same_answer() -> None:
    # Large enough that the budget, not a proof, ends the search.
    instance = layered_instance(120, 8, 12, seed=2)
    caps = slice_caps(instance, 0.3)
    hint = partition(instance, 0.3).owners
    first = refine_dp(instance, caps, hint, time_limit=0.3, seed=7)
    second = refine_dp(instance, caps, hint, time_limit=0.3, seed=7)
    assert first[0] == second[0]
    assert repr(first[1].objective) == repr(second[1].objective)
    assert (first[1].status, first[1].bound, first[1].accepted) == (
        second[1].status,
        second[1].bound,
        second[1].accepted,
    )


def test_dp_large_instance_respects_its_budget() -> None:
    instance = layered_instance(300, 16, 40, seed=0)
    caps = slice_caps(instance, 0.3)
    hint = partition(instance, 0.3).owners
    time_limit = 1.0
    owners, report = refine_dp(instance, caps, hint, time_limit=time_limit, seed=0)
    # The budget is deterministic time (~1.5-2 wall seconds here on an idle core); wall time
    # depends on machine load, so only the solver's own wall-clock safety net is asserted.
    assert report.status in ("OPTIMAL", "FEASIBLE")
    assert 0.0 < report.seconds <= ilp.WALL_FACTOR * time_limit + ilp.WALL_SLACK
    assert_valid(instance, caps, owners)
    assert max_load(instance, owners) <= max_load(instance, hint)
    assert lower_bound(instance) * (1 - 1e-9) <= report.bound <= report.objective
    assert_report(report, max_load(instance, owners))


def test_dp_window_model_is_local_and_never_worse(monkeypatch: pytest.MonkeyPatch) -> None:
    instance = layered_instance(40, 6, 4, seed=3)
    caps = slice_caps(instance, 1.0)
    hint = tuple(tuple(sorted(o % 6 for o in range(len(row)))) for row in instance.costs)
    monkeypatch.setattr(ilp, "FULL_MODEL_PAIRS", 100)  # forces a ±1 window around each owner
    owners, report = refine_dp(instance, caps, hint, time_limit=1.0, seed=0)
    assert_valid(instance, caps, owners)
    assert all(abs(o - h) <= 1 for row, hint_row in zip(owners, hint) for o, h in zip(row, hint_row))
    assert report.status != "OPTIMAL" and report.bound == lower_bound(instance)
    assert max_load(instance, owners) <= max_load(instance, hint)
    monkeypatch.setattr(ilp, "MAX_MODEL_PAIRS", 100)
    assert refine_dp(instance, caps, hint, time_limit=1.0, seed=0) == (
        hint,
        SolverReport("UNKNOWN", max_load(instance, hint), lower_bound(instance), 0.0, False),
    )


def test_dp_rejects_bad_arguments() -> None:
    instance = make_instance([[1, 2, 3]], [[1, 1, 1]], 2)
    caps = slice_caps(instance, 1.0)
    with pytest.raises(PlanError, match="time limit"):
        refine_dp(instance, caps, ((0, 0, 1),), time_limit=0.0, seed=0)
    with pytest.raises(PlanError, match="time limit"):
        refine_dp(instance, caps, ((0, 0, 1),), time_limit=float("nan"), seed=0)
    with pytest.raises(PlanError, match="non-decreasing"):
        refine_dp(instance, caps, ((1, 0, 1),), time_limit=1.0, seed=0)
    with pytest.raises(PlanError, match="exceeds the cap"):
        refine_dp(instance, (1,), ((0, 0, 1),), time_limit=1.0, seed=0)


# ---------------------------------------------------------------------------------------------
# TP hosts


def host_loads(values, hosts, num_hosts: int) -> list:
    loads = [0] * num_hosts
    for value, host in zip(values, hosts):
        loads[host] += value
    return loads


def host_cases() -> Iterator[tuple[tuple[float, ...], tuple[int, ...], int, int]]:
    rng = random.Random(11)
    for _ in range(10):
        count, num_hosts = rng.randint(1, 7), rng.randint(1, 3)
        sizes = tuple(rng.randint(1, 10) for _ in range(count))
        capacity = rng.randint(max(sizes), sum(sizes))
        yield tuple(float(rng.randint(1, 30)) for _ in range(count)), sizes, num_hosts, capacity


@pytest.mark.parametrize(("costs", "sizes", "num_hosts", "capacity"), list(host_cases()))
def test_hosts_reach_the_brute_force_optimum(costs, sizes, num_hosts: int, capacity: int) -> None:
    every = list(itertools.product(range(num_hosts), repeat=len(costs)))
    fits = [h for h in every if max(host_loads(sizes, h, num_hosts)) <= capacity]
    # When nothing fits, the hint's own largest host bytes become the limit.
    worst = max(fits or every, key=lambda h: (max(host_loads(costs, h, num_hosts)), h))
    limit = max(capacity, max(host_loads(sizes, worst, num_hosts)))
    feasible = [h for h in every if max(host_loads(sizes, h, num_hosts)) <= limit]
    optimum = min(max(host_loads(costs, h, num_hosts)) for h in feasible)
    hosts, report = refine_hosts(costs, sizes, worst, num_hosts, capacity, time_limit=EXACT_LIMIT, seed=0)
    assert max(host_loads(sizes, hosts, num_hosts)) <= limit
    assert report.status == "OPTIMAL"
    assert max(host_loads(costs, hosts, num_hosts)) == optimum
    assert_report(report, optimum)


def test_hosts_oversize_hint_sets_the_limit() -> None:
    # One task alone exceeds the capacity: the limit becomes the hint's largest host bytes.
    costs, sizes = (10.0, 4.0, 3.0, 3.0), (50, 5, 5, 5)
    hosts, report = refine_hosts(costs, sizes, (0, 1, 1, 1), 2, 20, time_limit=EXACT_LIMIT, seed=0)
    assert report.status == "OPTIMAL" and report.objective == 10.0 and not report.accepted
    hosts, report = refine_hosts(costs, sizes, (0, 0, 1, 1), 2, 20, time_limit=EXACT_LIMIT, seed=0)
    assert report.accepted and report.objective == 10.0 and hosts[0] not in hosts[1:]


def test_hosts_bad_hint_is_improved_and_accepted() -> None:
    rng = random.Random(3)
    costs = tuple(rng.uniform(1, 100) for _ in range(24))
    sizes = tuple(rng.randint(1, 100) for _ in range(24))
    hint = (0,) * 24
    hosts, report = refine_hosts(costs, sizes, hint, 4, sum(sizes), time_limit=0.5, seed=0)
    assert report.accepted and report.objective < sum(costs) / 2
    assert report.objective == max(host_loads(costs, hosts, 4))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.floats(0.0, 100.0), st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(1, 200),
)
def test_hosts_never_worse_than_the_hint(tasks, num_hosts: int, capacity: int) -> None:
    costs = tuple(c for c, _, _ in tasks)
    sizes = tuple(s for _, s, _ in tasks)
    hint = tuple(h % num_hosts for _, _, h in tasks)
    limit = max(capacity, max(host_loads(sizes, hint, num_hosts)))
    hosts, report = refine_hosts(costs, sizes, hint, num_hosts, capacity, time_limit=0.2, seed=1)
    assert max(host_loads(sizes, hosts, num_hosts)) <= limit
    assert max(host_loads(costs, hosts, num_hosts)) <= max(host_loads(costs, hint, num_hosts))
    assert report.accepted == (hosts != hint)
    assert_report(report, max(host_loads(costs, hosts, num_hosts)))


def test_hosts_same_seed_same_answer() -> None:
    rng = random.Random(8)
    costs = tuple(rng.uniform(1, 100) for _ in range(40))
    sizes = tuple(rng.randint(1, 100) for _ in range(40))
    hint = tuple(i % 8 for i in range(40))
    runs = [refine_hosts(costs, sizes, hint, 8, 700, time_limit=0.3, seed=4) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    assert repr(runs[0][1].objective) == repr(runs[1][1].objective)
    assert (runs[0][1].status, runs[0][1].bound) == (runs[1][1].status, runs[1][1].bound)


def test_hosts_reject_bad_arguments() -> None:
    with pytest.raises(PlanError, match="time limit"):
        refine_hosts((1.0,), (1,), (0,), 1, 1, time_limit=-1.0, seed=0)
    with pytest.raises(PlanError, match=r"\[0, 2\)"):
        refine_hosts((1.0,), (1,), (2,), 2, 1, time_limit=1.0, seed=0)
    with pytest.raises(PlanError, match="one entry per task"):
        refine_hosts((1.0, 2.0), (1,), (0,), 2, 1, time_limit=1.0, seed=0)
    with pytest.raises(PlanError, match="non-negative"):
        refine_hosts((-1.0,), (1,), (0,), 2, 1, time_limit=1.0, seed=0)
    with pytest.raises(PlanError, match="integers"):
        refine_hosts((1.0,), (1.5,), (0,), 2, 1, time_limit=1.0, seed=0)
    with pytest.raises(PlanError, match="seed"):
        refine_hosts((1.0,), (1,), (0,), 2, 1, time_limit=1.0, seed=-1)


# ---------------------------------------------------------------------------------------------
# Without ortools


def _refine_both() -> None:
    instance = make_instance([[3, 1]], [[1, 1]], 2)
    with pytest.raises(SolverUnavailable) as dp_error:
        refine_dp(instance, slice_caps(instance, 1.0), ((0, 1),), time_limit=1.0, seed=0)
    with pytest.raises(SolverUnavailable) as hosts_error:
        refine_hosts((1.0,), (1,), (0,), 1, 1, time_limit=1.0, seed=0)
    for error in (dp_error, hosts_error):
        message = str(error.value)
        assert message == "--solver ilp needs OR-Tools: pip install 'canzona[ilp]'"
        assert "\n" not in message and isinstance(error.value, PlanError)


def test_solver_unavailable_when_import_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_ortools(name: str, *args, **kwargs):
        if name == "ortools" or name.startswith("ortools."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ortools)
    _refine_both()


def test_solver_unavailable_when_ortools_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name == "ortools" or name.startswith("ortools.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "ortools", None)
    _refine_both()


def test_importing_the_module_does_not_import_ortools() -> None:
    code = "import sys, canzona.planner.partition.ilp; assert not any(m.startswith('ortools') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
