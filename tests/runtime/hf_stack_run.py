"""torchrun driver of tests/runtime/integrations/test_hf.py: examples/hf_trainer.py's model and data
trained by transformers' `Trainer` (`CanzonaTrainer`) or by an accelerate loop
(`canzona.runtime.integrations.hf.prepare`), recording what the single-process reference needs:
every rank's micro-batches per optimizer step, the final parameters, and whether anything reduced
the gradients a second time (a DDP wrapper, or a bucket canzona had to reduce again).

    torchrun --nproc-per-node 2 tests/runtime/hf_stack_run.py trainer|accelerate SCHEDULE OUTPUT DUMP
        [--steps N] [--resume CHECKPOINT] [--save-at N] [--no-clip] [--plain]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import transformers  # noqa: E402

from canzona.runtime.integrations import hf  # noqa: E402

import hf_trainer  # noqa: E402

ACCUMULATION, PER_DEVICE = 2, 2


def wrapped_in_ddp(model: Any) -> bool:
    """Whether DistributedDataParallel wraps the trained model anywhere."""
    while model is not None:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return True
        model = getattr(model, "module", None)
    return False


class Recording(transformers.Trainer):
    """A Trainer that notes each micro-batch with the optimizer step it belongs to."""

    batches: list[tuple[int, torch.Tensor]]

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.batches.append((self.state.global_step, inputs["input_ids"].detach().cpu().clone()))
        return super().training_step(model, inputs, num_items_in_batch)


class RecordingTrainer(Recording, hf.CanzonaTrainer):
    """`CanzonaTrainer`, recording."""


class PlainRecordingTrainer(Recording):
    """transformers' own Trainer with canzona's optimizer (the negative control: it wraps the
    model in DDP, which reduces every gradient before canzona does)."""


def run_trainer(options: argparse.Namespace) -> dict[str, Any]:
    chosen = PlainRecordingTrainer if options.plain else RecordingTrainer
    trainer = hf_trainer.make_trainer(
        options.schedule,
        options.output,
        options.steps,
        chosen,
        max_grad_norm=0.0 if options.no_clip else 1.0,
        save_steps=options.save_at,
    )
    trainer.batches = []
    trainer.train(resume_from_checkpoint=options.resume)
    optimizer = hf.canzona_optimizer(trainer.optimizer)
    return {
        "batches": trainer.batches,
        "ddp": wrapped_in_ddp(trainer.model_wrapped),
        "reduced_again": optimizer.engine.warned,
        "model": trainer.model,
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
    }


def run_accelerate(options: argparse.Namespace) -> dict[str, Any]:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = hf_trainer.make_model()
    optimizer = hf.CanzonaOptimizerFactory()(model, schedule=options.schedule, **hf_trainer.HYPERPARAMETERS)
    processes = accelerator.num_processes  # accelerate steps a prepared scheduler once per process per step
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=processes, num_training_steps=options.steps * processes
    )
    loader = DataLoader(
        hf_trainer.dataset(),
        batch_size=PER_DEVICE,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    model, optimizer, loader, scheduler = hf.prepare(accelerator, model, optimizer, loader, scheduler)
    step = 0
    if options.resume:
        accelerator.load_state(options.resume)
        step = int(options.resume.rsplit("-", 1)[1])
    batches: list[tuple[int, torch.Tensor]] = []
    source = accelerator.skip_first_batches(loader, step * ACCUMULATION) if step else loader
    for batch in source:
        with accelerator.accumulate(model):
            batches.append((step, batch["input_ids"].detach().cpu().clone()))
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients and not options.no_clip:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step == options.save_at:
                accelerator.save_state(os.path.join(options.output, f"checkpoint-{step}"))
            if step == options.steps:
                break
    return {
        "batches": batches,
        "ddp": wrapped_in_ddp(model),
        "model": accelerator.unwrap_model(model),
        "reduced_again": hf.canzona_optimizer(optimizer).engine.warned,
        "grad_norms": [],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stack", choices=("trainer", "accelerate"))
    parser.add_argument("schedule")
    parser.add_argument("output")
    parser.add_argument("dump")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--no-clip", action="store_true")
    parser.add_argument("--plain", action="store_true", help="transformers' own Trainer (the negative control)")
    options = parser.parse_args()
    result = (run_trainer if options.stack == "trainer" else run_accelerate)(options)
    batches: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(batches, result["batches"])
    if dist.get_rank() == 0:
        params = {name: param.detach().cpu().clone() for name, param in result["model"].named_parameters()}
        torch.save(
            {
                "batches": batches,
                "params": params,
                "ddp": result["ddp"],
                "reduced_again": result["reduced_again"],
                "grad_norms": result["grad_norms"],
            },
            options.dump,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
