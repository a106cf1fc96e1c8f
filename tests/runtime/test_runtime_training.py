"""What a training script does around the step, on real ranks, against the single-process
reference doing the same: parameter groups (no decay for 1-D parameters and embeddings), LR
schedulers driving every group, global-norm clipping, frozen and gradient-less parameters,
gradient accumulation, Megatron's main_grad, bf16 parameters with fp32 main copies, and the
baselines under all of it. At TP 2 x DP 2 every scenario runs under a meta default device
(`torch.set_default_device("meta")` after the parameters exist): a tensor the runtime made
without naming its device would land on meta and fail, so this also proves device discipline.
Each layout runs all its scenarios in one spawn of its ranks."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, OneCycleLR, SequentialLR

from canzona.schedules.format import Schedule

from rt_harness import DATA, labelled, make_schedule, run_ranks
from rt_oracle import Scenario, assemble_main, compare, ordered, scenario_reference, scenario_worker, shard

MODEL = DATA / "tiny_moe.json"
LAYOUTS = {"tp2xdp2": (2, 2), "dp2": (1, 2), "tp2": (2, 1)}
HP = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 0.01, "adamw_weight_decay": 0.05}
SETTINGS: dict[str, dict[str, Any]] = {
    "muon": {},
    "shampoo": {"block_size": 16, "precondition_frequency": 2},
    "soap": {"precondition_frequency": 2, "max_precond_dim": 40},
}
FROZEN = frozenset({"decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.1.pre_mlp_layernorm.weight"})
NO_GRAD_AT = {  # (parameter, step): no rank has a gradient; (parameter, step, dp rank): only that one has
    ("decoder.layers.0.self_attention.linear_qkv.weight", 1),
    ("decoder.final_layernorm.weight", 2),
    ("decoder.layers.1.mlp.router.weight", 0),
}
ONE_RANK_AT = {("decoder.layers.1.self_attention.linear_proj.weight", 2, 0), ("output_layer.weight", 3, 1)}


def decay_groups(params: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The usual recipe: decay matrices and the output layer, not 1-D parameters or embeddings."""
    no_decay = [(n, p) for n, p in params if p.dim() == 1 or "embedding" in n]
    decay = [(n, p) for n, p in params if not (p.dim() == 1 or "embedding" in n)]
    return [
        {"params": decay, "weight_decay": 0.1, "adamw_weight_decay": 0.1, "lr": 0.03},
        {"params": no_decay, "adamw_weight_decay": 0.0, "adamw_lr": 0.005},
    ]


def warmup_cosine(optimizer: torch.optim.Optimizer) -> Any:
    return SequentialLR(
        optimizer, [LinearLR(optimizer, 0.2, 1.0, total_iters=2), CosineAnnealingLR(optimizer, T_max=4)], milestones=[2]
    )


def one_cycle(optimizer: torch.optim.Optimizer) -> Any:
    return OneCycleLR(
        optimizer, max_lr=[2 * g["lr"] for g in optimizer.param_groups], total_steps=6, cycle_momentum=False
    )


def halving(optimizer: torch.optim.Optimizer) -> Any:
    return LambdaLR(optimizer, lambda step: 0.5**step)


def per_group(optimizer: torch.optim.Optimizer) -> Any:
    """One function per group the script passed (decay_groups: two), as LambdaLR takes them."""
    return LambdaLR(optimizer, [lambda step: 0.5**step, lambda step: 1.0 / (1 + step)])


def gradient_gaps(name: str, step: int, dp_rank: int) -> bool:
    if (name, step) in NO_GRAD_AT:
        return False
    return not any((name, step) == (n, s) for n, s, _ in ONE_RANK_AT) or (name, step, dp_rank) in ONE_RANK_AT


@cache
def _schedule(tp: int, dp: int, optimizer: str, dtype: str = "fp32") -> Schedule:
    return make_schedule(MODEL, tp, dp, optimizer=optimizer, dtype=dtype, **SETTINGS[optimizer])


def scenarios(tp: int, dp: int) -> dict[str, Scenario]:
    """Every recipe this layout runs (meta default device at TP 2 x DP 2)."""
    meta = (tp, dp) == (2, 2)
    out = {
        "groups-scheduler-clip": Scenario(
            _schedule(tp, dp, "muon"),
            steps=5,
            hp=HP,
            groups=decay_groups,
            scheduler=warmup_cosine,
            max_norm=5.0,
            meta=meta,
        ),
        "frozen-and-gradient-gaps": Scenario(
            _schedule(tp, dp, "shampoo"), steps=4, hp=HP, frozen=FROZEN, has_grad=gradient_gaps, meta=meta
        ),
        "accumulation-one-cycle": Scenario(
            _schedule(tp, dp, "soap"),
            steps=4,
            hp=HP,
            groups=decay_groups,
            scheduler=one_cycle,
            micro_batches=3,
            meta=meta,
        ),
        "main-grad-clip": Scenario(
            _schedule(tp, dp, "muon"), steps=3, hp=HP, grad_attr="main_grad", max_norm=50.0, meta=meta
        ),
        "per-group-lambdas": Scenario(
            _schedule(tp, dp, "muon"), steps=3, hp=HP, groups=decay_groups, scheduler=per_group, meta=meta
        ),
        "bf16": Scenario(
            _schedule(tp, dp, "muon", "bf16"),
            steps=5,
            hp={**HP, "adamw_lr": 1e-3},
            groups=decay_groups,
            scheduler=halving,
            max_norm=5.0,
            unit_norms=True,
            meta=meta,
        ),
    }
    if meta:
        # canzona's own optimizer on a schedule whose TP update is replicated (every TP rank
        # updates every matrix its DP rank owns)
        out["replicated-tp-update-gaps"] = Scenario(
            make_schedule(MODEL, tp, dp, optimizer="shampoo", tp_update="replicated", **SETTINGS["shampoo"]),
            steps=4,
            hp=HP,
            groups=decay_groups,
            has_grad=gradient_gaps,
            meta=True,
        )
        for strategy in ("tp-sc", "dp-sc"):
            # Muon: clipping scales by a norm summed in another order than the reference's,
            # which SOAP's eigenbases amplify past rtol 1e-5 (2.5e-5 measured after 3 steps).
            out[f"{strategy}-bf16-clip"] = Scenario(
                _schedule(tp, dp, "muon", "bf16"),
                steps=3,
                hp=HP,
                strategy=strategy,
                groups=decay_groups,
                max_norm=5.0,
                has_grad=gradient_gaps,
                meta=True,
            )
    return out


def _check_fp32(name: str, scenario: Scenario, results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    compare(scenario.schedule, [r["params"] for r in results], reference["params"])


def _check_bf16(name: str, scenario: Scenario, results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """fp32 main copies equal the reference's (rtol 1e-5); each bf16 parameter is exactly its
    main copy rounded; the bf16 values equal the reference's but where the two fp32 main copies
    round to neighbouring bf16 values (within one bf16 step)."""
    schedule, tp = scenario.schedule, scenario.schedule.request.tp
    main = assemble_main(schedule, results)
    assert set(main) == {e.name for e in schedule.params if e.name not in scenario.frozen}
    for param, expected in reference["main"].items():
        torch.testing.assert_close(
            main[param], expected, rtol=1e-5, atol=1e-6, msg=labelled(f"{name}: main copy of {param}")
        )
    for rank, result in enumerate(results):
        for entry in ordered(schedule):
            got = result["params"][entry.name]
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, shard(main[entry.name], entry, rank % tp, tp).to(torch.bfloat16)), (
                f"{name}: {entry.name} is not its main copy rounded"
            )
            expected = shard(reference["params"][entry.name], entry, rank % tp, tp)
            torch.testing.assert_close(
                got.float(),
                expected.float(),
                rtol=2**-7,
                atol=0.0,
                msg=labelled(f"{name} rank {rank} {entry.name}"),
            )
    if scenario.unit_norms:  # AdamW steps of lr 1e-3 < half a bf16 step at 1.0: only main copies move them
        norms = [e.name for e in schedule.params if len(e.shape) == 1 and e.name not in scenario.frozen]
        moved = sum(int((results[0]["params"][n] != 1.0).sum()) for n in norms) / sum(
            results[0]["params"][n].numel() for n in norms
        )
        assert moved > 0.5, f"{name}: only {moved:.0%} of the bf16 norm weights moved"


def _check(layout: str, name: str, scenario: Scenario, results: list[dict[str, Any]]) -> None:
    reference = scenario_reference(scenario)
    dtype = scenario.schedule.params[0].dtype
    (_check_bf16 if dtype == "bf16" else _check_fp32)(name, scenario, results, reference)
    expected = "canzona-replicated" if scenario.schedule.tp.update == "replicated" else scenario.strategy
    for rank, result in enumerate(results):
        assert result["strategy"] == expected, name
        assert result["groups"] == reference["groups"] == len(scenario.groups([]) if scenario.groups else [0]), name
        assert result["lrs"] == reference["lrs"], f"{name} rank {rank}: group learning rates"
        assert result["frozen_changed"] == [] and result["skipped_changed"] == [], f"{name} rank {rank}: {result}"
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5), f"{name} rank {rank}: clip norms"
        steps = {n: s for n, s in reference["param_steps"].items() if s != scenario.steps}
        assert {n: s for n, s in result["param_steps"].items() if n not in scenario.frozen} == steps, name
    if scenario.scheduler is not None:
        lrs = results[0]["lrs"]
        assert all(len({step[g] for step in lrs}) > 1 for g in range(len(lrs[0]))), (
            f"{name}: the scheduler drove every group"
        )
    if scenario.max_norm is not None:
        assert any(norm > scenario.max_norm for norm in reference["norms"]), f"{name}: clipping should bite"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_recipes_match_the_reference(layout: str) -> None:
    tp, dp = LAYOUTS[layout]
    cases = scenarios(tp, dp)
    results = run_ranks(scenario_worker, tp * dp, list(cases.values()), timeout=200)
    for index, (name, scenario) in enumerate(cases.items()):
        _check(layout, name, scenario, [rank[index] for rank in results])


def test_recipes_are_what_they_claim() -> None:
    """The groups split as documented and the gradient gaps cover both kinds of parameter."""
    schedule = _schedule(2, 2, "muon")
    entries = {e.name: e for e in schedule.params}
    params = [(e.name, torch.nn.Parameter(torch.zeros(e.shape))) for e in ordered(schedule)]
    decay, no_decay = decay_groups(params)
    assert {entries[n].optimizer for n, _ in decay["params"]} == {"matrix", "adamw"}
    assert {entries[n].optimizer for n, _ in no_decay["params"]} == {"adamw"}
    assert {entries[n].optimizer for n, _ in NO_GRAD_AT} == {"matrix", "adamw"}
    assert any(entries[n].tp_dim is None and entries[n].optimizer == "matrix" for n, _ in NO_GRAD_AT)
    assert all(not gradient_gaps(n, s, d) for n, s in NO_GRAD_AT for d in range(2))
    assert math.isclose(0.5**3, halving(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)).lr_lambdas[0](3))
