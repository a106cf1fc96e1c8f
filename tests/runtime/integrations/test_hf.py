"""transformers' `Trainer` and accelerate, the real packages, with canzona in DDP's place
(`canzona.runtime.integrations.hf`): examples/hf_trainer.py's tiny Qwen3ForCausalLM trained on 2
gloo ranks under torchrun (tests/runtime/hf_stack_run.py), with clipping, gradient accumulation and
an LR schedule, against the single-process reference on the same micro-batches; one reduction per
step (no DDP wrapper, no bucket reduced again); save and resume through each stack's own
checkpoints equal the uninterrupted run.

Tolerances are the runtime's (tests/runtime/test_runtime_models.py, measured against fp64): rtol
1e-5 with atol 1e-6 on matrices, atol 2e-5 on AdamW parameters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[hf]')")

from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import Schedule, read_schedule

from rt_harness import labelled, torchrun

ROOT = Path(__file__).resolve().parents[3]
DRIVER = ROOT / "tests" / "runtime" / "hf_stack_run.py"
sys.path.insert(0, str(ROOT / "examples"))
import hf_trainer  # noqa: E402

STEPS, SAVE_AT = 5, 3


@pytest.fixture(scope="module")
def schedule_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from canzona.cli.main import main as canzona

    path = tmp_path_factory.mktemp("hf") / "hf-dp2.yaml"
    assert (
        canzona(
            [
                "plan",
                "--model",
                f"py:{ROOT / 'examples' / 'hf_qwen3.py'}:make_model",
                "--dp",
                "2",
                "--bucket-size",
                "20000",
                "--group-mb",
                "0.05",
                "-o",
                str(path),
            ]
        )
        == 0
    )
    return path


def train(stack: str, schedule: Path, output: Path, *flags: str) -> dict[str, Any]:
    """One torchrun of the driver on 2 gloo ranks; what it recorded."""
    dump = output / f"dump-{len(list(output.glob('dump-*')))}.pt"
    args = [stack, str(schedule), str(output), str(dump), "--steps", str(STEPS), "--save-at", str(SAVE_AT), *flags]
    result = torchrun(DRIVER, 2, args, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return torch.load(dump, weights_only=False)  # type: ignore[no-any-return]


def reference(
    run: dict[str, Any], schedule: Schedule, scheduler_steps: int = 1, scale: int = 1, clip: bool = True
) -> dict[str, torch.Tensor]:
    """The single-process reference on the unsharded model: every step, all ranks' micro-batches
    of that step as one batch (the global token mean), clipped at 1, then the linear LR schedule
    (`scale` warm-up steps, STEPS x `scale` in all) stepped `scheduler_steps` times."""
    from transformers import get_scheduler

    from canzona.runtime.integrations.hf import trainer_param_groups

    torch.manual_seed(0)
    model = hf_trainer.make_model()
    hp = dict(hf_trainer.HYPERPARAMETERS)
    optimizer = ReferenceOptimizer(trainer_param_groups(model), schedule, adamw_weight_decay=hp["weight_decay"], **hp)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=scale, num_training_steps=STEPS * scale)
    for step in range(STEPS):
        tokens = torch.cat([batch for rank in run["batches"] for at, batch in rank if at == step])
        model(input_ids=tokens, labels=tokens).loss.backward()
        if clip:
            optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        model.zero_grad()
        for _ in range(scheduler_steps):
            scheduler.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def assert_matches(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], schedule: Schedule) -> None:
    matrices = {entry.name for entry in schedule.params if entry.optimizer == "matrix"}
    for name, value in theirs.items():
        atol = 1e-6 if name in matrices else 2e-5
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=atol, msg=labelled(name))


def spread(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |ours − theirs|."""
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_matches_the_reference_with_one_reduction_and_resumes(schedule_path: Path, tmp_path: Path) -> None:
    """`CanzonaTrainer`: gradient accumulation 2, max_grad_norm 1 on the reduced gradient, a linear
    schedule; then a resume from the step-3 checkpoint ends where the uninterrupted run did."""
    schedule = read_schedule(schedule_path)
    run = train("trainer", schedule_path, tmp_path)
    assert not run["ddp"] and not run["reduced_again"]
    assert len(run["batches"][0]) == len(run["batches"][1]) == 2 * STEPS
    assert_matches(run["params"], reference(run, schedule), schedule)
    resumed = train("trainer", schedule_path, tmp_path, "--resume", str(tmp_path / f"checkpoint-{SAVE_AT}"))
    assert (tmp_path / f"checkpoint-{SAVE_AT}" / "canzona_optimizer").is_dir()
    assert all(torch.equal(resumed["params"][name], value) for name, value in run["params"].items())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_matches_the_reference_and_resumes(schedule_path: Path, tmp_path: Path) -> None:
    """`prepare(accelerator, ...)`: `accumulate`, the accelerator's `clip_grad_norm_` and a prepared
    scheduler, which accelerate steps once per process per optimizer step (its `AcceleratedScheduler`:
    a schedule sized for STEPS x 2 at 2 processes, as the driver builds it). A reference that
    steps that schedule once per step is another run, far outside the tolerance: the reported
    5.4e-4. `save_state` / `load_state` resume."""
    schedule = read_schedule(schedule_path)
    run = train("accelerate", schedule_path, tmp_path)
    assert not run["ddp"] and not run["reduced_again"]
    assert_matches(run["params"], reference(run, schedule, scheduler_steps=2, scale=2), schedule)
    assert spread(run["params"], reference(run, schedule, scheduler_steps=1, scale=2)) > 1e-4
    resumed = train("accelerate", schedule_path, tmp_path, "--resume", str(tmp_path / f"checkpoint-{SAVE_AT}"))
    assert all(torch.equal(resumed["params"][name], value) for name, value in run["params"].items())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_transformers_own_trainer_reduces_twice(schedule_path: Path, tmp_path: Path) -> None:
    """The negative control of the one-reduction checks above: transformers' own Trainer with
    canzona's optimizer wraps the model in DDP, whose all-reduce rewrites every gradient after
    canzona packed it, so canzona reduces its buckets again."""
    run = train("trainer", schedule_path, tmp_path, "--plain")
    assert run["ddp"] and run["reduced_again"]


def test_only_canzonas_optimizer_takes_ddps_place() -> None:
    from canzona.runtime.integrations.hf import canzona_optimizer

    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="the optimizer is AdamW, not canzona's: canzona takes DDP's place"):
        canzona_optimizer(plain)
    scheduler = torch.optim.lr_scheduler.LambdaLR(plain, lambda step: 1.0)
    with pytest.raises(TypeError):
        canzona_optimizer(scheduler)  # a scheduler holds an optimizer, but is none


def test_fsdp_optimizer_is_refused_until_fsdp2_is_wired() -> None:
    """FsdpOptimizer has no `clip_grad_norm_` and no canzona checkpoint: both the Trainer's path and
    `prepare` refuse it in one line that points at the plain FSDP2 loop."""
    from canzona.runtime import FsdpOptimizer
    from canzona.runtime.integrations.hf import canzona_optimizer, prepare

    fsdp = FsdpOptimizer.__new__(FsdpOptimizer)  # the refusal reads only its type: no process group needed
    refusal = "FsdpOptimizer under transformers' Trainer or accelerate is not supported yet: .* examples/fsdp_qwen3.py"
    with pytest.raises(TypeError, match=refusal):
        canzona_optimizer(fsdp)
    with pytest.raises(TypeError, match=refusal):
        prepare(None, fsdp)  # refused before the accelerator is used


def test_the_trainers_weight_decay_groups() -> None:
    from canzona.runtime.integrations.hf import trainer_param_groups

    decayed, undecayed = trainer_param_groups(hf_trainer.make_model())
    names = {name for name, _ in undecayed["params"]}
    assert names and all("norm" in name for name in names) and undecayed["adamw_weight_decay"] == 0.0
    assert "model.embed_tokens.weight" in {name for name, _ in decayed["params"]}
