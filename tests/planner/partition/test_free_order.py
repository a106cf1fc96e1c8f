"""Free intra-bucket order: partition invariants, repacking, and the schedules it makes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dp import instances, max_load, slices_of

from canzona.planner.buffers import dp_instance
from canzona.planner.compile import compile_schedule
from canzona.planner.partition.dp import DpInstance, partition, rank_loads, slice_caps
from canzona.planner.partition.free_order import partition_free, reorder_buffer
from canzona.planner.partition.layout import PARAM_ALIGNMENT, build_buffer
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX, PlanError
from canzona.schedules.format import Schedule, dump_schedule, parse_schedule

ladder = st.sampled_from([0.0, 0.5, 1.0])


@settings(max_examples=120, deadline=None, derandomize=True)
@given(instances(max_buckets=5, max_items=8, max_ranks=9), st.one_of(ladder, st.floats(0.0, 1.0)))
def test_free_partition_invariants(instance: DpInstance, alpha: float) -> None:
    result = partition_free(instance, alpha)
    caps = slice_caps(instance, alpha)
    for b, (costs, owners) in enumerate(zip(instance.costs, result.owners)):
        assert len(owners) == len(costs) and all(0 <= r < instance.num_ranks for r in owners)
        assert max(slices_of(owners, instance.spans[b], instance.num_ranks)) <= caps[b]
    # Never worse than registration order (it is one of the starts), and deterministic.
    assert max_load(instance, result.owners) <= max_load(instance, partition(instance, alpha).owners)
    assert partition_free(instance, alpha) == result


@settings(max_examples=80, deadline=None, derandomize=True)
@given(instances(max_buckets=4, max_items=8, max_ranks=8), ladder, ladder)
def test_free_order_is_monotone_in_alpha(instance: DpInstance, alpha_a: float, alpha_b: float) -> None:
    low, high = sorted((alpha_a, alpha_b))
    assert max_load(instance, partition_free(instance, high).owners) <= max_load(
        instance, partition_free(instance, low).owners
    )


def test_few_matrices_per_rank_gain_from_free_order() -> None:
    """Two big then two small matrices over 2 ranks: contiguous cuts cannot pair each big one
    with a small one (best 12 = 10 + 1 + 1); free order can (11, the bound)."""
    instance = DpInstance(((10.0, 10.0, 1.0, 1.0),), ((64, 64, 64, 64),), (("a", "b", "c", "d"),), 2)
    assert max_load(instance, partition(instance, 1.0).owners) == 12.0
    assert max_load(instance, partition_free(instance, 1.0).owners) == 11.0


def test_reorder_groups_each_owner_and_repacks() -> None:
    model = load_model("qwen3-8b", 4)
    layout = build_buffer(model, MATRIX, 4, 8, 40_000_000)
    owners = tuple(tuple((7 * i) % 8 for i in range(len(b.entries))) for b in layout.buckets)
    new_layout, new_owners = reorder_buffer(layout, owners, 8)
    for old, new, old_owners, bucket_owners in zip(layout.buckets, new_layout.buckets, owners, new_owners):
        assert {e.param for e in old.entries} == {e.param for e in new.entries}
        assert list(bucket_owners) == sorted(bucket_owners)
        owner_of = {e.param: r for e, r in zip(old.entries, old_owners)}
        assert [owner_of[e.param] for e in new.entries] == list(bucket_owners)
        end = 0
        for entry in new.entries:  # packed at the alignment, in the new order
            assert entry.offset == -(-end // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
            end = entry.offset + entry.numel
        assert new.numel >= end and new.numel % 8 == 0


def test_free_order_schedule_validates_and_records_the_order() -> None:
    model = load_model("qwen3-8b", 4)
    registration = make_plan(model, PlanRequest("qwen3-8b", 4, 64, order="registration"))
    free = make_plan(model, PlanRequest("qwen3-8b", 4, 64, order="free"))
    # The DP partition: free order is at the pairing bound, registration order 1.8% above it.
    instance = dp_instance(build_buffer(model, MATRIX, 4, 64, 40_000_000), model, free.costs, 64)
    assert max(rank_loads(instance, partition_free(instance, 1.0).owners)) < max(
        rank_loads(instance, partition(instance, 1.0).owners)
    )
    # The whole plan (TP 4: device-aware ownership): free order's busiest device is no longer.
    worst = {plan.request.order: compile_schedule(plan).metrics.tp.worst_device_load for plan in (free, registration)}
    assert worst["free"] <= worst["registration"]
    schedule = parse_schedule(dump_schedule(compile_schedule(free)), "free.yaml")
    assert schedule.request.order == "free" and "order: free" in dump_schedule(schedule)
    assert "order:" not in dump_schedule(compile_schedule(registration))  # the default is left out
    # Loads follow the owners, whatever the order.
    assert rank_loads_of(schedule) == pytest.approx(list(free.loads), rel=1e-12)


def rank_loads_of(schedule: Schedule) -> list[float]:
    loads = [0.0] * schedule.request.dp
    for entry in schedule.params:
        if entry.owner is not None:
            loads[entry.owner] += entry.cost
    return loads


def test_order_defaults_to_free_and_to_registration_under_ilp() -> None:
    assert PlanRequest("qwen3-8b", 4, 64).order == "free"
    assert PlanRequest("qwen3-8b", 4, 64, solver="ilp").order == "registration"  # CP-SAT refines those only
    assert PlanRequest("qwen3-8b", 4, 64, order="registration").order == "registration"
    with pytest.raises(PlanError, match="--order free does not combine with --solver ilp"):
        PlanRequest("qwen3-8b", 4, 64, solver="ilp", order="free").validate()
