"""Train the tiny Qwen3-style model under DP x TP with canzona, on synthetic data, the way a
training script uses any torch.optim optimizer: bf16 parameters (the schedule's dtype; the
optimizer keeps fp32 main copies), no weight decay for 1-D parameters and embeddings, linear
warm-up then cosine decay of every group's learning rate, global gradient-norm clipping,
gradient accumulation over micro-batches (`no_sync()` on all but the last), the gradient
reduction overlapped with backward and the parameter gather with the next forward.

    canzona plan --model examples/tiny_qwen3.yaml --tp 2 --dp 4 --bucket-size 20000 \\
        --group-mb 0.03 -o /tmp/tiny.yaml
    torchrun --nproc-per-node 8 examples/train_tiny.py --tp 2 --dp 4 --schedule /tmp/tiny.yaml

NCCL with one GPU per process where the machine has GPUs, gloo on the CPU otherwise
(`launch.py`); the script is the same.

The MoE variant (tiny_qwen3_moe.py: 4 experts, top-2 routing) under expert parallelism:

    canzona plan --model examples/tiny_qwen3_moe.json --names megatron --tp 1 --dp 4 --ep 2 \
        --bucket-size 3000 --group-mb 0.01 -o /tmp/tiny_moe.yaml
    torchrun --nproc-per-node 4 examples/train_tiny.py --tp 1 --dp 4 --ep 2 \
        --config examples/tiny_qwen3_moe.json --schedule /tmp/tiny_moe.yaml

Global rank = dp_rank * tp + tp_rank; under expert parallelism dp_rank = expert_dp_rank * ep +
ep_rank. Prints the DP-mean loss, the gradient norm and the iteration time (forward, backward,
clip and step); `--strategy dp-sc|tp-sc` runs a baseline with the same math; `--no-overlap` turns both overlaps off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer, load_schedule, make_groups
from canzona.runtime.schedule import DTYPES

import tiny_qwen3_moe as moe
from launch import init_distributed
from tiny_qwen3 import TinyConfig, TinyQwen3, init_full_state, shard_state, synthetic_batch

STRATEGIES = {"canzona": CanzonaOptimizer, "dp-sc": DpScOptimizer, "tp-sc": TpScOptimizer}
TIMEOUT = timedelta(seconds=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--schedule", required=True, help="schedule file from `canzona plan`")
    parser.add_argument(
        "--config", default=str(Path(__file__).with_name("tiny_qwen3.json")), help="model shapes (HF config)"
    )
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (a MoE config, e.g. tiny_qwen3_moe.json)"
    )
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="canzona")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per DP rank (all micro-batches)")
    parser.add_argument("--micro-batches", type=int, default=2, help="split each batch, accumulating gradients")
    parser.add_argument("--no-overlap", action="store_true", help="reduce and gather inside step() only")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1, help="matrices and the output layer")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    parser.add_argument("--warmup", type=int, default=2, help="steps of linear warm-up before the cosine decay")
    return parser.parse_args(argv)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and the output layer; not norms, biases or the embedding. The matrix
    optimizer's parameters take `weight_decay`, AdamW's `adamw_weight_decay`."""
    named = list(model.named_parameters())
    flat = [(n, p) for n, p in named if p.dim() == 1 or "embedding" in n]
    rest = [(n, p) for n, p in named if not (p.dim() == 1 or "embedding" in n)]
    return [
        {"params": rest, "weight_decay": weight_decay, "adamw_weight_decay": weight_decay},
        {"params": flat, "adamw_weight_decay": 0.0},
    ]


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over `warmup` steps (from 10% of each group's lr), then cosine decay to zero."""
    cosine = CosineAnnealingLR(optimizer, T_max=max(1, steps - warmup), eta_min=0.0)
    if warmup < 1:
        return cosine
    return SequentialLR(optimizer, [LinearLR(optimizer, 0.1, 1.0, total_iters=warmup), cosine], milestones=[warmup])


def build_model(config: dict[str, Any], args: argparse.Namespace, tp_rank: int) -> tuple[Any, dict[str, Any]]:
    """The TP-sharded model (the MoE variant for a config with experts: this EP rank's experts)
    with its initial weights, and the optimizer's process-group keywords."""
    if "num_experts" not in config:
        dp_group, tp_group = make_groups(args.dp, args.tp, TIMEOUT)
        cfg = TinyConfig.from_hf(config)
        model = TinyQwen3(cfg, tp_group)
        model.load_state_dict(shard_state(init_full_state(cfg), args.tp, tp_rank))
        return model, {"dp_group": dp_group, "tp_group": tp_group}
    dp_group, tp_group, expert_dp_group = make_groups(args.dp, args.tp, TIMEOUT, ep=args.ep)
    moe_cfg = moe.MoeConfig.from_hf(config)
    model = moe.TinyQwen3Moe(moe_cfg, tp_group, moe.make_ep_group(args.dp, args.tp, args.ep, TIMEOUT))
    model.load_state_dict(moe.shard_state(moe.init_full_state(moe_cfg), args.tp, tp_rank, model.ep.local))
    return model, {"dp_group": dp_group, "tp_group": tp_group, "expert_dp_group": expert_dp_group}


def main(argv: list[str] | None = None) -> None:
    """Train and report."""
    args = parse_args(argv)
    device = init_distributed(TIMEOUT)
    if dist.get_world_size() != args.dp * args.tp:
        raise SystemExit(f"world size {dist.get_world_size()} is not dp {args.dp} x tp {args.tp}")
    dp_rank, tp_rank = divmod(dist.get_rank(), args.tp)
    dtype = DTYPES[load_schedule(args.schedule).params[0].dtype]
    model, groups = build_model(json.loads(Path(args.config).read_text()), args, tp_rank)
    model = model.to(device=device, dtype=dtype)
    cfg, dp_group = model.cfg, groups["dp_group"]
    overlap = not args.no_overlap
    optimizer = STRATEGIES[args.strategy](
        param_groups(model, args.weight_decay),
        args.schedule,
        **groups,
        lr=args.lr,
        adamw_lr=args.adamw_lr,
        model=model,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    scheduler = warmup_cosine(optimizer, args.warmup, args.steps)
    times, first = [], None
    for step in range(args.steps):
        started = time.perf_counter()
        batch = synthetic_batch(cfg, args.batch, args.seq, seed=step * args.dp + dp_rank).to(device)
        loss = torch.zeros((), device=device)
        for part, tokens in enumerate(batch.chunk(args.micro_batches)):
            micro = model(tokens) / args.micro_batches  # waits, module by module, for the last gather
            if part < args.micro_batches - 1:
                with optimizer.no_sync():  # accumulate: no reduction yet
                    micro.backward()
            else:
                micro.backward()  # the reduction starts bucket by bucket during this backward
            loss += micro.detach().float()
        norm = optimizer.clip_grad_norm_(args.max_norm)  # waits for the reduction: the true global norm
        optimizer.step()  # returns with the parameter gathers in flight
        times.append(time.perf_counter() - started)
        optimizer.zero_grad()
        scheduler.step()
        mean = loss.clone()
        dist.all_reduce(mean, group=dp_group)
        mean = float(mean) / args.dp
        first = mean if first is None else first
        if dist.get_rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(
                f"step {step:3d}  loss {mean:.4f}  grad norm {float(norm):.3f}  "
                f"lr {optimizer.param_groups[0]['lr']:.4f}  iteration {times[-1] * 1e3:.1f} ms",
                flush=True,
            )
    optimizer.finish_gather()  # before using the parameters outside the model's forward
    if dist.get_rank() == 0:
        print(
            f"{args.strategy}: loss {first:.4f} -> {mean:.4f}; "
            f"median iteration {statistics.median(times) * 1e3:.1f} ms",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
