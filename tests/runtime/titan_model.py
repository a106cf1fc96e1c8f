"""A tiny model with torchtitan 0.3.0's module structure and parameter names (Qwen3 flavour:
qk-norm, optional MoE layers with grouped 3-D experts), small enough for the DTensor runtime tests
to drive with plain `torch.distributed.tensor.parallel` plans (`parallelize_titan`). The tests
against torchtitan itself are in `tests/runtime/integrations/test_titan.py`; this model's names
and shapes are checked there against the real package's.

Registration order follows torchtitan: `tok_embeddings`, `layers.N` (attention: the fused
`qkv_linear.wqkv`, rows per KV head as [its query heads, k, v], then `wo`, `q_norm`, `k_norm`;
`feed_forward.w1/w2/w3` or `moe.routed_experts.inner_experts.w1_EFD/w2_EDF/w3_EFD` [E, ...] and
`moe.router.gate`; `attention_norm`, `ffn_norm`), `norm`, `lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TitanConfig:
    """Sizes of the tiny model; MoE layers are those in `moe_layers`."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    vocab_size: int = 256
    num_experts: int = 4
    top_k: int = 2
    moe_hidden_dim: int = 32
    moe_layers: tuple[int, ...] = (1,)
    eps: float = 1e-6


class FusedQKV(nn.Module):
    """torchtitan's `FusedQKVLinear`: one weight, and the attributes describing its layout."""

    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.heads_per_kv, self.head_dim = c.n_heads // c.n_kv_heads, c.head_dim
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)


class Attention(nn.Module):
    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.head_dim, self.n_rep = c.head_dim, c.n_heads // c.n_kv_heads
        self.qkv_linear = FusedQKV(c)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, L, heads, d] (normed), k and v [B, L, KV heads, d] (k normed)."""
        batch, seq, _ = x.shape
        grouped = self.qkv_linear.wqkv(x).view(batch, seq, -1, self.n_rep + 2, self.head_dim)
        q, k, v = torch.split(grouped, [self.n_rep, 1, 1], dim=-2)
        q = self.q_norm(q.reshape(batch, seq, -1, self.head_dim))
        return q, self.k_norm(k.reshape(batch, seq, -1, self.head_dim)), v.reshape(batch, seq, -1, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.heads(x)
        k, v = (t.repeat_interleave(self.n_rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for weight in (self.w1_EFD, self.w2_EDF, self.w3_EFD):
            nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.silu(x @ self.w1_EFD[expert].T) * (x @ self.w3_EFD[expert].T) @ self.w2_EDF[expert].T


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class RoutedExperts(nn.Module):
    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.inner_experts = GroupedExperts(c.dim, c.moe_hidden_dim, c.num_experts)


class MoE(nn.Module):
    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.routed_experts = RoutedExperts(c)
        self.router = Router(c.dim, c.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = torch.softmax(self.router.gate(tokens).float(), dim=-1)
        top_scores, chosen = scores.topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        experts = self.routed_experts.inner_experts
        for expert in range(experts.w1_EFD.shape[0]):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            if rows.numel():
                weight = top_scores[rows, slot].unsqueeze(-1).to(tokens.dtype)
                out = out.index_add(0, rows, weight * experts(tokens[rows], expert))
        return out.view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, layer: int, c: TitanConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.moe_enabled = layer in c.moe_layers
        if self.moe_enabled:
            self.moe = MoE(c)
        else:
            self.feed_forward = FeedForward(c.dim, c.hidden_dim)
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.eps)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class TitanModel(nn.Module):
    """torchtitan's decoder layout: tok_embeddings, layers (a ModuleDict keyed "0", "1", ...),
    norm, lm_head."""

    def __init__(self, c: TitanConfig = TitanConfig()) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(n): TransformerBlock(n, c) for n in range(c.n_layers)})
        self.norm = nn.RMSNorm(c.dim, eps=c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x))


def parallelize_titan(model: TitanModel, tp_mesh) -> TitanModel:
    """torchtitan's TP plan: embedding rowwise, norms sequence-parallel (q_norm/k_norm over the
    head dim), wqkv/w1/w3 colwise, wo/w2 rowwise, lm_head colwise; grouped experts w1/w3
    Shard(1), w2 Shard(2); the router replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1)),
        },
    )
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention.qkv_linear.wqkv": ColwiseParallel(use_local_output=False),
            "attention.q_norm": SequenceParallel(sequence_dim=2),
            "attention.k_norm": SequenceParallel(sequence_dim=2),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if not block.moe_enabled:
            plan.update(
                {
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
        if block.moe_enabled:
            experts = block.moe.routed_experts.inner_experts
            for name, dim in (("w1_EFD", 1), ("w2_EDF", 2), ("w3_EFD", 1)):
                experts.register_parameter(
                    name, nn.Parameter(distribute_tensor(getattr(experts, name), tp_mesh, [Shard(dim)]))
                )
            gate = block.moe.router.gate
            gate.register_parameter("weight", nn.Parameter(distribute_tensor(gate.weight, tp_mesh, [Replicate()])))
    return model
