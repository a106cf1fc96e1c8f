"""Gradients are the user's until `step()`: whatever `.grad` holds when the step starts is what
is reduced, with the backward-time reduction on or off, bit for bit.

Each case edits the gradients between backward and the step the way training scripts do:
`torch.nn.utils.clip_grad_norm_` on the model's parameters, `p.grad.mul_(0.5)`,
`p.grad = None`, a gradient hook registered after the optimizer was built (as transformers
registers its TP all-reduce at the first forward), and `torch.amp.GradScaler` with fp16
parameters (the optimizer unscales the reduced gradients; an overflow on one rank skips the
step on every rank). Every case runs with `overlap_grad_reduce` on and off, at DP 2 and at
TP 2 x DP 2, and is compared with the single-process reference fed the mean of the edited
local gradients (clipping by local norms differs per TP rank, so at TP 2 it is only compared
between on and off).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from canzona.runtime import CanzonaOptimizer, StepFailedError
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule

from rt_harness import DATA, make_schedule, optimizer_groups, run_ranks
from rt_oracle import GradModel, compare, full_grad, full_params, ordered, shard

MODEL = DATA / "tiny_moe.json"
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01}
STEPS = 3
SCALE = 256.0  # a power of two: scaled fp16 gradients are exact, so unscaling is too
HALVED = ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight")
DROPPED = "decoder.layers.1.self_attention.linear_proj.weight"
HOOKED = "decoder.layers.0.self_attention.linear_qkv.weight"
CASES = ("clip", "halve", "drop", "late-hook", "scaler")


def edit(case: str, grads: dict[str, torch.Tensor | None]) -> None:
    """What a script does to its local gradients between backward and the step (in place on
    the dict's tensors; `drop` sets one to None)."""
    if case == "clip":
        holders = []
        for grad in grads.values():
            if grad is not None:
                holder = torch.nn.Parameter(torch.zeros_like(grad))
                holder.grad = grad
                holders.append(holder)
        torch.nn.utils.clip_grad_norm_(holders, 1.0)
    elif case == "halve":
        for name in HALVED:
            grads[name].mul_(0.5)  # type: ignore[union-attr]
    elif case == "drop":
        grads[DROPPED] = None
    elif case == "late-hook":
        grads[HOOKED].mul_(2.0)  # type: ignore[union-attr]


def _local_grads(
    schedule: Schedule, step: int, dp_rank: int, tp_rank: int, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    tp = schedule.request.tp
    return {e.name: shard(full_grad(e, step, dp_rank) * scale, e, tp_rank, tp) for e in ordered(schedule, dp_rank)}


def _worker(
    rank: int, world: int, schedule: Schedule, case: str, overlap: bool, overflow_at: int | None
) -> dict[str, Any]:
    tp = schedule.request.tp
    dp_rank, tp_rank = divmod(rank, tp)
    full = full_params(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, tp))) for e in ordered(schedule, dp_rank)]
    model = GradModel(params)
    optimizer = CanzonaOptimizer(params, schedule, **optimizer_groups(schedule), overlap_grad_reduce=overlap, **HP)
    named = dict(params)
    if case == "late-hook":  # after construction, as transformers registers its hook at the first forward

        def double(param: torch.Tensor) -> None:
            param.grad.mul_(2.0)

        named[HOOKED].register_post_accumulate_grad_hook(double)
    scaler = _scaler(case, sharded=overflow_at is not None)
    for step in range(STEPS):
        grads = _local_grads(schedule, step, dp_rank, tp_rank)
        if step == overflow_at and rank == 1:
            grads[HOOKED] = grads[HOOKED].clone().fill_(float("inf"))
        loss = model([grads[name] for name, _ in params])
        (scaler.scale(loss) if scaler else loss).backward()
        if case not in ("late-hook", "scaler"):
            current = {name: p.grad for name, p in params}
            edit(case, current)
            for name, p in params:
                p.grad = current[name]
        if scaler:
            if overflow_at is not None:  # ShardedGradScaler agrees overflows across ranks as it unscales
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in params}


def _scaler(case: str, sharded: bool) -> Any:
    if case != "scaler":
        return None
    if not sharded:
        return torch.amp.GradScaler("cpu", init_scale=SCALE)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu", init_scale=SCALE)


def reference(schedule: Schedule, case: str, overflow_at: int | None = None) -> dict[str, torch.Tensor]:
    """The reference fed, each step, the fp32 mean over DP ranks of the edited gradients of
    whole tensors (what the TP shards' edits amount to, for edits that act elementwise); a step
    where a rank overflowed is skipped."""
    dp = schedule.request.dp
    full = full_params(schedule)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in ordered(schedule)]
    optimizer = ReferenceOptimizer(params, schedule, **HP)
    for step in range(STEPS):
        if step == overflow_at:
            continue
        per_rank = []
        for d in range(dp):
            grads: dict[str, torch.Tensor | None] = {e.name: full_grad(e, step, d) for e in ordered(schedule, d)}
            edit(case, grads)
            per_rank.append(grads)
        mean = {}
        for name in grads:
            present = [g for g in (r[name] for r in per_rank) if g is not None]
            if present:
                mean[name] = (
                    torch.stack(
                        [
                            (g if g is not None else torch.zeros_like(present[0])).float()
                            for g in (r[name] for r in per_rank)
                        ]
                    ).sum(0)
                    / dp
                )
        optimizer.step(mean)
    return {name: p.detach() for name, p in params}


def _schedule(tp: int, dp: int, case: str) -> Schedule:
    return make_schedule(MODEL, tp, dp, dtype="fp16" if case == "scaler" else "fp32")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2)], ids=["dp2", "tp2xdp2"])
def test_edits_between_backward_and_step_are_reduced(tp: int, dp: int) -> None:
    for case in CASES:
        schedule = _schedule(tp, dp, case)
        on, off = (run_ranks(_worker, tp * dp, schedule, case, overlap, None) for overlap in (True, False))
        for rank in range(tp * dp):
            for name in off[rank]:
                assert torch.equal(on[rank][name], off[rank][name]), (
                    f"{case}: overlap on and off differ at rank {rank} {name}"
                )
        if tp == 1 or case != "clip":
            compare(schedule, off, reference(schedule, case), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    """ShardedGradScaler, with `scaler.unscale_(optimizer)` before the step, agrees overflows
    across ranks; canzona skips the step on every rank (nothing applied) and the run goes on
    like the reference without that step."""
    schedule = _schedule(1, 2, "scaler")
    results = run_ranks(_worker, 2, schedule, "scaler", True, 1)
    compare(schedule, results, reference(schedule, "scaler", overflow_at=1), rtol=1e-5, atol=1e-6)


def _diverging_worker(rank: int, world: int, schedule: Schedule) -> str:
    """Plain torch.amp.GradScaler: its overflow check is local, so an overflow on one rank
    changes only that rank's scale; canzona refuses the next step on every rank, in one line."""
    params = [(e.name, torch.nn.Parameter(full_params(schedule)[e.name])) for e in ordered(schedule)]
    model = GradModel(params)
    optimizer = CanzonaOptimizer(params, schedule, **optimizer_groups(schedule), **HP)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(2):
        grads = _local_grads(schedule, step, rank, 0)
        if step == 0 and rank == 1:
            grads[HOOKED] = grads[HOOKED].clone().fill_(float("inf"))
        scaler.scale(model([grads[name] for name, _ in params])).backward()
        try:
            scaler.step(optimizer)
        except StepFailedError as error:
            return str(error)
        scaler.update()
        optimizer.zero_grad()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_plain_grad_scaler_whose_scales_diverge_is_refused_on_every_rank() -> None:
    schedule = _schedule(1, 2, "scaler")
    messages = run_ranks(_diverging_worker, 2, schedule)
    assert messages[0] == messages[1] and "ShardedGradScaler" in messages[0] and "differs across ranks" in messages[0]
