"""The DP collectives are issued in an order that is a fixed function of the schedule, the one
the simulator prices: reductions in readiness order during backward, gathers in the order the
next forward needs them (planner/predict/iteration.py)."""

from __future__ import annotations

import pytest

from canzona.planner.plan import TrainingSetup
from canzona.planner.predict.hardware import BUILTIN
from canzona.planner.predict.iteration import BUFFER_ORDER, device_compute
from canzona.planner.predict.step import ADAMW_BUFFER, DENSE
from canzona.runtime.schedule import load_schedule
from canzona.schedules.format import Schedule
from canzona.schedules.layout import build_dp_layout

from rt_harness import DATA, make_schedule

SIMULATOR_BUFFER = {"matrix": DENSE, "adamw": ADAMW_BUFFER}


def _simulator_order(schedule: Schedule, reduce: bool) -> list[tuple[str, int]]:
    """(buffer, bucket) in the order the iteration model puts the reductions / gathers."""
    compute = device_compute(schedule, BUILTIN["h100"], TrainingSetup(global_batch=schedule.request.dp * 8, seq_len=64))
    where = compute.ready if reduce else compute.needed
    fallback = 1.0 if reduce else 0.0
    keys = [
        (SIMULATOR_BUFFER[kind], index)
        for kind, buckets in (("matrix", schedule.dp.buckets), ("adamw", schedule.dp.adamw_buckets))
        for index in range(len(buckets))
    ]
    return sorted(keys, key=lambda key: (where.get(key, fallback), BUFFER_ORDER[key[0]], key[1]))


@pytest.mark.parametrize("source", ["tiny", "qwen3-8b/muon-tp2-dp4"])
def test_launch_order_is_the_simulators(source: str) -> None:
    schedule = make_schedule(DATA / "tiny_moe.json", 2, 2) if source == "tiny" else load_schedule(source)
    layout = build_dp_layout(schedule)
    runtime = {
        name: [(SIMULATOR_BUFFER[layout.buckets[b].kind], layout.buckets[b].index) for b in order]
        for name, order in (("reduce", layout.reduce_order), ("gather", layout.gather_order))
    }
    assert runtime["reduce"] == _simulator_order(schedule, reduce=True)
    assert runtime["gather"] == _simulator_order(schedule, reduce=False)
    assert runtime["gather"] == runtime["reduce"][::-1]
    kinds = {kind for kind, _ in runtime["reduce"]}
    assert kinds == {DENSE, ADAMW_BUFFER} and len(runtime["reduce"]) > 2
