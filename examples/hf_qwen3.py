"""A tiny Hugging Face transformers Qwen3 (random init from a config, no download) trained with
canzona under DTensor tensor parallelism (`parallelize_module`) and data parallelism, the model
as transformers builds it: the optimizer takes `model.named_parameters()` (DTensors included).

    canzona plan --model py:examples/hf_qwen3.py:make_model_tp2 --tp 2 --dp 2 --sequence-parallel \\
        --bucket-size 20000 --group-mb 0.05 -o /tmp/hf.yaml
    torchrun --standalone --nproc-per-node 4 examples/hf_qwen3.py --schedule /tmp/hf.yaml

    canzona plan --model py:examples/hf_qwen3.py:make_model --dp 4 -o /tmp/hf_dp.yaml   # DP only
    torchrun --standalone --nproc-per-node 4 examples/hf_qwen3.py --schedule /tmp/hf_dp.yaml

The TP plan (`parallelize`) is sequence parallel, as torchtitan's: norms `SequenceParallel`
(replicated DTensor weights whose gradients are `Partial`), Q/K/V and the MLP inputs colwise,
handing attention plain local heads (so q_norm/k_norm see only their TP rank's heads), o_proj and
down_proj rowwise back to sequence shards, a vocab-sharded embedding and head. Every norm's
gradient is then a partial sum over TP, which `--sequence-parallel` records and the optimizer
sums. `make_model_tp2` builds the same model on the meta device over a fake 2 x 2 mesh, so that
`canzona plan` reads the TP placements without a cluster. The DP x TP layout comes from the
schedule; global rank = dp_rank * tp + tp_rank.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
CPU = torch.device("cpu")


def make_model() -> nn.Module:
    """transformers' Qwen3ForCausalLM, tiny, fp32, eager attention."""
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG, attn_implementation="eager"))


def parallelize(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Sequence-parallel TP of the model over `tp_mesh` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for n in range(len(model.model.layers)):
        prefix = f"model.layers.{n}."
        plan.update(
            {
                prefix + "input_layernorm": SequenceParallel(),
                prefix + "post_attention_layernorm": SequenceParallel(),
                prefix + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                prefix + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
        )
        plan.update(
            {
                prefix + p: ColwiseParallel(input_layouts=Shard(1))
                for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
            }
        )
    return parallelize_module(model, tp_mesh, plan)


def fake_tp_mesh(tp: int = 2) -> Any:
    """The "tp" dim of a fake (communication-free) ("dp", "tp") mesh, for planning."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():  # `canzona check` may describe the model twice in one process
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2 * tp)
    return init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp", "tp"))["tp"]


def make_model_tp2() -> nn.Module:
    """The model under `parallelize` at TP 2, on a fake mesh (what `canzona plan` describes)."""
    return parallelize(make_model(), fake_tp_mesh())


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on `tokens` [batch, seq]."""
    logits = model(tokens).logits
    if hasattr(logits, "to_local"):
        logits = logits.to_local()
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def counting_batch(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Sequences that count up from a random start (mod the vocab): learnable in a few steps."""
    starts = torch.randint(0, CONFIG["vocab_size"], (batch, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(seq)) % CONFIG["vocab_size"]


def train(schedule: str, steps: int, batch: int = 4, seq: int = 16, device: torch.device = CPU) -> list[float]:
    """Train on this rank (inside an initialised process group, on `device`); the DP-mean loss
    of every step."""
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime import CanzonaOptimizer, load_schedule

    plan = load_schedule(schedule)
    dp, tp = plan.request.dp, plan.request.tp
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = make_model().to(device)
    if tp > 1:
        parallelize(model, mesh["tp"])
    optimizer = CanzonaOptimizer(
        model.named_parameters(),
        plan,
        mesh=mesh,
        timeout=timedelta(seconds=60),
        lr=0.05,
        adamw_lr=1e-2,
        weight_decay=0.01,
    )
    dp_rank, losses = mesh.get_local_rank("dp"), []
    for step in range(steps):
        loss = loss_of(model, counting_batch(batch, seq, seed=step * dp + dp_rank).to(device))
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(float(mean) / dp)
    return losses


def main() -> None:
    """torchrun entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", required=True, help="schedule file from `canzona plan` (it sets DP x TP)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from launch import init_distributed

    device = init_distributed(timedelta(seconds=60))
    losses = train(args.schedule, args.steps, device=device)
    if int(os.environ.get("RANK", "0")) == 0:
        for step, loss in enumerate(losses):
            print(f"step {step + 1}: loss {loss:.4f}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
