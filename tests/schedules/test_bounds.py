"""Plan-independent lower bounds (`canzona.schedules.bounds`): never above the best assignment,
found by brute force on small instances, and tight where pairing decides."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.schedules.bounds import device_lower_bound, dp_lower_bound


def optimum(costs: list[float], ranks: int, base: list[float]) -> float:
    """The smallest largest load over every assignment (brute force)."""
    best = float("inf")
    for owners in itertools.product(range(ranks), repeat=len(costs)):
        loads = list(base) if base else [0.0] * ranks
        for cost, owner in zip(costs, owners):
            loads[owner] += cost
        best = min(best, max(loads))
    return best


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    ranks=st.integers(1, 4),
    base=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    with_base=st.booleans(),
)
def test_never_above_the_optimum(costs: list[int], ranks: int, base: list[int], with_base: bool) -> None:
    loads = [float(b) for b in base[:ranks]] if with_base else []
    assert (
        dp_lower_bound([float(c) for c in costs], ranks, loads)
        <= optimum([float(c) for c in costs], ranks, loads) + 1e-9
    )


def test_pairing_proves_what_the_mean_cannot() -> None:
    # Three equal matrices on two ranks: two of them share a rank.
    assert dp_lower_bound([3.0, 3.0, 3.0], 2) == 6.0
    # The example, qwen3-8b tp4 dp64: 36 each of fc1, fc2, qkv, proj over 64 ranks. The
    # 36 fc1 sit on 36 ranks; if none takes anything else, 28 ranks carry everything else (11.74
    # each), so one takes at least a proj: fc1 + proj, 8.2% above total / D.
    costs = [8.935] * 36 + [4.811] * 36 + [2.255] * 36 + [2.062] * 36
    assert dp_lower_bound(costs, 64) == pytest.approx(8.935 + 2.062)
    assert dp_lower_bound(costs, 64) > sum(costs) / 64 * 1.08


def test_base_loads_and_edges() -> None:
    assert dp_lower_bound([], 3) == 0.0
    assert dp_lower_bound([], 2, [1.0, 5.0]) == 5.0
    assert dp_lower_bound([4.0], 2, [1.0, 5.0]) == 5.0  # on the lighter rank: 5
    assert dp_lower_bound([4.0, 4.0], 2, [1.0, 5.0]) == pytest.approx(7.0)  # the mean
    assert dp_lower_bound([5.0, 1.0], 1) == 6.0


def test_device_bound_takes_the_largest_of_its_parts() -> None:
    adamw = [1.0, 2.0]
    assert device_lower_bound(10.0, 2, 4.0, 2, 3.0, adamw) == pytest.approx((10 + 3) / 2)  # the mean
    assert device_lower_bound(2.0, 2, 12.0, 2, 3.0, adamw) == pytest.approx(12 / 2 + 1)  # a DP rank over its TP group
    assert device_lower_bound(2.0, 2, 1.0, 2, 9.0, adamw) == pytest.approx(9 + 1)  # the largest piece
    assert device_lower_bound(0.0, 2, 0.0, 2, 0.0, [0.0, 7.0]) == 7.0  # AdamW alone
