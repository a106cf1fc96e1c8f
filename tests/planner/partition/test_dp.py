"""α-balanced static DP partitioning: exactness, α caps, and invariants."""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner.partition.dp import (
    ALPHA_LADDER,
    DpAssignment,
    DpInstance,
    feasible,
    lower_bound,
    min_max_slice,
    partition,
    polished,
    polished_lpt,
    rank_loads,
    slice_caps,
)
from canzona.planner.partition.layout import owners_to_cuts
from canzona.planner.spec import PlanError

Owners = tuple[tuple[int, ...], ...]


def make_instance(costs, spans, num_ranks: int) -> DpInstance:
    costs = tuple(tuple(float(c) for c in bucket) for bucket in costs)
    spans = tuple(tuple(int(s) for s in bucket) for bucket in spans)
    names = tuple(tuple(f"b{b}.p{i}" for i in range(len(bucket))) for b, bucket in enumerate(costs))
    return DpInstance(costs, spans, names, num_ranks)


def monotone_owners(count: int, num_ranks: int) -> Iterator[tuple[int, ...]]:
    """Every non-decreasing owner sequence of `count` items over ranks [0, num_ranks)."""
    return itertools.combinations_with_replacement(range(num_ranks), count)


def slices_of(owners: tuple[int, ...], spans: tuple[int, ...], num_ranks: int) -> list[int]:
    slices = [0] * num_ranks
    for owner, span in zip(owners, spans):
        slices[owner] += span
    return slices


def brute_force_optimum(instance: DpInstance, caps: tuple[int, ...]) -> float:
    """Smallest max load over every valid assignment whose slices respect `caps`."""
    choices = []
    for spans, cap in zip(instance.spans, caps):
        options = [
            owners
            for owners in monotone_owners(len(spans), instance.num_ranks)
            if max(slices_of(owners, spans, instance.num_ranks)) <= cap
        ]
        assert options, "caps must leave some feasible assignment"
        choices.append(options)
    return min(max(rank_loads(instance, combo)) for combo in itertools.product(*choices))


def brute_force_min_max_slice(spans: tuple[int, ...], num_ranks: int) -> int:
    return min(max(slices_of(o, spans, num_ranks)) for o in monotone_owners(len(spans), num_ranks))


def max_load(instance: DpInstance, owners: Owners) -> float:
    return max(rank_loads(instance, owners))


def random_small_instance(rng: random.Random, num_buckets: int) -> DpInstance:
    num_ranks = rng.randint(1, 4)
    num_items = rng.randint(num_buckets, 7)
    sizes = [1] * num_buckets
    for _ in range(num_items - num_buckets):
        sizes[rng.randrange(num_buckets)] += 1
    costs = [[rng.randint(1, 20) for _ in range(size)] for size in sizes]
    spans = [[rng.randint(1, 6) for _ in range(size)] for size in sizes]
    return make_instance(costs, spans, num_ranks)


ALPHAS = (0.0, 0.5, 1.0)

# ---------------------------------------------------------------------------------------------
# Exact small cases against brute force


def test_one_bucket_is_exact_against_brute_force() -> None:
    rng = random.Random(20240501)
    for _ in range(250):
        instance = random_small_instance(rng, 1)
        for alpha in ALPHAS:
            optimum = brute_force_optimum(instance, slice_caps(instance, alpha))
            got = max_load(instance, partition(instance, alpha).owners)
            assert got == pytest.approx(optimum, rel=1e-9), (instance, alpha)


def test_one_bucket_hand_example() -> None:
    # Costs 5, 1, 1, 1, 5 over 2 ranks: best split is [5, 1, 1 | 1, 5] → 7.
    instance = make_instance([[5, 1, 1, 1, 5]], [[1] * 5], 2)
    result = partition(instance, 1.0)
    assert max_load(instance, result.owners) == 7.0
    assert sorted(rank_loads(instance, result.owners)) == [6.0, 7.0]
    assert lower_bound(instance) == 6.5


def _several_bucket_cases() -> Iterator[tuple[DpInstance, float]]:
    rng = random.Random(77)
    for _ in range(300):
        instance = random_small_instance(rng, rng.randint(2, 3))
        yield instance, rng.choice(ALPHAS)


def test_several_buckets_against_brute_force(record_property) -> None:
    optimal, worst = 0, 1.0
    cases = list(_several_bucket_cases())
    for instance, alpha in cases:
        optimum = brute_force_optimum(instance, slice_caps(instance, alpha))
        got = max_load(instance, partition(instance, alpha).owners)
        assert got >= optimum * (1 - 1e-12), (instance, alpha)
        assert got >= lower_bound(instance) * (1 - 1e-12)
        assert optimum >= lower_bound(instance) * (1 - 1e-12)
        optimal += got <= optimum * (1 + 1e-9)
        worst = max(worst, got / optimum)
    record_property("several_buckets_optimal_fraction", optimal / len(cases))
    record_property("several_buckets_worst_ratio", worst)
    assert 0 < optimal <= len(cases)


def test_several_buckets_within_125_percent_of_optimum() -> None:
    for instance, alpha in _several_bucket_cases():
        optimum = brute_force_optimum(instance, slice_caps(instance, alpha))
        got = max_load(instance, partition(instance, alpha).owners)
        assert got <= 1.25 * optimum * (1 + 1e-9), (instance, alpha, got, optimum)


def test_known_multi_bucket_instance_reaches_its_lower_bound() -> None:
    instance = make_instance([[7, 11], [1, 9, 2]], [[1, 2], [1, 1, 3]], 3)
    caps = slice_caps(instance, 0.0)
    assert caps == (2, 3)
    assert brute_force_optimum(instance, caps) == 11.0 == lower_bound(instance)
    assert max_load(instance, partition(instance, 0.0).owners) == 11.0  # exact bucket re-solve finds it


# ---------------------------------------------------------------------------------------------
# Float costs (non-integral, as the shampoo and soap FLOP models produce). Regressions: the LPT
# start once recovered a rank's previous load as loads[r] - cost (inexact: 0.1 + 0.2 - 0.1 !=
# 0.2) and crashed with IndexError; with D = 1 the contiguous start once rejected its own
# all-on-rank-0 plan because sum(costs) rounded below the plan's total (PlanError).


@pytest.mark.parametrize(
    ("costs", "num_ranks"),
    [([[0.1, 0.2]], 1), ([[0.1, 0.2, 0.1]], 2), ([[0.2, 0.1, 0.2]], 3), ([[0.1], [0.2]], 1)],
)
def test_float_costs_partition(costs, num_ranks: int) -> None:
    instance = make_instance(costs, [[1] * len(b) for b in costs], num_ranks)
    result = partition(instance, 1.0)
    check_assignment(instance, result)
    assert max_load(instance, result.owners) == pytest.approx(
        brute_force_optimum(instance, slice_caps(instance, 1.0)), rel=1e-9
    )


def test_float_costs_single_rank_several_buckets() -> None:
    instance = make_instance([[0.7], [0.6, 0.2, 0.2]], [[1], [1, 1, 1]], 1)
    result = partition(instance, 1.0)
    assert result.owners == ((0,), (0, 0, 0))


# ---------------------------------------------------------------------------------------------
# Slice caps and α


span_lists = st.lists(st.integers(1, 30), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(span_lists, st.integers(1, 5))
def test_min_max_slice_matches_brute_force(spans: list[int], num_ranks: int) -> None:
    assert min_max_slice(tuple(spans), num_ranks) == brute_force_min_max_slice(tuple(spans), num_ranks)


def test_min_max_slice_edge_cases() -> None:
    assert min_max_slice((), 3) == 0
    assert min_max_slice((5, 5, 5), 1) == 15
    assert min_max_slice((5, 5, 5), 3) == 5
    assert min_max_slice((5, 5, 5), 7) == 5
    assert min_max_slice((1, 1, 10), 2) == 10


def test_slice_caps_hand_example() -> None:
    instance = make_instance([[1, 1, 1, 1]], [[64, 64, 64, 64]], 2)
    assert slice_caps(instance, 0.0) == (128,)
    assert slice_caps(instance, 1.0) == (256,)
    # geometric: 128^0.5 · 256^0.5 = 181.02 → 181
    assert slice_caps(instance, 0.5) == (181,)


# Costs: many ties (a few fixed values) mixed with arbitrary non-integral positive floats.
item_costs = st.one_of(
    st.sampled_from([1.0, 2.0, 3.0, 0.1, 0.2, 0.7, 13.0, 1000.0]),
    st.floats(1e-3, 1e6, allow_nan=False, allow_infinity=False),
)


@st.composite
def instances(draw: st.DrawFn, max_buckets: int = 4, max_items: int = 6, max_ranks: int = 9) -> DpInstance:
    num_ranks = draw(st.integers(1, max_ranks))
    num_buckets = draw(st.integers(1, max_buckets))
    costs, spans = [], []
    for _ in range(num_buckets):
        count = draw(st.integers(1, max_items))
        costs.append(draw(st.lists(item_costs, min_size=count, max_size=count)))
        spans.append(draw(st.lists(st.integers(1, 200), min_size=count, max_size=count)))
    return make_instance(costs, spans, num_ranks)


alphas = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(instances())
def test_alpha_zero_gives_the_smallest_largest_slice(instance: DpInstance) -> None:
    result = partition(instance, 0.0)
    for spans, owners in zip(instance.spans, result.owners):
        assert max(slices_of(owners, spans, instance.num_ranks)) == min_max_slice(spans, instance.num_ranks)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(instances(), alphas)
def test_slices_stay_under_the_caps(instance: DpInstance, alpha: float) -> None:
    caps = slice_caps(instance, alpha)
    result = partition(instance, alpha)
    for b, (spans, owners) in enumerate(zip(instance.spans, result.owners)):
        assert max(slices_of(owners, spans, instance.num_ranks)) <= caps[b]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(instances(), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6))
def test_caps_are_monotone_in_alpha(instance: DpInstance, alpha_list: list[float]) -> None:
    ordered = sorted(set(alpha_list) | {0.0, 1.0})
    caps = [slice_caps(instance, alpha) for alpha in ordered]
    for low, high in zip(caps, caps[1:]):
        assert all(a <= b for a, b in zip(low, high)), (ordered, caps)
    assert caps[0] == tuple(min_max_slice(s, instance.num_ranks) for s in instance.spans)
    assert caps[-1] == tuple(sum(s) for s in instance.spans)


ladder_alphas = st.sampled_from(ALPHA_LADDER + (1.0,))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(instances(max_buckets=5, max_items=8, max_ranks=9), ladder_alphas, st.one_of(ladder_alphas, st.floats(0.0, 1.0)))
def test_a_larger_alpha_is_never_worse(instance: DpInstance, alpha_low: float, alpha_high: float) -> None:
    """Monotone α: the plan at any α is at least as good as at every coarser ladder α."""
    if alpha_high < alpha_low:
        return
    low = max_load(instance, partition(instance, alpha_low).owners)
    high = max_load(instance, partition(instance, alpha_high).owners)
    assert high <= low, (instance, alpha_low, alpha_high, low, high)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(instances(max_buckets=5, max_items=8, max_ranks=9), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_a_seeded_larger_alpha_is_never_worse(instance: DpInstance, alpha_a: float, alpha_b: float) -> None:
    """Off the ladder, the plan at a coarser α passed as a seed (what `--alpha auto` does)."""
    alpha_low, alpha_high = sorted((alpha_a, alpha_b))
    low = partition(instance, alpha_low)
    high = partition(instance, alpha_high, (low.owners,))
    assert max_load(instance, high.owners) <= max_load(instance, low.owners)
    caps = slice_caps(instance, alpha_high)
    for b, (spans, owners) in enumerate(zip(instance.spans, high.owners)):
        assert max(slices_of(owners, spans, instance.num_ranks)) <= caps[b]


def test_seeds_outside_the_caps_are_ignored() -> None:
    """A seed planned at a larger α (or for another buffer) cannot break α's caps."""
    instance = make_instance([[5, 1, 1, 1]], [[64, 64, 64, 64]], 2)
    loose = ((0, 1, 1, 1),)  # slices 64 / 192: only α = 1 allows it
    assert slice_caps(instance, 0.0) == (128,)
    for seeds in [(loose,), (((0, 1),),), (((0, 1, 2, 3),),)]:
        result = partition(instance, 0.0, seeds)
        assert max(slices_of(result.owners[0], instance.spans[0], 2)) <= 128


def test_the_search_pieces_free_order_builds_on() -> None:
    """`feasible`, `polished` and `polished_lpt`: the public starts of the local search."""
    instance = make_instance([[5, 1, 1, 1]], [[64, 64, 64, 64]], 2)
    caps = slice_caps(instance, 0.0)
    assert feasible(instance, caps, ((0, 0, 1, 1),))
    assert not feasible(instance, caps, ((0, 1, 1, 1),))  # slice of 192 over the cap of 128
    assert not feasible(instance, caps, ((1, 1, 0, 0),))  # owners must not decrease in registration order
    assert feasible(instance, caps, ((1, 1, 0, 0),), free=True)
    start = ((0, 0, 1, 1),)
    assert max(rank_loads(instance, polished(instance, caps, start))) <= max(rank_loads(instance, start))
    assert polished_lpt(instance, caps) is not None
    # Free order: three items of 128 elements cannot fit two slices of at most 192.
    packing = make_instance([[1, 1, 1]], [[128, 128, 128]], 2)
    assert polished_lpt(packing, (192,), free=True) is None


def _issue_15_instance() -> DpInstance:
    """qwen3-8b tp4 dp64, 40M buckets (Muon flops): before monotone α, 10.1% above the bound
    at α = 0 and 29.4% at α = 1."""
    from canzona.planner.buffers import dp_instance
    from canzona.planner.partition.costs import OptimizerConfig, make_cost_model, param_cost
    from canzona.planner.partition.layout import build_buffer
    from canzona.planner.sources.load import load_model
    from canzona.planner.spec import MATRIX

    model = load_model("qwen3-8b", 4)
    cost_model = make_cost_model("flops", OptimizerConfig())
    costs = tuple(param_cost(param, cost_model) for param in model.params)
    return dp_instance(build_buffer(model, MATRIX, 4, 64, 40_000_000), model, costs, 64)


def test_alpha_one_seeded_by_a_coarser_plan_beats_its_own_starts() -> None:
    """Regression of issue 15: items few per rank; α = 1's own starts end above α = 0's plan."""
    instance = _issue_15_instance()
    loads = {alpha: max_load(instance, partition(instance, alpha).owners) for alpha in (0.0, 0.5, 1.0)}
    assert loads[1.0] <= loads[0.5] <= loads[0.0]


# ---------------------------------------------------------------------------------------------
# Invariants of any partition


def check_assignment(instance: DpInstance, result: DpAssignment) -> None:
    num_ranks = instance.num_ranks
    assert isinstance(result.method, str) and result.method
    assert len(result.owners) == len(instance.costs)
    for costs, owners in zip(instance.costs, result.owners):
        # every item owned exactly once, by a rank in range, owners non-decreasing
        assert len(owners) == len(costs)
        assert all(0 <= owner < num_ranks for owner in owners)
        assert list(owners) == sorted(owners)
    loads = rank_loads(instance, result.owners)
    assert len(loads) == num_ranks
    total = sum(c for bucket in instance.costs for c in bucket)
    assert sum(loads) == pytest.approx(total, rel=1e-12)
    assert max(loads) >= lower_bound(instance) * (1 - 1e-12)


def check_cuts(instance: DpInstance, result: DpAssignment) -> None:
    num_ranks = instance.num_ranks
    for spans, owners in zip(instance.spans, result.owners):
        offsets = tuple(itertools.accumulate((0,) + spans[:-1]))
        numel = sum(spans)
        cuts = owners_to_cuts(owners, offsets, numel, num_ranks)
        assert len(cuts) == num_ranks + 1
        assert cuts[0] == 0 and cuts[-1] == numel
        assert list(cuts) == sorted(cuts)
        allowed = set(offsets) | {numel}
        assert all(cut in allowed for cut in cuts[1:-1])
        # owner of an item = the rank whose slice [cuts[r], cuts[r+1]) holds its offset
        recovered = tuple(bisect.bisect_right(cuts, offset) - 1 for offset in offsets)
        assert recovered == owners
        # each item lies wholly inside its owner's slice
        for owner, offset, span in zip(owners, offsets, spans):
            assert cuts[owner] <= offset and offset + span <= cuts[owner + 1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(instances(), alphas)
def test_partition_invariants(instance: DpInstance, alpha: float) -> None:
    result = partition(instance, alpha)
    check_assignment(instance, result)
    check_cuts(instance, result)
    again = partition(instance, alpha)
    assert again == result


@settings(max_examples=40, deadline=None, derandomize=True)
@given(instances(max_buckets=6, max_items=12, max_ranks=9), alphas)
def test_partition_invariants_larger(instance: DpInstance, alpha: float) -> None:
    result = partition(instance, alpha)
    check_assignment(instance, result)
    check_cuts(instance, result)


def test_owners_to_cuts_with_empty_slices() -> None:
    # ranks 0 and 2 own nothing; rank 3 owns the last two items
    assert owners_to_cuts((1, 3, 3), (0, 64, 192), 384, 5) == (0, 0, 64, 64, 384, 384)
    assert owners_to_cuts((0, 0, 0), (0, 64, 128), 256, 3) == (0, 256, 256, 256)
    assert owners_to_cuts((2, 2), (0, 64), 128, 3) == (0, 0, 0, 128)


def test_lower_bound_and_rank_loads() -> None:
    instance = make_instance([[3, 9], [4]], [[1, 1], [1]], 4)
    assert lower_bound(instance) == 9.0  # largest item beats total / D = 4
    instance = make_instance([[3, 3], [4]], [[1, 1], [1]], 2)
    assert lower_bound(instance) == 6.0  # three matrices on two ranks: two of them share one (not total / D = 5)
    assert rank_loads(instance, ((0, 1), (1,))) == [3.0, 7.0]


def test_empty_instance() -> None:
    instance = make_instance([], [], 3)
    assert partition(instance, 0.5).owners == ()
    assert lower_bound(instance) == 0.0


def test_single_rank_owns_everything() -> None:
    instance = make_instance([[3, 4], [5]], [[64, 64], [128]], 1)
    result = partition(instance, 0.3)
    assert result.owners == ((0, 0), (0,))
    assert rank_loads(instance, result.owners) == [12.0]


def test_more_ranks_than_items() -> None:
    instance = make_instance([[6, 6]], [[64, 64]], 8)
    result = partition(instance, 1.0)
    check_assignment(instance, result)
    assert max_load(instance, result.owners) == 6.0


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("alpha", [-0.1, 1.0000001, 2.0, -1e-9, math.nan, math.inf])
def test_alpha_outside_unit_interval_raises(alpha: float) -> None:
    instance = make_instance([[1, 2]], [[64, 64]], 2)
    with pytest.raises(PlanError, match="alpha"):
        partition(instance, alpha)
    with pytest.raises(PlanError, match="alpha"):
        slice_caps(instance, alpha)


@pytest.mark.parametrize("num_ranks", [0, -1])
def test_dp_below_one_raises(num_ranks: int) -> None:
    with pytest.raises(PlanError, match="dp"):
        make_instance([[1.0]], [[64]], num_ranks)
