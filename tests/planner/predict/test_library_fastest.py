"""The issue-26 done-when: simulated with `canzona simulate`'s defaults (H100 model, a global batch
of 256 x 4096 tokens, the same overlap for every strategy), every schedule in the checked-in
library has canzona's optimizer step and training iteration no slower than any other
matrix-optimizer strategy's (canzona-no-overlap is canzona itself; DDP + AdamW is a reference,
not a matrix optimizer)."""

from __future__ import annotations

import pytest

from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import TrainingSetup
from canzona.planner.predict.hardware import resolve_device
from canzona.planner.predict.sim_baselines import REFERENCES
from canzona.planner.predict.simulate import simulate
from canzona.schedules.format import read_schedule
from canzona.schedules.library import library_names, library_root

TIE = 1e-9  # TP-SC is canzona itself at tp 1: equal times count as canzona's


@pytest.mark.parametrize("name", [n for n in library_names() if "fsdp" not in n])
def test_canzona_is_fastest_in_step_and_iteration(name: str) -> None:
    schedule = read_schedule(library_root() / f"{name}.yaml")
    device = resolve_device("h100")
    optimizer = OptimizerConfig(**schedule.request.optimizer.model_dump())
    sim = simulate(schedule, device.hardware, device.time_model(optimizer), training=TrainingSetup())
    rivals = [s.name for s in sim.strategies if s.name not in REFERENCES and not s.name.startswith("canzona")]
    assert {"tp-sc", "dp-sc", "zero1-gather", "start-owner", "layer-wise"} <= set(rivals)
    step, iteration = sim.get("canzona").step, sim.iteration("canzona").iteration
    slower = {r: sim.get(r).step / step for r in rivals if sim.get(r).step < step * (1 - TIE)}
    slower |= {
        f"{r} (iteration)": sim.iteration(r).iteration / iteration
        for r in rivals
        if sim.iteration(r).iteration < iteration * (1 - TIE)
    }
    assert not slower, f"{name}: faster than canzona: {slower}"
