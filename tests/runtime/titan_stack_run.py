"""torchrun driver of tests/runtime/integrations/test_titan.py: torchtitan 0.3.0's tiny Qwen3
(tests/runtime/titan_model_real.py) parallelized by torchtitan's own `parallelize_qwen3` (FSDP2,
and TP under the `partial_dtensor` backend), trained by torchtitan's components as its trainer
uses them: the optimizer built from `CanzonaOptimizersContainer.Config`, its LR schedulers,
`dist_utils.clip_grad_norm_`, its loss, and its `CheckpointManager` to save and resume. Records
what the single-process reference needs: every DP rank's micro-batch per step, the final
parameters and the gradient norms.

    torchrun --nproc-per-node 4 tests/runtime/titan_stack_run.py SCHEDULE OUTPUT DUMP --dp 2 --tp 2
        [--steps N] [--save-at N] [--resume]
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_model_real  # noqa: E402

titan_model_real.use_cpu()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.qwen3.parallelize import parallelize_qwen3  # noqa: E402
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config  # noqa: E402

from canzona.runtime.integrations.titan_optimizers import CanzonaOptimizersContainer  # noqa: E402

BACKEND = "partial_dtensor"
HYPERPARAMETERS = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.1, "adamw_weight_decay": 0.1}
MAX_NORM, BATCH, SEQ = 0.5, 2, 8


def lr_schedulers_config() -> LRSchedulersContainer.Config:
    """One warm-up step, then linear decay to 10%."""
    return LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1)


def batch(step: int, dp_rank: int) -> torch.Tensor:
    """The micro-batch of DP rank `dp_rank` at `step` (inputs and labels: SEQ + 1 tokens)."""
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, titan_model_real.SIZES["vocab_size"], (BATCH, SEQ + 1), generator=generator)


class TrainState:
    """The step counter torchtitan's checkpoint saves beside the model and optimizer."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def parallelized(dp: int, tp: int) -> tuple[torch.nn.Module, ParallelDims]:
    config = titan_model_real.config()
    set_qwen3_sharding_config(config, enable_sp=tp > 1, enable_ep=False)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=dp * tp, spmd_backend=BACKEND)
    torch.manual_seed(0)
    model = parallelize_qwen3(config.build(), parallel_dims=dims, parallelism=ParallelismConfig(spmd_backend=BACKEND),
                              training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
                              compile_config=CompileConfig(), ac_config=None, dump_folder="")
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # torchtitan's trainer: the loss is already a global token mean
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (NCCL runs it as torchtitan asks)
    return model, dims


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("schedule", "output", "dump"):
        parser.add_argument(name)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dist_utils.set_spmd_backend(BACKEND)
    model, dims = parallelized(options.dp, options.tp)
    optimizers = CanzonaOptimizersContainer.Config(schedule=options.schedule, hyperparameters=HYPERPARAMETERS,
                                                   timeout_seconds=60).build(model_parts=[model])
    schedulers = lr_schedulers_config().build(optimizers=optimizers, training_steps=options.steps)
    state = TrainState()
    checkpoint = CheckpointManager.Config(enable=True, folder=options.output, interval=max(options.save_at, 1),
                                          last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    if options.resume:
        assert checkpoint.load(step=options.save_at), "no checkpoint to resume from"
    dp_rank = dist.get_rank() // options.tp
    norms, batches = [], []
    while state.step < options.steps:
        tokens = batch(state.step, dp_rank)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            logits = model(tokens[:, :-1])
            loss = cross_entropy_loss(logits, tokens[:, 1:], global_vocab_size=titan_model_real.SIZES["vocab_size"])
            (loss / (tokens[:, 1:].numel() * options.dp)).backward()  # torchtitan: the sum over the global tokens
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        batches.append((state.step, tokens))
        state.step += 1
        if state.step == options.save_at and not options.resume:
            checkpoint.save(curr_step=state.step)
    final = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for name, p in model.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batches)
    if dist.get_rank() == 0:
        dp_batches = [everyone[d * options.tp] for d in range(options.dp)]
        torch.save({"params": final, "batches": dp_batches, "norms": norms}, options.dump)
    checkpoint.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
