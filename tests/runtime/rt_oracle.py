"""The clean oracle: deterministic full parameters and per-DP-rank gradients (seeded), a
distributed worker that trains the TP shards with a runtime optimizer, and the single-process
reference on the full tensors with the DP-mean gradients."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer
from canzona.runtime.schedule import DTYPES
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import ParamEntry, Schedule

from rt_harness import labelled, optimizer_groups

STRATEGIES = {"canzona": CanzonaOptimizer, "tp-sc": TpScOptimizer, "dp-sc": DpScOptimizer}

# DP 4 in the backend's order: (schedule settings, hyperparameters, rtol; atol = rtol / 10).
# Measured (benchmarks/numerics.py, 6 steps; the rtol the check needs against the fp32
# reference, and the fp32 reference's own against fp64): Muon 3.3e-7 (4.5e-7); Shampoo with
# matrix_eps 1e-3: 1.2e-5 (1.1e-5); SOAP with max_precond_dim 16: 1.4e-4, DP-SC 7.4e-4 (4.2e-4).
# The tests' own Shampoo/SOAP settings are ill-conditioned (rank-deficient statistics: a 5e-8
# change of the mean gradient moves Shampoo by 4e-3 and SOAP by O(1), and the fp32 reference is
# as far from fp64), so no tolerance under O(1) would mean anything there.
DP4: dict[str, tuple[dict[str, Any], dict[str, Any], float]] = {
    "muon": ({}, {}, 1e-5),
    "shampoo": ({"block_size": 16, "precondition_frequency": 2}, {"matrix_eps": 1e-3}, 5e-5),
    "soap": ({"precondition_frequency": 2, "max_precond_dim": 16}, {}, 2e-3),
}


def _generator(*key: Any) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def full_params(schedule: Schedule) -> dict[str, torch.Tensor]:
    """Full (gathered-layout) initial values of every parameter, in its schedule dtype."""
    return {
        e.name: (torch.randn(e.shape, generator=_generator("init", e.name)) * 0.1).to(DTYPES[e.dtype])
        for e in schedule.params
    }


def full_grad(entry: ParamEntry, step: int, dp_rank: int) -> torch.Tensor:
    """DP rank `dp_rank`'s full gradient of `entry` at `step` (a shared part plus a per-rank
    part), in the parameter's dtype."""
    shared = torch.randn(entry.shape, generator=_generator("grad", entry.name, step))
    own = torch.randn(entry.shape, generator=_generator("noise", entry.name, step, dp_rank))
    return (shared + 0.5 * own).to(DTYPES[entry.dtype])


def shard(full: torch.Tensor, entry: ParamEntry, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full tensor."""
    return full if entry.tp_dim is None else full.chunk(tp, dim=entry.tp_dim)[tp_rank].contiguous()


def ordered(schedule: Schedule, dp_rank: int | None = None) -> list[ParamEntry]:
    """The schedule's parameters in registration order (those DP rank `dp_rank` holds: every
    dense one and its EP rank's experts)."""
    return sorted((e for e in schedule.params if dp_rank is None or holds(schedule, e, dp_rank)), key=lambda e: e.index)


def holds(schedule: Schedule, entry: ParamEntry, dp_rank: int) -> bool:
    """Whether DP rank `dp_rank` holds `entry` (an expert: only at its EP rank, dp_rank mod ep)."""
    return entry.ep_rank is None or entry.ep_rank == dp_rank % schedule.request.ep


def dp_mean(schedule: Schedule, entry: ParamEntry, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The gradient the step sees, from every DP rank's own (None: none): the fp32 sum over the
    ranks holding the parameter, divided by the DP size (an expert's too, Megatron's scaling)."""
    held = [
        torch.zeros(entry.shape) if g is None else g.float() for d, g in enumerate(grads) if holds(schedule, entry, d)
    ]
    return torch.stack(held).sum(0) / schedule.request.dp


def train_worker(
    rank: int, world: int, schedules: list[Schedule], steps: int, strategy: str, hp: dict[str, Any]
) -> list[dict[str, torch.Tensor]]:
    """Train the shards of every schedule in turn on this rank; each schedule's final shards."""
    out = []
    for schedule in schedules:
        dp, tp = schedule.request.dp, schedule.request.tp
        assert world == dp * tp
        dp_rank, tp_rank = divmod(rank, tp)
        groups = optimizer_groups(schedule)
        full = full_params(schedule)
        entries = ordered(schedule, dp_rank)
        params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, tp))) for e in entries]
        optimizer = STRATEGIES[strategy](params, schedule, **groups, **hp)
        for step in range(steps):
            for entry, (_, param) in zip(entries, params):
                param.grad = shard(full_grad(entry, step, dp_rank), entry, tp_rank, tp)
            optimizer.step()
            optimizer.zero_grad()
        out.append({name: param.detach().clone() for name, param in params})
    return out


def reference_run(schedule: Schedule, steps: int, hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference optimizer on the full tensors with the DP-mean gradients (in fp32, as
    the runtime reduces them)."""
    dp = schedule.request.dp
    full = full_params(schedule)
    entries = ordered(schedule)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in entries]
    optimizer = ReferenceOptimizer(params, schedule, **hp)
    for step in range(steps):
        grads = {e.name: dp_mean(schedule, e, [full_grad(e, step, d) for d in range(dp)]) for e in entries}
        optimizer.step(grads)
    return {name: param.detach() for name, param in params}


def compare(
    schedule: Schedule,
    results: list[dict[str, torch.Tensor]],
    reference: dict[str, torch.Tensor],
    rtol: float | None = 1e-5,
    atol: float | None = 1e-6,
) -> None:
    """Every rank's every shard equals the reference's shard of the same parameter."""
    tp = schedule.request.tp
    for rank, shards in enumerate(results):
        tp_rank = rank % tp
        for entry in ordered(schedule, rank // tp):
            expected = shard(reference[entry.name], entry, tp_rank, tp)
            got = shards[entry.name]
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=labelled(f"rank {rank} {entry.name}"))


# --- Scenarios: one training recipe run by the runtime on forked ranks and by the reference ---

GroupsOf = Callable[[list[tuple[str, torch.nn.Parameter]]], Any]
HasGrad = Callable[[str, int, int], bool]  # (name, step, dp rank)


@dataclass
class Scenario:
    """A training recipe: schedule, steps, defaults and what a script does around the step
    (groups, LR scheduler, clipping, frozen parameters, missing gradients, micro-batches,
    Megatron's main_grad, a meta default device)."""

    schedule: Schedule
    steps: int = 4
    hp: dict[str, Any] = field(default_factory=dict)
    strategy: str = "canzona"
    groups: GroupsOf | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    max_norm: float | None = None
    has_grad: HasGrad | None = None
    frozen: frozenset[str] = frozenset()
    micro_batches: int = 1
    grad_attr: str = "grad"
    unit_norms: bool = False  # 1-D parameters start at 1.0, as real norm weights do
    meta: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    backward: bool = False  # gradients from a real backward through `GradModel` (gradient hooks fire)
    no_sync: bool = True  # with backward: the first micro-batches inside optimizer.no_sync()


def scenario_init(scenario: Scenario) -> dict[str, torch.Tensor]:
    """Full initial values (norm weights at 1.0 with `unit_norms`)."""
    full = full_params(scenario.schedule)
    if scenario.unit_norms:
        for e in scenario.schedule.params:
            if len(e.shape) == 1:
                full[e.name] = torch.ones(e.shape, dtype=DTYPES[e.dtype])
    return full


def _present(scenario: Scenario, name: str, step: int, dp_rank: int) -> bool:
    return name not in scenario.frozen and (scenario.has_grad is None or scenario.has_grad(name, step, dp_rank))


def rank_grad(scenario: Scenario, entry: ParamEntry, step: int, dp_rank: int) -> torch.Tensor | None:
    """DP rank `dp_rank`'s accumulated full gradient at `step`: the micro-batch gradients
    summed in the parameter's dtype, as backward accumulates `.grad` (fp32 for main_grad)."""
    if not _present(scenario, entry.name, step, dp_rank):
        return None
    dtype = torch.float32 if scenario.grad_attr == "main_grad" else DTYPES[entry.dtype]
    total = None
    for micro in range(scenario.micro_batches):
        grad = full_grad(entry, step * 100 + micro, dp_rank).to(dtype)
        total = grad if total is None else total + grad
    return total


class Leaf(torch.nn.Module):
    """Holds one parameter; its forward contributes (w · g).sum(), whose gradient is g exactly."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = param

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad).sum().float()


class GradModel(torch.nn.Module):
    """A model whose backward produces chosen gradients: one `Leaf` per parameter, run in
    registration order, so backward reaches the last-registered parameters first, like a real
    network's, and each module's forward pre-hook sees its own parameter."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        self.leaves = torch.nn.ModuleList(Leaf(param) for _, param in params)

    def forward(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        total = torch.zeros((), device="cpu")
        for leaf, grad in zip(self.leaves, grads):
            if grad is not None and leaf.weight.requires_grad:
                total = total + leaf(grad)
        return total


def _micro_grads(scenario: Scenario, step: int, micro: int, dp_rank: int, tp_rank: int) -> list[torch.Tensor | None]:
    """This rank's local gradient of every parameter in micro-batch `micro` (None: none)."""
    tp = scenario.schedule.request.tp
    out: list[torch.Tensor | None] = []
    for entry in ordered(scenario.schedule, dp_rank):
        present = _present(scenario, entry.name, step, dp_rank)
        grad = full_grad(entry, step * 100 + micro, dp_rank) if present else None
        out.append(None if grad is None else shard(grad, entry, tp_rank, tp))
    return out


def emulate_megatron_main_grad(optimizer: Any, params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """What Megatron's DDP does after each backward of a parameter: add `.grad` into the fp32
    `.main_grad`, drop `.grad`, and mark the parameter ready (here: `optimizer.grad_ready`)."""

    def hook(param: torch.nn.Parameter) -> None:
        grad = param.grad.float()
        param.main_grad = grad if param.main_grad is None else param.main_grad + grad  # type: ignore[attr-defined]
        param.grad = None
        optimizer.grad_ready(param)

    for _, param in params:
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def _backward_grads(
    scenario: Scenario, model: GradModel, optimizer: Any, step: int, dp_rank: int, tp_rank: int
) -> None:
    """The step's micro-batches through a real backward (the first ones inside no_sync)."""
    params = [leaf.weight for leaf in model.leaves]
    if scenario.grad_attr == "main_grad":
        for param in params:
            param.main_grad = None  # type: ignore[attr-defined]  # the buffers' owner zeroes them
    for micro in range(scenario.micro_batches):
        with torch.device("cpu"):  # the test's own tensors, also under a meta default device
            grads = _micro_grads(scenario, step, micro, dp_rank, tp_rank)
        last = micro == scenario.micro_batches - 1
        if not any(g is not None for g in grads):
            continue
        if scenario.no_sync and not last:
            with optimizer.no_sync():
                model(grads).backward()
        else:
            model(grads).backward()


def _set_grads(
    scenario: Scenario, params: list[tuple[str, torch.nn.Parameter]], step: int, dp_rank: int, tp_rank: int
) -> None:
    tp = scenario.schedule.request.tp
    with torch.device("cpu"):  # the test's own tensors, also under a meta default device
        for entry, (_, param) in zip(ordered(scenario.schedule, dp_rank), params):
            grad = rank_grad(scenario, entry, step, dp_rank)
            local = None if grad is None else shard(grad, entry, tp_rank, tp)
            if scenario.grad_attr == "main_grad":
                param.main_grad = local  # type: ignore[attr-defined]
            else:
                param.grad = local


def _scenario_rank(scenario: Scenario, rank: int) -> dict[str, Any]:
    schedule = scenario.schedule
    dp, tp = schedule.request.dp, schedule.request.tp
    dp_rank, tp_rank = divmod(rank, tp)
    groups = optimizer_groups(schedule)
    full = scenario_init(scenario)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, tp))) for e in ordered(schedule, dp_rank)]
    for name, param in params:
        param.requires_grad_(name not in scenario.frozen)
        if scenario.grad_attr == "main_grad":
            param.main_grad = None  # type: ignore[attr-defined]
    initial = {name: p.detach().clone() for name, p in params}
    given = scenario.groups(params) if scenario.groups else params
    model = GradModel(params) if scenario.backward else None
    options = {**scenario.options, **({"model": model} if scenario.options.get("overlap_param_gather") else {})}
    if scenario.meta:
        torch.set_default_device("meta")
    try:
        optimizer = STRATEGIES[scenario.strategy](
            given, schedule, **groups, grad_attr=scenario.grad_attr, **scenario.hp, **options
        )
        if model is not None and scenario.grad_attr == "main_grad":
            emulate_megatron_main_grad(optimizer, params)
        scheduler = scenario.scheduler(optimizer) if scenario.scheduler else None
        norms, lrs, skipped_changed, rounds, gathers = [], [], [], [], []
        for step in range(scenario.steps):
            if model is not None:
                _backward_grads(scenario, model, optimizer, step, dp_rank, tp_rank)
            else:
                _set_grads(scenario, params, step, dp_rank, tp_rank)
            hooked = optimizer.engine.round
            rounds.append(None if hooked is None else (hooked.early, hooked.launched, hooked.closed))
            if scenario.max_norm is not None:
                norms.append(float(optimizer.clip_grad_norm_(scenario.max_norm)))
            skipped = [
                (n, p.detach().clone()) for n, p in params if not any(_present(scenario, n, step, d) for d in range(dp))
            ]
            optimizer.step()
            gathers.append(0 if optimizer.engine.gather is None else len(optimizer.engine.gather.pending))
            optimizer.zero_grad()
            skipped_changed += [
                f"{n} at step {step}" for n, before in skipped if not torch.equal(before, dict(params)[n])
            ]
            lrs.append([group["lr"] for group in optimizer.param_groups])
            if scheduler is not None:
                scheduler.step()
        optimizer.finish_gather()
        state = optimizer.state_dict()
    finally:
        if scenario.meta:
            torch.set_default_device(None)
    return {
        "params": {name: p.detach().clone() for name, p in params},
        "frozen_changed": [n for n in scenario.frozen if n in initial and not torch.equal(initial[n], dict(params)[n])],
        "skipped_changed": skipped_changed,
        "norms": norms,
        "lrs": lrs,
        "groups": len(optimizer.param_groups),
        "main": {key: value for key, value in state["tensors"].items() if key.startswith("main/")},
        "param_steps": state["param_steps"],
        "rounds": rounds,  # per step, the reduction backward launched: (by its hooks, in all, closed)
        "gathers": gathers,  # per step, bucket gathers still in flight when step() returned
        "strategy": optimizer.strategy.name,
    }


def scenario_worker(rank: int, world: int, scenarios: list[Scenario]) -> list[dict[str, Any]]:
    """Run every scenario in turn on this rank (one spawn for many cases)."""
    return [_scenario_rank(scenario, rank) for scenario in scenarios]


def scenario_reference(scenario: Scenario) -> dict[str, Any]:
    """The reference optimizer on the full tensors, doing what the scenario's ranks do, with
    each step's gradient the fp32 DP mean of the ranks' (missing ones count as zero; a
    parameter no rank has a gradient for is left out)."""
    schedule = scenario.schedule
    dp = schedule.request.dp
    full = scenario_init(scenario)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in ordered(schedule)]
    for name, param in params:
        param.requires_grad_(name not in scenario.frozen)
    optimizer = ReferenceOptimizer(scenario.groups(params) if scenario.groups else params, schedule, **scenario.hp)
    scheduler = scenario.scheduler(optimizer) if scenario.scheduler else None
    norms, lrs = [], []
    for step in range(scenario.steps):
        grads = {}
        for entry in ordered(schedule):
            per_rank = [rank_grad(scenario, entry, step, d) for d in range(dp)]
            if any(g is not None for d, g in enumerate(per_rank) if holds(schedule, entry, d)):
                grads[entry.name] = dp_mean(schedule, entry, per_rank)
        if scenario.max_norm is not None:
            norms.append(float(optimizer.clip_grad_norm_(scenario.max_norm, grads)))
        optimizer.step(grads)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if scheduler is not None:
            scheduler.step()
    mains = {name: optimizer.state[p]["main"] for name, p in params if "main" in optimizer.state[p]}
    return {
        "params": {name: p.detach() for name, p in params},
        "norms": norms,
        "lrs": lrs,
        "main": mains,
        "groups": len(optimizer.param_groups),
        "param_steps": {name: optimizer.state[p]["step"] for name, p in params if p.requires_grad},
    }


def assemble_main(schedule: Schedule, results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 main copy, full shape, from the chunks the ranks hold."""
    entries = {e.name: e for e in schedule.params}
    out: dict[str, torch.Tensor] = {}
    for result in results:
        for key, logical in result["main"].items():
            name = key.removeprefix("main/")
            target = out.setdefault(name, torch.full(tuple(logical.size), float("nan")))
            for offsets, data in logical.chunks:
                if len(offsets) == 1:
                    target[offsets[0] : offsets[0] + data.numel()] = data
                else:
                    target.copy_(data)
    return {name: _gathered_rows(tensor.view(entries[name].shape), entries[name]) for name, tensor in out.items()}


def _gathered_rows(main: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
    """A matrix main copy is saved with its rows in canonical (submatrix) order: back to the
    gathered TP order the parameters use."""
    if entry.optimizer != "matrix" or not entry.row_blocks:
        return main
    out, row = torch.empty_like(main), 0
    for block in entry.row_blocks:
        for start, stop in block:
            out[start:stop] = main[row : row + stop - start]
            row += stop - start
    return out
