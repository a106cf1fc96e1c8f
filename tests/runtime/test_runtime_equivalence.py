"""After several steps, every rank's every parameter equals the single-process reference on the
unsharded tensors (fp32, rtol 1e-5): canzona and both baselines, Muon / Shampoo / SOAP with
AdamW on the rest, α = 0 and α = 1, TP 2 x DP 2, DP-only and TP-only, several micro-groups.

At DP 2 every reduction sums two values, the same in any order, so results are exact. At DP 4
the default rooted reductions sum in the backend's order, not the reference's rank order:
Muon keeps rtol 1e-5; Shampoo and SOAP amplify the difference (measured against an fp64
reference by benchmarks/numerics.py, table in docs/runtime.md), so they run well-conditioned
settings there with the tolerances `DP4` states. `all_to_all` (rank order) is exact at DP 4 on
every setting, and the same job run twice is bit-identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rt_harness import DATA, make_schedule, run_ranks
from rt_oracle import DP4, compare, reference_run, train_worker

STEPS = 6
LAYOUTS = {"tp2xdp2": (2, 2), "dp2": (1, 2), "tp2": (2, 1)}
SETTINGS: dict[str, dict[str, Any]] = {
    "muon": {},
    "shampoo": {"block_size": 16, "precondition_frequency": 2},
    "soap": {"precondition_frequency": 2, "max_precond_dim": 40},
}
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}
MODEL = DATA / "tiny_moe.json"


def _schedules(tp: int, dp: int, optimizer: str, **options: Any) -> list[Any]:
    schedules = [
        make_schedule(MODEL, tp, dp, optimizer=optimizer, alpha=alpha, **SETTINGS[optimizer], **options)
        for alpha in (0.0, 1.0)
    ]
    for schedule in schedules:
        assert len(schedule.dp.buckets) > 1
        if tp > 1:
            assert max(len(rank.groups) for rank in schedule.tp.ranks) >= 2, "want several micro-groups in flight"
    return schedules


def _check(strategy: str, tp: int, dp: int, optimizer: str, hp: dict[str, Any] = HP, **options: Any) -> None:
    schedules = _schedules(tp, dp, optimizer, **options)
    results = run_ranks(train_worker, tp * dp, schedules, STEPS, strategy, hp)
    for index, schedule in enumerate(schedules):
        compare(schedule, [rank[index] for rank in results], reference_run(schedule, STEPS, hp))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_canzona_matches_reference(layout: str, optimizer: str) -> None:
    _check("canzona", *LAYOUTS[layout], optimizer)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["tp-sc", "dp-sc"])
@pytest.mark.parametrize("optimizer", ["muon", "soap"])
def test_baselines_match_reference(strategy: str, optimizer: str) -> None:
    _check(strategy, 2, 2, optimizer)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_muon_options_and_split_gate_up() -> None:
    hp = {**HP, "nesterov": False, "update_scale": "shape", "ns_steps": 3, "momentum": 0.9}
    _check("canzona", 2, 2, "muon", hp, split_fc1=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bf16_parameters_round_like_the_reference() -> None:
    (schedule,) = _schedules(2, 2, "muon", dtype="bf16")[1:]
    results = run_ranks(train_worker, 4, [schedule], STEPS, "canzona", HP)
    compare(schedule, [rank[0] for rank in results], reference_run(schedule, STEPS, HP), rtol=None, atol=None)


def test_alpha_changes_the_cuts() -> None:
    low, high = _schedules(1, 2, "muon")
    assert [b.cuts for b in low.dp.buckets] != [b.cuts for b in high.dp.buckets]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_dp4_in_the_backends_order_matches_reference_within_measured_tolerance(optimizer: str) -> None:
    settings, extra, rtol = DP4[optimizer]
    hp = {**HP, **extra}
    schedules = [make_schedule(MODEL, 1, 4, optimizer=optimizer, alpha=alpha, **settings) for alpha in (0.0, 1.0)]
    for strategy in ("canzona", "dp-sc"):
        results = run_ranks(train_worker, 4, schedules, STEPS, strategy, hp)
        for index, schedule in enumerate(schedules):
            compare(
                schedule,
                [rank[index] for rank in results],
                reference_run(schedule, STEPS, hp),
                rtol=rtol,
                atol=rtol / 10,
            )


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_dp4_all_to_all_sums_in_rank_order_exactly(optimizer: str) -> None:
    schedules = _schedules(1, 4, optimizer)
    results = run_ranks(train_worker, 4, schedules, STEPS, "canzona", {**HP, "dp_collectives": "all_to_all"})
    for index, schedule in enumerate(schedules):
        reference = reference_run(schedule, STEPS, HP)
        for rank in results:
            assert all(torch.equal(rank[index][name], value) for name, value in reference.items())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_same_job_twice_is_bit_identical() -> None:
    """SOAP at DP 4 in the backend's order: its O(1) amplification would show any change in
    the summation order from one run to the next."""
    schedules = _schedules(1, 4, "soap")
    first, second = (run_ranks(train_worker, 4, schedules, STEPS, "canzona", HP) for _ in range(2))
    for a, b in zip(first, second):
        for index in range(len(schedules)):
            assert all(torch.equal(a[index][name], b[index][name]) for name in a[index])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["tp2xdp2", "dp2"])
def test_gram_newton_schulz_matches_reference(layout: str) -> None:
    """A schedule planned with `ns_method: gram` runs Gram Newton–Schulz on its MLP matrices
    (three and six times as long as wide) and the standard iteration on the squarer ones, on
    every rank as in the single-process reference (which reads the same settings)."""
    from canzona.schedules.costs import runs_gram

    tp, dp = LAYOUTS[layout]
    schedules = [
        make_schedule(DATA / "tiny_qwen3_wide.json", tp, dp, optimizer="muon", alpha=alpha, ns_method="gram")
        for alpha in (0.0, 1.0)
    ]
    shapes = [(e.shape[0], e.shape[-1]) for e in schedules[0].params if e.optimizer == "matrix"]
    assert any(runs_gram(*s, "gram") for s in shapes) and not all(runs_gram(*s, "gram") for s in shapes)
    results = run_ranks(train_worker, tp * dp, schedules, STEPS, "canzona", HP)
    for index, schedule in enumerate(schedules):
        assert schedule.request.optimizer.ns_method == "gram"
        gram = reference_run(schedule, STEPS, HP)
        compare(schedule, [rank[index] for rank in results], gram)
        if tp == 1:  # whole tensors on every rank: the run is the Gram reference's, not the standard one's
            standard = reference_run(schedule, STEPS, {**HP, "ns_method": "standard"})
            ran = results[0][index]
            assert all(torch.equal(ran[name], value) for name, value in gram.items())
            assert not all(torch.equal(ran[name], value) for name, value in standard.items())
