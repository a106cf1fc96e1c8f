"""The rest of the public API on real ranks: the per-bucket DP collectives, a DeviceMesh instead of
groups, and checkpointing the optimizer state mid-run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from canzona.runtime import CanzonaOptimizer
from canzona.runtime.exchange import comm
from canzona.runtime.exchange.comm import ALL_REDUCE
from canzona.schedules.format import Schedule
from canzona.schedules.layout import DpBucket

from rt_harness import DATA, make_groups, make_schedule, run_ranks
from rt_oracle import compare, full_grad, full_params, ordered, reference_run, shard

MODEL = DATA / "tiny_moe.json"


def _collectives(rank: int, world: int, cuts: list[int], mode: str) -> tuple[list[float], list[float]]:
    bucket = DpBucket("matrix", 0, 2, tuple(cuts), tuple(range(world)), ())
    send = torch.cat([torch.full((2,), -1.0), torch.arange(cuts[-1], dtype=torch.float32) * (rank + 1)])
    kept = list(range(world)) if mode == ALL_REDUCE else [rank]
    comm.start_reduce(send, bucket, mode, rank, dist.group.WORLD, list(range(world)), kept).wait(None, "test")
    assert send[:2].tolist() == [-1.0, -1.0]  # only the bucket moves
    mean = torch.cat([send[2 + cuts[r] : 2 + cuts[r + 1]] for r in kept]).tolist()
    gathered = torch.full((2 + cuts[-1],), -1.0)
    if mode != ALL_REDUCE:  # DP-SC gathers nothing
        gathered[2 + cuts[rank] : 2 + cuts[rank + 1]] = float(rank)  # this rank's slice holds its values
        comm.start_gather(gathered, bucket, mode, rank, dist.group.WORLD, list(range(world))).wait(None, "test")
    return mean, gathered.tolist()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cuts", [[0, 3, 3, 8, 9], [0, 3, 6, 9, 12]], ids=["uneven", "equal"])
@pytest.mark.parametrize("mode", ["rooted", "all_to_all", "reslice", ALL_REDUCE])
def test_per_bucket_reduction_and_gather(mode: str, cuts: list[int]) -> None:
    """Each form of the per-bucket collectives gives every rank the DP mean of its slice (every
    slice for all_reduce), in place in the bucket buffer, and gathers every rank's slice in
    place; an empty slice is fine."""
    results = run_ranks(_collectives, 4, cuts, mode)
    factor = sum(r + 1 for r in range(4)) / 4
    for rank, (mean, gathered) in enumerate(results):
        low, high = (0, cuts[-1]) if mode == ALL_REDUCE else (cuts[rank], cuts[rank + 1])
        assert mean == [factor * i for i in range(low, high)]
        if mode != ALL_REDUCE:
            assert gathered == [-1.0, -1.0] + [float(r) for r in range(4) for _ in range(cuts[r], cuts[r + 1])]


def _train(
    optimizer: CanzonaOptimizer,
    schedule: Schedule,
    params: list[tuple[str, Any]],
    steps: range,
    dp_rank: int,
    tp_rank: int,
) -> None:
    tp = schedule.request.tp
    for step in steps:
        for entry, (_, param) in zip(ordered(schedule), params):
            param.grad = shard(full_grad(entry, step, dp_rank), entry, tp_rank, tp)
        optimizer.step()
        optimizer.zero_grad()


def _local_params(schedule: Schedule, tp_rank: int) -> list[tuple[str, torch.nn.Parameter]]:
    full = full_params(schedule)
    return [
        (e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, schedule.request.tp))) for e in ordered(schedule)
    ]


def _mesh_worker(rank: int, world: int, schedule: Schedule, steps: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = divmod(rank, 2)
    params = _local_params(schedule, tp_rank)
    optimizer = CanzonaOptimizer(params, schedule, mesh=mesh)
    assert (optimizer.dp_rank, optimizer.tp_rank) == (dp_rank, tp_rank)
    _train(optimizer, schedule, params, range(steps), dp_rank, tp_rank)
    return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_device_mesh() -> None:
    schedule = make_schedule(MODEL, 2, 2)
    results = run_ranks(_mesh_worker, 4, schedule, 5)
    compare(schedule, results, reference_run(schedule, 5, {}))


def _checkpoint_worker(rank: int, world: int, schedule: Schedule, steps: int) -> dict[str, Any]:
    dp_group, tp_group = make_groups(2, 2)
    dp_rank, tp_rank = divmod(rank, 2)
    params = _local_params(schedule, tp_rank)
    first = CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group)
    _train(first, schedule, params, range(3), dp_rank, tp_rank)
    saved = first.state_dict()
    assert saved["step"] == 3 and any(key.startswith("matrix/") for key in saved["tensors"]), (
        "each rank hosts some matrices here"
    )
    second = CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group)
    second.load_state_dict(saved)
    _train(second, schedule, params, range(3, steps), dp_rank, tp_rank)
    partial = dict(saved, tensors={k: v for k, v in saved["tensors"].items() if not k.startswith("matrix/")})
    with pytest.raises(ValueError, match="the saved state lacks matrix/"):
        second.load_state_dict(partial)
    other = dict(saved, layout=dict(saved["layout"], model={"name": "other", "source": "other.json", "sha256": None}))
    with pytest.raises(ValueError, match="different models"):
        second.load_state_dict(other)
    assert second.step_count == steps, "a rejected state changes nothing"
    return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_state_dict_resumes_exactly() -> None:
    schedule = make_schedule(MODEL, 2, 2, optimizer="soap", precondition_frequency=2)
    results = run_ranks(_checkpoint_worker, 4, schedule, 6)
    compare(schedule, results, reference_run(schedule, 6, {}))


def _single_rank_worker(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    group = dist.group.WORLD
    params = _local_params(schedule, 0)
    optimizer = CanzonaOptimizer(params, schedule, dp_group=group, tp_group=group, lr=0.05)
    _train(optimizer, schedule, params, range(4), 0, 0)
    with pytest.raises(NotImplementedError, match="fixed by the schedule"):
        optimizer.add_param_group({"params": []})
    return {name: p.detach().clone() for name, p in params}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_single_rank() -> None:
    schedule = make_schedule(MODEL, 1, 1, optimizer="shampoo", block_size=16)
    (result,) = run_ranks(_single_rank_worker, 1, schedule)
    compare(schedule, [result], reference_run(schedule, 4, {"lr": 0.05}))


def _groups_worker(rank: int, world: int) -> tuple[list[int], list[int]]:
    from canzona.runtime import make_groups

    with pytest.raises(ValueError, match="dp 3 x tp 1 does not match the world size 4"):
        make_groups(3, 1)
    dp_group, tp_group = make_groups(2, 2)
    return dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(tp_group)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_make_groups_follows_the_rank_layout() -> None:
    results = run_ranks(_groups_worker, 4)
    for rank, (dp_ranks, tp_ranks) in enumerate(results):
        dp_rank, tp_rank = divmod(rank, 2)
        assert dp_ranks == [d * 2 + tp_rank for d in range(2)]
        assert tp_ranks == [dp_rank * 2 + t for t in range(2)]
