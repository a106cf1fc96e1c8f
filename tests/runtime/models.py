"""Real models for the runtime tests, as factories `canzona plan --model py:FILE:FACTORY` reads:
a tiny transformers Qwen3 (`examples/hf_qwen3.py`, with its TP plan) and Qwen3-MoE (random init
from a config, no downloads) and the torchtitan-named model of `titan_model.py`, each plain or
under DTensor TP.

The TP plans are the stacks' own styles, runnable on CPU gloo: sequence-parallel norms
(`SequenceParallel`: replicated DTensor weights, `Partial` gradients), colwise Q/K/V and MLP
inputs that gather the sequence and hand attention local heads (so q_norm / k_norm, plain
tensors, see only their TP rank's heads: partial gradients too), rowwise outputs that
reduce-scatter back to sequence shards, a vocab-sharded embedding and output head. Every norm's
gradient is then a partial sum over TP, which `--sequence-parallel` records. The `_tp2`
factories build the same model on a fake 2 x 2 ("dp", "tp") mesh for planning.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_model import TitanConfig, TitanModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_qwen3

QWEN3: dict[str, Any] = hf_qwen3.CONFIG
make_tiny_hf_qwen3 = hf_qwen3.make_model
parallelize_hf_qwen3 = hf_qwen3.parallelize
_fake_tp_mesh = hf_qwen3.fake_tp_mesh
QWEN3_MOE: dict[str, Any] = dict(
    QWEN3, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True
)
TITAN = TitanConfig(moe_layers=())
# TP 2 and TP 3 shard its vocabulary (251) unevenly, as DTensor does (torch.chunk; torch's colwise /
# rowwise styles infer an activation's global shape from even shards, so the FFN (102) divides);
# its 6 heads split whole over either
QWEN3_ODD: dict[str, Any] = dict(
    QWEN3,
    vocab_size=251,
    intermediate_size=102,
    num_attention_heads=6,
    num_key_value_heads=6,
    head_dim=8,
    hidden_size=48,
)
QWEN3_VOCAB: dict[str, Any] = dict(QWEN3_ODD, vocab_size=151936, num_hidden_layers=1)  # Qwen3's own vocabulary


def make_tiny_hf_qwen3_moe() -> nn.Module:
    """transformers' Qwen3MoeForCausalLM, tiny (layer 0 dense, layer 1 with 4 grouped 3-D experts)."""
    import transformers

    config = transformers.Qwen3MoeConfig(**QWEN3_MOE, attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(config)


def make_tiny_hf_qwen3_odd() -> nn.Module:
    """transformers' Qwen3ForCausalLM with dims TP 2 and TP 3 shard unevenly (`QWEN3_ODD`)."""
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_ODD, attn_implementation="eager"))


def make_tiny_hf_qwen3_vocab() -> nn.Module:
    """`make_tiny_hf_qwen3_odd` with Qwen3's vocabulary of 151936 and one layer (`QWEN3_VOCAB`)."""
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_VOCAB, attn_implementation="eager"))


def qwen3_vocab_config() -> dict[str, Any]:
    """The config.json of `make_tiny_hf_qwen3_vocab`, as `save_pretrained` writes it for the
    fp32 model (with its dtype)."""
    import transformers

    config = transformers.Qwen3Config(**QWEN3_VOCAB)
    config.architectures = ["Qwen3ForCausalLM"]
    return config.to_dict() | {"dtype": "float32"}


def make_tiny_hf_qwen3_odd_tp2() -> nn.Module:
    """`make_tiny_hf_qwen3_odd` under `parallelize_hf_qwen3` at TP 2 (fake mesh)."""
    return parallelize_hf_qwen3(make_tiny_hf_qwen3_odd(), _fake_tp_mesh(2))


def make_tiny_titan() -> nn.Module:
    """The torchtitan-named dense model of `titan_model.py`."""
    return TitanModel(TITAN)


def parallelize_titan(model: TitanModel, tp_mesh: Any) -> TitanModel:
    """torchtitan's TP plan for the dense model, with attention on local heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention.qkv_linear.wqkv": ColwiseParallel(input_layouts=Shard(1)),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(input_layouts=Shard(1)),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        )
    return model


def apply_transformers_tp_plan(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """transformers' own TP plan of the model (`config.base_model_tp_plan`: colwise / rowwise
    projections, and q_norm / k_norm `replicated_with_grad_allreduce`, whose gradients
    transformers sums over TP in a hook it registers at the first forward), applied as
    `from_pretrained(tp_plan="auto")` applies it while loading: each style shards its module's
    parameters (every rank keeps its own chunk of the same seeded initialisation) and wraps its
    forward."""
    import re

    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    modules = dict(model.named_modules())
    for pattern, style_name in model.config.base_model_tp_plan.items():
        rule = re.compile("^model\\." + re.escape(pattern).replace("\\*", "\\d+") + "$")
        for name in [n for n in modules if rule.match(n)]:
            style = ALL_PARALLEL_STYLES[style_name]
            for param in list(modules[name]._parameters):
                style.shard_param(modules[name], param, tp_mesh)
            style.install_forward(modules[name], tp_mesh)
    return model


def make_tiny_hf_qwen3_auto_tp2() -> nn.Module:
    """The tiny HF Qwen3 under transformers' own TP plan at TP 2 (fake mesh)."""
    return apply_transformers_tp_plan(make_tiny_hf_qwen3(), _fake_tp_mesh())


def make_tiny_hf_qwen3_tp2() -> nn.Module:
    """The tiny HF Qwen3 under `parallelize_hf_qwen3` at TP 2 (fake mesh)."""
    return parallelize_hf_qwen3(make_tiny_hf_qwen3(), _fake_tp_mesh())


def make_tiny_titan_tp2() -> nn.Module:
    """The torchtitan-named model under `parallelize_titan` at TP 2 (fake mesh)."""
    return parallelize_titan(TitanModel(TITAN), _fake_tp_mesh())


class Toy(nn.Module):
    """A block with every kind of parameter the binding meets: colwise and rowwise matrices, a
    norm, and grouped 3-D experts [4, 6, 8]."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.norm = nn.RMSNorm(16)
        self.down = nn.Linear(16, 8, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 6, 8) * 0.1)


def make_toy() -> nn.Module:
    """The plain `Toy`."""
    return Toy()


def parallelize_toy(model: Toy, tp_mesh: Any) -> Toy:
    """`Toy` as DTensors: up Shard(0), down Shard(1), norm Replicate, experts Shard(1)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for module, name, placement in (
        (model.up, "weight", Shard(0)),
        (model.down, "weight", Shard(1)),
        (model.norm, "weight", Replicate()),
        (model, "experts", Shard(1)),
    ):
        module.register_parameter(
            name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), tp_mesh, [placement]))
        )
    return model


def make_toy_tp2() -> nn.Module:
    """`Toy` under `parallelize_toy` at TP 2 (fake mesh)."""
    return parallelize_toy(Toy(), _fake_tp_mesh())


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM (HF or titan) on `tokens` [batch, seq]."""
    out = model(tokens)
    logits = out.logits if hasattr(out, "logits") else out
    if hasattr(logits, "to_local"):
        logits = logits.to_local()
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
