"""torchrun driver of tests/runtime/integrations/test_titan.py: torchtitan 0.3.0's tiny Qwen3
(tests/runtime/titan_model_real.py) trained with canzona, recording what the single-process
reference needs: every DP rank's micro-batch per step, the final parameters, the gradient norms.

- `--mode fsdp` (torchtitan's trainer): parallelized by torchtitan's own `parallelize_qwen3`
  (FSDP2, and TP inside it), trained by torchtitan's components as its trainer uses them: the
  optimizer built from `CanzonaOptimizersContainer.Config`, its LR schedulers,
  `dist_utils.clip_grad_norm_`, its loss, and its `CheckpointManager` to save and resume.
- `--mode tp`: only torchtitan's TP (`model.parallelize`, no FSDP2), DP by canzona
  (`CanzonaOptimizer` over `make_groups`, its `clip_grad_norm_` on the reduced gradient), under
  either SPMD backend (`--backend spmd_types`: TP shards are plain tensors).
- `--mode plain`: torchtitan's model unparallelized, DP by canzona.

    torchrun --nproc-per-node 4 tests/runtime/titan_stack_run.py SCHEDULE OUTPUT DUMP --dp 2 --tp 2
        [--mode fsdp|tp|plain] [--backend partial_dtensor|spmd_types] [--steps N] [--save-at N] [--resume]
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
import titan_model_real

titan_model_real.use_cpu()

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.qwen3.parallelize import parallelize_qwen3  # noqa: E402
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config  # noqa: E402

from canzona.runtime import CanzonaOptimizer, DcpState, make_groups  # noqa: E402
from canzona.runtime.integrations.titan_optimizers import CanzonaOptimizersContainer  # noqa: E402

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


def parallelized(options: argparse.Namespace) -> tuple[torch.nn.Module, ParallelDims]:
    """The model as `options.mode` parallelizes it, and torchtitan's parallel dims."""
    dp, tp, backend = options.dp, options.tp, options.backend
    config = titan_model_real.config()
    set_qwen3_sharding_config(config, enable_sp=tp > 1, enable_ep=False)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=dp * tp, spmd_backend=backend)
    torch.manual_seed(0)
    model = config.build()
    if options.mode == "tp":
        model.parallelize(dims)
    elif options.mode == "fsdp":
        model = parallelize_qwen3(
            model,
            parallel_dims=dims,
            parallelism=ParallelismConfig(spmd_backend=backend),
            training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
        _sum_reductions(model)
    return model, dims


def _sum_reductions(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # torchtitan's trainer: the loss is already a global token mean
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (NCCL runs it as torchtitan asks)


def build_optimizers(model: torch.nn.Module, options: argparse.Namespace) -> Any:
    """torchtitan's container (FSDP2), or CanzonaOptimizer reducing over DP itself."""
    if options.mode == "fsdp":
        config = CanzonaOptimizersContainer.Config(
            schedule=options.schedule, hyperparameters=HYPERPARAMETERS, timeout_seconds=60
        )
        return config.build(model_parts=[model])
    dp_group, tp_group = make_groups(options.dp, options.tp, timeout=timedelta(seconds=60))
    return CanzonaOptimizer(
        model.named_parameters(), options.schedule, dp_group=dp_group, tp_group=tp_group, timeout=60, **HYPERPARAMETERS
    )


def clip(model: torch.nn.Module, optimizers: Any, options: argparse.Namespace) -> float:
    """Clip at MAX_NORM: torchtitan's clipping of FSDP2's reduced gradients, or canzona's of its own."""
    if options.mode == "fsdp":
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
    else:
        norm = optimizers.clip_grad_norm_(MAX_NORM)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_shapes() -> list[torch.Size]:
    """The unsharded model's parameter shapes, in order."""
    return [p.shape for p in titan_model_real.build().parameters()]


def full_tensor(param: torch.Tensor, shape: torch.Size, tp: int) -> torch.Tensor:
    """The whole parameter: a DTensor's full tensor, or a plain TP shard (spmd_types) gathered
    from the TP ranks of DP rank 0 along the dim it is split on."""
    if hasattr(param, "full_tensor"):
        return param.full_tensor().detach().clone()
    if param.shape == shape:
        return param.detach().clone()
    dim = next(d for d, (local, full) in enumerate(zip(param.shape, shape)) if local != full)
    pieces = [torch.empty_like(param) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, param.detach().contiguous())
    return torch.cat(pieces[:tp], dim)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("schedule", "output", "dump"):
        parser.add_argument(name)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mode", choices=("fsdp", "tp", "plain"), default="fsdp")
    parser.add_argument("--backend", choices=("partial_dtensor", "spmd_types"), default="partial_dtensor")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dist_utils.set_spmd_backend(options.backend)
    model, dims = parallelized(options)
    optimizers = build_optimizers(model, options)
    fsdp = options.mode == "fsdp"  # else a CanzonaOptimizer: the schedulers take a list, DCP its DcpState
    schedulers = lr_schedulers_config().build(
        optimizers=optimizers if fsdp else [optimizers], training_steps=options.steps
    )
    state = TrainState()
    checkpoint = CheckpointManager.Config(
        enable=True, folder=options.output, interval=max(options.save_at, 1), last_save_model_only=False
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers if fsdp else DcpState(optimizers),
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
    )
    if options.resume:
        assert checkpoint.load(step=options.save_at), "no checkpoint to resume from"
    dp_rank = dist.get_rank() // options.tp
    norms, batches = [], []
    while state.step < options.steps:
        tokens = batch(state.step, dp_rank)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            logits = model(tokens[:, :-1])
            loss = cross_entropy_loss(logits, tokens[:, 1:], global_vocab_size=titan_model_real.SIZES["vocab_size"])
            # FSDP2 sums over DP (torchtitan divides by the global tokens); canzona averages over DP
            (loss / (tokens[:, 1:].numel() * (options.dp if fsdp else 1))).backward()
        norms.append(clip(model, optimizers, options))
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        batches.append((state.step, tokens))
        state.step += 1
        if state.step == options.save_at and not options.resume:
            checkpoint.save(curr_step=state.step)
    final = {
        name: full_tensor(p, shape, options.tp) for (name, p), shape in zip(model.named_parameters(), full_shapes())
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batches)
    if dist.get_rank() == 0:
        dp_batches = [everyone[d * options.tp] for d in range(options.dp)]
        torch.save({"params": final, "batches": dp_batches, "norms": norms}, options.dump)
    checkpoint.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
