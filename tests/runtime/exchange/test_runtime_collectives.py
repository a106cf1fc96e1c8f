"""Every per-bucket DP collective a schedule can record (`ring`: a native reduce-scatter /
all-gather over slices padded to the largest; `rooted`: a reduce to / broadcast from each
slice's owner; `all_to_all`) runs on gloo and ends where the single-process reference does:
after several steps every rank's every parameter equals it (Muon, rtol as at DP 4), at DP 4,
at TP 2 x DP 2, and under expert parallelism (expert buckets over the expert-DP group). The
runtime executes what the file says: a bucket's recorded collective decides, unless the
optimizer is given one for every bucket."""

from __future__ import annotations

from typing import Any

import pytest

from canzona.runtime.exchange.comm import AS_SCHEDULED, bucket_mode
from canzona.schedules.format import Schedule, sealed
from canzona.schedules.layout import build_dp_layout
from canzona.schedules.limits import BUCKET_COLLECTIVES

from rt_harness import DATA, make_schedule, run_ranks
from rt_oracle import DP4, compare, reference_run, train_worker

STEPS = 3
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}


def with_collective(schedule: Schedule, collective: str) -> Schedule:
    """`schedule` with every matrix and expert bucket recording `collective` (digest resealed)."""
    dp = schedule.dp
    buckets = [b.model_copy(update={"collective": collective}) for b in dp.buckets]
    experts = [b.model_copy(update={"collective": collective}) for b in dp.expert_buckets]
    section = dp.model_copy(update={"buckets": buckets, "expert_buckets": experts})
    return sealed(schedule.model_copy(update={"dp": section}))


def _uneven(schedule: Schedule, empty: bool) -> bool:
    """Whether some bucket has slices of different sizes (`empty`: one of them empty)."""
    return any(
        len(set(b.slice_bytes)) > 1 and (0 in b.slice_bytes or not empty)
        for b in (*schedule.dp.buckets, *schedule.dp.expert_buckets)
    )


def _check(schedule: Schedule, rtol: float = 1e-5, empty: bool = True) -> None:
    assert _uneven(schedule, empty), "the test needs uneven slices (padding to pad)"
    forms = [with_collective(schedule, collective) for collective in BUCKET_COLLECTIVES]
    results = run_ranks(train_worker, 4, forms, STEPS, "canzona", HP)
    reference = reference_run(schedule, STEPS, HP)
    for index, form in enumerate(forms):
        compare(form, [rank[index] for rank in results], reference, rtol=rtol, atol=rtol / 10)


def test_the_recorded_collective_decides_unless_one_is_given() -> None:
    schedule = with_collective(make_schedule(DATA / "tiny_moe4.json", 1, 4), "ring")
    bucket = build_dp_layout(schedule).buckets[0]
    assert bucket.kind == "matrix" and bucket.collective == "ring"
    assert bucket_mode(bucket, AS_SCHEDULED) == "ring"
    assert bucket_mode(bucket, "all_to_all") == "all_to_all"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_collective_matches_reference_dp4() -> None:
    _check(make_schedule(DATA / "tiny_moe4.json", 1, 4, bucket_size=4000), rtol=DP4["muon"][2])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_collective_matches_reference_tp2_dp2() -> None:
    _check(make_schedule(DATA / "tiny_moe.json", 2, 2, bucket_size=2000), empty=False)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_collective_matches_reference_expert_parallel() -> None:
    schedule: Any = make_schedule(DATA / "tiny_moe4.json", 1, 4, ep=2, bucket_size=1500)
    assert schedule.dp.expert_buckets
    _check(schedule, rtol=DP4["muon"][2])
