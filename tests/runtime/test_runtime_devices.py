"""One rank on a device: bf16 parameters, decay groups, clipping and a few steps equal the
reference optimizer run on the same device, and every tensor the optimizer keeps lives there.
On CPU with gloo (always), and on CUDA with NCCL (`pytest -m gpu`; skipped without a GPU).
The multi-rank device discipline is proven on CPU by the meta-default-device scenarios in
test_runtime_training.py."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from canzona.runtime import CanzonaOptimizer
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule

from rt_harness import DATA, labelled, make_schedule, run_ranks
from rt_oracle import full_grad, full_params, ordered

MODEL = DATA / "tiny_moe.json"
HP = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 1e-3, "adamw_weight_decay": 0.05}
STEPS = 3


def _groups(params: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    flat = [(n, p) for n, p in params if p.dim() == 1]
    return [{"params": [(n, p) for n, p in params if p.dim() > 1]}, {"params": flat, "adamw_weight_decay": 0.0}]


def single_rank_run(schedule: Schedule, device: str) -> dict[str, Any]:
    """The runtime and the reference side by side on one rank and `device`."""
    group = dist.group.WORLD
    full = full_params(schedule)
    ours = [(e.name, torch.nn.Parameter(full[e.name].to(device))) for e in ordered(schedule)]
    theirs = [(e.name, torch.nn.Parameter(full[e.name].to(device))) for e in ordered(schedule)]
    optimizer = CanzonaOptimizer(_groups(ours), schedule, dp_group=group, tp_group=group, **HP)
    reference = ReferenceOptimizer(_groups(theirs), schedule, **HP)
    norms = []
    for step in range(STEPS):
        grads = {e.name: full_grad(e, step, 0).to(device) for e in ordered(schedule)}
        for name, param in ours:
            param.grad = grads[name]
        mean = {name: grad.float() for name, grad in grads.items()}
        norms.append((float(optimizer.clip_grad_norm_(1.0)), float(reference.clip_grad_norm_(1.0, mean))))
        optimizer.step()
        optimizer.zero_grad()
        reference.step(mean)
    state = optimizer.engine.state
    kept = [optimizer.engine.send, *state.adamw.values(), *state.main.matrices.values()]
    kept += [data for value in optimizer.state_dict()["tensors"].values() for _, data in value.chunks]
    return {
        "devices": sorted({t.device.type for t in kept}),
        "params": [(name, p.detach().cpu(), q.detach().cpu()) for (name, p), (_, q) in zip(ours, theirs)],
        "main": {
            name: (state.main.matrices[i].cpu(), reference.state[q]["main"].cpu())
            for (name, q), i in zip(theirs, range(len(theirs)))
            if i in state.main.matrices
        },
        "norms": norms,
    }


def _check(result: dict[str, Any], device: str) -> None:
    assert result["devices"] == [device]
    assert result["main"], "bf16 matrices have main copies"
    for name, (got, expected) in result["main"].items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=labelled(f"main copy of {name}"))
    for name, got, expected in result["params"]:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0.0, msg=labelled(name))
    for ours, theirs in result["norms"]:
        assert ours == pytest.approx(theirs, rel=1e-5) and ours > 1.0


def _cpu_worker(rank: int, world: int, schedule: Schedule) -> dict[str, Any]:
    return single_rank_run(schedule, "cpu")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_single_rank_on_cpu_with_gloo() -> None:
    schedule = make_schedule(MODEL, 1, 1, dtype="bf16")
    (result,) = run_ranks(_cpu_worker, 1, schedule)
    _check(result, "cpu")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_single_rank_on_cuda_with_nccl() -> None:
    schedule = make_schedule(MODEL, 1, 1, dtype="bf16")
    torch.cuda.set_device(0)  # NCCL's all_gather_object stages on the current device
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            result = single_rank_run(schedule, "cuda")
        finally:
            dist.destroy_process_group()
    _check(result, "cuda")
