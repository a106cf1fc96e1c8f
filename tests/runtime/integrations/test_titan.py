"""torchtitan 0.3.0, the real package: its Qwen3 models are what `--names torchtitan` lists, and
canzona trains them as torchtitan's optimizer (`CanzonaOptimizersContainer`).

- The convention: torchtitan's own tiny Qwen3 (dense, and with a MoE layer) described live equals
  the plan of the same architecture's config.json under `--names torchtitan` (names, order,
  shapes, fused wqkv row blocks, grouped experts), at TP 1 and, parallelized by torchtitan, at
  TP 2 under both of its SPMD backends.
- Training (tests/runtime/titan_stack_run.py on 4 gloo ranks) against the single-process
  reference on the same batches: torchtitan's `parallelize_qwen3` (FSDP2 4 shards, and FSDP2 2 x
  TP 2) with its LR schedule, clipping and loss; and without FSDP2, torchtitan's model over DP 4
  and its TP plan at TP 2 x DP 2 under both SPMD backends with `CanzonaOptimizer`. A save at
  step 2 through torchtitan's `CheckpointManager`, resumed, equals the uninterrupted run bit
  for bit; a schedule that would leave spmd_types' partial gradients unsummed is refused.

Tolerances, measured against an fp64 reference after 4 steps: every matrix is within 2.6e-7 of
fp64 on both sides (rtol 1e-5, atol 1e-6 here); the output head (AdamW, 256 rows, near-cancelling
moments) differs from fp64 by 1.7e-5 in canzona and 3.4e-5 in the fp32 reference (FSDP 4), so
AdamW parameters are compared with atol 5e-5."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[titan]')")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
import titan_model_real  # noqa: E402

titan_model_real.use_cpu()
from canzona.planner.sources.conventions import mark_partial_norms  # noqa: E402
from canzona.planner.sources.load import load_model, model_from_data  # noqa: E402
from canzona.planner.spec import ModelOptions, ModelSpec  # noqa: E402
from canzona.runtime.tools.describe import describe_module  # noqa: E402
from canzona.runtime.tools.reference import ReferenceOptimizer  # noqa: E402
from canzona.schedules.format import read_schedule  # noqa: E402

import titan_stack_run  # noqa: E402
from rt_harness import in_child, labelled, torchrun  # noqa: E402

DRIVER = ROOT / "tests" / "runtime" / "titan_stack_run.py"
STEPS, SAVE_AT = 4, 2
MATRIX_ATOL, ADAMW_ATOL = 1e-6, 5e-5  # measured against fp64: see the module docstring


def rows(spec: ModelSpec, tp_dims: bool = True) -> list[tuple[Any, ...]]:
    """Everything the planner reads of each parameter (at TP 1 a live model has no TP dims)."""
    return [
        (
            p.name,
            p.shape,
            p.dtype,
            p.tp_dim if tp_dims else None,
            p.optimizer,
            p.submatrices,
            p.row_blocks,
            p.parent,
            p.expert_index,
            p.num_experts,
            p.grad_reduce,
        )
        for p in spec.params
    ]


def live_spec(model: torch.nn.Module, tp: int) -> ModelSpec:
    description = describe_module(model)
    return model_from_data(
        description.to_data(), description.name, "py:test:model", description.sha256, tp, ModelOptions()
    )


def convention(tmp: Path, moe: bool, tp: int, **options: Any) -> ModelSpec:
    path = titan_model_real.hf_config(tmp / f"config-{moe}.json", moe)
    return load_model(str(path), tp, ModelOptions(names="torchtitan", **options))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_convention_is_torchtitans_qwen3(tmp_path: Path, moe: bool) -> None:
    live = live_spec(titan_model_real.build(moe), 1)
    assert rows(live, tp_dims=False) == rows(convention(tmp_path, moe, 1), tp_dims=False)
    wqkv = next(p for p in live.params if p.name.endswith("qkv_linear.wqkv.weight"))
    assert len(wqkv.submatrices) == 3  # --split-qkv's default splits torchtitan's fused QKV into Q, K and V


def _tp2_described(backend: str) -> list[Any]:
    """Both tiny models parallelized by torchtitan at TP 2 (fake process group), described."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    specs = []
    for moe in (False, True):
        config = titan_model_real.config(moe)
        set_qwen3_sharding_config(config, enable_sp=True, enable_ep=False)
        model = config.build()
        model.parallelize(
            ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, spmd_backend=backend)
        )
        specs.append(live_spec(model, 2))
    return specs


@pytest.mark.slow
def test_the_convention_is_torchtitans_tp_layout(tmp_path: Path) -> None:
    expected = [convention(tmp_path, moe, 2) for moe in (False, True)]
    for spec, planned in zip(in_child(lambda: _tp2_described("partial_dtensor")), expected):
        assert rows(spec) == rows(planned)  # DTensor: norms replicated, their gradients read at the step
    for spec, planned in zip(in_child(lambda: _tp2_described("spmd_types")), expected):
        # spmd_types types the norms and the router `R` over TP: before FSDP2 completes them,
        # their gradients are partial sums, which is what a TP-only model needs canzona to sum
        partial = {p.name for p in spec.params if p.grad_reduce}
        assert partial == {p.name for p in mark_partial_norms(list(planned.params)) if p.grad_reduce} | {
            p.name for p in planned.params if p.name.endswith("router.gate.weight")
        }
        assert [r[:-1] for r in rows(spec)] == [r[:-1] for r in rows(planned)]


PLANS = {  # name: (dp, tp, extra plan options)
    "fsdp4": (4, 1, ["--fsdp"]),
    "fsdp2xtp2": (2, 2, ["--fsdp"]),
    "dp4": (4, 1, []),
    "dp2xtp2": (2, 2, ["--sequence-parallel"]),  # without FSDP2 the norms' gradients stay partial over TP
    "dp2xtp2-unsummed": (2, 2, []),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from canzona.cli.main import main as canzona

    folder = tmp_path_factory.mktemp("titan")
    config = titan_model_real.hf_config(folder / "config.json")
    paths = {}
    for name, (dp, tp, options) in PLANS.items():
        paths[name] = folder / f"{name}.yaml"
        assert (
            canzona(
                [
                    "plan",
                    "--model",
                    str(config),
                    "--names",
                    "torchtitan",
                    "--dp",
                    str(dp),
                    "--tp",
                    str(tp),
                    *options,
                    "-o",
                    str(paths[name]),
                ]
            )
            == 0
        )
    return paths


def train(schedule: Path, output: Path, plan: str, *flags: str, fails: bool = False) -> Any:
    """One torchrun of the driver on 4 gloo ranks at `plan`'s sizes; what it recorded (`fails`:
    its stderr, and that it failed)."""
    dp, tp, _ = PLANS[plan]
    dump = output / f"dump-{len(list(output.glob('dump-*')))}.pt"
    args = [str(schedule), str(output / "checkpoint"), str(dump), "--dp", str(dp), "--tp", str(tp)]
    result = torchrun(DRIVER, 4, [*args, "--steps", str(STEPS), "--save-at", str(SAVE_AT), *flags])
    if fails:
        assert result.returncode != 0 and not dump.exists()
        return result.stderr
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return torch.load(dump, weights_only=False)


def reference(run: dict[str, Any], schedule: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The single-process reference on the unsharded model: every step, all DP ranks' batches
    as one (the global token mean), clipped, then the same torchtitan LR schedule."""
    from torchtitan.components.loss import cross_entropy_loss

    model = titan_model_real.build()
    optimizer = ReferenceOptimizer(model.named_parameters(), read_schedule(schedule), **titan_stack_run.HYPERPARAMETERS)
    schedulers = titan_stack_run.lr_schedulers_config().build(optimizers=[optimizer], training_steps=STEPS)
    norms = []
    for step in range(STEPS):
        tokens = torch.cat([batch for rank in run["batches"] for at, batch in rank if at == step])
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), titan_stack_run.MAX_NORM)))
        optimizer.step()
        schedulers.step()
        model.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}, norms


def check_against_reference(run: dict[str, Any], schedule: Path) -> None:
    expected, norms = reference(run, schedule)
    assert min(norms) > titan_stack_run.MAX_NORM  # every step clipped
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms), rtol=1e-5, atol=0)
    matrices = {e.param or e.name for e in read_schedule(schedule).params if e.optimizer == "matrix"}
    for name, value in expected.items():
        atol = MATRIX_ATOL if name in matrices else ADAMW_ATOL
        torch.testing.assert_close(run["params"][name], value, rtol=1e-5, atol=atol, msg=labelled(name))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["fsdp4", "fsdp2xtp2"])
def test_torchtitan_training_equals_the_reference(plans: dict[str, Path], tmp_path: Path, plan: str) -> None:
    """torchtitan's trainer components: parallelize_qwen3, the container, clipping, checkpoints."""
    run = train(plans[plan], tmp_path, plan)
    check_against_reference(run, plans[plan])
    if plan == "fsdp2xtp2":  # resume from torchtitan's checkpoint at SAVE_AT: the same bits as the uninterrupted run
        resumed = train(plans[plan], tmp_path, plan, "--resume")
        assert resumed["norms"] == run["norms"][SAVE_AT:]
        assert all(torch.equal(resumed["params"][name], value) for name, value in run["params"].items())
    else:  # the optimizer state of FSDP 4 does not load under FSDP 2 x TP 2 (the model's would): every rank raises
        stderr = train(plans["fsdp2xtp2"], tmp_path, "fsdp2xtp2", "--resume", fails=True)
        assert stderr.count("another FSDP schedule") >= 4, stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan, mode, backend",
    [("dp4", "plain", "partial_dtensor"), ("dp2xtp2", "tp", "partial_dtensor"), ("dp2xtp2", "tp", "spmd_types")],
)
def test_torchtitans_model_without_fsdp_equals_the_reference(
    plans: dict[str, Path], tmp_path: Path, plan: str, mode: str, backend: str
) -> None:
    """torchtitan's model, its TP plan under either backend (spmd_types: plain tensors holding
    shards), DP by CanzonaOptimizer; under DTensor TP saved through torchtitan's checkpointer as a
    `DcpState` and resumed exactly. (Under spmd_types without FSDP2 torchtitan's checkpointer
    saves each plain weight shard as if it were the whole weight, so the model cannot resume.)"""
    run = train(plans[plan], tmp_path, plan, "--mode", mode, "--backend", backend)
    check_against_reference(run, plans[plan])
    if mode == "tp" and backend == "partial_dtensor":
        resumed = train(plans[plan], tmp_path, plan, "--mode", mode, "--backend", backend, "--resume")
        assert resumed["norms"] == run["norms"][SAVE_AT:]
        assert all(torch.equal(resumed["params"][name], value) for name, value in run["params"].items())


@pytest.mark.slow
def test_spmd_types_partial_gradients_the_schedule_does_not_sum_are_refused(
    plans: dict[str, Path], tmp_path: Path
) -> None:
    """Planned without --sequence-parallel, the schedule would leave the norms' partial
    gradients unsummed under spmd_types: construction fails on every rank, naming the fix."""
    stderr = train(
        plans["dp2xtp2-unsummed"], tmp_path, "dp2xtp2-unsummed", "--mode", "tp", "--backend", "spmd_types", fails=True
    )
    assert stderr.count("--sequence-parallel") >= 4, stderr[-4000:]


def test_the_container_refuses_what_it_cannot_run() -> None:
    from canzona.runtime.integrations.titan_optimizers import CanzonaOptimizersContainer

    model = titan_model_real.build()
    config = CanzonaOptimizersContainer.Config
    with pytest.raises(ValueError, match="optimizer.schedule"):
        config().build(model_parts=[model])
    from torchtitan.components.optimizer import ParamGroupConfig

    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]
    with pytest.raises(ValueError, match="param_groups must be empty"):
        config(schedule="s.yaml", param_groups=groups).build(model_parts=[model])
    with pytest.raises(ValueError, match="pipeline"):
        config(schedule="s.yaml").build(model_parts=[model, model])
