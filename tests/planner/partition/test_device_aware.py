"""Device-aware DP ownership and even slices: what they change and what they keep."""

from __future__ import annotations

from functools import cache

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition import device_aware
from canzona.planner.partition.dp import DpInstance, rank_loads
from canzona.planner.partition.even_slices import even_slices, proxy
from canzona.planner.plan import Plan, PlanRequest, make_plan
from canzona.planner.sources.load import load_model


@cache
def qwen8b_tp4_dp64(device_stage: bool = True) -> Plan:
    limit = device_aware.MAX_RANK_TASKS
    device_aware.MAX_RANK_TASKS = limit if device_stage else -1
    try:
        return make_plan(load_model("qwen3-8b", 4), PlanRequest("qwen3-8b", 4, 64))
    finally:
        device_aware.MAX_RANK_TASKS = limit


def test_the_busiest_device_of_the_issue_layout_drops() -> None:
    """qwen3-8b tp4 dp64: the DP partition is at its (pairing) bound with 36 fc1 + proj ranks whose
    busiest device is 5.06e12; moving matrices between DP ranks shortens it by over 10%."""
    before = compile_schedule(qwen8b_tp4_dp64(False)).metrics
    after = compile_schedule(qwen8b_tp4_dp64(True)).metrics
    assert before.dp.gap == pytest.approx(0.0, abs=1e-12)
    assert after.tp.worst_device_load < 0.9 * before.tp.worst_device_load
    assert after.tp.worst_device_load >= after.tp.device_lower_bound
    assert "+device" in after.dp.method


def test_the_dp_balance_stays_within_its_constraint() -> None:
    plan, partition = qwen8b_tp4_dp64(True), qwen8b_tp4_dp64(False)
    cap = max(max(partition.loads), plan.request.tp * plan.device_lower_bound)
    assert max(plan.loads) <= cap * (1 + 1e-12)
    assert sum(plan.loads) == pytest.approx(sum(partition.loads), rel=1e-12)  # matrices move, none is lost


def test_no_device_stage_without_tp_or_without_flops() -> None:
    for request in (PlanRequest("qwen3-8b", 1, 64), PlanRequest("qwen3-8b", 4, 64, cost="numel")):
        assert "+device" not in make_plan(load_model("qwen3-8b", request.tp), request).dense.method


def _instance(buckets: int, items: int, kinds: int = 2) -> DpInstance:
    costs = tuple(tuple(1.0 + (i % kinds) for i in range(items)) for _ in range(buckets))
    spans = tuple(tuple(64 for _ in range(items)) for _ in range(buckets))
    names = tuple(tuple(f"b{b}.{i}" for i in range(items)) for b in range(buckets))
    return DpInstance(costs, spans, names, 2)


@pytest.mark.parametrize("free", [True, False])
def test_even_slices_halves_whole_buckets_at_equal_loads(free: bool) -> None:
    """Two ranks, four equal buckets, each whole on one rank (balanced, every byte on one link):
    swaps of equal-cost matrices leave every load as it was and every slice near half. (In
    registration order only the ends of a rank's run can change hands: equal matrices there.)"""
    instance = _instance(4, 8, 2 if free else 1)
    owners = ((0,) * 8, (0,) * 8, (1,) * 8, (1,) * 8)
    caps = tuple(sum(spans) for spans in instance.spans)
    evened = even_slices(instance, caps, owners, free)
    assert rank_loads(instance, evened) == rank_loads(instance, owners)
    for spans, bucket_owners in zip(instance.spans, evened):
        fills = [sum(s for s, o in zip(spans, bucket_owners) if o == r) for r in range(2)]
        assert proxy(fills, sum(spans)) == sum(spans) // 2
        if not free:
            assert list(bucket_owners) == sorted(bucket_owners)


def test_even_slices_respects_the_caps() -> None:
    instance = _instance(2, 4)
    owners = ((0, 0, 0, 0), (1, 1, 1, 1))
    tight = (256, 256)  # a rank may take the whole bucket and nothing else
    assert even_slices(instance, tight, owners, True) != owners
    assert even_slices(instance, (256, 256), owners, True) == even_slices(instance, tight, owners, True)
    none = (0, 0)  # caps no partition can meet: nothing may move
    assert even_slices(instance, none, owners, True) == owners
