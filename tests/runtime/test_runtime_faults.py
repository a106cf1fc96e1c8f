"""Faults fail safely and quickly: a rank that fails before the step changes anything (a pre-hook,
a non-finite gradient) makes every rank raise the same error and nothing is applied; a rank
that fails while updating makes every rank raise the same error, after which the optimizer
refuses to step until a checkpoint is loaded; a killed rank makes the others raise within the
timeout instead of hanging; a corrupted checkpoint, another model's checkpoint and a save
interrupted before its commit give clear errors on every rank and never damage the previous
checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import canzona.runtime.optimizer as optimizer_module
import canzona.runtime.state.checkpoint as checkpoint
from canzona.runtime import (
    CanzonaOptimizer,
    CheckpointError,
    StepFailedError,
    load_checkpoint,
    save_checkpoint,
)
from canzona.schedules.format import Schedule

from rt_harness import (
    DATA,
    make_groups,
    make_schedule,
    reload_and_step,
    run_ranks,
    run_ranks_raw,
    timed_collective_failure,
)
from rt_oracle import compare, full_grad, full_params, ordered, reference_run, shard

MODEL = DATA / "tiny_moe.json"
TIMEOUT = 3.0


def _setup(schedule: Schedule, rank: int, **options: Any) -> tuple[CanzonaOptimizer, list[tuple[str, Any]]]:
    dp_group, tp_group = make_groups(schedule.request.dp, schedule.request.tp)
    tp = schedule.request.tp
    full = full_params(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank % tp, tp))) for e in ordered(schedule)]
    return CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group, timeout=TIMEOUT, **options), params


def _grads(optimizer: CanzonaOptimizer, params: list[tuple[str, Any]], step: int) -> None:
    schedule, tp = optimizer.schedule, optimizer.tp_size
    for entry, (_, param) in zip(ordered(schedule), params):
        param.grad = shard(full_grad(entry, step, optimizer.dp_rank), entry, optimizer.tp_rank, tp)


def _train(optimizer: CanzonaOptimizer, params: list[tuple[str, Any]], steps: range) -> None:
    for step in steps:
        _grads(optimizer, params, step)
        optimizer.step()


def _snapshot(
    optimizer: CanzonaOptimizer, params: list[tuple[str, Any]]
) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]], int]:
    state = {key: [data.clone() for _, data in t.chunks] for key, t in optimizer.state_dict()["tensors"].items()}
    return [p.detach().clone() for _, p in params], state, optimizer.step_count


def _unchanged(before: Any, after: Any) -> bool:
    params_a, state_a, step_a = before
    params_b, state_b, step_b = after
    same_params = all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    same_state = state_a.keys() == state_b.keys() and all(
        torch.equal(a, b) for key in state_a for a, b in zip(state_a[key], state_b[key])
    )
    return same_params and same_state and step_a == step_b


class _FailingRule:
    """A matrix rule whose update fails, as `torch.linalg.eigh` does when it cannot converge."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def init_state(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Any:
        return self.rule.init_state(rows, cols, device, dtype)

    def update(self, state: Any, grad: torch.Tensor, step: int) -> torch.Tensor:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")


def _failing_step(optimizer: CanzonaOptimizer, params: list[tuple[str, Any]], step: int) -> tuple[str, bool]:
    """Run a step expected to fail everywhere; its message and whether nothing changed."""
    before = _snapshot(optimizer, params)
    with pytest.raises(StepFailedError) as caught:
        optimizer.step()
    return str(caught.value), _unchanged(before, _snapshot(optimizer, params))


def _failing_rule(failing: Any) -> Any:
    """Make `make_rule` (as the optimizer calls it) return `failing(rule)` on this rank; returns
    the original, to put back."""
    original = optimizer_module.make_rule
    optimizer_module.make_rule = lambda name, hp: failing(original(name, hp))  # type: ignore[assignment]
    return original


def _inside_step_worker(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    optimizer, params = _setup(schedule, rank, check_finite=True)
    _train(optimizer, params, range(2))
    out: dict[str, Any] = {"hosts": bool(optimizer.plan.hosted)}
    _grads(optimizer, params, 2)

    def hook(_: CanzonaOptimizer, args: Any, kwargs: Any) -> None:
        raise RuntimeError("gradient norm spike")

    handle = optimizer.register_step_pre_hook(hook) if rank == 2 else None
    out["hook"] = _failing_step(optimizer, params, 2)
    if handle is not None:
        handle.remove()
    saved = params[3][1].grad.clone()
    if rank == 1:
        params[3][1].grad[0, 0] = float("nan")
    out["nan"] = _failing_step(optimizer, params, 2)
    params[3][1].grad = saved
    # A failure while updating: state may have changed, so the optimizer refuses to go on until
    # a checkpoint (here: a state dict and the parameters' values) is loaded.
    state, values = optimizer.state_dict(), [p.detach().clone() for _, p in params]
    original = _failing_rule(_FailingRule) if rank == 3 else None
    out["compute"] = _failing_step(optimizer, params, 2)
    if original is not None:
        optimizer_module.make_rule = original  # type: ignore[assignment]
    with pytest.raises(StepFailedError) as refused:
        optimizer.step()
    out["refused"] = str(refused.value)
    out["params"] = reload_and_step(optimizer, state, params, values)  # the same step now succeeds
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_failing_inside_a_step_fails_every_rank() -> None:
    schedule = make_schedule(MODEL, 2, 2, optimizer="shampoo", block_size=16, precondition_frequency=2)
    results = run_ranks(_inside_step_worker, 4, schedule)
    assert results[3]["hosts"], "rank 3 must host a matrix for the compute failure to happen"
    expected = {
        "hook": "rank 2: RuntimeError: gradient norm spike",
        "nan": "rank 1: non-finite gradient in " + ordered(schedule)[3].name,
    }
    for case, fragment in expected.items():
        messages = {result[case][0] for result in results}
        assert len(messages) == 1, f"{case}: every rank raises the same error: {messages}"
        message = messages.pop()
        assert (
            fragment in message
            and "nothing was applied on any rank" in message
            and message.startswith("canzona: step 3 failed")
        ), message
        assert all(result[case][1] for result in results), f"{case}: parameters or state changed"
    messages = {result["compute"][0] for result in results}
    assert len(messages) == 1, f"compute: every rank raises the same error: {messages}"
    message = messages.pop()
    assert message.startswith("canzona: step 3 failed while updating") and "rank 3: updating " in message, message
    assert "LinAlgError: linalg.eigh: The algorithm failed to converge" in message
    for result in results:
        assert "load a checkpoint" in result["refused"], result["refused"]
    compare(schedule, [result["params"] for result in results], reference_run(schedule, 3, {}))


class _Dying(_FailingRule):
    """A rank that dies in the middle of its host compute: at once, or (`hang`) once every
    other rank has raised (their marker files in `folder`), or after HANG_S at the latest."""

    def __init__(self, rule: Any, hang: bool, folder: str, others: int) -> None:
        super().__init__(rule)
        self.hang, self.folder, self.others = hang, folder, others

    def update(self, state: Any, grad: torch.Tensor, step: int) -> torch.Tensor:
        if self.hang:
            deadline = time.monotonic() + HANG_S
            while len(os.listdir(self.folder)) < self.others and time.monotonic() < deadline:
                time.sleep(0.05)
            if len(os.listdir(self.folder)) == self.others:
                Path(self.folder, "..", "stuck-rank-outlived-the-others").touch()
        os._exit(1)


def _killed_worker(rank: int, world: int, schedule: Schedule, hang: bool, folder: str) -> dict[str, Any]:
    optimizer, params = _setup(schedule, rank)
    _train(optimizer, params, range(2))
    if rank == 3:
        _failing_rule(lambda rule: _Dying(rule, hang, folder, world - 1))
    _grads(optimizer, params, 2)
    result = timed_collective_failure(optimizer)
    Path(folder, f"rank-{rank}-raised").touch()
    return result


# Only a hang reaches this: the other ranks raise after the collectives' TIMEOUT, whatever the load.
HANG_S = 60.0


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("hang", [False, True], ids=["killed", "hung-then-killed"])
def test_a_killed_or_hung_rank_makes_every_other_rank_raise_within_the_timeout(hang: bool, tmp_path: Path) -> None:
    """Every other rank raises (a collective's timeout, not the harness's deadline, ends their
    wait); a stuck rank is still stuck when they do: it dies only after all three raised."""
    schedule = make_schedule(MODEL, 2, 2)
    (tmp_path / "raised").mkdir()
    outcomes = run_ranks_raw(_killed_worker, 4, schedule, hang, str(tmp_path / "raised"), timeout=2 * HANG_S)
    assert outcomes[3][0] == "died"
    for rank in range(3):
        status, result = outcomes[rank]
        assert status == "ok", result
        assert result["error"] is not None, f"rank {rank} finished a step with a dead peer"
        assert "canzona:" in result["error"] and "restart from the last checkpoint" in result["error"]
        assert result["elapsed"] < HANG_S, f"rank {rank} took {result['elapsed']:.1f} s"
    assert (tmp_path / "stuck-rank-outlived-the-others").exists() == hang, "the others waited for the stuck rank"


def _corruption_worker(rank: int, world: int, schedule: Schedule, folder: str) -> dict[str, Any]:
    optimizer, params = _setup(schedule, rank)
    _train(optimizer, params, range(2))
    save_checkpoint(optimizer, folder)
    saved = _snapshot(optimizer, params)
    root = Path(folder)
    record = json.loads((root / checkpoint.MANIFEST).read_text())
    data = root / record["data"]
    victim = sorted(record["files"])[1]  # a file rank 0 does not verify itself
    out: dict[str, Any] = {}
    cases = {
        "garbled": (data / victim, lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:]),
        "truncated": (data / victim, lambda b: b[: len(b) // 2]),
        "record": (root / checkpoint.MANIFEST, lambda b: b.replace(b'"step": 2', b'"step": 7')),
        "missing": (root / checkpoint.MANIFEST, None),
    }
    fresh, _ = _setup(schedule, rank)
    for case, (path, damage) in cases.items():
        original = path.read_bytes()
        dist.barrier()
        if rank == 0:
            path.unlink() if damage is None else path.write_bytes(damage(original))
        dist.barrier()
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(fresh, folder)
        out[case] = str(caught.value)
        assert fresh.step_count == 0, "a failed load changes nothing"
        dist.barrier()
        if rank == 0:
            path.write_bytes(original)
        dist.barrier()
    load_checkpoint(fresh, folder)
    out["restored"] = _unchanged(saved, _snapshot(fresh, params))
    out["victim"] = victim
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_corrupted_checkpoint_fails_on_every_rank(tmp_path: Path) -> None:
    schedule = make_schedule(MODEL, 2, 2, optimizer="soap", precondition_frequency=2)
    results = run_ranks(_corruption_worker, 4, schedule, str(tmp_path / "checkpoint"))
    victim = results[0]["victim"]
    expected = {
        "garbled": f"rank 1: checkpoint file .*{victim}' is corrupt \\(sha256 mismatch",
        "truncated": f"rank 1: checkpoint file .*{victim}' is corrupt",
        "record": "CHECKPOINT.json' is corrupt \\(checksum mismatch\\)",
        "missing": "no committed checkpoint at",
    }
    for case, pattern in expected.items():
        messages = {result[case] for result in results}
        assert len(messages) == 1, f"{case}: every rank raises the same error: {messages}"
        assert re.search(pattern, messages.pop()), f"{case}: {results[0][case]}"
    assert all(result["restored"] for result in results)


def _other_model_worker(rank: int, world: int, schedules: dict[str, Schedule], folder: str) -> dict[str, str]:
    optimizer, _ = _setup(schedules["saved"], rank)
    save_checkpoint(optimizer, folder)
    out = {}
    for case in ("model", "optimizer"):
        other, _ = _setup(schedules[case], rank)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(other, folder)
        out[case] = str(caught.value)
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_checkpoint_of_another_model_or_optimizer_is_rejected(tmp_path: Path) -> None:
    schedules = {
        "saved": make_schedule(MODEL, 2, 2),
        "model": make_schedule(DATA / "tiny_moe_v300.json", 2, 2),
        "optimizer": make_schedule(MODEL, 2, 2, optimizer="soap"),
    }
    results = run_ranks(_other_model_worker, 4, schedules, str(tmp_path / "checkpoint"))
    for case, fragment in {
        "model": "different models: tiny_moe",
        "optimizer": "different matrix optimizers: muon before, soap now",
    }.items():
        messages = {result[case] for result in results}
        assert len(messages) == 1 and fragment in messages.pop(), results[0][case]
        assert "does not fit this optimizer" in results[0][case]


def _interrupted_save_worker(rank: int, world: int, schedule: Schedule, folder: str) -> dict[str, Any]:
    optimizer, params = _setup(schedule, rank)
    _train(optimizer, params, range(2))
    save_checkpoint(optimizer, folder)
    committed = _snapshot(optimizer, params)
    _train(optimizer, params, range(2, 3))
    commit = checkpoint._commit
    if rank == 0:

        def crash(root: Path, manifest: dict[str, Any]) -> None:
            raise OSError("simulated crash between writing and committing")

        checkpoint._commit = crash  # type: ignore[assignment]
    with pytest.raises(CheckpointError, match="committing.*simulated crash") as caught:
        save_checkpoint(optimizer, folder)
    checkpoint._commit = commit  # type: ignore[assignment]
    folders_after_crash = sorted(p.name for p in Path(folder).glob("data-*"))
    fresh, fresh_params = _setup(schedule, rank)
    load_checkpoint(fresh, folder)
    restored = _unchanged((committed[0][:0], *committed[1:]), (fresh_params[:0], *_snapshot(fresh, fresh_params)[1:]))
    save_checkpoint(optimizer, folder)
    dist.barrier()
    return {
        "error": str(caught.value),
        "folders_after_crash": folders_after_crash,
        "restored_state": restored,
        "step": fresh.step_count,
        "folders_at_end": sorted(p.name for p in Path(folder).glob("data-*")),
    }


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_save_interrupted_before_its_commit_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    schedule = make_schedule(MODEL, 2, 2, optimizer="soap", precondition_frequency=2)
    results = run_ranks(_interrupted_save_worker, 4, schedule, str(tmp_path / "checkpoint"))
    for result in results:
        assert result["step"] == 2 and result["restored_state"], "the committed checkpoint loads as it was saved"
        assert len(result["folders_after_crash"]) == 2, "the unfinished data folder is left beside the committed one"
        assert len(result["folders_at_end"]) == 1 and result["folders_at_end"][0].startswith("data-00000003-")
    assert len({result["error"] for result in results}) == 1


class _Payload:
    """What a crafted checkpoint would smuggle in: unpickling it runs a command."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _crafted_metadata_worker(rank: int, world: int, schedule: Schedule, folder: str, marker: str) -> str:
    optimizer, params = _setup(schedule, rank)
    _train(optimizer, params, range(1))
    save_checkpoint(optimizer, folder)
    record = json.loads((Path(folder) / checkpoint.MANIFEST).read_text())
    dist.barrier()
    if rank == 0:
        (Path(folder) / record["data"] / checkpoint.DCP_METADATA).write_bytes(pickle.dumps(_Payload(marker)))
    dist.barrier()
    fresh, _ = _setup(schedule, rank)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(fresh, folder, verify=False)  # the checksums would catch this file; a forger reseals them
    return str(caught.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_crafted_checkpoint_metadata_runs_nothing(tmp_path: Path) -> None:
    """DCP's metadata is a pickle: canzona unpickles only DCP's metadata classes, so a file that
    would run a command is refused on every rank and the command never runs."""
    marker = tmp_path / "ran"
    results = run_ranks(
        _crafted_metadata_worker, 4, make_schedule(MODEL, 2, 2), str(tmp_path / "checkpoint"), str(marker)
    )
    assert not marker.exists()
    assert all("refusing to unpickle" in message and "posix.system" in message for message in results), results
