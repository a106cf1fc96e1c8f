"""The binding of DTensor parameters (`canzona.runtime.binding`) with gradients set by hand in
placements that differ from the parameters' (canzona and the DP-SC / TP-SC baselines): a
`Replicate` gradient of `Shard(0)`, `Shard(1)` and grouped 3-D expert parameters (re-split
locally), and `Partial` gradients of a replicated norm the schedule sums over TP. After several
steps (under a meta default device) every parameter equals the single-process reference fed the
full gradients. A gradient that would need communication the schedule does not plan fails the
step on every rank. Grouped experts under expert parallelism (each rank passes its EP rank's
experts as one tensor), and a checkpoint of them moving from EP 1 to EP 2. Also the pure part:
folding expert slices back into the model's tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_models import plan

from canzona.runtime.binding import model_entries, slices_of
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule

import models
from rt_harness import GROUP_TIMEOUT, labelled, run_ranks

STEPS = 4
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}
SHAPES = {"up.weight": (16, 8), "norm.weight": (16,), "down.weight": (8, 16), "experts": (4, 6, 8)}


def full_grad(name: str, step: int) -> torch.Tensor:
    """The full gradient of `name` at `step` (alike on every rank)."""
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(1000 * step + len(name)))


def _set_grads(live: torch.nn.Module, mesh: Any, step: int, bad: str | None) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    tp_rank, tp = mesh.get_local_rank(), mesh.size()
    for name, param in live.named_parameters():
        grad = full_grad(name, step)
        if name == "norm.weight" and bad != "whole":  # TP rank r holds part r of the sum: Partial
            part = grad * (tp_rank + 1) / sum(range(1, tp + 1))
            param.grad = DTensor.from_local(part, mesh, [Partial()])
        elif bad == "re-split" and name == "up.weight":  # Shard(1) for a Shard(0) parameter: an all-to-all nobody plans
            param.grad = distribute_tensor(grad, mesh, [Shard(1)])
        else:
            param.grad = distribute_tensor(grad, mesh, [Replicate()])


def toy_rank(rank: int, world: int, schedule: Schedule, strategy: str) -> dict[str, Any]:
    """Train the DTensor toy with hand-set gradients; then one step with a bad gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    live = models.parallelize_toy(models.make_toy(), mesh["tp"])
    kind = {"canzona": CanzonaOptimizer, "dp-sc": DpScOptimizer, "tp-sc": TpScOptimizer}[strategy]
    optimizer = kind(live.named_parameters(), schedule, mesh=mesh, timeout=GROUP_TIMEOUT, **HP)
    for step in range(STEPS):
        _set_grads(live, mesh["tp"], step, bad=None)
        with torch.device("meta"):  # every tensor the step creates names its device
            optimizer.step()
    values = {name: p.full_tensor() for name, p in live.named_parameters()}
    errors = {}
    for bad in ("re-split", "whole"):  # a Shard(1) gradient of a Shard(0) parameter; a whole one the schedule sums
        _set_grads(live, mesh["tp"], STEPS, bad=bad)
        try:
            optimizer.step()
            errors[bad] = "no error"
        except Exception as failure:
            errors[bad] = f"{type(failure).__name__}: {failure}"
    unchanged = all(torch.equal(p.full_tensor(), values[name]) for name, p in live.named_parameters())
    return {"params": values, "errors": errors, "unchanged": unchanged}


@pytest.fixture(scope="module")
def toy_tp2(tmp_path_factory: pytest.TempPathFactory) -> Schedule:
    """The DTensor toy's schedule at TP 2 (every strategy's test shares it)."""
    return plan(tmp_path_factory.mktemp("toy"), "toy", 2, 1, "--sequence-parallel")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["canzona", "dp-sc", "tp-sc"])
def test_dtensor_gradients_in_other_placements(strategy: str, toy_tp2: Schedule) -> None:
    schedule = toy_tp2
    entries = {e.name: e for e in schedule.params}
    assert entries["norm.weight"].grad_reduce == "tp" and entries["experts[3]"].tp_dim == 0
    results = run_ranks(toy_rank, 2, schedule, strategy, timeout=90)
    torch.manual_seed(0)
    reference_model = models.make_toy()
    reference = ReferenceOptimizer(reference_model.named_parameters(), schedule, **HP)
    for step in range(STEPS):
        reference.step(grads={name: full_grad(name, step) for name in SHAPES})
    for rank, result in enumerate(results):
        for name, value in reference_model.named_parameters():
            torch.testing.assert_close(
                result["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=labelled(f"rank {rank} {name}")
            )
        assert result["unchanged"], f"rank {rank}: a failed step changed parameters"
    for bad, needle in (
        ("re-split", "only a replicated gradient is re-split locally"),
        ("whole", "the gradient of norm.weight is already whole over TP (Replicate()), but the schedule sums it"),
    ):
        (error,) = {r["errors"][bad] for r in results}
        assert error.startswith("StepFailedError") and needle in error, error


def test_expert_slices_fold_into_the_models_tensor(tmp_path: Path) -> None:
    schedule = plan(tmp_path, "hf_moe", 1, 2)
    folded = model_entries(schedule.params)
    gate_up = folded["model.layers.1.mlp.experts.gate_up_proj"]
    first = next(e for e in schedule.params if e.name == "model.layers.1.mlp.experts.gate_up_proj[0]")
    assert gate_up.shape == [4, *first.shape] and gate_up.index == first.index and gate_up.param is None
    assert [e.slice for e in slices_of(schedule.params)["model.layers.1.mlp.experts.gate_up_proj"]] == [0, 1, 2, 3]
    assert not any("[" in name for name in folded)
    assert list(folded) == [name for name, _ in models.make_tiny_hf_qwen3_moe().named_parameters()]


# ---------------------------------------------------------------------------------------------
# Grouped experts under expert parallelism: each rank passes its EP rank's experts as one tensor


def rank_grad(name: str, step: int, dp_rank: int) -> torch.Tensor:
    """DP rank `dp_rank`'s own full gradient of `name` at `step`."""
    return full_grad(name, step) * (1.0 + dp_rank) + 0.01 * dp_rank


def ep_rank_worker(rank: int, world: int, schedule: Schedule) -> dict[str, torch.Tensor]:
    """Train the plain toy at DP 2 x EP 2: this rank holds experts [2 r, 2 r + 2) as [2, 6, 8]."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import CanzonaOptimizer

    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("edp", "ep", "tp"))
    torch.manual_seed(0)
    live = models.make_toy()
    live.experts = torch.nn.Parameter(live.experts.detach()[2 * rank : 2 * rank + 2].clone())
    optimizer = CanzonaOptimizer(live.named_parameters(), schedule, mesh=mesh, timeout=GROUP_TIMEOUT, **HP)
    for step in range(STEPS):
        for name, param in live.named_parameters():
            grad = rank_grad(name, step, rank)
            param.grad = grad[2 * rank : 2 * rank + 2].clone() if name == "experts" else grad
        optimizer.step()
    return {name: p.detach().clone() for name, p in live.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_grouped_experts_under_expert_parallelism(tmp_path: Path) -> None:
    schedule = plan(tmp_path, "toy", 1, 2, "--ep", "2")
    assert {e.ep_rank for e in schedule.params if e.param == "experts"} == {0, 1}
    results = run_ranks(ep_rank_worker, 2, schedule, timeout=90)
    torch.manual_seed(0)
    reference_model = models.make_toy()
    reference = ReferenceOptimizer(reference_model.named_parameters(), schedule, **HP)
    for step in range(STEPS):
        reference.step(grads=_ep_grads(step))
    for rank, result in enumerate(results):
        for name, value in reference_model.named_parameters():
            expected = value.detach()[2 * rank : 2 * rank + 2] if name == "experts" else value.detach()
            torch.testing.assert_close(
                result[name], expected, rtol=1e-5, atol=1e-6, msg=labelled(f"rank {rank} {name}")
            )


def _ep_grads(step: int) -> dict[str, torch.Tensor]:
    """The gradients the step sees at DP 2 x EP 2: dense ones the DP mean, an expert its one
    holder's gradient over the DP size."""
    grads = {name: sum(rank_grad(name, step, d) for d in range(2)) / 2 for name in SHAPES if name != "experts"}
    grads["experts"] = torch.cat([rank_grad("experts", step, d)[2 * d : 2 * d + 2] for d in range(2)]) / 2
    return grads


def resharded_worker(
    rank: int, world: int, dense: Schedule, expert: Schedule, checkpoint: str
) -> dict[str, torch.Tensor]:
    """Two steps at DP 2 with every expert on every rank, a checkpoint, then two more at DP 2 x
    EP 2 from it (this rank's experts only)."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import CanzonaOptimizer, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    live = models.make_toy()
    optimizer = CanzonaOptimizer(
        live.named_parameters(),
        dense,
        mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")),
        timeout=GROUP_TIMEOUT,
        **HP,
    )
    for step in range(RESHARD_AT):
        for name, param in live.named_parameters():
            param.grad = rank_grad(name, step, rank)
        optimizer.step()
    save_checkpoint(optimizer, checkpoint)
    live.experts = torch.nn.Parameter(live.experts.detach()[2 * rank : 2 * rank + 2].clone())
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("edp", "ep", "tp"))
    optimizer = CanzonaOptimizer(live.named_parameters(), expert, mesh=mesh, timeout=GROUP_TIMEOUT, **HP)
    load_checkpoint(optimizer, checkpoint)
    for step in range(RESHARD_AT, STEPS):
        for name, param in live.named_parameters():
            grad = rank_grad(name, step, rank)
            param.grad = grad[2 * rank : 2 * rank + 2].clone() if name == "experts" else grad
        optimizer.step()
    return {name: p.detach().clone() for name, p in live.named_parameters()}


RESHARD_AT = 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_checkpoint_of_grouped_experts_moves_from_ep1_to_ep2(tmp_path: Path) -> None:
    dense, expert = plan(tmp_path, "toy", 1, 2), plan(tmp_path / "ep2", "toy", 1, 2, "--ep", "2")
    results = run_ranks(resharded_worker, 2, dense, expert, str(tmp_path / "checkpoint"), timeout=90)
    torch.manual_seed(0)
    reference_model = models.make_toy()
    reference = ReferenceOptimizer(reference_model.named_parameters(), dense, **HP)
    for step in range(STEPS):
        mean = {name: sum(rank_grad(name, step, d) for d in range(2)) / 2 for name in SHAPES}
        reference.step(grads=mean if step < RESHARD_AT else _ep_grads(step))
    for rank, result in enumerate(results):
        for name, value in reference_model.named_parameters():
            expected = value.detach()[2 * rank : 2 * rank + 2] if name == "experts" else value.detach()
            torch.testing.assert_close(
                result[name], expected, rtol=1e-5, atol=1e-6, msg=labelled(f"rank {rank} {name}")
            )
