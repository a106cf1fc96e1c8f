"""The torch.optim contract on real ranks: bad hyperparameters, groups and gradients fail with
one clear error on every rank before any collective (and change nothing); closures, hooks and
zero_grad behave as in torch.optim; torch.distributed.checkpoint's state_dict helpers refuse
with a pointer to save_checkpoint; a bf16 run resumes bit for bit from state_dict and from a
checkpoint (main copies, groups and scheduler included); reload_model_params re-syncs main copies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from canzona.runtime import CanzonaOptimizer, ScheduleMismatchError, StepFailedError, load_checkpoint, save_checkpoint
from canzona.schedules.format import Schedule

from rt_harness import DATA, LONG_TIMEOUT, REFUSAL_S, make_groups, make_schedule, run_ranks
from rt_oracle import full_grad, full_params, ordered, shard

MODEL = DATA / "tiny_moe.json"
Params = list[tuple[str, torch.nn.Parameter]]


def _params(schedule: Schedule, rank: int) -> Params:
    tp = schedule.request.tp
    full = full_params(schedule)
    return [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank % tp, tp))) for e in ordered(schedule)]


def _grads(schedule: Schedule, params: Params, step: int, rank: int) -> None:
    tp = schedule.request.tp
    for entry, (_, param) in zip(ordered(schedule), params):
        param.grad = shard(full_grad(entry, step, rank // tp), entry, rank % tp, tp)


def _norms_only(params: Params) -> list[dict[str, Any]]:
    return [
        {"params": [(n, p) for n, p in params if p.dim() > 1]},
        {"params": [(n, p) for n, p in params if p.dim() == 1]},
    ]


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _construction_cases(schedule: Schedule, rank: int, groups: tuple[Any, Any]) -> dict[str, str]:
    def build(params: Any, **options: Any) -> Any:
        return lambda: CanzonaOptimizer(params, schedule, dp_group=groups[0], tp_group=groups[1], **options)

    params = _params(schedule, rank)
    matrices, norms = _norms_only(params)
    frozen = _params(schedule, rank)
    if rank == 1:
        frozen[3][1].requires_grad_(False)
    cases = {
        "negative lr": build(params, lr=-0.1),
        "negative group lr": build([{**matrices, "lr": -1.0}, norms]),
        "negative lr on rank 2": build(params, lr=-0.1 if rank == 2 else 0.02),
        "a parameter in two groups": build([matrices, {"params": matrices["params"][:1] + norms["params"]}]),
        "a name not in the schedule": build(
            [matrices, {"params": norms["params"] + [("bogus.weight", torch.nn.Parameter(torch.zeros(2)))]}]
        ),
        "an unknown group key": build([{**matrices, "momentun": 0.9}, norms]),
        "a key for absent parameters": build([matrices, {**norms, "weight_decay": 0.0}]),
        "a betas key": build(params, adamw_betas=(0.9, 1.5)),
        "a missing grad_attr": build(params, grad_attr="main_grad"),
        "unnamed parameters": build([p for _, p in params]),
        "ranks freezing differently": build(frozen),
    }
    out = {}
    for name, call in cases.items():
        dist.barrier()
        out[name] = _outcome(call)
    return out


def _snapshot(optimizer: CanzonaOptimizer, params: Params) -> Any:
    state = optimizer.state_dict()
    tensors = {key: [data.clone() for _, data in value.chunks] for key, value in state["tensors"].items()}
    return [p.detach().clone() for _, p in params], tensors, optimizer.step_count


def _same(before: Any, after: Any) -> bool:
    same_params = all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    same_state = before[1].keys() == after[1].keys() and all(
        torch.equal(a, b) for key in before[1] for a, b in zip(before[1][key], after[1][key])
    )
    return same_params and same_state and before[2] == after[2]


def _step_cases(schedule: Schedule, rank: int, groups: tuple[Any, Any]) -> dict[str, tuple[str, bool]]:
    params = _params(schedule, rank)
    optimizer = CanzonaOptimizer(_norms_only(params), schedule, dp_group=groups[0], tp_group=groups[1])
    _grads(schedule, params, 0, rank)
    optimizer.step()
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList([p for _, p in params])

    def bad_lr() -> None:
        kept = optimizer.param_groups[1]["adamw_lr"]
        optimizer.param_groups[1]["adamw_lr"] = -1.0 if rank == 3 else 0.01
        try:
            optimizer.step()
        finally:
            optimizer.param_groups[1]["adamw_lr"] = kept

    def closure_fails() -> None:
        def closure() -> float:
            if rank == 1:
                raise ValueError("loss is nan")
            return 1.0

        optimizer.step(closure)

    def closure_after_clip() -> None:
        optimizer.clip_grad_norm_(1.0)
        optimizer.step(lambda: 1.0)

    for _, param in params:
        param.main_grad = None  # type: ignore[attr-defined]
    megatron = CanzonaOptimizer(params, schedule, dp_group=groups[0], tp_group=groups[1], grad_attr="main_grad")

    def wrong_grad_shape() -> None:  # torch refuses such a .grad, but nothing checks a main_grad
        for _, param in params:
            param.main_grad = torch.zeros(3) if rank == 0 else param.grad.float()  # type: ignore[attr-defined]
        megatron.step()

    cases = {
        "a bad lr between steps": bad_lr,
        "a bad max_norm": lambda: optimizer.clip_grad_norm_(0.0),
        "a closure failing on one rank": closure_fails,
        "a closure after clipping": closure_after_clip,
        "a gradient of the wrong shape": wrong_grad_shape,
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(model, optimizer),
        "set_optimizer_state_dict": lambda: set_optimizer_state_dict(
            model, optimizer, {"state": {}, "param_groups": []}
        ),
    }
    out = {}
    for name, call in cases.items():
        _grads(schedule, params, 1, rank)
        before = _snapshot(optimizer, params)
        dist.barrier()
        out[name] = (_outcome(call), _same(before, _snapshot(optimizer, params)))
    _grads(schedule, params, 1, rank)
    optimizer.step()  # the groups still work
    return out


def _bad_input_worker(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    groups = make_groups(2, 2, LONG_TIMEOUT)
    started = time.monotonic()
    out: dict[str, Any] = {"construction": _construction_cases(schedule, rank, groups)}
    out["step"] = _step_cases(schedule, rank, groups)
    out["seconds"] = time.monotonic() - started
    return out


CONSTRUCTION = {
    "negative lr": "ranks 0, 1, 2, 3: bad hyperparameters: lr must be >= 0, got -0.1",
    "negative group lr": "param_groups[0]: lr must be >= 0, got -1.0",
    "negative lr on rank 2": "schedule does not fit this run; rank 2: bad hyperparameters: lr must be >= 0",
    "a parameter in two groups": (
        "parameters do not match the schedule: embedding.word_embeddings.weight is in param groups 0 and 1"
    ),
    "a name not in the schedule": "param group 1: not in the schedule: bogus.weight",
    "an unknown group key": "param group 0: unknown key(s) 'momentun'",
    "a key for absent parameters": (
        "param group 1: 'weight_decay' would apply to its matrix parameters, but it has none; "
        "AdamW parameters take adamw_lr"
    ),
    "a betas key": "adamw_betas[1] must be in [0, 1), got 1.5",
    "a missing grad_attr": "grad_attr 'main_grad': no such attribute on embedding.word_embeddings.weight",
    "unnamed parameters": "parameters must be (name, tensor) pairs",
    "ranks freezing differently": (
        "ranks optimize different parameters (not optimized: none on ranks 0, 2, 3; "
        "decoder.layers.0.self_attention.linear_qkv.weight on rank 1)"
    ),
}
STEP = {
    "a bad lr between steps": (
        "StepFailedError: canzona: step 2 failed before its first collective, nothing was applied on any rank; "
        "rank 3: param_groups[1]: adamw_lr must be >= 0, got -1.0"
    ),
    "a bad max_norm": (
        "StepFailedError: canzona: step 2 failed before its first collective, nothing was applied on any rank; "
        "ranks 0, 1, 2, 3: clip_grad_norm_: max_norm must be a positive finite number, got 0.0"
    ),
    "a closure failing on one rank": "rank 1: the closure raised ValueError: loss is nan",
    "a closure after clipping": (
        "failed before applying its update, nothing was applied on any rank; "
        "ranks 0, 1, 2, 3: step(closure) after clip_grad_norm_"
    ),
    "a gradient of the wrong shape": (
        "rank 0: the gradient of embedding.word_embeddings.weight has shape [3], the parameter [128, 32]"
    ),
    "get_optimizer_state_dict": (
        "NotImplementedError: canzona: CanzonaOptimizer's state is sharded by its schedule and kept in logical form; "
        "torch.distributed.checkpoint.state_dict cannot save or load it: "
        "use canzona.runtime.save_checkpoint(optimizer, path) / load_checkpoint(optimizer, path)"
    ),
    "set_optimizer_state_dict": (
        "ValueError: not a canzona optimizer state (format None, expected 'canzona-logical/1'); "
        "CanzonaOptimizer's state is sharded"
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_fails_on_every_rank_with_one_clear_error() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    results = run_ranks(_bad_input_worker, 4, schedule, timeout=100)
    for case, fragment in CONSTRUCTION.items():
        messages = {result["construction"][case] for result in results}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        message = messages.pop()
        assert message.startswith(ScheduleMismatchError.__name__) and fragment in message, f"{case}: {message}"
        assert "\n" not in message, f"{case}: one line"
    for case, fragment in STEP.items():
        outcomes = {result["step"][case] for result in results}
        assert len(outcomes) == 1, f"{case}: ranks disagree: {outcomes}"
        message, unchanged = outcomes.pop()
        assert fragment in message, f"{case}: {message}"
        assert unchanged, f"{case}: parameters or state changed"
        if case.startswith(("a ", "get")) and "optimizer_state_dict" not in case:
            assert message.startswith(StepFailedError.__name__), message
    assert max(result["seconds"] for result in results) < REFUSAL_S, "no rank waited for a collective timeout"


def _contract_worker(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    group = dist.group.WORLD
    params = _params(schedule, rank)
    optimizer = CanzonaOptimizer(params, schedule, dp_group=group, tp_group=group, lr=0.05)
    calls: list[Any] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt.step_count)))

    def replace_closure(opt: Any, args: Any, kwargs: Any) -> Any:
        calls.append(("pre", opt.step_count))
        return args, {"closure": lambda: (calls.append(("closure", torch.is_grad_enabled())), 7.0)[1]}

    handle = optimizer.register_step_pre_hook(replace_closure)
    _grads(schedule, params, 0, rank)
    loss = optimizer.step(lambda: 1.0)
    handle.remove()
    optimizer.zero_grad(set_to_none=False)
    zeroed = all(p.grad is not None and not bool(p.grad.any()) for _, p in params)
    optimizer.zero_grad()
    state = optimizer.state_dict()
    with pytest.raises(NotImplementedError, match="save_checkpoint"):
        state["state"]
    with pytest.raises(ValueError, match="not a canzona optimizer state"):
        optimizer.load_state_dict(torch.optim.SGD([torch.zeros(1, requires_grad=True)]).state_dict())
    return {
        "optimizer": isinstance(optimizer, torch.optim.Optimizer),
        "loss": loss,
        "calls": calls,
        "zeroed": zeroed,
        "groups": len(optimizer.param_groups),
        "state": (len(optimizer.state), optimizer.state[params[1][1]]),
        "grads": [p.grad for _, p in params],
        "repr": repr(optimizer),
    }


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_closure_hooks_and_zero_grad_follow_torch_optim() -> None:
    schedule = make_schedule(MODEL, 1, 1)
    (result,) = run_ranks(_contract_worker, 1, schedule)
    assert result["optimizer"] and result["groups"] == 1  # named_parameters(): one group, matrices and AdamW alike
    assert result["loss"] == 7.0, "the pre-hook replaced the closure, which ran and gave the loss"
    assert result["calls"] == [("pre", 0), ("closure", True), ("post", 1)]
    assert result["zeroed"] and all(g is None for g in result["grads"])
    assert result["state"] == (len(schedule.params), {"step": 1})
    assert "Parameter Group 0" in result["repr"] and "adamw_lr" in result["repr"]


def _bf16_run(
    schedule: Schedule,
    rank: int,
    groups: tuple[Any, Any],
    steps: range,
    params: Params | None = None,
    resume: Any = None,
    lr: float = 0.02,
) -> tuple[CanzonaOptimizer, Any, Params]:
    params = params or _params(schedule, rank)
    optimizer = CanzonaOptimizer(
        _norms_only(params), schedule, dp_group=groups[0], tp_group=groups[1], lr=lr, adamw_lr=1e-3
    )
    scheduler = LambdaLR(optimizer, lambda step: 0.8**step)
    if resume is not None:
        resume(optimizer, scheduler)
    for step in steps:
        _grads(schedule, params, step, rank)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return optimizer, scheduler, params


def _resume_worker(rank: int, world: int, schedule: Schedule, folder: str) -> dict[str, Any]:
    groups = make_groups(2, 2)
    straight, _, straight_params = _bf16_run(schedule, rank, groups, range(4))
    first, first_scheduler, params = _bf16_run(schedule, rank, groups, range(2))
    saved, saved_scheduler = first.state_dict(), first_scheduler.state_dict()
    save_checkpoint(first, folder)
    copy = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]

    def from_memory(optimizer: Any, scheduler: Any) -> None:
        optimizer.load_state_dict(saved)
        scheduler.load_state_dict(saved_scheduler)

    def from_checkpoint(optimizer: Any, scheduler: Any) -> None:
        load_checkpoint(optimizer, folder)
        scheduler.load_state_dict(saved_scheduler)

    memory, _, _ = _bf16_run(schedule, rank, groups, range(2, 4), params, from_memory, lr=0.5)
    disk, _, _ = _bf16_run(schedule, rank, groups, range(2, 4), copy, from_checkpoint, lr=0.5)

    def tensors(optimizer: CanzonaOptimizer) -> dict[str, list[torch.Tensor]]:
        return {k: [d for _, d in v.chunks] for k, v in optimizer.state_dict()["tensors"].items()}

    reloaded, _, reloaded_params = _bf16_run(schedule, rank, groups, range(2))
    name, param = reloaded_params[3]
    with torch.no_grad():
        param.copy_(torch.full_like(param, 0.5))
    reloaded.reload_model_params()
    _grads(schedule, reloaded_params, 2, rank)
    reloaded.step()
    return {
        "params": [{n: p.detach().clone() for n, p in run} for run in (straight_params, params, copy)],
        "state": [tensors(o) for o in (straight, memory, disk)],
        "lrs": [[g["lr"] for g in o.param_groups] for o in (straight, memory, disk)],
        "has_main": any(key.startswith("main/") for key in saved["tensors"]),
        "reloaded": (param.detach().float() - 0.5).abs().max().item(),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bf16_training_resumes_bit_for_bit(tmp_path: Path) -> None:
    schedule = make_schedule(MODEL, 2, 2, dtype="bf16")
    results = run_ranks(_resume_worker, 4, schedule, str(tmp_path / "checkpoint"))
    assert any(result["has_main"] for result in results), "main copies are part of the state"
    for rank, result in enumerate(results):
        straight, memory, disk = result["params"]
        for name in straight:
            assert torch.equal(straight[name], memory[name]) and torch.equal(straight[name], disk[name]), (
                f"rank {rank} {name}"
            )
        expected = result["state"][0]
        for state in result["state"][1:]:
            assert state.keys() == expected.keys()
            assert all(torch.equal(a, b) for key in expected for a, b in zip(expected[key], state[key])), f"rank {rank}"
        assert result["lrs"][0] == result["lrs"][1] == result["lrs"][2], "group learning rates restored"
        assert result["reloaded"] < 0.05, "after reload_model_params the step starts from the new weights"
