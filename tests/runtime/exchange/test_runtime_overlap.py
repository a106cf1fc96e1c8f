"""Gradient reduction overlapped with backward, gradient accumulation with `no_sync()`, and
parameter gathers overlapped with the next forward, on real ranks with a real backward
(`GradModel`: each parameter's gradient is chosen, so the single-process reference sees exactly
what the ranks accumulate).

For Muon, Shampoo and SOAP at TP 2 x DP 2 and DP 4: three micro-batches, the first two inside
`no_sync()`, equal the reference stepping the summed gradient of all three (one batch of 3x
size) within the stated tolerance (rtol 1e-5; at DP 4 the measured `DP4` ones); backward
launched every bucket's reduction itself; overlap off, gradient overlap and gradient + gather
overlap give bit-identical parameters and state."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from canzona.runtime import CanzonaOptimizer, ScheduleMismatchError, StepFailedError
from canzona.runtime.exchange import reduction

from rt_harness import DATA, make_groups, make_schedule, run_ranks, run_ranks_raw, timed_collective_failure
from rt_oracle import (
    DP4,
    GradModel,
    Scenario,
    compare,
    full_grad,
    full_params,
    ordered,
    reference_run,
    scenario_reference,
    scenario_worker,
    shard,
)

MODEL = DATA / "tiny_moe.json"
HP = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 0.01, "adamw_weight_decay": 0.05}
SETTINGS: dict[str, dict[str, Any]] = {
    "muon": {},
    "shampoo": {"block_size": 16, "precondition_frequency": 2},
    "soap": {"precondition_frequency": 2, "max_precond_dim": 40},
}
LAYOUTS = {"tp2xdp2": (2, 2), "dp4": (1, 4)}
VARIANTS = {
    "off": {"overlap_grad_reduce": False},
    "grad": {},
    "grad+gather": {"overlap_param_gather": True},
}


def _settings(optimizer: str, dp: int) -> tuple[dict[str, Any], dict[str, Any], float]:
    return DP4[optimizer] if dp > 2 else (SETTINGS[optimizer], {}, 1e-5)


def scenarios(tp: int, dp: int, optimizer: str) -> dict[str, Scenario]:
    settings, extra, _ = _settings(optimizer, dp)
    schedule = make_schedule(MODEL, tp, dp, optimizer=optimizer, **settings)
    return {
        name: Scenario(schedule, steps=3, hp={**HP, **extra}, micro_batches=3, backward=True, options=options)
        for name, options in VARIANTS.items()
    }


def _identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    same_params = all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    return same_params and a["param_steps"] == b["param_steps"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_overlap_and_accumulation_match_reference_and_each_other(layout: str, optimizer: str) -> None:
    tp, dp = LAYOUTS[layout]
    cases = scenarios(tp, dp, optimizer)
    results = run_ranks(scenario_worker, tp * dp, list(cases.values()), timeout=250)
    rtol = _settings(optimizer, dp)[2]
    reference = scenario_reference(cases["off"])
    buckets = len(cases["off"].schedule.dp.buckets) + len(cases["off"].schedule.dp.adamw_buckets)
    for index, name in enumerate(cases):
        ranks = [rank[index] for rank in results]
        compare(cases[name].schedule, [r["params"] for r in ranks], reference["params"], rtol=rtol, atol=rtol / 10)
        for rank, result in enumerate(ranks):
            assert _identical(result, results[rank][0]), f"{name} differs from overlap off on rank {rank}"
            if name == "off":
                assert result["rounds"] == [None] * 3, "without overlap nothing is launched before the step"
            else:  # every gradient came from backward: its hooks launched every bucket but the one
                # holding the last gradient, packed once backward ended (a gradient is packed
                # when the next one arrives, after every hook of its parameter has run)
                assert result["rounds"] == [(buckets - 1, buckets, True)] * 3, f"{name} rank {rank}: {result['rounds']}"
            # with gather overlap the step returns at once; the next forward's modules wait
            assert result["gathers"] == [buckets if name == "grad+gather" else 0] * 3, f"{name} rank {rank}"


FROZEN = frozenset({"decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.pre_mlp_layernorm.weight"})
GAPS = {("decoder.layers.0.self_attention.linear_qkv.weight", 1), ("decoder.final_layernorm.weight", 2)}
ONE_RANK = {("decoder.layers.1.self_attention.linear_proj.weight", 2, 0), ("output_layer.weight", 1, 1)}


def gaps(name: str, step: int, dp_rank: int) -> bool:
    """No rank has a gradient for (name, step) in GAPS; only the listed rank for ONE_RANK."""
    if (name, step) in GAPS:
        return False
    return not any((name, step) == (n, s) for n, s, _ in ONE_RANK) or (name, step, dp_rank) in ONE_RANK


def recipes() -> dict[str, Scenario]:
    """What a training script does around an overlapped step, under a meta default device."""
    muon = make_schedule(MODEL, 2, 2)
    both = {"overlap_param_gather": True}
    return {
        "megatron-main-grad-clip": Scenario(
            muon,
            steps=3,
            hp=HP,
            micro_batches=2,
            backward=True,
            grad_attr="main_grad",
            max_norm=50.0,
            options=both,
            meta=True,
        ),
        "plain-accumulation": Scenario(muon, steps=3, hp=HP, micro_batches=3, backward=True, no_sync=False, meta=True),
        "frozen-and-gaps": Scenario(
            muon, steps=4, hp=HP, backward=True, frozen=FROZEN, has_grad=gaps, options=both, meta=True
        ),
        "dp-sc": Scenario(
            muon, steps=3, hp=HP, micro_batches=2, backward=True, strategy="dp-sc", max_norm=5.0, meta=True
        ),
        "tp-sc": Scenario(
            muon, steps=3, hp=HP, micro_batches=2, backward=True, strategy="tp-sc", options=both, meta=True
        ),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_recipes_with_overlap_match_the_reference() -> None:
    """Megatron's main_grad (its hook calls grad_ready), accumulation without no_sync (every
    backward reduces, the last one counts), frozen parameters and gradient gaps (a bucket
    whose parameter has no gradient is launched at the end of backward), the baselines, and
    clipping, all with overlap, all under a meta default device (device discipline)."""
    cases = recipes()
    results = run_ranks(scenario_worker, 4, list(cases.values()), timeout=250)
    for index, (name, scenario) in enumerate(cases.items()):
        reference = scenario_reference(scenario)
        ranks = [rank[index] for rank in results]
        compare(scenario.schedule, [r["params"] for r in ranks], reference["params"])
        for rank, result in enumerate(ranks):
            assert result["frozen_changed"] == [] and result["skipped_changed"] == [], f"{name} rank {rank}: {result}"
            assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5), f"{name} rank {rank}: clip norms"
            steps = {n: s for n, s in reference["param_steps"].items() if s != scenario.steps}
            assert {n: s for n, s in result["param_steps"].items() if n not in scenario.frozen} == steps, name
            assert all(r is not None and r[2] for r in result["rounds"]), (
                f"{name} rank {rank}: backward launched nothing"
            )
    gapped = [rank[list(cases).index("frozen-and-gaps")]["rounds"] for rank in results]
    assert any(early < launched for rounds in gapped for early, launched, _ in rounds), (
        "a gap left a bucket to the end of backward"
    )


TIMEOUT = 3.0


def _setup_backward(schedule: Any, rank: int, **options: Any) -> tuple[Any, GradModel, list[tuple[str, Any]]]:
    dp_group, tp_group = make_groups(schedule.request.dp, schedule.request.tp)
    tp = schedule.request.tp
    full = full_params(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank % tp, tp))) for e in ordered(schedule)]
    model = GradModel(params)
    optimizer = CanzonaOptimizer(
        params, schedule, dp_group=dp_group, tp_group=tp_group, timeout=TIMEOUT, model=model, **options
    )
    return optimizer, model, params


def _backward(optimizer: Any, model: GradModel, step: int, poison: str | None = None) -> None:
    """This rank's step-`step` gradients through backward; `poison`: a parameter whose gradient
    gets a NaN."""
    schedule, tp = optimizer.schedule, optimizer.tp_size
    grads = []
    for entry in ordered(schedule):
        grad = shard(full_grad(entry, step, optimizer.dp_rank), entry, optimizer.tp_rank, tp).clone()
        if entry.name == poison:
            grad.view(-1)[0] = float("nan")
        grads.append(grad)
    model(grads).backward()


def _snapshot(
    optimizer: Any, params: list[tuple[str, Any]]
) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]], int]:
    state = {key: [data.clone() for _, data in t.chunks] for key, t in optimizer.state_dict()["tensors"].items()}
    return [p.detach().clone() for _, p in params], state, optimizer.step_count


def _same(a: Any, b: Any) -> bool:
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and a[1].keys() == b[1].keys()
        and all(torch.equal(x, y) for key in a[1] for x, y in zip(a[1][key], b[1][key]))
        and a[2] == b[2]
    )


def _failing(optimizer: Any, params: list[tuple[str, Any]]) -> tuple[str, bool]:
    before = _snapshot(optimizer, params)
    with pytest.raises(StepFailedError) as caught:
        optimizer.step()
    optimizer.zero_grad()
    return str(caught.value), _same(before, _snapshot(optimizer, params))


def _mid_backward_worker(rank: int, world: int, schedule: Any, victim: str) -> dict[str, Any]:
    optimizer, model, params = _setup_backward(schedule, rank, check_finite=True, overlap_param_gather=True)
    for step in range(2):
        _backward(optimizer, model, step)
        optimizer.step()
        optimizer.zero_grad()
    out: dict[str, Any] = {}
    _backward(optimizer, model, 2, poison=victim if rank == 1 else None)
    out["nan"] = _failing(optimizer, params)
    read = reduction.Round.read

    def broken(self: Any, index: int, grad: Any) -> Any:
        if self.plan.names[index] == victim:
            raise RuntimeError("device lost")
        return read(self, index, grad)

    if rank == 2:
        reduction.Round.read = broken  # type: ignore[method-assign]
    _backward(optimizer, model, 2)
    reduction.Round.read = read  # type: ignore[method-assign]
    out["raise"] = _failing(optimizer, params)
    _backward(optimizer, model, 2)  # the same step with good gradients now succeeds
    optimizer.step()
    optimizer.finish_gather()
    out["params"] = {name: p.detach().clone() for name, p in params}
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_failure_mid_backward_reduction_fails_every_rank_and_applies_nothing() -> None:
    """A rank whose hook meets a bad gradient (NaN with check_finite) or raises while packing
    keeps launching its buckets (nobody hangs); the step then fails on every rank with that
    rank's problem and nothing applied; the same step with good gradients succeeds."""
    schedule = make_schedule(MODEL, 2, 2)
    victim = ordered(schedule)[7].name
    results = run_ranks(_mid_backward_worker, 4, schedule, victim)
    expected = {
        "nan": f"rank 1: non-finite gradient in {victim}",
        "raise": f"rank 2: packing the gradient of {victim}: RuntimeError: device lost",
    }
    for case, fragment in expected.items():
        messages = {result[case][0] for result in results}
        assert len(messages) == 1, f"{case}: every rank raises the same error: {messages}"
        message = messages.pop()
        assert fragment in message and "after reducing its gradients, nothing was applied on any rank" in message, (
            message
        )
        assert all(result[case][1] for result in results), f"{case}: parameters or state changed"
    compare(schedule, [result["params"] for result in results], reference_run(schedule, 3, {}))


def _dying_worker(rank: int, world: int, schedule: Any) -> dict[str, Any]:
    optimizer, model, params = _setup_backward(schedule, rank)
    _backward(optimizer, model, 0)
    optimizer.step()
    optimizer.zero_grad()
    if rank == 3:  # dies in the middle of backward, after its first buckets were launched
        params[len(params) // 2][1].register_post_accumulate_grad_hook(lambda _: os._exit(1))
    _backward(optimizer, model, 1)
    return timed_collective_failure(optimizer)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_dying_mid_backward_makes_every_other_rank_raise_within_the_timeout() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    outcomes = run_ranks_raw(_dying_worker, 4, schedule, timeout=60)
    assert outcomes[3][0] == "died"
    for rank in range(3):
        status, result = outcomes[rank]
        assert status == "ok", result
        assert result["error"] is not None and "restart from the last checkpoint" in result["error"], result
        assert result["elapsed"] < 60, f"rank {rank} took {result['elapsed']:.1f} s"  # only a hang reaches 60 s


def _irregular_worker(rank: int, world: int, schedule: Any, overlap: bool) -> dict[str, Any]:
    """Backward passes a script may run around the step, with overlap on or off."""
    optimizer, model, params = _setup_backward(schedule, rank, overlap_grad_reduce=overlap)
    stale = []
    _backward(optimizer, model, 0)
    optimizer.zero_grad()  # a backward nobody steps: its reduction is finished and dropped
    _backward(optimizer, model, 0)
    optimizer.step()
    optimizer.zero_grad()
    _backward(optimizer, model, 1)
    with optimizer.no_sync():  # changes gradients already being reduced: redone at the step
        _backward(optimizer, model, 1)
    stale.append(optimizer.engine.round is not None and bool(optimizer.engine.round.stale))
    optimizer.step()
    optimizer.zero_grad()
    _backward(optimizer, model, 2)
    optimizer.clip_grad_norm_(1.0)
    _backward(optimizer, model, 2)  # after clipping: the step uses the clipped reduction, as without overlap
    optimizer.step()
    return {"params": {name: p.detach().clone() for name, p in params}, "stale": stale}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_irregular_backward_sequences_give_what_overlap_off_gives() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    off, on = (run_ranks(_irregular_worker, 4, schedule, overlap) for overlap in (False, True))
    for rank in range(4):
        assert all(torch.equal(on[rank]["params"][n], off[rank]["params"][n]) for n in off[rank]["params"]), rank
        assert on[rank]["stale"] == [True] and off[rank]["stale"] == [False]


def _bad_options_worker(rank: int, world: int, schedule: Any) -> list[str]:
    dp_group, tp_group = make_groups(schedule.request.dp, schedule.request.tp)
    full = full_params(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank % 2, 2))) for e in ordered(schedule)]
    messages = []
    attempts = [
        {"overlap_param_gather": True},
        {"overlap_grad_reduce": "yes"},
        {"overlap_param_gather": True, "model": GradModel(params[1:])},  # misses a parameter
    ]
    for options in attempts:
        try:
            CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group, **options)
        except (ValueError, ScheduleMismatchError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    optimizer = CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group)
    try:
        optimizer.grad_ready(torch.nn.Parameter(torch.zeros(2)))
    except ValueError as error:
        messages.append(f"ValueError: {error}")
    return messages


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_bad_overlap_options_fail_clearly_on_every_rank() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    results = run_ranks(_bad_options_worker, 4, schedule)
    first = ordered(schedule)[0].name
    assert all(result == results[0] for result in results)
    assert (
        results[0][0]
        == "ValueError: overlap_param_gather=True needs model=<the torch.nn.Module whose parameters are optimized>"
    )
    assert results[0][1] == "ValueError: overlap_grad_reduce must be True or False, got 'yes'"
    assert results[0][2].startswith("ScheduleMismatchError: canzona: the schedule does not fit this run")
    assert f"{first}: not a parameter of the model given as model=" in results[0][2]
    assert results[0][3] == "ValueError: grad_ready: not a parameter this optimizer updates"


def _edited_worker(rank: int, world: int, schedule: Any, overlap: bool, edit: str) -> dict[str, Any]:
    """One backward, an edit of rank 0's gradients after it, one step."""
    optimizer, model, params = _setup_backward(schedule, rank, overlap_grad_reduce=overlap)
    _backward(optimizer, model, 0)
    matrix = next(param for name, param in params if param.ndim == 2 and param.shape[0] > 1)
    if rank == 0 and edit == "none":
        matrix.grad = None  # counts as a zero gradient on this rank
    elif rank == 0 and edit == "swap":
        matrix.grad[[0, 1]] = matrix.grad[[1, 0]].clone()  # in place; sum and 2-norm unchanged
    optimizer.step()
    return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("edit", ["none", "swap"])
def test_gradients_edited_after_backward_on_one_rank_count_with_overlap_on(edit: str) -> None:
    """A gradient set to None, or rows swapped in place, on one DP rank after backward: overlap
    on (backward already reduced it) gives exactly what overlap off gives, and the edit matters."""
    schedule = make_schedule(MODEL, 1, 2)
    off, on = (run_ranks(_edited_worker, 2, schedule, overlap, edit) for overlap in (False, True))
    unedited = run_ranks(_edited_worker, 2, schedule, True, "")
    for rank in range(2):
        assert all(torch.equal(on[rank][n], off[rank][n]) for n in off[rank]), rank
        assert any(not torch.equal(on[rank][n], unedited[rank][n]) for n in off[rank]), rank


def _lr_worker(rank: int, world: int, schedule: Any) -> dict[str, Any]:
    optimizer, model, params = _setup_backward(schedule, rank)
    _backward(optimizer, model, 0)
    if rank == 0:
        optimizer.param_groups[0]["lr"] = 0.05
    before = [p.detach().clone() for _, p in params]
    try:
        optimizer.step()
        error = None
    except StepFailedError as failure:
        error = str(failure)
    return {"error": error, "unchanged": all(torch.equal(b, p) for b, (_, p) in zip(before, params))}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_learning_rate_set_on_one_rank_only_fails_every_rank() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    for result in run_ranks(_lr_worker, 4, schedule):
        assert result["error"] is not None and "hyperparameters" in result["error"] and result["unchanged"], result
