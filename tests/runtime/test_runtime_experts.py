"""Expert parallelism: after several steps every expert and dense parameter equals the
single-process reference, at EP 2 x DP 2 (expert-DP 1), EP 2 x DP 4 (expert-DP 2) and TP 2 x
EP 2; Muon, Shampoo and SOAP with AdamW on the rest (the router is a matrix, as the planner
records it; shared experts and an AdamW router in a parameter list). Dense buckets at DP 4 sum
in the backend's order, so every layout runs the settings and tolerances `DP4` states (measured
against fp64, docs/runtime.md). An expert's gradient is the sum over the DP ranks holding it
divided by the DP size (`rt_oracle.dp_mean`). Also: clipping, gradient gaps, bf16 through a real
backward with both overlaps, all under a meta default device; the construction mismatches; a
DeviceMesh with an EP dim; checkpoints moving from EP 2 to EP 4 and EP 1; the layout per EP rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rt_harness import DATA, labelled, make_schedule, run_ranks
from rt_oracle import (
    DP4,
    Scenario,
    assemble_main,
    compare,
    ordered,
    reference_run,
    scenario_reference,
    scenario_worker,
    shard,
    train_worker,
)

STEPS = 5
MODEL = DATA / "tiny_moe4.json"  # 4 experts, top-2; layer 0 dense
LAYOUTS = {"ep2xdp2": (1, 2, 2), "ep2xdp4": (1, 4, 2), "tp2xep2": (2, 2, 2)}  # (tp, dp, ep)
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}


def ep_schedule(tp: int, dp: int, ep: int, optimizer: str = "muon", **options: Any) -> Any:
    """A schedule of the tiny MoE with several dense and expert buckets."""
    settings = {"bucket_size": 1500 // tp, **DP4[optimizer][0], **options}
    schedule = make_schedule(MODEL, tp, dp, optimizer=optimizer, ep=ep, **settings)
    assert schedule.dp.expert_buckets and len(schedule.dp.buckets) > 1
    return schedule


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_and_dense_match_reference(layout: str, optimizer: str) -> None:
    tp, dp, ep = LAYOUTS[layout]
    schedule = ep_schedule(tp, dp, ep, optimizer)
    assert len(schedule.dp.expert_buckets) > 1
    rtol, hp = DP4[optimizer][2], {**HP, **DP4[optimizer][1]}
    reference = reference_run(schedule, STEPS, hp)
    for strategy in ("canzona", "dp-sc", "tp-sc") if optimizer == "muon" else ("canzona",):
        (results,) = zip(*run_ranks(train_worker, tp * dp, [schedule], STEPS, strategy, hp))
        compare(schedule, list(results), reference, rtol=rtol, atol=rtol / 10)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["ep2xdp4", "tp2xep2"])
def test_shared_experts_and_an_adamw_router_as_the_planner_records_them(layout: str) -> None:
    """A parameter list with a shared expert (dense matrices: reduced over all of DP) and the
    router on AdamW (an AdamW bucket) beside 4 routed experts with fused [gate; up] fc1 rows."""
    tp, dp, ep = LAYOUTS[layout]
    schedule = make_schedule(DATA / "tiny_moe_shared.yaml", tp, dp, ep=ep, bucket_size=1200 // tp)
    entries = {e.name: e for e in schedule.params}
    assert entries["decoder.layers.0.mlp.router.weight"].optimizer == "adamw"
    assert (
        entries["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].ep_rank is None and schedule.dp.expert_buckets
    )
    (results,) = zip(*run_ranks(train_worker, tp * dp, [schedule], STEPS, "canzona", HP))
    compare(schedule, list(results), reference_run(schedule, STEPS, HP), rtol=DP4["muon"][2], atol=DP4["muon"][2] / 10)


EXPERT = "decoder.layers.1.mlp.experts.linear_fc1.weight2"  # on EP rank 1
NO_GRAD_AT = {(EXPERT, 1), ("decoder.layers.1.mlp.router.weight", 2), ("decoder.final_layernorm.weight", 3)}
FROZEN = frozenset(
    {
        "decoder.layers.1.mlp.experts.linear_fc2.weight0",
        "decoder.layers.1.mlp.experts.linear_fc1.weight3",
        "decoder.layers.0.mlp.linear_fc2.weight",
    }
)  # experts of both EP ranks (on every rank holding them)


def _gaps(name: str, step: int, dp_rank: int) -> bool:
    return (name, step) not in NO_GRAD_AT


def ep_scenarios(tp: int, dp: int, ep: int) -> dict[str, Scenario]:
    """Clipping (the global norm counts every expert once, at the DP-mean scale: a wrong expert
    divisor shows here, where Muon and Shampoo updates are scale-free), gradient gaps on an
    expert, frozen experts, and bf16 experts through a real backward with both overlaps; all under a meta
    default device, so the EP path names every tensor's device."""
    return {
        "clip-gaps-frozen": Scenario(
            ep_schedule(tp, dp, ep), steps=5, hp=HP, max_norm=5.0, has_grad=_gaps, frozen=FROZEN, meta=True
        ),
        "bf16-backward-overlap": Scenario(
            ep_schedule(tp, dp, ep, dtype="bf16"),
            steps=5,
            hp=HP,
            max_norm=5.0,
            meta=True,
            backward=True,
            micro_batches=2,
            options={"overlap_param_gather": True},
        ),
    }


def _check_scenario(name: str, scenario: Scenario, results: list[dict[str, Any]]) -> None:
    schedule, tp = scenario.schedule, scenario.schedule.request.tp
    reference = scenario_reference(scenario)
    if schedule.params[0].dtype == "fp32":
        compare(
            schedule, [r["params"] for r in results], reference["params"], rtol=DP4["muon"][2], atol=DP4["muon"][2] / 10
        )
    else:  # main copies equal the reference's; each bf16 parameter is its main copy rounded
        main = assemble_main(schedule, results)
        assert set(main) == {e.name for e in schedule.params if e.name not in scenario.frozen}
        for param, expected in reference["main"].items():
            torch.testing.assert_close(
                main[param], expected, rtol=1e-5, atol=1e-6, msg=labelled(f"{name}: main copy of {param}")
            )
        for rank, result in enumerate(results):
            for entry in ordered(schedule, rank // tp):
                rounded = shard(main[entry.name], entry, rank % tp, tp).to(torch.bfloat16)
                assert torch.equal(result["params"][entry.name], rounded), f"{name}: {entry.name} on rank {rank}"
    steps = {n: s for n, s in reference["param_steps"].items() if s != scenario.steps}
    for rank, result in enumerate(results):
        assert result["frozen_changed"] == [], f"{name} rank {rank}: frozen parameters moved"
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5), f"{name} rank {rank}: clip norms"
        assert result["skipped_changed"] == [], f"{name} rank {rank}"
        counted = {n: s for n, s in result["param_steps"].items() if n not in scenario.frozen}
        assert counted == steps, f"{name} rank {rank}: step counts (another EP rank's experts too)"
    assert any(norm > scenario.max_norm for norm in reference["norms"]), f"{name}: clipping should bite"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["ep2xdp4", "tp2xep2"])
def test_training_recipes_under_expert_parallelism(layout: str) -> None:
    tp, dp, ep = LAYOUTS[layout]
    cases = ep_scenarios(tp, dp, ep)
    results = run_ranks(scenario_worker, tp * dp, list(cases.values()), timeout=150)
    for index, (name, scenario) in enumerate(cases.items()):
        _check_scenario(name, scenario, [rank[index] for rank in results])


def _mismatches_then_mesh(rank: int, world: int, schedule: Any, steps: int) -> dict[str, Any]:
    """Each mismatch raises on every rank (in one spawn: a refused construction leaves the
    groups usable); then the optimizer built from a DeviceMesh with an EP dim trains."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import CanzonaOptimizer
    from canzona.runtime.process_groups import make_groups as runtime_make_groups

    from rt_harness import GROUP_TIMEOUT
    from rt_oracle import full_grad, full_params

    req = schedule.request
    full = full_params(schedule)

    def params_of(dp_rank: int) -> list[tuple[str, torch.nn.Parameter]]:
        return [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in ordered(schedule, dp_rank)]

    dp_group, tp_group, expert_group = runtime_make_groups(req.dp, req.tp, GROUP_TIMEOUT, ep=req.ep)
    _, _, ep4_group = runtime_make_groups(req.dp, req.tp, GROUP_TIMEOUT, ep=4)
    cases = {
        "ep size": (params_of(rank), {"expert_dp_group": ep4_group}),
        "no expert group": (params_of(rank), {}),
        "wrong rank": (params_of(0 if rank == 1 else rank), {"expert_dp_group": expert_group}),
        "frozen expert": (params_of(rank), {"expert_dp_group": expert_group}),
    }
    if rank == 1:  # rank 3, of the same EP rank, does not freeze it
        next(p for n, p in cases["frozen expert"][0] if ".experts." in n).requires_grad_(False)
    errors = {}
    for name, (params, extra) in cases.items():
        try:
            CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group, **extra)
            errors[name] = "built"
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {error}"
    mesh = init_device_mesh("cpu", (req.dp // req.ep, req.ep, req.tp), mesh_dim_names=("edp", "ep", "tp"))
    params = params_of(rank)
    optimizer = CanzonaOptimizer(params, schedule, mesh=mesh, **HP)
    for step in range(steps):
        for (_, param), entry in zip(params, ordered(schedule, rank)):
            param.grad = full_grad(entry, step, rank)
        optimizer.step()
    return {"errors": errors, "params": {name: p.detach().clone() for name, p in params}}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_mismatches_fail_on_every_rank_and_a_mesh_with_an_ep_dim_works() -> None:
    schedule = ep_schedule(1, 4, 2)
    results = run_ranks(_mismatches_then_mesh, 4, schedule, STEPS)
    expected = {
        "ep size": "the schedule is for EP 2 (expert-DP 2), but the expert-DP group has 1 ranks (EP 4)",
        "no expert group": "the schedule is for expert parallelism (ep 2): pass expert_dp_group=",
        "wrong rank": "rank 1: experts on the wrong rank: this is EP rank 1 "
        "(DP rank 1 = expert-DP rank 0 x ep 2 + EP rank 1), "
        "but it was given decoder.layers.1.mlp.experts.linear_fc1.weight0 (EP rank 0)",
        "frozen expert": "ranks optimize different parameters (not optimized: "
        "decoder.layers.1.mlp.experts.linear_fc1.weight2 on rank 1; none on rank 3)",
    }
    for rank, result in enumerate(results):
        for name, fragment in expected.items():
            message = result["errors"][name]
            assert message.startswith("ScheduleMismatchError: canzona: ") and fragment in message, (
                f"rank {rank} {name}: {message}"
            )
    compare(
        schedule,
        [r["params"] for r in results],
        reference_run(schedule, STEPS, HP),
        rtol=DP4["muon"][2],
        atol=DP4["muon"][2] / 10,
    )


def _ep_move_worker(
    rank: int,
    world: int,
    first: Any,
    second: Any,
    folder: str,
    hp: dict[str, Any],
    steps: tuple[int, int],
    strategy: str,
) -> dict[str, Any]:
    """K steps under `first` (by `strategy`), save, gather the parameters, load under `second`
    (another EP size: experts change ranks) into canzona, M more steps."""
    import torch.distributed as dist

    from canzona.runtime import CanzonaOptimizer, load_checkpoint, save_checkpoint

    from rt_harness import optimizer_groups
    from rt_oracle import STRATEGIES, full_grad, full_params

    def train(optimizer: Any, schedule: Any, params: list[tuple[str, Any]], span: range) -> None:
        for step in span:
            for (_, param), entry in zip(params, ordered(schedule, rank)):
                param.grad = full_grad(entry, step, rank)
            optimizer.step()
            optimizer.zero_grad()

    k, m = steps
    full = full_params(first)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in ordered(first, rank)]
    optimizer = STRATEGIES[strategy](params, first, **optimizer_groups(first), **hp)
    train(optimizer, first, params, range(k))
    save_checkpoint(optimizer, folder)
    held: list[Any] = [None] * world
    dist.all_gather_object(held, {name: p.detach().clone() for name, p in params})
    for values in held:
        full.update(values)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in ordered(second, rank)]
    resumed = CanzonaOptimizer(params, second, **optimizer_groups(second), **hp)
    assert load_checkpoint(resumed, folder)["step"] == k
    train(resumed, second, params, range(k, k + m))
    return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("optimizer", "ep", "strategy"),
    [("muon", 4, "canzona"), ("shampoo", 4, "canzona"), ("muon", 1, "canzona"), ("shampoo", 4, "dp-sc")],
)
def test_a_checkpoint_moves_from_ep2_to_another_ep_size(optimizer: str, ep: int, strategy: str, tmp_path: Any) -> None:
    """EP 2 x DP 4 to EP 4 x DP 4 (and to no EP; and saved by DP-SC, whose expert replicas are
    written by each expert-DP group's first rank). The DP 4 gradients are summed in rank order
    (all_to_all) as the reference sums them, so the comparison checks the move alone (rtol 1e-5)."""
    from canzona.runtime.tools.reference import ReferenceOptimizer
    from canzona.schedules.reshard import reshard_report

    from rt_oracle import dp_mean, full_grad, full_params

    first = ep_schedule(1, 4, 2, optimizer, alpha=0.0)
    second = (
        ep_schedule(1, 4, 4, optimizer, bucket_size=1000)
        if ep == 4
        else make_schedule(MODEL, 1, 4, optimizer=optimizer, **DP4[optimizer][0])
    )
    moved = 6 if ep == 4 else 8  # at EP 4 only expert 0 (its fc1 and fc2) keeps its EP rank
    assert reshard_report(first, second).notes == [
        f"experts: EP 2 -> EP {ep}, {moved} of 8 expert matrices change EP rank"
    ]
    hp, k, m = {**HP, **DP4[optimizer][1]}, 3, 3
    results = run_ranks(
        _ep_move_worker,
        4,
        first,
        second,
        str(tmp_path / "checkpoint"),
        {**hp, "dp_collectives": "all_to_all"},
        (k, m),
        strategy,
    )
    full = full_params(first)
    params = [(e.name, torch.nn.Parameter(full[e.name])) for e in ordered(first)]
    reference = ReferenceOptimizer(params, second, **hp)
    for step in range(k + m):
        schedule = first if step < k else second
        reference.step(
            {e.name: dp_mean(schedule, e, [full_grad(e, step, d) for d in range(4)]) for e in ordered(schedule)}
        )
    # DP-SC all-reduces in the backend's order: its first k steps take DP 4's measured tolerance
    rtol = 1e-5 if strategy == "canzona" else DP4[optimizer][2]
    compare(second, results, {name: p.detach() for name, p in params}, rtol=rtol, atol=rtol / 10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ep_rank_lays_out_its_own_experts_over_its_expert_dp_group(layout: str) -> None:
    from canzona.schedules.layout import EXPERT, build_dp_layout, local_entries

    tp, dp, ep = LAYOUTS[layout]
    schedule = ep_schedule(tp, dp, ep)
    orders = set()
    for ep_rank in range(ep):
        built = build_dp_layout(schedule, ep_rank)
        local = {e.index: e for e in local_entries(schedule, ep_rank)}
        assert {e.ep_rank for e in local.values()} == {None, ep_rank}
        covered: dict[int, list[tuple[int, int]]] = {}
        for rank, pieces in enumerate(built.rank_pieces):
            for piece in pieces:
                covered.setdefault(piece.param, []).append((piece.src, piece.src + piece.length))
                if local[piece.param].ep_rank is not None:
                    assert rank % ep == ep_rank, f"expert {local[piece.param].name} sliced to DP rank {rank}"
        for index, entry in local.items():  # every local element exactly once
            spans = sorted(covered[index])
            assert (
                spans[0][0] == 0 and spans[-1][1] == entry.numel and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            )
        assert built.total == sum(b.numel for b in built.buckets)
        experts = [b for b in built.buckets if b.kind == EXPERT]
        assert experts and all(b.dp_ranks == tuple(o * ep + ep_rank for o in range(dp // ep)) for b in experts)
        assert all(local[p].ep_rank == ep_rank for b in experts for p in b.params)
        orders.add(
            tuple((built.buckets[b].kind, built.buckets[b].index) for b in built.reduce_order + built.gather_order)
        )
    assert len(orders) == 1, "every EP rank issues the buckets in one order"
