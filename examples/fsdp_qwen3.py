"""A tiny Hugging Face transformers Qwen3 (random init from a config, no download) sharded by
FSDP2 (`fully_shard`, each decoder layer then the root) and trained with canzona's
`FsdpOptimizer`: Muon on the matrices, each on one host device of the DP group, AdamW on the
rest where it lies.

    canzona plan --model py:examples/fsdp_qwen3.py:make_model --dp 4 --fsdp -o /tmp/fsdp.yaml
    torchrun --standalone --nproc-per-node 4 examples/fsdp_qwen3.py --schedule /tmp/fsdp.yaml

    canzona plan --model py:examples/fsdp_qwen3.py:make_model --dp 4 --fsdp --dp-replicate 2 -o /tmp/hsdp.yaml
    torchrun --standalone --nproc-per-node 4 examples/fsdp_qwen3.py --schedule /tmp/hsdp.yaml   # HSDP 2 x 2

The plan is made from the plain model: FSDP2's shards are torch.chunk's of dim 0, which the
planner lays out itself. NCCL with one GPU per process where the machine has GPUs, gloo on the
CPU otherwise (`launch.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_qwen3 import CONFIG, counting_batch


def make_model() -> nn.Module:
    """transformers' Qwen3ForCausalLM, tiny, fp32, eager attention (what `canzona plan` reads)."""
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG, attn_implementation="eager"))


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 over `mesh`: every decoder layer, then the root (embedding, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on `tokens` [batch, seq]."""
    logits = model(tokens).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def train(schedule: str, steps: int, device: torch.device, batch: int = 4, seq: int = 16) -> list[float]:
    """Train on this rank (inside an initialised process group); the mean loss of every step."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import FsdpOptimizer, load_schedule

    plan = load_schedule(schedule)
    replicas = plan.request.dp_replicate
    shape, names = (
        ((replicas, dist.get_world_size() // replicas), ("replicate", "shard"))
        if replicas > 1
        else ((dist.get_world_size(),), ("dp",))
    )
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = shard(make_model().to(device), mesh)
    optimizer = FsdpOptimizer(model.named_parameters(), plan, timeout=timedelta(seconds=60), lr=0.05, adamw_lr=1e-2)
    losses = []
    for step in range(steps):
        loss = loss_of(
            model, counting_batch(batch, seq, seed=step * dist.get_world_size() + dist.get_rank()).to(device)
        )
        loss.backward()  # FSDP2 reduce-scatters the gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # works on FSDP2's DTensor gradients
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def main() -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", required=True, help="schedule file from `canzona plan --fsdp`")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from launch import init_distributed

    device = init_distributed(timedelta(seconds=60))
    losses = train(args.schedule, args.steps, device)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
