"""The α–β model of one collective: every second computed by hand."""

from __future__ import annotations

import pytest

from canzona.planner.predict.collectives import (
    Exchange,
    Link,
    all_gather,
    all_reduce,
    broadcast,
    phase_seconds,
    reduce_scatter,
    rooted,
    uneven,
)

LINK4 = Link("test", 4, bandwidth=100.0, latency=1.0)

# ---------------------------------------------------------------------------------------------
# Collectives: seconds = steps · α + busiest rank's max(sent, received) / bandwidth


def test_equal_reduce_scatter_by_hand() -> None:
    # 4 ranks, 10 fp32 elements each: every rank sends 30·4 = 120 B and receives 3·10·4 = 120 B.
    assert reduce_scatter(LINK4, [10, 10, 10, 10], 4).seconds() == pytest.approx(3 * 1.0 + 120 / 100)


def test_uneven_reduce_scatter_pays_the_busiest_receiver() -> None:
    # The whole bucket on rank 0: it receives 3·40·4 = 480 B (the other ranks send 160 B each).
    exchange = reduce_scatter(LINK4, [40, 0, 0, 0], 4)
    assert exchange.received == (480.0, 0.0, 0.0, 0.0)
    assert exchange.seconds() == pytest.approx(3 + 4.8)


def test_all_gather_mirrors_reduce_scatter() -> None:
    exchange = all_gather(LINK4, [40, 0, 0, 0], 2)
    assert exchange.sent == (240.0, 0.0, 0.0, 0.0)
    assert exchange.received == (0.0, 80.0, 80.0, 80.0)
    assert exchange.seconds() == pytest.approx(3 + 2.4)


def test_ring_all_reduce_by_hand() -> None:
    # 40 fp32 = 160 B; each rank moves 2·3/4·160 = 240 B each way over 2·3 steps.
    assert all_reduce(LINK4, 40, 4).seconds() == pytest.approx(6 * 1.0 + 2.4)


def test_broadcast_and_rooted_by_hand() -> None:
    assert broadcast(LINK4, 200.0).seconds() == pytest.approx(2 * 1.0 + 2.0)  # ⌈log2 4⌉ = 2 steps
    # Rooted: one tree per non-empty slice (2 here), every link carries the 50 elements once.
    assert rooted(LINK4, [40, 0, 10, 0], 4).seconds() == pytest.approx(2 * 2 * 1.0 + 200 / 100)


def test_group_of_one_and_empty_collectives_are_free() -> None:
    alone = Link("alone", 1, 1.0, 1.0)
    assert reduce_scatter(alone, [100], 4).seconds() == 0.0
    assert all_reduce(alone, 100, 4).seconds() == 0.0
    assert reduce_scatter(LINK4, [0, 0, 0, 0], 4).seconds() == 0.0


def test_fused_collectives_sum_bytes_and_pay_alpha_once() -> None:
    link = Link("pair", 2, bandwidth=100.0, latency=1.0)
    first, second = reduce_scatter(link, [10, 0], 4), reduce_scatter(link, [0, 10], 4)
    # Separately: each has a 40 B busiest direction → 2 · (1 + 0.4).
    assert phase_seconds([first, second]) == pytest.approx(2.8)
    # Fused: every rank sends 40 B and receives 40 B → 1 + 0.4.
    assert phase_seconds([first, second], fused=True) == pytest.approx(1.4)
    # Broadcasts never fuse.
    casts = [broadcast(link, 100.0), broadcast(link, 100.0)]
    assert phase_seconds(casts, fused=True) == phase_seconds(casts) == pytest.approx(4.0)


def test_p2p_round_costs_one_alpha() -> None:
    assert Exchange("p2p", LINK4, (50.0, 0.0), (0.0, 50.0)).seconds() == pytest.approx(1.0 + 0.5)




def test_uneven_picks_what_the_runtime_issues() -> None:
    # Rooted only where the slices differ; equal slices are a native ring collective.
    assert uneven(LINK4, [40, 0, 10, 0], 4, gather=False, use_rooted=True).kind == "rooted"
    assert uneven(LINK4, [10, 10, 10, 10], 4, gather=False, use_rooted=True).kind == "reduce-scatter"
    assert uneven(LINK4, [40, 0, 10, 0], 4, gather=True, use_rooted=False).kind == "all-gather"
    # On a bucket landing on one rank, rooted pays the bucket once where all_to_all pays it n − 1 times.
    skewed = [40, 0, 0, 0]
    assert uneven(LINK4, skewed, 4, False, True).seconds() == pytest.approx(2 * 1.0 + 160 / 100)
    assert uneven(LINK4, skewed, 4, False, False).seconds() == pytest.approx(3 * 1.0 + 480 / 100)
