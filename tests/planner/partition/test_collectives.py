"""The α–β model of one collective: every second computed by hand."""

from __future__ import annotations

import pytest

from canzona.planner.partition.collectives import (
    NS_BF16_FLOPS,
    REFERENCE_NETWORK,
    Exchange,
    Link,
    all_gather,
    all_reduce,
    broadcast,
    bucket_exchange,
    bucket_seconds,
    cheapest_seconds,
    choose_collective,
    padded_ring,
    phase_seconds,
    reduce_scatter,
    resliced,
    rooted,
)
from canzona.planner.predict.hardware import BUILTIN
from canzona.schedules.geometry import reslice_moves
from canzona.schedules.limits import BUCKET_COLLECTIVES

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
    # Rooted: one chain per non-empty slice (2 here, 2 steps each); rank r sends every slice but
    # its own and receives every slice but its predecessor's: the busiest moves 50 − 0 elements.
    exchange = rooted(LINK4, [40, 0, 10, 0], 4)
    assert exchange.sent == (40.0, 200.0, 160.0, 200.0)
    assert exchange.received == (200.0, 40.0, 200.0, 160.0)
    assert exchange.seconds() == pytest.approx(2 * 2 * 1.0 + 200 / 100)


def test_padded_ring_pays_the_largest_slice_n_minus_one_times() -> None:
    assert padded_ring(LINK4, [40, 0, 10, 0], 4).seconds() == pytest.approx(3 * 1.0 + 3 * 40 * 4 / 100)
    # Equal slices: the native ring, the same as an equal reduce-scatter.
    assert padded_ring(LINK4, [10] * 4, 4).seconds() == pytest.approx(reduce_scatter(LINK4, [10] * 4, 4).seconds())


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


def test_bucket_exchange_is_what_the_runtime_issues() -> None:
    skewed = [40, 0, 10, 0]
    assert bucket_exchange(LINK4, skewed, 4, gather=False, collective="rooted").kind == "rooted"
    assert bucket_exchange(LINK4, skewed, 4, gather=False, collective="ring").kind == "reduce-scatter"
    assert bucket_exchange(LINK4, skewed, 4, gather=True, collective="all_to_all").kind == "all-gather"
    # Equal slices are a native ring whether recorded as ring or rooted.
    for collective in ("ring", "rooted"):
        assert bucket_exchange(LINK4, [10] * 4, 4, False, collective).seconds() == pytest.approx(3 + 1.2)
    # On a bucket landing on one rank, rooted pays the bucket once where all_to_all pays it n − 1 times.
    alone = [40, 0, 0, 0]
    assert bucket_exchange(LINK4, alone, 4, False, "rooted").seconds() == pytest.approx(2 * 1.0 + 160 / 100)
    assert bucket_exchange(LINK4, alone, 4, False, "all_to_all").seconds() == pytest.approx(3 * 1.0 + 480 / 100)
    with pytest.raises(ValueError, match="unknown bucket collective"):
        bucket_exchange(LINK4, alone, 4, False, "tree")


def test_reslice_moves_each_element_from_its_equal_slice_to_its_owner() -> None:
    # Equal slices of 10; the owners' slices are [0, 40), [40, 40), [40, 40), [40, 40).
    assert reslice_moves([40, 0, 0, 0]) == [(0, 30), (10, 0), (10, 0), (10, 0)]
    # Owners' cuts at 0, 15, 20, 30, 40: rank 0 receives 5 from rank 1, rank 1 keeps 5.
    assert reslice_moves([15, 5, 10, 10]) == [(0, 5), (5, 0), (0, 0), (0, 0)]
    assert reslice_moves([10] * 4) == [(0, 0)] * 4
    # What moves out of the equal slices is what moves into the owners' slices.
    moves = reslice_moves([7, 0, 21, 3, 1, 0, 8, 0])
    assert sum(sent for sent, _ in moves) == sum(received for _, received in moves)


def test_reslice_is_the_ring_over_equal_slices_plus_one_round() -> None:
    # [40, 0, 0, 0]: every rank moves 3 equal slices of 10 (120 bytes of 4); rank 0 also
    # receives 30 elements, the others send 10: 240 bytes on the busiest, 3 + 1 α.
    reduce = resliced(LINK4, [40, 0, 0, 0], 4, gather=False)
    assert reduce.sent == (120.0, 160.0, 160.0, 160.0) and reduce.received == (240.0, 120.0, 120.0, 120.0)
    assert reduce.seconds() == pytest.approx(4 * 1.0 + 240 / 100)
    gather = bucket_exchange(LINK4, [40, 0, 0, 0], 4, True, "reslice")
    assert (gather.sent, gather.received) == (reduce.received, reduce.sent)
    # Equal slices: nothing moves, no round: the native ring.
    assert bucket_exchange(LINK4, [10] * 4, 4, False, "reslice").seconds() == pytest.approx(3 + 1.2)


def test_reslice_wins_on_many_uneven_slices_over_a_slow_latency_free_link() -> None:
    """Slices of 12 and 8 over eight ranks: the padded ring moves 7 x 12, rooted chains the
    bucket less 8 with 8 x 3 α, reslice 7 x 10 plus 2 of spill-over with 8 α."""
    link = Link("wide", 8, bandwidth=100.0, latency=1e-3)
    slices = [12, 8] * 4
    costs = {c: bucket_seconds(link, slices, 4, 2, c) for c in BUCKET_COLLECTIVES}
    assert costs["reslice"] == pytest.approx(2 * 8 * 1e-3 + 72 * 6 / 100)
    assert choose_collective(link, slices, 2) == "reslice"


def test_costs_are_continuous_in_the_slice_sizes() -> None:
    """No jump between exactly equal and nearly equal slices: for each form, and for the
    cheapest, moving one element between slices changes the time by about one element."""
    link = Link("wide", 4, bandwidth=1e9, latency=1e-6)
    equal, nearly = [1_000_000] * 4, [1_000_001, 999_999, 1_000_000, 1_000_000]
    one_element = 3 * 4 / 1e9  # n - 1 elements of 4 bytes, the most any form can add
    for collective in BUCKET_COLLECTIVES:
        for gather in (False, True):
            a = bucket_exchange(link, equal, 4, gather, collective).seconds()
            b = bucket_exchange(link, nearly, 4, gather, collective).seconds()
            # Rooted chains pay their own α when the slices differ; bytes never jump.
            assert abs(a - b) <= one_element + (8 - 3) * 1e-6
    # The cheapest form: equal slices tie the ring with rooted (which runs the native ring there),
    # and nearly equal ones take the ring, for the same price but an element.
    cheapest = [min(bucket_seconds(link, s, 4, 2, c) for c in BUCKET_COLLECTIVES) for s in (equal, nearly)]
    assert abs(cheapest[0] - cheapest[1]) <= 2 * one_element
    assert choose_collective(link, nearly, 2) == "ring"
    assert bucket_seconds(link, equal, 4, 2, choose_collective(link, equal, 2)) == pytest.approx(cheapest[0])


def test_the_cheapest_form_wins() -> None:
    link = Link("pair", 2, bandwidth=100.0, latency=1.0)
    # Two ranks, both slices non-empty: the ring moves the larger slice in one step, rooted
    # chains move the same bytes in two: ring.
    assert choose_collective(link, [30, 10], 2) == "ring"
    # A whole bucket on one rank: every form moves it once in one step: the default wins ties.
    assert choose_collective(link, [40, 0], 2) == "rooted"
    # Four ranks, one large slice: rooted moves the bucket once; the padded ring 3 x the slice.
    assert choose_collective(LINK4, [1000, 10, 10, 10], 2) == "rooted"
    # A group of one moves nothing: the default.
    assert choose_collective(Link("one", 1, 1.0, 1.0), [10], 2) == "rooted"


def test_bucket_seconds_is_both_exchanges() -> None:
    """The planner's shortcut prices exactly what the simulator's per-rank exchanges do."""
    import random

    rng = random.Random(26)
    for _ in range(300):
        n = rng.randint(1, 9)
        slices = [rng.choice([0, rng.randint(1, 50), 20]) for _ in range(n)]
        link = Link("any", n, bandwidth=rng.uniform(1, 100), latency=rng.uniform(0, 2))
        for collective in BUCKET_COLLECTIVES:
            both = (
                bucket_exchange(link, slices, 4, False, collective).seconds()
                + bucket_exchange(link, slices, 2, True, collective).seconds()
            )
            assert bucket_seconds(link, slices, 4, 2, collective) == pytest.approx(both, rel=1e-12, abs=1e-12)


def test_the_reference_device_is_the_h100_model() -> None:
    """What the planner prices collectives and teams on is the `h100` hardware model."""
    h100 = BUILTIN["h100"]
    assert h100.network == REFERENCE_NETWORK
    assert h100.matrix_flops == NS_BF16_FLOPS


def test_the_choice_is_the_argmin_of_every_form() -> None:
    """Skipping `reslice` where the ring over equal slices alone is no cheaper than another
    form never changes the choice or the price."""
    import random

    rng = random.Random(35)
    for _ in range(400):
        n = rng.randint(1, 12)
        slices = [rng.choice([0, rng.randint(1, 80), 16]) for _ in range(n)]
        link = Link("any", n, bandwidth=rng.uniform(1, 100), latency=rng.choice([0.0, rng.uniform(0, 2)]))
        costs = [bucket_seconds(link, slices, 4, 2, c) for c in BUCKET_COLLECTIVES]
        assert choose_collective(link, slices, 2) == BUCKET_COLLECTIVES[costs.index(min(costs))]
        assert cheapest_seconds(link, slices, 2) == min(costs)
