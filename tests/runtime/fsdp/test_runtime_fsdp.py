"""FsdpOptimizer on real FSDP2 models (multi-process gloo): a tiny HF Qwen3 and a torchtitan-named
model, FSDP2 over 2 and 4 ranks, HSDP 2 x 2, and DTensor TP 2 x FSDP2 DP 2. Each schedule comes
from one `canzona plan --model py:... --fsdp` command. After the steps the parameters equal the
single-process reference (`ReferenceOptimizer` on the unsharded model, fed the same DP-mean
gradients) within the runtime tests' tolerance (fp32, rtol 1e-5); mismatches between model and
schedule raise the same error on every rank."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from canzona.runtime.fsdp.optimizer import FsdpOptimizer
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule, read_schedule

import fsdp_models
from rt_harness import GROUP_TIMEOUT, labelled, run_ranks, run_ranks_raw

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent.parent  # the folder of fsdp_models.py
STEPS = 5
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 1e-3, "adamw_weight_decay": 0.01}
BATCH, SEQ = 2, 17  # the titan model's 16 input tokens split evenly over TP 2 (sequence parallel)


@cache
def planned(factory: str, tp: int, dp: int, replicate: int = 1, folder: str = "") -> str:
    """The schedule of one `canzona plan --model py:fsdp_models.py:FACTORY ... --fsdp` command."""
    out = Path(folder) / f"{factory}-tp{tp}-dp{dp}-r{replicate}.yaml"
    command = [
        sys.executable,
        "-m",
        "canzona.cli",
        "plan",
        "--model",
        f"py:fsdp_models.py:{factory}",
        "--tp",
        str(tp),
        "--dp",
        str(dp),
        "--fsdp",
        "--group-mb",
        "0.05",
        "-o",
        str(out),
    ] + (["--dp-replicate", str(replicate)] if replicate > 1 else [])
    done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return str(out)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fsdp"))


def _shard(model: torch.nn.Module, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize = (
            fsdp_models.parallelize_titan
            if isinstance(model, fsdp_models.TitanModel)
            else fsdp_models.parallelize_qwen3
        )
        parallelize(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = mesh
    for block in fsdp_models.blocks(model):
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return mesh


def _dp_rank(mesh: Any) -> int:
    """The data-parallel rank (replica x shards + shard): TP ranks share their data."""
    names = mesh.mesh_dim_names
    coordinate = dict(zip(names, mesh.get_coordinate()))
    if "tp" in names:
        return coordinate["dp"]
    return mesh.get_coordinate()[0] * (mesh.shape[1] if mesh.ndim == 2 else 1) + (
        mesh.get_coordinate()[1] if mesh.ndim == 2 else 0
    )


def _reloaded(optimizer: FsdpOptimizer, model: torch.nn.Module, schedule: Schedule) -> FsdpOptimizer:
    """A new optimizer that continues from `optimizer`'s state dict (through torch.save)."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    again = FsdpOptimizer(model.named_parameters(), schedule, timeout=GROUP_TIMEOUT, **HP)
    again.load_state_dict(torch.load(buffer, weights_only=False))
    return again


def _train(
    rank: int,
    world: int,
    factory: str,
    path: str,
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    reload_at: int | None = None,
) -> float:
    """Train the FSDP2 model and the reference side by side (LR halved every 2 steps on both;
    `reload_at`: continue from a state-dict round trip after that many steps); the largest
    relative difference."""
    model = getattr(fsdp_models, factory.removesuffix("_tp2"))()
    reference = copy.deepcopy(model)
    mesh = _shard(model, mesh_shape, names)
    schedule = read_schedule(path)
    optimizer = FsdpOptimizer(model.named_parameters(), schedule, timeout=GROUP_TIMEOUT, **HP)
    oracle = ReferenceOptimizer(reference.named_parameters(), schedule, **HP)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (optimizer, oracle)]
    dp_rank = _dp_rank(mesh)
    for step in range(STEPS):
        if step == reload_at:
            optimizer = _reloaded(optimizer, model, schedule)
            resumed = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            resumed.load_state_dict(schedulers[0].state_dict())
            schedulers[0] = resumed
        tokens = torch.randint(0, 255, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + dp_rank))
        fsdp_models.loss_of(model, tokens, mesh["tp"] if "tp" in names else None).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        with torch.device("meta"):  # every tensor the step creates names its device
            optimizer.step()
        optimizer.zero_grad()
        oracle.step(grads=grads)
        for lr_scheduler in schedulers:
            lr_scheduler.step()
    worst = 0.0
    expected = dict(reference.named_parameters())
    # bf16: the same fp32 main copies on both sides, so at most one bf16 rounding step apart
    rtol, atol = (1e-5, 1e-6) if schedule.params[0].dtype == "fp32" else (2**-7, 0.0)
    for name, param in model.named_parameters():
        got = param.full_tensor().detach()
        torch.testing.assert_close(got, expected[name].detach(), rtol=rtol, atol=atol, msg=labelled(name))
        worst = max(worst, float(((got - expected[name]).abs() / expected[name].abs().clamp_min(1e-6)).max()))
    if schedule.params[0].dtype != "fp32":  # the main copies themselves agree in fp32
        main = {name: optimizer.state[param]["main"] for name, param in model.named_parameters()}
        for name, param in model.named_parameters():
            rows = param.to_local().shape[0]
            start = _first_row(param)
            reference_main = oracle.state[expected[name]]["main"]
            torch.testing.assert_close(
                main[name],
                reference_main[start : start + rows],
                rtol=1e-5,
                atol=1e-6,
                msg=labelled(f"main copy of {name}"),
            )
    return worst


def _first_row(param: torch.Tensor) -> int:
    """The first global row of this rank's FSDP2 shard (1-D FSDP mesh)."""
    from canzona.schedules.geometry import fsdp_rows

    mesh = param.device_mesh
    return fsdp_rows(param.shape[0], mesh.size())[mesh.get_coordinate()[0]][0]


@pytest.mark.parametrize("factory,world", [("qwen3", 2), ("qwen3", 4), ("titan", 2), ("titan", 4), ("qwen3_bf16", 2)])
def test_fsdp2_equals_the_reference(factory: str, world: int, folder: str) -> None:
    pytest.importorskip("transformers")
    path = planned(factory, 1, world, 1, folder)
    run_ranks(_train, world, factory, path, (world,), ("dp",), timeout=180)


def test_state_dict_round_trip_continues_the_run(folder: str) -> None:
    pytest.importorskip("transformers")
    path = planned("qwen3", 1, 2, 1, folder)
    assert len(read_schedule(path).tp.ranks[0].groups) > 1  # the pipeline has a next group in flight
    run_ranks(_train, 2, "qwen3", path, (2,), ("dp",), 2, timeout=180)


def _other_layout(rank: int, world: int, path: str, other: str) -> str:
    model = fsdp_models.qwen3()
    _shard(model, (2,), ("dp",))
    saved = FsdpOptimizer(model.named_parameters(), read_schedule(path), timeout=GROUP_TIMEOUT).state_dict()
    again = FsdpOptimizer(model.named_parameters(), read_schedule(other), timeout=GROUP_TIMEOUT)
    with pytest.raises(ValueError, match="saved under another FSDP schedule"):
        again.load_state_dict(saved)
    return "refused"


def _unsteppable(rank: int, world: int, path: str) -> list[str]:
    """State dicts a step could not use are refused at load, with nothing loaded: string keys (a
    checkpointer's flattening), an entry without its step."""
    model = fsdp_models.qwen3()
    _shard(model, (2,), ("dp",))
    optimizer = FsdpOptimizer(model.named_parameters(), read_schedule(path), timeout=GROUP_TIMEOUT)
    saved = optimizer.state_dict()
    keyed = {**saved, "state": {str(key): value for key, value in saved["state"].items()}}
    stepless = copy.deepcopy(saved)
    stepless["state"][0].pop("step")
    messages = []
    for bad in (keyed, stepless):
        with pytest.raises(ValueError, match="cannot be stepped") as raised:
            optimizer.load_state_dict(bad)
        messages.append(str(raised.value))
    optimizer.load_state_dict(saved)  # the state it saved still loads
    return messages


def test_state_it_cannot_step_is_refused_at_load(folder: str) -> None:
    pytest.importorskip("transformers")
    messages = run_ranks(_unsteppable, 2, planned("qwen3", 1, 2, 1, folder), timeout=180)[0]
    assert "keyed by '0'" in messages[0] and "has no integer 'step'" in messages[1]


def test_state_dict_of_another_schedule_is_refused(folder: str) -> None:
    pytest.importorskip("transformers")
    path = planned("qwen3", 1, 2, 1, folder)
    other = str(Path(folder) / "qwen3-soap.yaml")
    command = [
        sys.executable,
        "-m",
        "canzona.cli",
        "plan",
        "--model",
        "py:fsdp_models.py:qwen3",
        "--dp",
        "2",
        "--fsdp",
        "--optimizer",
        "soap",
        "-o",
        other,
    ]
    assert subprocess.run(command, cwd=HERE, capture_output=True, timeout=120).returncode == 0
    assert run_ranks(_other_layout, 2, path, other, timeout=180) == ["refused", "refused"]


def _failing_host(rank: int, world: int, path: str) -> str:
    """Rank 1's host updates raise in step 2: every rank raises the same error, no parameter
    changes, the optimizer refuses to step until a state is loaded, and with the state saved
    before the step loaded the next step runs as if the failed one never happened."""
    import canzona.runtime.fsdp.optimizer as fsdp_optimizer
    from canzona.runtime import StepFailedError

    model = fsdp_models.qwen3()
    _shard(model, (2,), ("dp",))
    optimizer = FsdpOptimizer(model.named_parameters(), read_schedule(path), timeout=GROUP_TIMEOUT, **HP)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    fsdp_models.loss_of(model, tokens).backward()
    optimizer.step()
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    saved = copy.deepcopy(optimizer.state_dict())
    make_rule = fsdp_optimizer.make_rule
    if rank == 1:
        fsdp_optimizer.make_rule = lambda *args: (_ for _ in ()).throw(RuntimeError("injected"))  # type: ignore[assignment]
    with pytest.raises(StepFailedError, match="rank 1: updating .*RuntimeError: injected") as raised:
        optimizer.step()
    fsdp_optimizer.make_rule = make_rule  # type: ignore[assignment]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), before[name], rtol=0, atol=0)
        assert optimizer.state[p]["step"] == 1
    with pytest.raises(StepFailedError, match="load the optimizer state"):
        optimizer.step()
    optimizer.load_state_dict(saved)
    optimizer.step()
    return str(raised.value)


def test_a_failing_host_fails_the_step_on_every_rank(folder: str) -> None:
    pytest.importorskip("transformers")
    messages = run_ranks(_failing_host, 2, planned("qwen3", 1, 2, 1, folder), timeout=180)
    assert messages[0] == messages[1] and "no rank applied it" in messages[0]


def test_hsdp_2x2_equals_the_reference(folder: str) -> None:
    pytest.importorskip("transformers")
    path = planned("qwen3", 1, 4, 2, folder)
    run_ranks(_train, 4, "qwen3", path, (2, 2), ("replicate", "shard"), timeout=180)


def test_hsdp_2x1_one_device_per_replica_hosts_everything(folder: str) -> None:
    """One device per fragmentation group: the pipeline skips its all-to-alls, and the update
    must not use the gradient itself as scratch."""
    pytest.importorskip("transformers")
    path = planned("qwen3", 1, 2, 2, folder)
    run_ranks(_train, 2, "qwen3", path, (2, 1), ("replicate", "shard"), timeout=180)


@pytest.mark.parametrize("factory", ["titan_tp2", "qwen3_tp2", "titan_odd_tp2"])
def test_tp2_x_fsdp2_equals_the_reference(factory: str, folder: str) -> None:
    pytest.importorskip("transformers")
    path = planned(factory, 2, 2, 1, folder)
    matrices = [e for e in read_schedule(path).params if e.optimizer == "matrix"]
    # qwen3: matrices replicated over TP too; titan: TP shards that FSDP2 splits unevenly (65 rows
    # over 2); titan_odd: TP shards of different sizes too (its vocabulary, 128 and 127 rows)
    assert any(e.tp_dim is None for e in matrices) == (factory == "qwen3_tp2")
    assert any(e.tp_dim == 0 and e.shape[0] // 2 % 2 for e in matrices) == (factory != "qwen3_tp2")
    uneven = [e.name for e in read_schedule(path).params if e.tp_dim is not None and e.shape[e.tp_dim] % 2]
    assert ("lm_head.weight" in uneven) == (factory == "titan_odd_tp2")
    run_ranks(_train, 4, factory, path, (2, 2), ("dp", "tp"), timeout=180)


# ---------------------------------------------------------------------------------------------
# Mismatches: one clear error on every rank, no hang


def _mismatch(rank: int, world: int, path: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], how: str) -> None:
    from canzona.runtime import CanzonaOptimizer

    model = fsdp_models.qwen3()
    if how != "unsharded":
        _shard(model, mesh_shape, names)
    params = list(model.named_parameters())
    if how == "renamed" and rank == 1:
        params[3] = ("model.layers.0.self_attn.query.weight", params[3][1])
    if how == "missing" and rank == 1:
        path += ".missing"
    if how == "frozen" and rank == 0:
        params[2][1].requires_grad_(False)
    if how == "canzona":
        from rt_harness import make_groups

        dp_group, tp_group = make_groups(world, 1)
        CanzonaOptimizer(params, read_schedule(path), dp_group=dp_group, tp_group=tp_group)
    else:
        FsdpOptimizer(params, path, timeout=GROUP_TIMEOUT)


def _replicated_schedule(folder: str) -> str:
    out = Path(folder) / "qwen3-replicated.yaml"
    command = [
        sys.executable,
        "-m",
        "canzona.cli",
        "plan",
        "--model",
        "py:fsdp_models.py:qwen3",
        "--dp",
        "2",
        "-o",
        str(out),
    ]
    assert subprocess.run(command, cwd=HERE, capture_output=True, timeout=120).returncode == 0
    return str(out)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("without-fsdp", "planned without --fsdp"),
        ("shard-size", "mesh (replicate, shard, tp) [4]"),
        ("hsdp-on-fsdp", "mesh (replicate, shard, tp) [2, 2]"),
        ("renamed", "model.layers.0.self_attn.query.weight"),
        ("unsharded", "no parameter is a DTensor"),
        ("canzona-on-fsdp-schedule", "execute it with canzona.runtime.FsdpOptimizer"),
        ("missing", "rank 1: cannot read schedule"),
        ("frozen", "ranks optimize different parameters"),
        ("canzona-on-fsdp-model", "sharded by FSDP2 over mesh dim 'dp'"),
    ],
)
def test_mismatch_raises_on_every_rank(case: str, needle: str, folder: str) -> None:
    pytest.importorskip("transformers")
    mesh_shape, names, how = (2,), ("dp",), case
    if case in ("without-fsdp", "canzona-on-fsdp-model"):
        path = _replicated_schedule(folder)
        how = "canzona" if case == "canzona-on-fsdp-model" else case
    elif case == "shard-size":
        path = planned("qwen3", 1, 4, 1, folder)
    elif case == "hsdp-on-fsdp":
        path, mesh_shape = planned("qwen3", 1, 4, 2, folder), (4,)
    elif case == "canzona-on-fsdp-schedule":
        path, how = planned("qwen3", 1, 2, 1, folder), "canzona"
    else:
        path = planned("qwen3", 1, 2, 1, folder)
    world = mesh_shape[0]
    outcomes = run_ranks_raw(_mismatch, world, path, mesh_shape, names, how, timeout=120)
    messages = {payload.splitlines()[0] for status, payload in outcomes.values() if status == "error"}
    assert len(outcomes) == world and all(status == "error" for status, _ in outcomes.values()), outcomes
    assert len(messages) == 1, messages
    (message,) = messages
    assert "ScheduleMismatchError" in message and needle in message, message


def test_grouped_experts_are_refused_with_one_line(tmp_path: Path) -> None:
    """An HF Qwen3-MoE (grouped 3-D experts) plans with --fsdp, and FsdpOptimizer refuses it in
    one line (a local problem every rank reports at construction)."""
    transformers = pytest.importorskip("transformers")
    from canzona.planner.compile import compile_schedule
    from canzona.planner.fsdp import make_fsdp_plan
    from canzona.planner.plan import PlanRequest
    from canzona.planner.sources.load import load_model
    from canzona.planner.spec import ModelOptions
    from canzona.runtime.fsdp.optimizer import local_problems

    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        mlp_only_layers=[0],
    )
    (tmp_path / "config.json").write_text(config.to_json_string())
    spec = load_model(str(tmp_path / "config.json"), 1, ModelOptions(names="hf"))
    schedule = compile_schedule(make_fsdp_plan(spec, PlanRequest(str(tmp_path), 1, 2, sharding="fsdp")))
    (problem,) = local_problems(schedule, [], None)
    assert (
        problem.startswith("grouped expert tensors ('model.layers.1.mlp.experts.")
        and "not yet executed under FSDP" in problem
    )
