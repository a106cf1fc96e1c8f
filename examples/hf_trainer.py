"""transformers' `Trainer` with canzona in DDP's place: a tiny `Qwen3ForCausalLM` (random init from
a config, no download; examples/hf_qwen3.py's) trained by `CanzonaTrainer` on data-parallel
ranks, with the Trainer's gradient clipping, accumulation, LR schedule and checkpoints.

    canzona plan --model py:examples/hf_qwen3.py:make_model --dp 2 -o /tmp/hf_dp2.yaml
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --schedule /tmp/hf_dp2.yaml --output /tmp/run
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --schedule /tmp/hf_dp2.yaml --output /tmp/run \\
        --steps 10 --resume          # goes on from the last checkpoint in /tmp/run

`CanzonaTrainer` leaves the model unwrapped (canzona reduces the gradients over DP at its
schedule's cuts: no DistributedDataParallel, one reduction per step), clips with `max_grad_norm`
on the reduced gradient, accumulates through canzona's `no_sync`, and saves every rank's optimizer
state in each checkpoint (`canzona_optimizer/`), which `resume_from_checkpoint` loads. The
optimizer comes through `optimizer_cls_and_kwargs` (`CanzonaOptimizerFactory`); runs on GPUs
(NCCL) and CPUs (gloo) alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_qwen3 import CONFIG, make_model

SEQ, SEQUENCES = 16, 64
# AdamW's eps 1e-5: this tiny model sees some tokens rarely, and with 1e-8 their near-zero
# gradients take sign-like steps that the last bit of a summation order can flip.
HYPERPARAMETERS: dict[str, Any] = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, adamw_eps=1e-5)


def dataset() -> list[dict[str, torch.Tensor]]:
    """Sequences that count up from a random start (mod the vocab), each its own labels."""
    starts = torch.randint(0, CONFIG["vocab_size"], (SEQUENCES, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(SEQ)) % CONFIG["vocab_size"]
    return [{"input_ids": row, "labels": row} for row in tokens]


def training_arguments(output: str, steps: int, **overrides: Any) -> Any:
    """The Trainer's settings: 2 sequences per device, 2 micro-batches per step, clipping at 1,
    a linear schedule with one warm-up step, a checkpoint every 3 steps."""
    from transformers import TrainingArguments

    cuda = torch.cuda.is_available()
    settings: dict[str, Any] = dict(
        output_dir=output,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_steps=3,
        save_strategy="steps",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        dataloader_drop_last=True,
        disable_tqdm=True,
        ddp_timeout=120,
    )
    return TrainingArguments(**{**settings, **overrides})


def make_trainer(schedule: str, output: str, steps: int, trainer_class: Any = None, **overrides: Any) -> Any:
    """A `CanzonaTrainer` (or `trainer_class`, a subclass) of the model and data, its optimizer
    built by `CanzonaOptimizerFactory` from the schedule."""
    from canzona.runtime.integrations.hf import CanzonaOptimizerFactory, CanzonaTrainer

    torch.manual_seed(0)  # the same initial weights on every rank
    return (trainer_class or CanzonaTrainer)(
        model=make_model(),
        args=training_arguments(output, steps, **overrides),
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(CanzonaOptimizerFactory, {"schedule": schedule, **HYPERPARAMETERS}),
    )


def last_checkpoint(output: str) -> str | None:
    """The newest `checkpoint-N` folder in `output`, if any."""
    found = [name for name in os.listdir(output) if name.startswith("checkpoint-")] if os.path.isdir(output) else []
    return os.path.join(output, max(found, key=lambda name: int(name.split("-")[1]))) if found else None


def main() -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", required=True, help="a schedule planned from examples/hf_qwen3.py:make_model")
    parser.add_argument("--output", required=True, help="the Trainer's output folder (checkpoints)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --output")
    arguments = parser.parse_args()
    trainer = make_trainer(arguments.schedule, arguments.output, arguments.steps)
    result = trainer.train(resume_from_checkpoint=last_checkpoint(arguments.output) if arguments.resume else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if int(os.environ.get("RANK", "0")) == 0 and losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {result.global_step} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
