"""Tiny models for the FSDP2 tests: transformers' Qwen3 built from a config (random init, no
download) and the torchtitan-structured model of `titan_model`, plus factories that plan them
(`canzona plan --model py:...`): the TP one gives its parameters DTensor placements on a fake
(communication-free) process group, as docs/models.md shows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_model import Attention, TitanConfig, TitanModel, parallelize_titan

QWEN3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    tie_word_embeddings=False,
)
TITAN = TitanConfig(moe_layers=(), hidden_dim=130)  # w1/w3 rows split unevenly by FSDP2 (33, 33, 33, 31 over 4)
TITAN_ODD = TitanConfig(moe_layers=(), hidden_dim=130, vocab_size=255)  # a vocabulary TP 2 shards unevenly (128, 127)


def qwen3() -> nn.Module:
    """A tiny HF Qwen3 (fp32, seeded random init)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**QWEN3)
    return transformers.Qwen3ForCausalLM(config)


class LocalAttention(Attention):
    """The same attention computed on each TP rank's own heads: CPU scaled-dot-product attention
    has no DTensor rule, so q, k, v (DTensors sharded on the head dim after the sequence-parallel
    q/k norms) become local tensors for it, and wo's rowwise plan takes the local result back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (t.to_local() if hasattr(t, "to_local") else t for t in self.heads(x))
        k, v = (t.repeat_interleave(self.n_rep, dim=2) for t in (k, v))
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def qwen3_bf16() -> nn.Module:
    """The tiny HF Qwen3 with bf16 parameters."""
    return qwen3().to(torch.bfloat16)


def _titan(config: Any) -> nn.Module:
    torch.manual_seed(0)
    model = TitanModel(config)
    for block in model.layers.values():
        block.attention.__class__ = LocalAttention
    return model


def titan() -> nn.Module:
    """The dense torchtitan-named model (fp32, seeded random init); its attention runs on local
    heads under TP (`LocalAttention`, no parameter of its own)."""
    return _titan(TITAN)


def titan_tp2() -> nn.Module:
    """The torchtitan model under torchtitan's TP plan at TP 2 (for planning only)."""
    model = titan()
    parallelize_titan(model, _fake_tp2_mesh())
    return model


def titan_odd() -> nn.Module:
    """`titan` with a vocabulary of 255 rows, which TP 2 shards unevenly (as DTensor chunks)."""
    return _titan(TITAN_ODD)


def titan_odd_tp2() -> nn.Module:
    """`titan_odd` under torchtitan's TP plan at TP 2 (for planning only)."""
    model = titan_odd()
    parallelize_titan(model, _fake_tp2_mesh())
    return model


def parallelize_qwen3(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """A DTensor TP plan for transformers' Qwen3 on CPU: q/k/v and gate/up colwise, o and down
    rowwise, q_norm/k_norm sequence-parallel over the head dim (DTensor then leaves their
    gradients partial, and FSDP2 sums them when it redistributes); embedding, norms, lm_head
    and the last layer's MLP stay replicated over TP (matrices whose host gathers only its TP
    column's pieces)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    layers = blocks(model)
    for index, block in enumerate(layers):
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
        if index < len(layers) - 1:
            plan.update(
                {
                    "mlp.gate_proj": ColwiseParallel(),
                    "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
    return model


def _fake_tp2_mesh() -> Any:
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def qwen3_tp2() -> nn.Module:
    """The HF Qwen3 under `parallelize_qwen3` at TP 2 (for planning only)."""
    return parallelize_qwen3(qwen3(), _fake_tp2_mesh())


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers FSDP2 wraps one by one."""
    inner: Any = getattr(model, "model", model)
    layers = inner.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def loss_of(model: nn.Module, tokens: torch.Tensor, tp_mesh: Any = None) -> torch.Tensor:
    """Next-token cross-entropy of either model (`tp_mesh`: the titan model's output is split
    over the vocabulary on it, and is gathered for the loss)."""
    if isinstance(model, TitanModel):
        logits = model(tokens[:, :-1])
        if tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            shape = (*logits.shape[:2], model.lm_head.weight.shape[0])  # the local logits may be a shorter chunk
            stride = (shape[1] * shape[2], shape[2], 1)
            logits = DTensor.from_local(logits, tp_mesh, [Shard(2)], shape=shape, stride=stride).full_tensor()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return model(input_ids=tokens, labels=tokens).loss
