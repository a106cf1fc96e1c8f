"""The simulator prices what the runtime runs: Muon's Newton–Schulz method (FLOPs of the
iteration each matrix runs, fallback included) at the rate of its precision (`ns_dtype`), and
Shampoo's and SOAP's fp32 products at the fp32 rate."""

from __future__ import annotations

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.collectives import FP32_SHARE, NS_BF16_FLOPS, TF32_SHARE
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.predict.hardware import BUILTIN
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model
from canzona.schedules.costs import muon_flops
from canzona.schedules.format import Schedule

H100 = BUILTIN["h100"]


def _schedule(**settings: object) -> Schedule:
    name = str(settings.pop("name", "muon"))
    request = PlanRequest("qwen3-1.7b", 1, 8, optimizer=OptimizerConfig(name, **settings))  # type: ignore[arg-type]
    return compile_schedule(make_plan(load_model("qwen3-1.7b", 1), request))


@pytest.mark.parametrize(("dtype", "share"), [("fp32", FP32_SHARE), ("tf32", TF32_SHARE), ("bf16", 1.0)])
def test_the_simulated_optimizer_compute_follows_ns_dtype(dtype: str, share: float) -> None:
    auto, chosen = _schedule(), _schedule(ns_dtype=dtype)
    assert [e.owner for e in chosen.params] == [e.owner for e in auto.params]  # the same plan, another precision
    sims = {name: simulate(s, H100) for name, s in (("auto", auto), (dtype, chosen))}
    assert sims["auto"].precision == "bf16" and sims[dtype].precision == dtype
    assert sims["auto"].update.endswith("bf16") and sims[dtype].update.endswith(dtype)
    # DP-SC computes every matrix on every device, so its compute is all of them plus AdamW
    full = sum(muon_flops(r, c, 5) for e in auto.params if e.optimizer == "matrix" for r, c in _pieces(e))
    adamw = sims["auto"].get("dp-sc").compute - full / NS_BF16_FLOPS
    assert adamw > 0
    for name, sim in sims.items():
        rate = NS_BF16_FLOPS * (1.0 if name == "auto" else share)
        assert sim.get("dp-sc").compute - adamw == pytest.approx(full / rate, rel=1e-9)


def _pieces(entry: object) -> list[tuple[int, int]]:
    from canzona.planner.predict.step import submatrices

    return submatrices(entry.shape, entry.row_blocks)  # type: ignore[attr-defined]


def test_gram_is_priced_by_the_flops_it_runs_and_squarer_matrices_fall_back() -> None:
    standard, gram = _schedule(), _schedule(ns_method="gram")
    sims = [simulate(s, H100) for s in (standard, gram)]
    flops = [
        sum(muon_flops(r, c, 5, method, 2) for e in standard.params if e.optimizer == "matrix" for r, c in _pieces(e))
        for method in ("standard", "gram")
    ]
    assert flops[1] < flops[0]  # qwen3-1.7b's MLP matrices are 3x as long as wide
    adamw = sims[0].get("dp-sc").compute - flops[0] / NS_BF16_FLOPS
    assert sims[1].get("dp-sc").compute - adamw == pytest.approx(flops[1] / NS_BF16_FLOPS, rel=1e-9)
    costs = {e.name: e.cost for e in gram.params}
    for e in standard.params:
        if e.optimizer == "matrix" and e.shape[0] == e.shape[-1]:  # square Q/O: the standard iteration
            assert costs[e.name] == e.cost
    assert sum(costs.values()) < sum(e.cost for e in standard.params)
    assert "gram" in sims[1].update and "standard" in sims[0].update


def test_shampoo_and_soap_are_priced_at_the_fp32_rate() -> None:
    for name in ("shampoo", "soap"):
        sim = simulate(_schedule(name=name), H100)
        assert sim.precision == "fp32" and H100.rate("fp32") == pytest.approx(48e12)
