"""On CUDA with NCCL (`pytest -m gpu`; skipped without a GPU): the default bf16 Newton–Schulz
against the bf16 reference, a schedule of several micro-groups, and (two or more GPUs) teams.
The tolerance is the bf16 one measured in test_runtime_precision.py."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_runtime_precision import BF16_RTOL

from canzona.runtime import CanzonaOptimizer, make_groups
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule

from rt_harness import DATA, labelled, make_schedule
from rt_oracle import compare, full_grad, full_params, ordered, reference_run, shard

MODEL = DATA / "tiny_moe.json"
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01}
STEPS = 3
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _one_gpu(schedule: Schedule) -> dict[str, Any]:
    """CanzonaOptimizer (defaults: bf16 Newton–Schulz on CUDA) and the reference, on GPU 0."""
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            full = full_params(schedule)
            ours = [(e.name, torch.nn.Parameter(full[e.name].cuda())) for e in ordered(schedule)]
            theirs = [(e.name, torch.nn.Parameter(full[e.name].cuda())) for e in ordered(schedule)]
            group = dist.group.WORLD
            optimizer = CanzonaOptimizer(ours, schedule, dp_group=group, tp_group=group, **HP)
            reference = ReferenceOptimizer(theirs, schedule, **HP)
            for step in range(STEPS):
                grads = {e.name: full_grad(e, step, 0).cuda() for e in ordered(schedule)}
                for name, param in ours:
                    param.grad = grads[name]
                optimizer.step()
                reference.step({name: grad.float() for name, grad in grads.items()})
            return {"ours": {n: p.detach().cpu() for n, p in ours}, "theirs": {n: p.detach().cpu() for n, p in theirs}}
        finally:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@needs_cuda
@pytest.mark.parametrize("group_bytes", [1 << 30, 4096], ids=["one-group", "several-groups"])
def test_bf16_newton_schulz_on_cuda_matches_the_reference(group_bytes: int) -> None:
    schedule = make_schedule(MODEL, 1, 1, dtype="bf16", group_bytes=group_bytes)
    if group_bytes == 4096:
        assert len(schedule.tp.ranks[0].groups) > 1
    result = _one_gpu(schedule)
    for name, got in result["ours"].items():
        torch.testing.assert_close(
            got.float(),
            result["theirs"][name].float(),
            rtol=BF16_RTOL,
            atol=BF16_RTOL / 10,
            msg=labelled(name),
        )


def _team_rank(rank: int, world: int, folder: str, schedule: Schedule, queue: Any) -> None:
    """TP rank `rank` of a TP 2 x DP 1 schedule on GPU `rank` (the oracle's values, moved there)."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank, world_size=world)
    full, entries = full_params(schedule), ordered(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, rank, world).cuda())) for e in entries]
    dp_group, tp_group = make_groups(1, world)
    optimizer = CanzonaOptimizer(params, schedule, dp_group=dp_group, tp_group=tp_group, **HP)
    for step in range(STEPS):
        for entry, (_, param) in zip(entries, params):
            param.grad = shard(full_grad(entry, step, 0), entry, rank, world).cuda()
        optimizer.step()
        optimizer.zero_grad()
    queue.put((rank, {name: p.detach().cpu() for name, p in params}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="teams need two GPUs (TP 2)")
def test_teams_on_two_gpus_match_the_reference() -> None:
    schedule = make_schedule(MODEL, 2, 1, coop="force")
    assert any(group.teams for rank in schedule.tp.ranks for group in rank.groups)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        processes = [context.Process(target=_team_rank, args=(r, 2, folder, schedule, queue)) for r in range(2)]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=240) for _ in range(2))
        for process in processes:
            process.join()
    reference = reference_run(schedule, STEPS, {**HP, "ns_dtype": "bf16"})
    compare(schedule, [results[r] for r in range(2)], reference, rtol=BF16_RTOL, atol=BF16_RTOL / 10)
